"""8 fake CPU devices: the speculative loop on a mesh == on one device (run by
test_spec_mesh.py in a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``;
skipped anywhere else).

For meshes (1,1,8), (2,2,2), (8,1,1), with a tiny random target and tiny EAGLE-3 and
DFlash drafts loaded straight into their shardings: greedy tokens equal the single-device tokens
(and target-only generation), the acceptance histograms and round counts are equal, also under
speculators' relaxed rule (several tokens committed per round); 3 prompts on a batch split 4 or
8 ways are padded and unpadded. Params carry their rule's sharding, both KV caches are split by
batch and heads inside the loop, one compile per shape, unplaced modules are placed as copies,
and ``specjax generate --draft`` / ``specjax bench`` run with ``--mesh cpu-8``.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import specjax.sharding as shd
from specjax.decode import speculative as spec
from tests.sharding import tiny

pytestmark = pytest.mark.skipif(jax.device_count() != 8, reason="needs 8 devices (tests/sharding/test_spec_mesh.py)")

MESHES = [(1, 1, 8), (2, 2, 2), (8, 1, 1)]  # tensor only; every axis split; data only
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21]]  # 3 rows: padded on 2 meshes
NEW = 7
K = 3
RELAXED = dict(verifier_accept_k=40, accept_tolerance=1.0)  # lossy: random drafts get tokens accepted
COMMON = dict(k=K, max_new_tokens=NEW, eos_token_ids=[], prompt_bucket=16)


def write_draft(out: Path, algo: str, *, seed: int = 3) -> Path:
    """A complete tiny speculators checkpoint of ``algo`` for tiny.write_target's model
    (weights N(0, 1/fan_in), pruned vocabulary), written without torch."""
    import bridge
    from specjax.models.drafts.load import build_draft
    from specjax.models.params import tree_of

    cfg = bridge.parse_config(tiny.draft_config(algo))
    rng = np.random.default_rng(seed)
    tree = tiny._fill(tree_of(build_draft(cfg, abstract=True)), rng)
    sel = np.sort(rng.choice(tiny.V, size=tiny.VD, replace=False))
    t2d = np.zeros(tiny.V, bool)
    t2d[sel] = True
    tree["t2d"], tree["d2t"] = t2d, (sel - np.arange(tiny.VD)).astype(np.int64)
    bridge.save_checkpoint(out, cfg, tree=tree, progress=False)
    return Path(out)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("specmesh")
    return {"target": tiny.write_target(root / "target"), "eagle3": tiny.write_eagle3(root / "eagle3"),
            "dflash": write_draft(root / "dflash", "dflash")}


@pytest.fixture(scope="module")
def ref(ckpts):
    """Single-device results: target-only greedy tokens, speculative tokens and stats (exact and
    relaxed) for each draft."""
    from specjax.decode.generate import generate_ids
    from specjax.models.hf import load_hf_dir

    model = load_hf_dir(ckpts["target"])
    out = {"model": model, "greedy": generate_ids(model, PROMPTS, max_new_tokens=NEW, eos_token_ids=[]).tokens}
    for algo in ("eagle3", "dflash"):
        sd = spec.load_spec_draft(str(ckpts[algo]), model)
        assert shd.mesh_of(sd.module) is None
        split = spec.split_pair(model, sd.module)
        out[algo] = {"draft": sd,
                     "exact": spec.speculative_generate_ids(model, sd, PROMPTS, split=split, **COMMON),
                     "relaxed": spec.speculative_generate_ids(model, sd, PROMPTS, split=split, **RELAXED, **COMMON)}
        assert out[algo]["exact"].tokens == out["greedy"]
        assert out[algo]["relaxed"].stats.hist[:, 1:].sum() > 0  # rounds committing several tokens: ragged paths run
    return out


def assert_same(got, want):
    assert got.tokens == want.tokens
    assert got.stop_reasons == want.stop_reasons
    np.testing.assert_array_equal(got.stats.hist, want.stats.hist)
    assert got.rounds == want.rounds and got.stats.lossy == want.stats.lossy


def assert_placed(tree, rules, mesh):
    """Every leaf of ``tree`` (a module or state) has exactly its rule's NamedSharding."""
    n = 0
    for kp, a in jax.tree_util.tree_flatten_with_path(nnx.state(tree) if isinstance(tree, nnx.Module) else tree)[0]:
        name = shd.path_str(kp)
        spec_ = rules.match(name).spec if a.ndim else P()
        assert a.sharding == NamedSharding(mesh, spec_), (name, a.sharding, spec_)
        n += 1
    assert n > 5


@pytest.mark.parametrize("sizes", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_speculative_tokens_and_stats_equal_single_device(sizes, ckpts, ref):
    mesh = shd.make_mesh(sizes)
    lt = shd.load_target(ckpts["target"], mesh, progress=False)
    assert_placed(lt.model, shd.TARGET_RULES, mesh)
    for algo in ("eagle3", "dflash"):
        if algo == "dflash" and sizes != (2, 2, 2):
            continue  # the block draft on one mesh (every axis split, 3 rows padded to 4): suite time
        sd = spec.load_spec_draft(str(ckpts[algo]), lt, mesh=mesh)
        assert_placed(sd.module, shd.DRAFT_RULES, mesh)
        graphdef, state = spec.place_pair(lt.model, sd.module, mesh)
        assert jax.tree.leaves(state)[0] is jax.tree.leaves(spec.split_pair(lt.model, sd.module)[1])[0]  # no copy
        n0 = spec.TRACE_COUNT["speculative"]
        exact = spec.speculative_generate_ids(lt.model, sd, PROMPTS, split=(graphdef, state), **COMMON)
        relaxed = spec.speculative_generate_ids(lt.model, sd, PROMPTS, split=(graphdef, state), **RELAXED, **COMMON)
        assert spec.TRACE_COUNT["speculative"] == n0 + 1, "one compile per shape (the relaxation is a runtime value)"
        assert_same(exact, ref[algo]["exact"])
        assert_same(relaxed, ref[algo]["relaxed"])
        assert exact.tokens == ref["greedy"]
    if sizes == (2, 2, 2):  # no split given, mesh=None: the loop finds the mesh the params live on
        assert_same(spec.speculative_generate_ids(lt.model, sd, PROMPTS, **COMMON), ref["eagle3"]["exact"])


def test_unplaced_modules_are_placed_as_copies_and_a_self_draft_shares_its_layers(ckpts, ref):
    """``mesh=`` with single-device modules: the pair is placed as a copy (target by TARGET_RULES,
    draft by DRAFT_RULES; a self draft's layers are the target's own variables); 3 rows -> 4."""
    mesh = shd.make_mesh((2, 2, 2))
    model, sd = ref["model"], ref["eagle3"]["draft"]
    _, state = spec.place_pair(model, sd.module, mesh)
    assert_placed(state["target"], shd.TARGET_RULES, mesh)
    assert_placed(state["draft"], shd.DRAFT_RULES, mesh)
    selfd = spec.load_spec_draft("self:1", model)
    want = spec.speculative_generate_ids(model, selfd, PROMPTS, **COMMON)
    got = spec.speculative_generate_ids(model, selfd, PROMPTS, mesh=mesh, **COMMON)
    assert_same(got, want)
    assert got.tokens == ref["greedy"] and 1.0 < want.stats.tau < K + 1  # a real, partial acceptance
    assert shd.mesh_of(model) is None and shd.mesh_of(sd.module) is None  # the modules are untouched


def test_both_kv_caches_sharded_by_batch_and_heads_inside_the_loop(ckpts, ref):
    mesh = shd.make_mesh((2, 1, 4))
    sd = ref["eagle3"]["draft"]
    graphdef, state = spec.place_pair(ref["model"], sd.module, mesh)
    params = spec.SpecParams(k=K)
    B, Pl = 4, 16

    @jax.jit
    def run(state, ids, lens):
        pair = nnx.merge(graphdef, state)
        st = spec.spec_core(pair.target, pair.draft, ids, lens, jax.numpy.full((B,), NEW), jax.random.key(0),
                            jax.numpy.zeros((0,), int), jax.numpy.asarray([1.0, 0.0]), params=params,
                            max_new_tokens=NEW, max_len=Pl + NEW, draft_len=Pl + NEW + 2 * (K + 1), pad_id=0,
                            cache_dtype=jax.numpy.float32, draft_dtype=jax.numpy.float32, mesh=mesh)
        return st.dec.cache, st.dcache

    ids = np.full((B, Pl), 0, np.int32)
    ids[:, :8] = np.arange(3, 35).reshape(B, 8)
    tcache, dcache = run(state, shd.put(ids, shd.batch_sharding(mesh, 2)),
                         shd.put(np.full((B,), 8, np.int32), shd.batch_sharding(mesh, 1)))
    # the target's cache is heads-major [B, H, S, D], the draft's seq-major [B, S, H, D]
    for cache, pspec, local in ((tcache, P(("data", "fsdp"), "tensor", None, None),
                                 (B // 2, tiny.NKV // 4, tcache.k[0].shape[2], tiny.HD)),
                                (dcache, P(("data", "fsdp"), None, "tensor", None),
                                 (B // 2, dcache.k[0].shape[1], tiny.NKV // 4, tiny.HD))):
        want = NamedSharding(mesh, pspec)
        assert all(x.sharding.is_equivalent_to(want, 4) for x in cache.k + cache.v)
        assert cache.k[0].addressable_shards[0].data.shape == local
        assert cache.lengths.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"))), 1)
    assert len(dcache.k) == 1 and len(tcache.k) == 2


def test_cli_generate_with_draft_and_bench_on_cpu_8(ckpts, ref, tmp_path):
    from typer.testing import CliRunner

    from specjax.cli import app

    base = ["generate", "-t", str(ckpts["target"]), "-n", str(NEW), "--json", "--draft", str(ckpts["eagle3"]),
            "--k", str(K), "--lossless"]
    for p in PROMPTS:
        base += ["-p", " ".join(f"w{t}" for t in p)]
    bad = CliRunner().invoke(app, base + ["--mesh", "1,1,1"])  # wrong device count: refused, names the mesh
    assert bad.exit_code == 2 and "uses 1 devices but 8 are visible" in bad.output, bad.output
    r = CliRunner().invoke(app, base + ["--mesh", "cpu-8"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output.strip().splitlines()[-1])
    assert doc["mesh"] == "mesh {data: 2, fsdp: 2, tensor: 2} over 8 cpu device(s)"
    assert [c["token_ids"] for c in doc["completions"]] == ref["greedy"]
    want = json.loads(json.dumps(ref["eagle3"]["exact"].stats.to_dict()))
    assert doc["acceptance"] == want
    r = CliRunner().invoke(app, base + ["--mesh", "cpu-8", "--tree", "[(0,), (1,), (0, 0)]"])  # the tree loop, sharded
    assert r.exit_code == 0, r.output
    assert [c["token_ids"] for c in json.loads(r.output.strip().splitlines()[-1])["completions"]] == ref["greedy"]
    # bench: one batch of the same 3 prompts (padded to 4 rows: the program above is reused)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(" ".join(f"w{t}" for t in p)) + "\n" for p in PROMPTS))
    png = tmp_path / "acc.png"
    r = CliRunner().invoke(app, ["bench", "-t", str(ckpts["target"]), "-d", str(ckpts["eagle3"]), "--prompts",
                                 str(prompts), "--k", str(K), "-n", str(NEW), "-b", "4", "--no-chat", "--json",
                                 "--no-progress", "--plot", str(png), "--mesh", "cpu-8"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output.strip().splitlines()[-1])
    assert d["mesh"] == doc["mesh"] and d["identical_greedy_outputs"] == "3/3"
    assert d["speculative"]["tokens"] == d["target_only"]["tokens"] == 3 * NEW
    assert d["tokens_per_step"] == want["tokens_per_step"] and d["rounds"] == want["rounds"]
    assert d["cost"]["c"] > 0 and d["cost"]["target_step_ms"] > 0 and png.read_bytes()[:4] == b"\x89PNG"
    # bench with the tree side, sharded (the tree above: its loop program is reused), and its cost probes
    r = CliRunner().invoke(app, ["bench", "-t", str(ckpts["target"]), "-d", str(ckpts["eagle3"]), "--prompts",
                                 str(prompts), "--k", str(K), "-n", str(NEW), "-b", "4", "--no-chat", "--json",
                                 "--no-progress", "--tree", "[(0,), (1,), (0, 0)]", "--mesh", "cpu-8"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output.strip().splitlines()[-1])
    t = d["tree"]
    assert d["mesh"] == doc["mesh"] and t["identical_greedy_outputs"] == "3/3" and t["nodes"] == 3
    assert t["speculative"]["tokens"] == 3 * NEW and t["rounds"] > 0
    assert t["cost"]["verify_ms"] > 0 and t["cost"]["draft_ms"] > 0 and t["cost"]["target_step_ms"] > 0


def test_tree_loop_on_a_mesh_equals_single_device(ckpts, ref):
    """The tree loop sharded (batch split and padded, heads split): for a static and a dynamic tree,
    the greedy tokens, accept histograms and per-node accept counts equal the single-device loop's,
    with a self draft (real, partial acceptance) and the tiny EAGLE-3 draft loaded on the mesh
    (data 2 x tensor 4: 3 rows padded to 4, heads split)."""
    from specjax.decode.tree_loop import DynamicTreeSpec, tree_generate_ids

    mesh = shd.make_mesh((2, 1, 4))
    model = ref["model"]
    lt = shd.load_target(ckpts["target"], mesh, progress=False)
    kw = dict(max_new_tokens=NEW, eos_token_ids=[], prompt_bucket=16)
    trees = ["[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]", DynamicTreeSpec(topk=2, depth=3, num_nodes=5)]
    for name, one, sharded in (("self:1", spec.load_spec_draft("self:1", model), None),
                               ("eagle3", ref["eagle3"]["draft"], spec.load_spec_draft(str(ckpts["eagle3"]), lt,
                                                                                      mesh=mesh))):
        for tree in trees:
            want = tree_generate_ids(model, one, PROMPTS, tree=tree, **kw)
            got = (tree_generate_ids(model, one, PROMPTS, tree=tree, mesh=mesh, **kw) if sharded is None
                   else tree_generate_ids(lt.model, sharded, PROMPTS, tree=tree, **kw))  # found on the params
            assert got.tokens == want.tokens == ref["greedy"], (name, tree)
            np.testing.assert_array_equal(got.stats.hist, want.stats.hist)
            np.testing.assert_array_equal(got.node_hits, want.node_hits)
            if name == "self:1":
                assert want.stats.hist[:, 1:].sum() > 0  # drafted nodes accepted: paths, compaction, hand-off run

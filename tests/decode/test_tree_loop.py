"""The static-tree speculative loop with an EAGLE-3 draft: greedy output token-identical to
target-only greedy generation for several trees (ragged prompts, one jitted while loop), with
rounds that accept 1 to 3 drafted nodes; block drafts (P-EAGLE, DFlash, DSpark) too; a tree
deeper than a block, or a draft that cannot draft trees, is refused.

Both LM heads are restricted to the same 3 tokens (other columns zeroed: the argmax is one of 4) so that a random draft's
top-c children often contain the target's argmax: the tree paths, compaction and hand-off all run."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.decode.generate import generate_ids
from specjax.decode.sampling import SamplingParams, probs
from specjax.decode.selfdraft import SelfDraft
from specjax.decode.speculative import load_spec_draft
from specjax.decode.tree import TokenTree
from specjax.decode.tree_draft import DynamicTreeSpec, TreeDraftError
from specjax.decode.tree_loop import tree_generate_ids
from specjax.models.hf import load_hf_dir
from specjax.models.target import KVCache

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21], [3, 4]]
NEW = 24
TREES = {
    "vllm": "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]",
    "wide": "[(0,), (1,), (2,), (3,), (0, 0), (1, 0), (0, 1), (0, 0, 0)]",
    "chain": TokenTree.chain(3),
    # the full 4-ary tree of depth 3 (84 nodes): the 4 tokens the heads can reach, every path
    "full": [p for d in (1, 2, 3) for p in itertools.product(range(4), repeat=d)],
    "dynamic": DynamicTreeSpec(topk=4, depth=3, num_nodes=20),  # EAGLE-2: best 20 of 36 candidates
}


def _restrict_head(kernel, keep=3, scale=6.0):
    w = np.asarray(kernel[...])
    out = np.zeros_like(w)
    out[:, :keep] = w[:, :keep] * scale
    kernel.set_value(jnp.asarray(out))


@pytest.fixture(scope="module")
def pair(verifiers, tmp_path_factory):
    from tests.refs.speculators_ckpts import build

    target = load_hf_dir(verifiers["llama"])
    path = build("eagle3", tmp_path_factory.mktemp("tree-eagle3") / "eagle3", verifiers["llama"], num_layers=1)
    draft = load_spec_draft(str(path), target)
    _restrict_head(target.lm_head.kernel)
    _restrict_head(draft.module.lm_head.kernel)
    return target, draft


@pytest.fixture(scope="module")
def reference(pair):
    target, _ = pair
    return generate_ids(target, PROMPTS, max_new_tokens=NEW, eos_token_ids=[]).tokens


def _check_cache(target, res):
    """The loop's final target cache holds, in its committed slots, exactly the K/V of a fresh
    prefill of prompt + generated tokens (the last generated token is not in the cache yet):
    compaction kept each accepted path's rows, in order. (Without compaction the greedy tokens of
    this insensitive 4-token head can survive; the cache cannot.)"""
    cache = res.trace["target_cache"]
    for b, (prompt, toks) in enumerate(zip(PROMPTS, res.tokens)):
        seq = prompt + toks[:-1]
        assert int(cache.lengths[b]) >= len(seq)
        fresh = target(jnp.asarray([seq], jnp.int32), cache=KVCache.init(target.config, 1, len(seq))).cache
        for layer in range(len(cache.k)):
            np.testing.assert_allclose(np.asarray(cache.k[layer][b, :, : len(seq)]), np.asarray(fresh.k[layer][0]),
                                       atol=1e-4, rtol=0)
            np.testing.assert_allclose(np.asarray(cache.v[layer][b, :, : len(seq)]), np.asarray(fresh.v[layer][0]),
                                       atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(TREES))
def test_greedy_tree_loop_equals_target_only(pair, reference, name):
    target, draft = pair
    res = tree_generate_ids(target, draft, PROMPTS, tree=TREES[name], max_new_tokens=NEW, eos_token_ids=[],
                            trace=True)
    assert res.tokens == reference, name
    _check_cache(target, res)
    total = res.stats.total
    print(f"tree {name}: accepted-nodes histogram {total.tolist()}, rounds {res.rounds}, tau {res.stats.tau:.2f}")
    assert total[1:].sum() > 0, total  # drafted nodes are committed
    if name in ("full", "dynamic"):  # deep paths through rank > 0 nodes (and the full tree's leaves' bonus)
        assert total[2] > 0 and (name == "dynamic" or total[3] > 0), total
        assert res.rounds < NEW - 1  # fewer target forwards than tokens


@pytest.fixture(scope="module")
def block_drafts(pair, verifiers, tmp_path_factory):
    """P-EAGLE, DFlash (block 4: 3 drafted tokens) and DSpark (its Markov head) for the pair's
    target, LM heads restricted as the EAGLE-3 draft's."""
    from tests.refs.speculators_ckpts import build

    target, _ = pair
    out = {}
    for algo in ("peagle", "dflash", "dspark"):
        d = load_spec_draft(str(build(algo, tmp_path_factory.mktemp(f"tree-{algo}") / algo, verifiers["llama"])),
                            target)
        _restrict_head(d.module.lm_head.kernel)
        out[algo] = d
    return out


@pytest.mark.parametrize("algo", ["peagle", "dflash", "dspark"])
def test_block_drafts_draft_trees(pair, reference, block_drafts, algo):
    """Block drafts draft trees (P-EAGLE and DFlash: every node of a depth gets that depth's top-c
    tokens; DSpark: each node's path fed to its Markov head): greedy output and final cache as
    target-only for a static and a dynamic tree, and a chain-shaped tree accepts exactly what the
    chain loop accepts at k = 3, round by round."""
    from specjax.decode.speculative import speculative_generate_ids

    target, _ = pair
    draft = block_drafts[algo]
    assert draft.module.tree_drafting == ("markov" if algo == "dspark" else "parallel")
    for tree in (TREES["vllm"], DynamicTreeSpec(topk=3, depth=3, num_nodes=8)):
        res = tree_generate_ids(target, draft, PROMPTS, tree=tree, max_new_tokens=NEW, eos_token_ids=[], trace=True)
        assert res.tokens == reference, (algo, tree)
        _check_cache(target, res)
        assert res.stats.total[1:].sum() > 0, res.stats.total  # drafted nodes are committed
    chain = speculative_generate_ids(target, draft, PROMPTS, k=3, max_new_tokens=NEW, eos_token_ids=[])
    spine = tree_generate_ids(target, draft, PROMPTS, tree=TokenTree.chain(3), max_new_tokens=NEW, eos_token_ids=[])
    assert spine.tokens == chain.tokens == reference
    np.testing.assert_array_equal(spine.stats.hist, chain.stats.hist)


@pytest.mark.parametrize("algo", ["peagle", "dflash", "dspark"])
def test_block_tree_nodes_are_the_chain_proposals_ranks(pair, block_drafts, algo):
    """A block draft's static tree, node by node: the rank-r child of the rank-0 node at depth d is
    the r-th best token of the greedy chain proposal's depth-d logits (DSpark: that chain feeds
    the rank-0 path to its Markov head, as the tree does)."""
    from specjax.decode.tree import parse_tree
    from specjax.decode.tree_draft import propose_tree

    target, _ = pair
    d = block_drafts[algo].module
    H, taps = target.config.hidden_size, d.tap_ids(target.config.num_hidden_layers)
    rng = np.random.default_rng(0)
    B, n = 2, 5
    rows = d.aux_from_taps(tuple(jnp.asarray(rng.standard_normal((B, n, H)), jnp.float32) for _ in taps))
    ids = jnp.asarray(rng.integers(0, 3, (B, n)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, n))
    nv = jnp.asarray([5, 3], jnp.int32)
    cache = d.init_cache(B, 32, jnp.float32)
    tree = parse_tree("[(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1)]")
    got, _ = propose_tree(d, cache, rows, ids, pos, nv, tree)
    prop = d.speculate(cache, rows, ids, pos, n_valid=nv, k=3)
    order = np.argsort(-np.asarray(prop.logits, np.float64), axis=-1, kind="stable")  # [B, 3, V] ranks per depth
    want = np.stack([order[:, 0, 0], order[:, 0, 1], order[:, 1, 0], order[:, 1, 1], order[:, 2, 0], order[:, 2, 1]], 1)
    np.testing.assert_array_equal(np.asarray(got.tokens)[:, 1:], want)
    np.testing.assert_array_equal(order[:, :, 0], np.asarray(prop.tokens))  # the chain is the rank-0 path


def test_tree_depth_and_draft_kind_are_checked(pair, block_drafts):
    target, _ = pair
    with pytest.raises(TreeDraftError, match=r"a dflash draft proposes at most 3 tokens per block; the tree is 4 deep"):
        tree_generate_ids(target, block_drafts["dflash"], PROMPTS[:1], tree=TokenTree.chain(4), max_new_tokens=4)

    class Opaque:  # a draft with neither a tree_drafting kind nor teacher-forced proposals
        algorithm = "opaque"

        def propose(self, cache, rows, ids, pos, *, k=None):
            raise AssertionError("not reached")

    from specjax.decode.tree_draft import check_tree_draft
    with pytest.raises(TreeDraftError, match=r"a opaque draft cannot draft a token tree: it has no tree_drafting"):
        check_tree_draft(Opaque())


def test_self_draft_trees(pair, reference):
    """The target's own layers as the draft (teacher-forced chains): the oracle (all layers)
    accepts the full depth of the rank-0 path every round; a 1-layer self draft less."""
    target, _ = pair
    for layers, tree in ((None, TREES["vllm"]), (1, DynamicTreeSpec(topk=2, depth=3, num_nodes=6))):
        res = tree_generate_ids(target, SelfDraft(target, layers), PROMPTS, tree=tree, max_new_tokens=NEW,
                                eos_token_ids=[], trace=True)
        assert res.tokens == reference, layers
        _check_cache(target, res)
        total = res.stats.total
        if layers is None:
            assert total[3] >= 0.9 * total.sum(), total  # the oracle's rank-0 path: all 3 accepted
        else:
            assert total[1:].sum() > 0, total


def test_mtp_tree_loop_equals_target_only(verifiers, tmp_path):
    """An MTP head (Qwen3 verifier) drafts trees too: greedy output and final cache as target-only."""
    from tests.refs.speculators_ckpts import build

    target = load_hf_dir(verifiers["qwen3"])
    draft = load_spec_draft(str(build("mtp", tmp_path / "mtp", verifiers["qwen3"])), target)
    ref = generate_ids(target, PROMPTS, max_new_tokens=12, eos_token_ids=[]).tokens
    for tree in (TREES["vllm"], DynamicTreeSpec(topk=3, depth=2, num_nodes=6)):
        res = tree_generate_ids(target, draft, PROMPTS, tree=tree, max_new_tokens=12, eos_token_ids=[], trace=True)
        assert res.tokens == ref, tree
        _check_cache(target, res)


N_SAMPLES = 20_000


_LOGITS: dict = {}


def _joint_logits(target, prompt):
    """The target's logits after ``prompt`` + every two-token continuation [V*V, P+2, V], computed
    once per (target, prompt): the eager forward costs seconds, and every sampled test reuses it."""
    key = (id(target), tuple(prompt))
    if key not in _LOGITS:
        V = target.config.vocab_size
        ab = np.asarray(list(itertools.product(range(V), repeat=2)), np.int32)
        seqs = jnp.asarray(np.concatenate([np.broadcast_to(prompt, (len(ab), len(prompt))), ab], 1))
        _LOGITS[key] = (target, target(seqs).logits)  # the target is held so that its id stays unique
    return _LOGITS[key][1]


def _exact_joint3(target, prompt, sampling):
    """P(t1, t2, t3 | prompt) [V, V, V] under ``sampling`` from the target's logits (float64)."""
    V = target.config.vocab_size
    lg = _joint_logits(target, prompt)
    P = len(prompt)
    p = lambda x: np.asarray(probs(x, sampling), np.float64)  # noqa: E731
    p1, p2, p3 = p(lg[0, P - 1]), p(lg[::V, P]), p(lg[:, P + 1]).reshape(V, V, V)
    j = p1[:, None, None] * p2[:, :, None] * p3
    return j / j.sum()


@pytest.fixture(scope="module")
def peaked_pair(tmp_path_factory):
    """A 16-token Llama with peaked next-token distributions (LM head x 10) and random EAGLE-3,
    DFlash and DSpark drafts over the full 16-token vocabulary: (target, {algorithm: draft})."""
    from tests.refs import speculators_ckpts as ck

    root = tmp_path_factory.mktemp("tree-peaked")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ck, "VOCAB", 16)  # the helper's vocabulary: a full draft vocabulary of 16
        ver = ck.make_verifier(root / "verifier", "llama", vocab_size=16)
        paths = {a: ck.build(a, root / a, ver, num_layers=1 if a == "eagle3" else None)
                 for a in ("eagle3", "dflash", "dspark")}
    target = load_hf_dir(ver)
    target.lm_head.kernel.set_value(target.lm_head.kernel[...] * 10.0)
    return target, {a: load_spec_draft(str(p), target) for a, p in paths.items()}


@pytest.mark.parametrize("tree,draft_sampling,sampling", [
    ("vllm", "greedy", SamplingParams(temperature=0.6, top_p=0.9)),
    (DynamicTreeSpec(topk=2, depth=2, num_nodes=4), "greedy", SamplingParams(temperature=1.0, top_p=0.9)),
    ("vllm", "sample", SamplingParams(temperature=1.0, top_p=0.9)),
    ("vllm", "sample", SamplingParams(temperature=0.6, top_p=0.9))],
    ids=["vllm-t0.6_p0.9", "dynamic-t1_p0.9", "vllm_iid-t1_p0.9", "vllm_iid-t0.6_p0.9"])
def test_sampled_tree_loop_is_lossless(peaked_pair, sampling, tree, draft_sampling):
    """The first three tokens of 20 000 tree-loop samples (vLLM's tree, and a dynamic tree: two
    siblings at depth 1; point-mass proposals, and i.i.d. sampled ones on vLLM's tree, at
    temperatures 0.6 and 1) follow the target's exact joint distribution (chi-square)."""
    target, drafts = peaked_pair
    _assert_follows_target(target, drafts["eagle3"], tree, draft_sampling, sampling)


@pytest.mark.parametrize("algo,tree,draft_sampling,sampling", [
    ("dspark", "vllm", "sample", SamplingParams(temperature=1.0, top_p=0.9)),
    ("dflash", DynamicTreeSpec(topk=2, depth=2, num_nodes=4), "greedy", SamplingParams(temperature=0.6, top_p=0.9))],
    ids=["dspark_vllm_iid_t1", "dflash_dynamic_t0.6"])
def test_sampled_block_tree_loop_is_lossless(peaked_pair, algo, tree, draft_sampling, sampling):
    """Block drafts' trees under sampling (DSpark's Markov children drawn i.i.d. per node, DFlash's
    shared children of a dynamic tree) follow the target's exact joint distribution too."""
    target, drafts = peaked_pair
    _assert_follows_target(target, drafts[algo], tree, draft_sampling, sampling)


def _assert_follows_target(target, draft, tree, draft_sampling, sampling):
    prompt = [5, 6, 7]
    res = tree_generate_ids(target, draft, [prompt] * N_SAMPLES, tree=TREES.get(tree, tree), max_new_tokens=3,
                            eos_token_ids=[], sampling=sampling, seed=4, prompt_bucket=4,
                            draft_sampling=draft_sampling)
    toks = np.asarray(res.tokens)
    assert toks.shape == (N_SAMPLES, 3)
    total = res.stats.total
    assert total[0] > 500 and total[1:].sum() > 500, total  # rejections and accepts both happen
    joint = _exact_joint3(target, prompt, sampling)
    V = joint.shape[0]
    obs = np.bincount((toks[:, 0] * V + toks[:, 1]) * V + toks[:, 2], minlength=V ** 3).astype(np.float64)
    exp = joint.reshape(-1) * N_SAMPLES
    assert obs[exp == 0].sum() == 0, "tokens outside top-p were emitted"
    big = exp >= 5
    assert big.sum() >= 20, big.sum()
    o, e = np.append(obs[big], obs[~big].sum()), np.append(exp[big], exp[~big].sum())
    pval = float(stats.chisquare(o, e * o.sum() / e.sum()).pvalue)
    print(f"tree loop chi-square {tree} {draft_sampling} {sampling}: p = {pval:.4f} over {big.sum()} cells, accepted-nodes {total.tolist()}")
    assert pval > 0.01, pval


def test_dynamic_tree_spec_is_validated():
    assert DynamicTreeSpec(topk=2, depth=2, num_nodes=6).max_depth == 2
    with pytest.raises(ValueError, match=r"1 <= num_nodes <= 6 \(the candidates\), got topk=2 depth=2 num_nodes=7"):
        DynamicTreeSpec(topk=2, depth=2, num_nodes=7)
    with pytest.raises(ValueError, match="topk >= 1"):
        DynamicTreeSpec(topk=0, depth=2, num_nodes=1)


def test_sampled_proposals_need_a_static_tree(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="a dynamic tree takes the draft's top-k children"):
        tree_generate_ids(target, draft, PROMPTS[:1], tree=DynamicTreeSpec(2, 2, 3), max_new_tokens=4,
                          sampling=SamplingParams(temperature=1.0), draft_sampling="sample")
    with pytest.raises(ValueError, match="draft_sampling must be 'greedy' or 'sample'"):
        tree_generate_ids(target, draft, PROMPTS[:1], tree=TREES["vllm"], max_new_tokens=4,
                          sampling=SamplingParams(temperature=1.0), draft_sampling="topk")


@pytest.mark.parametrize("tree", ["wide", "full", "dynamic"])
def test_stepwise_tree_drafting_equals_forced_chains(pair, tree):
    """Drafting a tree with one chain step per node from its parent's state (the default for
    EAGLE-3 / MTP) gives the same tree as re-running a teacher-forced chain per node: same tokens,
    same shape, same committed draft cache; and the loop with either gives the same output."""
    from specjax.decode.tree_draft import as_tree, propose_tree

    target, draft = pair
    d = draft.module
    tr = as_tree(TREES[tree])
    rng = np.random.default_rng(0)
    B, n = 3, 5
    taps = d.tap_ids(target.config.num_hidden_layers)
    aux = tuple(jnp.asarray(rng.normal(size=(B, n, target.config.hidden_size)), jnp.float32) for _ in taps)
    rows = d.aux_from_taps(aux)
    toks = jnp.asarray(rng.integers(3, 40, size=(B, n)), jnp.int32)
    pos = jnp.asarray(np.arange(n)[None] + np.array([[0], [4], [9]]), jnp.int32)
    nv = jnp.asarray([5, 3, 4], jnp.int32)
    dcache = d.init_cache(B, 64, jnp.float32)
    run = lambda steps: jax.jit(lambda *a: propose_tree(d, *a, tr, steps=steps))(dcache, rows, toks, pos, nv)  # noqa: E731
    (a, ca), (b, cb) = run(True), run(False)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.mask), np.asarray(b.mask))
    np.testing.assert_array_equal(np.asarray(a.children), np.asarray(b.children))
    for x, y in zip(jax.tree_util.tree_leaves(ca), jax.tree_util.tree_leaves(cb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert len(set(np.asarray(a.tokens)[:, 1:].ravel().tolist())) > 1  # a real tree of several tokens


def test_cli_generate_with_a_tree(tmp_path):
    """`specjax generate --draft self:1 --tree ...` prints the target-only tokens, a sampled tree
    runs, and bad tree options fail with exit code 2 and a message naming the option (on a tiny
    target: what is checked is the CLI's wiring; the loops' losslessness on SmolLM2 is
    tests/decode/test_tree_smollm2.py)."""
    import json

    from typer.testing import CliRunner

    from specjax.cli import app
    from tests.sharding import tiny

    target = tiny.write_target(tmp_path / "t", layers=2)
    runner = CliRunner()
    base = ["generate", "-t", str(target), "-p", "w5 w9 w17 w33 w4", "-n", "12", "--json"]
    ref = json.loads(runner.invoke(app, base).stdout)["completions"][0]
    r = runner.invoke(app, base + ["--draft", "self:1", "--tree", "[(0,), (1,), (0, 0)]"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["completions"][0]["token_ids"] == ref["token_ids"]
    assert out["acceptance"]["k"] == 2
    r = runner.invoke(app, base + ["--draft", "self:1", "--tree", "[(0,), (1,)]", "--temperature", "0.7",
                                   "--draft-sampling", "sample"])  # i.i.d. sampled children
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)["completions"][0]
    assert len(got["token_ids"]) == 12 or got["stop_reason"] == "eos", got
    for extra, msg in ((["--tree", "[(0,), (2,)]", "--draft", "self:1"], "sibling (1,) is missing"),
                       (["--tree", "[(0,)]"], "needs --draft"),
                       (["--tree-topk", "2", "--draft", "self:1"], "--tree-topk, --tree-depth and --tree-nodes together")):
        r = runner.invoke(app, base + extra)
        assert r.exit_code == 2 and msg in r.output, (extra, r.output)

"""The trainer and hidden-state extraction on 8 fake CPU devices == one device.

``test_trainer_on_meshes`` runs this file as a script in ONE subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the device count is fixed before jax
starts). The script, on a tiny random target (tests/sharding/tiny.py) and pretokenized rows:

* extraction with the target loaded on mesh 2x2x2 (library) and by ``specjax data extract --mesh
  2,1,4`` writes the cache the single-device target writes;
* three trainer steps on meshes 8x1x1 (8 packed rows per step, validation included) and 2x2x2
  (4 rows) end at the parameters of the single-device trainer fed the same [N, T] rows
  (``Run(data_parallel=N)``), within 1e-5 relative (float32, AdamW);
* params, frozen tensors and optimizer state carry their rule shardings; one train and one eval
  compile per run;
* a resume on 8x1x1 (8 rows per step instead of 4) of a 2x2x2 run is refused, naming both meshes;
* ``specjax train --mesh cpu-8 --config <recipe> --resume`` trains on 2x2x2 (the target loaded
  from its directory onto the mesh) and ends bit for bit where the library run ended.
* ``data.online``: the target, placed by ``TARGET_RULES``, runs inside the 2x2x2 train step and
  starts at the cached run's loss (1e-6) and ends at it (1e-5; params 1e-4); one compile, no cache written;
* a 1-device mesh (what ``--mesh default`` gives on one device: explicit shardings, placed
  state) computes bit for bit what ``mesh=None`` computes; a rows-per-step that is not a multiple
  of data x fsdp is refused, naming the mesh.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tests.sharding.eight import run_eight

TIMEOUT_S = 300
AUX = [0, 1, 2]  # the tiny target has 3 layers; the cache holds [0, 1, 2, 3]


def test_trainer_on_meshes(tmp_path):
    out = run_eight(["-W", "ignore", "-m", "tests.sharding.test_train_mesh", str(tmp_path)],
                    what="the 8-device trainer script", timeout_s=TIMEOUT_S)
    done = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert done, out[-4000:]
    res = json.loads(done[-1][len("RESULT "):])
    assert res["devices"] == 8
    assert set(res["checked"]) >= {"extract 2x2x2", "cli extract 2x1x4", "8x1x1", "2x2x2", "1x1x1", "resume 2x2x2", "resume refused",
                                   "cli cpu-8", "online 2x2x2"}, res


# ----------------------------------------------------------------------------- the 8-device script


def _make_data(root: Path, n_rows: int = 72):
    """A tiny 3-layer target (HF directory), and a data directory of pretokenized rows with its
    float32 hidden-state cache made by the single-device target."""
    from specjax.models.loading import load_target
    from specjax.train.pipeline import DataSpec, prepare_data
    from tests.sharding import tiny

    tgt = tiny.write_target(root / "target", layers=3)
    rows_file = root / "rows.jsonl"
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in _rows(n_rows)))
    lt = load_target(str(tgt), progress=False)
    data = root / "data"
    prepare_data(data, DataSpec(prompts=str(rows_file), regenerate=False, aux_layer_ids=AUX, seq_length=64,
                                hidden_states_dtype="float32", draft_vocab_size=48), lt, progress=False)
    return tgt, lt, data


def _rows(n: int, seed: int = 0):
    """Pretokenized rows (ids in the tiny vocab, assistant-only-like masks), lengths 10..40."""
    import numpy as np

    from tests.sharding import tiny

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        L = int(rng.integers(10, 41))
        ids = rng.integers(3, tiny.V, L).tolist()
        p = int(rng.integers(2, L // 2))
        out.append({"input_ids": ids, "loss_mask": [0] * p + [1] * (L - p)})
    return out


def _recipe(data: Path, out: Path, *extra: str):
    from specjax.train.config import load_recipe

    return load_recipe(None, [f"data.path={data}", "data.total_seq_len=64", f"draft.target_layer_ids={AUX}",
                              "draft.draft_vocab_size=48", f"trainer.output_dir={out}", "trainer.compute_dtype=float32",
                              "data.train_data_ratio=1.0", "optimizer.optimizer=adamw", "optimizer.lr=1e-4", "loss.ttt_steps=2",
                              "trainer.max_steps=3", "trainer.checkpoint_every=2", "trainer.save_best=false",
                              "seed=3", *extra])


def _rel(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _assert_params_close(got, want, what: str, tol: float = 1e-5):
    import jax

    worst = max(((_rel(a, b), jax.tree_util.keystr(p)) for (p, a), b in
                 zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want))), key=lambda x: x[0])
    assert worst[0] <= tol, f"{what}: params differ by {worst[0]:.2e} (relative) at {worst[1]}"


def _assert_rule_shardings(tree, rules, mesh, what: str):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import specjax.sharding as shd

    n = 0
    for kp, a in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = shd.path_str(kp)
        spec = rules.match(name).spec if a.ndim else P()
        assert a.sharding == NamedSharding(mesh, spec), (what, name, a.sharding, spec)
        n += 1
    assert n > 5, what


def main(root: Path) -> None:
    import jax
    import numpy as np

    import specjax.sharding as shd
    from specjax.train.dataset import read_rows
    from specjax.train.errors import ResumeError, TrainError
    from specjax.train.hidden_states import extract_hidden_states, hs_path, read_hs
    from specjax.train.trainer import Run

    assert jax.device_count() == 8, jax.devices()
    t_all = time.perf_counter()
    checked, times = [], {}

    # ---- data: single-device extraction (prepare_data), then the same cache from the 2x2x2 mesh
    t0 = time.perf_counter()
    tgt, lt, data = _make_data(root)

    rows = read_rows(data)
    m222 = shd.make_mesh((2, 2, 2))
    lt222 = shd.load_target(str(tgt), m222, progress=False)
    d2 = root / "data-mesh"
    res = extract_hidden_states(lt222.model, rows, d2, aux_layer_ids=AUX, dtype="float32", max_batch_tokens=1024,
                                progress=False)
    assert res["written"] == len(rows)
    for i in range(len(rows)):
        a, b = read_hs(hs_path(d2, i)), read_hs(hs_path(data, i))
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_allclose(a.hidden_states, b.hidden_states, rtol=1e-5, atol=1e-5, err_msg=f"hs_{i}")
    checked.append("extract 2x2x2")
    # the CLI: target loaded onto mesh 2x1x4 from its directory, batches on (data, fsdp)
    import shutil

    from typer.testing import CliRunner

    from specjax.cli import app

    d3 = root / "data-cli"
    shutil.copytree(data, d3, ignore=shutil.ignore_patterns("hidden_states"))
    r = CliRunner().invoke(app, ["data", "extract", "--data", str(d3), "--target", str(tgt), "--aux-layer-ids", "0,1,2",
                                 "--hidden-states-dtype", "float32", "--mesh", "2,1,4", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.strip().splitlines()[-1])["written"] == len(rows), r.output
    for i in range(len(rows)):
        np.testing.assert_allclose(read_hs(hs_path(d3, i)).hidden_states, read_hs(hs_path(data, i)).hidden_states,
                                   rtol=1e-5, atol=1e-5, err_msg=f"hs_{i}")
    checked.append("cli extract 2x1x4")
    times["data"] = round(time.perf_counter() - t0, 1)

    # ---- trainer: mesh == one device fed the same [N, T] rows (validation on the 8x1x1 pair only:
    # it packs 7 held-out rows, so its last step carries empty filler rows)
    def run(name, mesh, n=None, *extra):
        t = time.perf_counter()
        r = Run(_recipe(data, root / name, *extra), target=lt, mesh=mesh, data_parallel=n, progress=False)
        s = r.train()
        times[name] = round(time.perf_counter() - t, 1)
        return r, s

    runs = {}
    for sizes, extra in (((8, 1, 1), ("data.train_data_ratio=0.9",)), ((2, 2, 2), ())):
        name = "x".join(map(str, sizes))
        mesh = shd.make_mesh(sizes)
        n = shd.batch_divisor(mesh)
        ref, rs = run(f"ref{n}", None, n, *extra)
        got, gs = run(name, mesh, None, *extra)
        assert gs["rows_per_step"] == n and gs["mesh"] == shd.describe(mesh), gs
        assert gs["steps"] == rs["steps"] == 3 and gs["tokens_seen"] == rs["tokens_seen"], (gs, rs)
        assert gs["compiles"] == {"train_step": 1, "eval_step": 1 if extra else 0}, gs["compiles"]
        np.testing.assert_allclose(gs["last_metrics"]["loss"], rs["last_metrics"]["loss"], rtol=1e-5)
        if extra:
            vm, vr = ([json.loads(x) for x in (root / d / "metrics.jsonl").read_text().splitlines() if '"val"' in x]
                      for d in (name, f"ref{n}"))
            assert len(vm) == len(vr) == 1, (vm, vr)
            np.testing.assert_allclose(vm[0]["loss"], vr[0]["loss"], rtol=1e-5)
            np.testing.assert_allclose(vm[0]["full_acc_0"], vr[0]["full_acc_0"], rtol=1e-5)
            assert len(got.val_steps()[-1]) == 8 and any(len(b) == 0 for b in got.val_steps()[-1])
            first = got.train_data.step_batches(0)[0]  # 8 different packed rows per step
            assert len(first) == 8 and all(len(b) for b in first), first
            assert len(set(np.concatenate(first).tolist())) == sum(map(len, first)), first
        _assert_params_close(got.params, ref.params, name)
        _assert_params_close(got.opt_state, ref.opt_state, name + " optimizer state", tol=1e-4)  # the gradients
        _assert_rule_shardings(got.params, shd.DRAFT_RULES, mesh, name + " params")
        _assert_rule_shardings(got.fns.frozen, shd.DRAFT_RULES, mesh, name + " frozen")  # the device copy the step takes
        _assert_rule_shardings(got.opt_state, shd.OPTIMIZER_RULES, mesh, name + " optimizer state")
        runs[name] = got
        checked.append(name)
        if sizes == (2, 2, 2):  # the same 4 rows per step on a 1-device mesh == mesh=None, bit for bit
            one_mesh = shd.make_mesh((1, 1, 1), devices=jax.devices()[:1])
            one, os_ = run("1x1x1", one_mesh, n)
            assert os_["mesh"] == shd.describe(one_mesh) and os_["rows_per_step"] == 4, os_
            for a, b in zip(jax.tree.leaves((one.params, one.opt_state)), jax.tree.leaves((ref.params, ref.opt_state))):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            try:
                Run(_recipe(data, root / "bad"), target=lt, mesh=mesh, data_parallel=6, progress=False)
                raise AssertionError("6 rows per step on a mesh with data x fsdp = 4 was accepted")
            except TrainError as e:
                assert "multiple of data x fsdp = 4 on mesh {data: 2, fsdp: 2, tensor: 2}" in str(e), e
            checked.append("1x1x1")

    # ---- online: the target (single-device lt, placed by TARGET_RULES) runs inside the 2x2x2 step and
    # computes the states the cache holds: the cached 4-row run's loss and params
    on, ons = run("online 2x2x2", m222, None, "data.online=true", "data.hidden_states_dtype=float32")  # the cache's
    assert ons["compiles"]["train_step"] == 1 and ons["online_target_lengths"] == [64], ons
    # step 1's loss (before any update), then the run's
    first = [[json.loads(x)["loss"] for x in (root / d / "metrics.jsonl").read_text().splitlines()
              if '"step": 1,' in x and '"val"' not in x] for d in ("online 2x2x2", "ref4")]
    assert len(first[0]) == len(first[1]) == 1, first
    np.testing.assert_allclose(first[0][0], first[1][0], rtol=1e-6)
    np.testing.assert_allclose(ons["last_metrics"]["loss"], rs["last_metrics"]["loss"], rtol=1e-5)
    _assert_params_close(on.params, ref.params, "online 2x2x2", tol=1e-4)
    _assert_rule_shardings(on.fns.frozen[1], shd.TARGET_RULES, m222, "online target")
    assert not any((root / "online 2x2x2").rglob("hs_*.safetensors"))
    checked.append("online 2x2x2")

    # ---- resume: the 2x2x2 run's step-2 checkpoint (its step-3 one dropped, as if killed before
    # writing it), resumed by the CLI on the cpu-8 preset (2x2x2, target loaded from its directory
    # onto the mesh) == the uninterrupted run, bit for bit. 8 rows per step (8x1x1) is refused.
    t = time.perf_counter()
    res_dir = root / "resume"
    shutil.copytree(root / "2x2x2", res_dir, ignore=shutil.ignore_patterns("last", "summary.json"))
    shutil.rmtree(res_dir / "checkpoints" / "3")
    try:
        Run(_recipe(data, res_dir), target=lt, mesh=shd.make_mesh((8, 1, 1)), progress=False, resume=True)
        raise AssertionError("a resume with 8 rows per step of a 4-row run was accepted")
    except ResumeError as e:
        msg = str(e)
        assert "mesh {data: 2, fsdp: 2, tensor: 2}" in msg and "mesh {data: 8, fsdp: 1, tensor: 1}" in msg, msg
    checked.append("resume refused")
    (root / "recipe.yaml").write_text(_recipe(data, res_dir, f"target={tgt}").to_yaml())
    r = CliRunner().invoke(app, ["train", "--config", str(root / "recipe.yaml"), "--mesh", "cpu-8", "--resume",
                                 "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output.strip().splitlines()[-1])
    assert doc["mesh"] == shd.describe(m222) and doc["rows_per_step"] == 4 and doc["steps"] == 3, doc
    assert doc["compiles"]["train_step"] == 1 and (res_dir / "last" / "config.json").is_file(), doc
    want = json.loads((root / "2x2x2" / "summary.json").read_text())["last_metrics"]
    assert doc["last_metrics"]["loss"] == want["loss"], (doc["last_metrics"], want)
    checked.append("cli cpu-8")
    back = Run(_recipe(data, res_dir), target=lt, mesh=m222, progress=False, resume=True)
    p0, o0 = back.build_state()
    step, params, opt_state, _ = back.restore(back._manager(), p0, o0)
    assert step == 3
    _assert_rule_shardings(params, shd.DRAFT_RULES, m222, "restored params")
    _assert_rule_shardings(opt_state, shd.OPTIMIZER_RULES, m222, "restored optimizer state")
    want = runs["2x2x2"]
    for a, b in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves((want.params, want.opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    checked.append("resume 2x2x2")
    times["resume+cli"] = round(time.perf_counter() - t, 1)
    times["total"] = round(time.perf_counter() - t_all, 1)
    print("RESULT " + json.dumps({"devices": jax.device_count(), "checked": checked, "seconds": times}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

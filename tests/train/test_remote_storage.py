"""Data, runs and exports on a bucket (``gs://``), through the same code as a real one: a fake
bucket maps ``gs://`` onto a local directory for ``etils.epath`` (``mock_epath``) and for Orbax's
tensorstore driver, and logs every object opened. Covers: ``data prepare`` into a bucket with the
markers uploaded last, staging back without re-downloading, training from it with a bucket
output directory (kill, resume: bit-exact with a local run), the export read back bit-exact with
``bridge.load_checkpoint``, and the error when the filesystem package is missing."""

from __future__ import annotations

import contextlib
import json
import os
from unittest import mock

import jax
import numpy as np
import pytest
from etils.epath.testing import mock_epath

import bridge
from bridge.errors import WriteError
from specjax import storage
from specjax.train import pipeline
from specjax.train.errors import DatasetError
from specjax.train.run_files import has_checkpoint, partial_saves
from specjax.train.trainer import Run
from tests.train.conftest import TINY_AUX, tiny_prompts, tiny_spec

try:
    import gcsfs  # noqa: F401

    HAS_GCSFS = True
except ImportError:
    HAS_GCSFS = False


class FakeBucket:
    """``gs://<bucket>/<key>`` -> ``<root>/<bucket>/<key>`` for every epath call and for Orbax's
    tensorstore kvstore; ``opened`` logs ``(mode, gs-url)`` of every file opened in the bucket."""

    def __init__(self, root):
        self.root = str(root)
        self.opened: list[tuple[str, str]] = []

    def local(self, p) -> str:
        s = os.fspath(p)
        return os.path.join(self.root, s[len("gs://"):]) if s.startswith("gs://") else s

    def url(self, s) -> str:
        s = os.fspath(s)
        return "gs://" + os.path.relpath(s, self.root) if s.startswith(self.root + os.sep) else s

    @contextlib.contextmanager
    def active(self):
        L = self.local

        def one(f, p, *a, **k):
            return f(L(p), *a, **k)

        def two(f, p, d, *a, **k):
            return f(L(p), L(d), *a, **k)

        def open_(f, p, mode):
            if os.fspath(p).startswith("gs://"):
                self.opened.append((mode, os.fspath(p)))
            return f(L(p), mode)

        def walk(f, top, **k):
            for r, ds, fs in f(L(top), **k):
                yield self.url(r), ds, fs

        from orbax.checkpoint._src.path import gcs_utils  # the one place Orbax builds a GCS tensorstore spec

        with mock_epath(open=open_, exists=one, isdir=one, listdir=one, makedirs=one, mkdir=one, remove=one,
                        rmtree=one, stat=one, glob=lambda f, p: [self.url(x) for x in f(L(p))], walk=walk,
                        rename=two, replace=two, copy=two), \
                mock.patch.object(gcs_utils, "get_kvstore_for_gcs", lambda p: {"driver": "file", "path": L(p)}), \
                mock.patch.object(gcs_utils, "is_hierarchical_namespace_enabled", lambda p: False):
            yield self

    def writes(self, prefix: str) -> list[str]:
        return [u[len(prefix):].lstrip("/") for m, u in self.opened if "w" in m and u.startswith(prefix)]

    def reads(self, prefix: str) -> list[str]:
        return [u[len(prefix):].lstrip("/") for m, u in self.opened if "r" in m and u.startswith(prefix)]


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    with FakeBucket(tmp_path / "gcs").active() as b:
        yield b


def recipe(data, out, *extra):
    from specjax.train.config import load_recipe

    return load_recipe(None, [f"data.path={data}", "data.total_seq_len=128", f"draft.target_layer_ids={TINY_AUX}",
                              "draft.draft_vocab_size=40", f"trainer.output_dir={out}", "trainer.compute_dtype=float32",
                              "data.train_data_ratio=0.75", "optimizer.lr=3e-3", "trainer.checkpoint_every=4",
                              "trainer.epochs=2", *extra])


def _tree_bytes(root) -> dict[str, bytes]:
    return {n: (root / n).read_bytes() for n in storage.files(root, hidden=False)}


def test_paths_local_or_remote_and_a_missing_filesystem(tmp_path):
    assert not storage.is_remote(tmp_path / "x") and not storage.is_remote("runs/a")
    assert storage.is_remote("gs://b/x") and storage.scheme("S3://b/x") == "s3"
    assert storage.path(f"file://{tmp_path}/x") == tmp_path / "x"
    with pytest.raises(storage.StorageError, match=r"unsupported URL scheme memory://"):
        storage.path("memory://b/x")
    if HAS_GCSFS:
        pytest.skip("gcsfs is installed: the missing-filesystem error cannot happen")
    with pytest.raises(storage.StorageBackendError, match=r"gs://b/run: gs:// paths need the gcsfs package.*"
                                                          r"pip install 'specjax\[gcs\]'"):
        storage.path("gs://b/run")
    from typer.testing import CliRunner

    from specjax.cli import app

    r = CliRunner().invoke(app, ["data", "prepare", "--out", "gs://b/data", "--no-regenerate",
                                 "--prompts", str(tiny_prompts(tmp_path / "p.jsonl", 2))])
    assert r.exit_code == 2 and "gcsfs" in r.output and "gs://b/data" in r.output, r.output


def test_prepare_to_a_bucket_then_stage_it_back(bucket, tiny_target, tiny_data, tmp_path):
    url = "gs://b/data"
    spec = tiny_spec(tiny_prompts(tmp_path / "p.jsonl"))
    meta = pipeline.prepare_data(url, spec, tiny_target, progress=False)
    assert meta["complete"] and meta["rows"] == json.loads((tiny_data / "specjax_data.json").read_text())["rows"]
    written = bucket.writes(url)
    assert written[-2:] == ["state.json", "specjax_data.json"], written[-4:]  # the markers last
    remote = storage.path(url)
    local_ref = _tree_bytes(tiny_data)
    got = _tree_bytes(remote)
    hs = [n for n in local_ref if n.startswith("hidden_states/")]
    assert hs and all(got[n] == local_ref[n] for n in hs)  # the same rows and hidden states as a local build
    for n in ("data-00000-of-00001.arrow", "t2d-40.npy", "d2t-40.npy", "token_freq.pt"):
        assert got[n] == local_ref[n], n
    with pytest.raises(DatasetError, match="already complete"):
        pipeline.prepare_data(url, spec, tiny_target, progress=False)

    bucket.opened.clear()
    staged = pipeline.local_data_dir(url, progress=False)  # the build's cache copy: nothing to fetch
    assert staged == storage.cache_dir(url) and bucket.reads(url + "/hidden_states") == []
    rows, m = pipeline.load_data_dir(staged)
    assert len(rows) == meta["rows"] and m["complete"]

    # a remote rewritten since (other markers) is fetched again whole, into the same place
    doc = json.loads(remote.joinpath("specjax_data.json").read_text())
    remote.joinpath("specjax_data.json").write_text(json.dumps({**doc, "seconds": -1}))
    (staged / hs[0]).write_bytes(b"x" * len(got[hs[0]]))  # same size, other bytes: must not be trusted
    bucket.opened.clear()
    assert pipeline.local_data_dir(url, progress=False) == staged
    assert sorted(bucket.reads(url + "/hidden_states")) == sorted(n.split("/", 1)[1] for n in hs)
    assert (staged / hs[0]).read_bytes() == got[hs[0]]
    assert json.loads((staged / "specjax_data.json").read_text())["seconds"] == -1

    from typer.testing import CliRunner

    from specjax.cli import app

    r = CliRunner().invoke(app, ["data", "inspect", url])  # the CLI reads the bucket's directory the same way
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["rows"] == meta["rows"] and json.loads(r.stdout)["hidden_states_cached"] == meta["rows"]


def test_train_on_a_bucket_resumes_bit_exact_and_exports_there(bucket, tiny_target, tiny_data, tmp_path):
    ref = Run(recipe(tiny_data, tmp_path / "ref"), target=tiny_target, progress=False)
    ref.train()
    # the data directory copied to the bucket (what `gsutil cp -r` would do), then trained from there
    storage.publish(tiny_data, "gs://b/data", markers=pipeline.MARKERS, progress=False)
    r1 = Run(recipe("gs://b/data", "gs://b/run"), target=tiny_target, progress=False)
    r1.train(stop_after=5)  # killed after 5 steps: checkpoints 4 and 5 in the bucket
    ck = storage.path("gs://b/run/checkpoints")
    assert sorted(p.name for p in ck.iterdir()) == ["4", "5"]
    assert not storage.path("gs://b/run/last").exists()
    (ck / "5" / "commit_success.txt").unlink()  # killed during the step-5 save: on a bucket, no commit file
    assert [p.name for p in partial_saves(ck)] == ["5"] and has_checkpoint(ck)
    r2 = Run(recipe("gs://b/data", "gs://b/run"), target=tiny_target, progress=False, resume=True)
    s = r2.train()
    assert s["steps"] == ref.total_steps and s["last"] == "gs://b/run/last"
    for a, b in zip(jax.tree.leaves((ref.params, ref.opt_state)), jax.tree.leaves((r2.params, r2.opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    run = storage.path("gs://b/run")
    steps = [json.loads(l)["step"] for l in run.joinpath("metrics.jsonl").read_text().splitlines()
             if "split" not in json.loads(l)]
    assert steps == list(range(1, ref.total_steps + 1))  # each step once across the kill
    assert json.loads(run.joinpath("summary.json").read_text())["steps"] == ref.total_steps
    want = {**json.loads((tmp_path / "ref/resume.json").read_text()), "data.path": "gs://b/data"}
    assert json.loads(run.joinpath("resume.json").read_text()) == want
    assert bucket.writes("gs://b/run/last")[-1] == "config.json"
    for name in ("last", "best"):
        staged = storage.stage_in(f"gs://b/run/{name}", markers=("config.json",), progress=False)
        assert (staged / "config.json").read_bytes() == (tmp_path / "ref" / name / "config.json").read_bytes()
        got, want = bridge.load_checkpoint(staged), bridge.load_checkpoint(tmp_path / "ref" / name)
        assert got.metadata == want.metadata
        g, w = got.flat(), want.flat()
        assert g.keys() == w.keys()
        for k in w:
            assert g[k].dtype == w[k].dtype and np.array_equal(g[k], w[k]), k
    with pytest.raises(Exception, match="already holds a run"):
        Run(recipe("gs://b/data", "gs://b/run"), target=tiny_target, progress=False)


def test_export_refuses_an_existing_bucket_directory_and_replaces_it_config_last(bucket, tiny_target, tiny_data,
                                                                                  tmp_path):
    from specjax.train.export import export_draft

    run = Run(recipe(tiny_data, tmp_path / "r"), target=tiny_target, progress=False)
    model = run.model_of(run.build_state()[0])  # the initial draft: no training needed here
    want = export_draft(tmp_path / "local", model, run.config_doc)
    out = export_draft("gs://b/x/draft", model, run.config_doc)
    assert str(out) == "gs://b/x/draft" and bucket.writes("gs://b/x/draft")[-1] == "config.json"
    storage.path("gs://b/x/draft/stale.bin").write_bytes(b"old")
    with pytest.raises(WriteError, match="gs://b/x/draft: destination exists"):
        export_draft("gs://b/x/draft", model, run.config_doc, overwrite=False)
    bucket.opened.clear()
    export_draft("gs://b/x/draft", model, run.config_doc, overwrite=True)
    assert bucket.writes("gs://b/x/draft") == ["model.safetensors", "config.json"]
    assert _tree_bytes(storage.path("gs://b/x/draft")) == _tree_bytes(want)  # stale.bin gone, the same bytes


def test_inspect_audit_convert_on_a_bucket(bucket, tmp_path):
    """`specjax inspect/audit/convert` take bucket URLs: a checkpoint in the bucket is staged (and
    not fetched again while unchanged), converted to Orbax in the bucket (its metadata uploaded
    last), and back to a local speculators checkpoint, bit-exact with the original; an existing
    bucket destination is refused without --overwrite."""
    from typer.testing import CliRunner

    from specjax.cli import app
    from tests.sharding import tiny

    local = tiny.write_eagle3(tmp_path / "d")
    storage.publish(local, "gs://b/draft", markers=("config.json",), progress=False)
    run = lambda *a: CliRunner().invoke(app, list(a))  # noqa: E731
    r = run("inspect", "gs://b/draft", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["algorithm"] == "eagle3"
    n_reads = len(bucket.reads("gs://b/draft"))
    r = run("audit", "gs://b/draft")
    assert r.exit_code == 0 and "OK gs://b/draft" in r.output, r.output
    assert set(bucket.reads("gs://b/draft")[n_reads:]) == {"config.json"}  # only the marker again: the rest is staged
    r = run("convert", "gs://b/draft", "gs://b/orbax", "--to", "orbax", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["output"] == "gs://b/orbax"
    up = bucket.writes("gs://b/orbax")
    assert up and up[-1] == "_CHECKPOINT_METADATA" and len(up) == len(set(up)), up  # the marker last
    r = run("convert", "gs://b/draft", "gs://b/orbax", "--to", "orbax")
    assert r.exit_code == 2 and "destination exists; pass --overwrite" in r.output, r.output
    r = run("convert", "gs://b/orbax", str(tmp_path / "back"), "--to", "speculators")
    assert r.exit_code == 0, r.output
    a, b = bridge.load_checkpoint(local), bridge.load_checkpoint(tmp_path / "back")
    la, lb = jax.tree_util.tree_flatten_with_path(a.tree)[0], jax.tree_util.tree_flatten_with_path(b.tree)[0]
    # a target given as a bucket URL is staged and loads as the local directory does
    target = tiny.write_target(tmp_path / "t")
    storage.publish(target, "gs://b/target", markers=("config.json",), progress=False)
    gen = ["generate", "-p", "w5 w6 w7", "-n", "4", "--json", "-t"]
    want, got = run(*gen, str(target)), run(*gen, "gs://b/target")
    assert want.exit_code == got.exit_code == 0, got.output
    assert json.loads(got.stdout)["completions"] == json.loads(want.stdout)["completions"]
    assert a.config == b.config and [p for p, _ in la] == [p for p, _ in lb] and len(la) > 5
    for (p, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), p


def test_extract_and_vocab_on_a_bucket(bucket, tiny_target_dir, tiny_data, tmp_path):
    """`data extract` / `data vocab --data gs://...`: the directory is staged, the new files (hidden
    states; token_freq.pt and the vocabulary maps) are uploaded with the markers last, bit-exact
    with the same commands on a local copy; a second extract uploads nothing."""
    import shutil

    from typer.testing import CliRunner

    from specjax.cli import app

    url = "gs://b/rows"
    bare = tmp_path / "bare"
    shutil.copytree(tiny_data, bare, ignore=shutil.ignore_patterns("hidden_states", "*.npy", "token_freq.pt"))
    storage.publish(bare, url, markers=pipeline.MARKERS, progress=False)
    run = lambda *a: CliRunner().invoke(app, list(a))  # noqa: E731
    aux = ",".join(map(str, TINY_AUX))
    up = {}
    for d in (str(bare), url):
        bucket.opened.clear()
        r = run("data", "extract", "--data", d, "--target", str(tiny_target_dir), "--aux-layer-ids", aux, "--json")
        assert r.exit_code == 0, r.output
        up["extract"] = bucket.writes(url)
        bucket.opened.clear()
        r = run("data", "vocab", "--data", d, "--draft-vocab-size", "40", "--target", str(tiny_target_dir))
        assert r.exit_code == 0 and "d2t-40.npy" in r.output, r.output
        up["vocab"] = bucket.writes(url)
    rows = json.loads((bare / "specjax_data.json").read_text())["rows"]
    hs = [n for n in up["extract"] if n.startswith("hidden_states/")]
    assert len(hs) == rows and up["extract"][:rows] == hs, up["extract"]  # the rows first, then changed markers
    assert set(up["extract"][rows:]) <= set(pipeline.MARKERS), up["extract"]
    assert sorted(up["vocab"]) == ["d2t-40.npy", "t2d-40.npy", "token_freq.pt"], up["vocab"]  # unchanged files stay
    assert _tree_bytes(storage.path(url)) == _tree_bytes(bare)
    bucket.opened.clear()
    r = run("data", "extract", "--data", url, "--target", str(tiny_target_dir), "--aux-layer-ids", aux, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout.strip().splitlines()[-1])["written"] == 0, r.output
    assert bucket.writes(url) == []

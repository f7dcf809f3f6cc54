"""Hub repo ids (specjax.hub): targets, drafts and checkpoints by repo id from a fake local HF
cache (``models--org--name/snapshots/<sha>/`` + ``refs/main``, as huggingface_hub lays it out);
not-cached ids name the commands that fetch them; downloading only on an explicit opt-in, and a
clear error (no traceback) when the opt-in meets an offline or unreachable Hub."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specjax import hub
from specjax.cli import app

REPO = Path(__file__).resolve().parents[1]
SHA = "0123456789abcdef0123456789abcdef01234567"
TARGET_ID, DRAFT_ID, MISSING_ID = "tiny-org/tiny-llama", "tiny-org/tiny-eagle3", "tiny-org/not-cached"

runner = CliRunner()


def put_in_cache(cache: Path, repo_id: str, src: Path, sha: str = SHA) -> Path:
    """Lay ``src`` out as huggingface_hub caches a model repo; the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / sha
    shutil.copytree(src, snap)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(sha)
    return snap


@pytest.fixture(scope="module")
def models(spec_root, verifiers):
    """A tiny llama target (with a tokenizer) and an EAGLE-3 draft built for it by speculators."""
    from tests.refs.speculators_ckpts import build
    from tests.train.conftest import write_char_tokenizer

    target = spec_root / "hub-target-llama"
    if not target.exists():
        shutil.copytree(verifiers["llama"], target)
        write_char_tokenizer(target)
    draft = spec_root / "hub-draft-eagle3"
    if not draft.exists():
        build("eagle3", draft, verifiers["llama"])
    return target, draft


@pytest.fixture
def hf_cache(tmp_path, monkeypatch, models):
    """The fake cache as the process's HF cache, offline (as this machine is)."""
    import huggingface_hub.constants as hc

    cache = tmp_path / "hub"
    target, draft = models
    put_in_cache(cache, TARGET_ID, target)
    put_in_cache(cache, DRAFT_ID, draft)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(hub.ENV_ALLOW, raising=False)
    return cache


def _json(r):
    assert r.exit_code == 0, r.output
    return json.loads(r.output[r.output.index("{"):])


def test_resolve_paths_ids_and_cache(hf_cache, models, tmp_path):
    target, draft = models
    assert hub.resolve(str(draft)) == draft  # a path stays a path
    assert hub.resolve(DRAFT_ID, kind="draft") == hf_cache / "models--tiny-org--tiny-eagle3" / "snapshots" / SHA
    assert hub.is_repo_id(DRAFT_ID) and hub.is_repo_id("gpt2")
    assert not hub.is_repo_id(str(draft)) and not hub.is_repo_id("a/b/c") and not hub.is_repo_id("./x")
    assert not hub.is_repo_id("bad id!") and not hub.is_repo_id(None)
    with pytest.raises(hub.NotCachedError) as e:
        hub.resolve(MISSING_ID, kind="draft")
    msg = str(e.value)
    assert (f"draft '{MISSING_ID}' is neither a local path nor a repo id in the local HF cache ({hf_cache})" in msg
            and "rerun with --download (or SPECJAX_ALLOW_DOWNLOAD=1)" in msg and f"`hf download {MISSING_ID}`" in msg)


def test_inspect_audit_convert_by_repo_id(hf_cache, models, tmp_path):
    target, draft = models
    snap = hf_cache / "models--tiny-org--tiny-eagle3" / "snapshots" / SHA
    by_path = _json(runner.invoke(app, ["inspect", str(draft), "--json"]))
    by_id = _json(runner.invoke(app, ["inspect", DRAFT_ID, "--json"]))
    assert by_id.pop("path") == str(snap) and by_id.pop("files") == [str(snap / "model.safetensors")]
    assert by_id == {k: v for k, v in by_path.items() if k not in ("path", "files")}
    r = runner.invoke(app, ["inspect", DRAFT_ID])
    assert r.exit_code == 0 and f"{DRAFT_ID} (" in r.output and "eagle3" in r.output

    want = _json(runner.invoke(app, ["audit", str(draft), "--verifier", str(target), "--json"]))
    got = _json(runner.invoke(app, ["audit", DRAFT_ID, "--verifier", TARGET_ID, "--json"]))
    assert want["errors"] == got["errors"] == [] and got["algorithm"] == "eagle3"

    out = tmp_path / "orbax"
    r = runner.invoke(app, ["convert", DRAFT_ID, str(out), "--to", "orbax", "--check", "--json"])
    res = _json(r)
    assert res["format"] == "orbax" and res["check"]["tensors"] > 0 and out.is_dir()


def test_generate_with_target_and_draft_by_repo_id(hf_cache, models):
    target, draft = models
    args = ["generate", "-p", "hello", "-n", "4", "--json"]
    ids = _json(runner.invoke(app, args + ["--target", TARGET_ID, "--draft", DRAFT_ID]))
    paths = _json(runner.invoke(app, args + ["--target", str(target), "--draft", str(draft)]))
    assert ids["kind"] == "hf_cache" and ids["target"] == str(hf_cache / "models--tiny-org--tiny-llama" / "snapshots" / SHA)
    assert ids["draft"].endswith(f"models--tiny-org--tiny-eagle3/snapshots/{SHA}")
    assert [c["token_ids"] for c in ids["completions"]] == [c["token_ids"] for c in paths["completions"]]
    assert len(ids["completions"][0]["token_ids"]) == 4 and "acceptance" in ids


@pytest.mark.parametrize("argv, kind", [
    (["inspect", MISSING_ID], "checkpoint"),
    (["audit", MISSING_ID], "checkpoint"),
    (["convert", MISSING_ID, "out", "--to", "orbax"], "checkpoint"),
    (["generate", "-p", "x", "--target", TARGET_ID, "--draft", MISSING_ID], "draft"),
])
def test_not_cached_names_the_fetch_commands(hf_cache, argv, kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, argv)
    assert r.exit_code == 2, r.output
    msg = " ".join(r.output.split())
    assert f"{kind} '{MISSING_ID}' is neither a local path nor a repo id in the local HF cache" in msg
    assert "rerun with --download (or SPECJAX_ALLOW_DOWNLOAD=1)" in msg and f"`hf download {MISSING_ID}`" in msg
    assert "Traceback" not in r.output and not (tmp_path / "out").exists()


def test_target_not_cached_message(hf_cache):
    r = runner.invoke(app, ["generate", "-p", "x", "--target", MISSING_ID])
    assert r.exit_code == 2
    msg = " ".join(r.output.split())
    assert (f"target '{MISSING_ID}' is not a file, a directory, or a repo id in the local HF cache ({hf_cache}; "
            f"nothing is downloaded without an explicit opt-in): rerun with --download" in msg)
    assert f"`hf download {MISSING_ID}`" in msg and "Traceback" not in r.output


@pytest.mark.parametrize("opt_in", ["flag", "env"])
def test_download_opt_in_offline_is_a_clear_error(hf_cache, opt_in, monkeypatch):
    argv = ["inspect", MISSING_ID]
    if opt_in == "flag":
        argv.append("--download")
    else:
        monkeypatch.setenv(hub.ENV_ALLOW, "1")
    r = runner.invoke(app, argv)
    assert r.exit_code == 2, r.output
    msg = " ".join(r.output.split())
    assert (f"cannot download checkpoint '{MISSING_ID}': huggingface_hub is in offline mode (HF_HUB_OFFLINE=1) and "
            f"the repo is not in the local HF cache ({hf_cache})" in msg)
    assert f"`hf download {MISSING_ID}`" in msg and "Traceback" not in r.output
    # a cached repo still resolves under the opt-in while offline
    assert runner.invoke(app, ["inspect", DRAFT_ID, "--download", "--json"]).exit_code == 0


def test_download_happens_only_with_the_opt_in(hf_cache, models, monkeypatch):
    """Online (a stand-in for the Hub client that fills the cache as a real download would):
    without the opt-in nothing is fetched; with it the draft is downloaded and inspected."""
    import huggingface_hub

    real = huggingface_hub.snapshot_download
    calls = []

    def fake_snapshot_download(repo_id, *, local_files_only=False, **kw):
        if local_files_only:
            return real(repo_id, local_files_only=True, **kw)
        calls.append((repo_id, kw))
        return str(put_in_cache(hf_cache, repo_id, models[1], sha="f" * 40))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    remote = "tiny-org/remote-eagle3"
    r = runner.invoke(app, ["inspect", remote, "--json"])
    assert r.exit_code == 2 and calls == [] and f"hf download {remote}" in r.output
    got = _json(runner.invoke(app, ["inspect", remote, "--download", "--json"]))
    assert calls == [(remote, {"allow_patterns": hub.ALLOW_PATTERNS, "ignore_patterns": hub.IGNORE_PATTERNS})]
    assert got["algorithm"] == "eagle3"
    # now cached: later runs need no opt-in and fetch nothing
    assert runner.invoke(app, ["inspect", remote, "--json"]).exit_code == 0 and len(calls) == 1


def test_real_hub_client_from_env_cache_and_unreachable_hub(models, tmp_path):
    """The same through the environment a user sets (HF_HUB_CACHE read by huggingface_hub at
    import), in a fresh process; an opt-in download against an unreachable endpoint fails with
    one line naming the repo, not a traceback."""
    cache = tmp_path / "hub"
    put_in_cache(cache, DRAFT_ID, models[1])
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    env.pop(hub.ENV_ALLOW, None)
    cli = [sys.executable, "-m", "specjax.cli"]
    r = subprocess.run(cli + ["inspect", DRAFT_ID, "--json"], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["algorithm"] == "eagle3"
    env.update({"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "2",
                "HF_HUB_DOWNLOAD_TIMEOUT": "2"})
    r = subprocess.run(cli + ["inspect", MISSING_ID, "--download"], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, (r.stdout, r.stderr[-2000:])
    assert (f"cannot download checkpoint '{MISSING_ID}' from the Hub: the Hub at http://127.0.0.1:9 is unreachable "
            f"(ConnectError:" in r.stderr and f"`hf download {MISSING_ID}`" in r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 3, r.stderr


def test_data_prepare_download_opt_in_offline(hf_cache, tmp_path):
    """``data prepare --download`` checks its prompts, then meets the offline Hub: one message, nothing written."""
    out = tmp_path / "data"
    r = runner.invoke(app, ["data", "prepare", "--prompts", "builtin:stdlib:2", "--out", str(out),
                            "--target", MISSING_ID, "--download"])
    assert r.exit_code == 2, r.output
    msg = " ".join(r.output.split())
    assert f"cannot download target '{MISSING_ID}': huggingface_hub is in offline mode (HF_HUB_OFFLINE=1)" in msg
    assert "Traceback" not in r.output and not out.exists()

"""The bridge commands as a user runs them: output, exit codes, no tracebacks."""

import json
import os
import shutil
import subprocess
import sys

from typer.testing import CliRunner

from specjax.cli import app
from tests.bridge.headers import gemma4_31b_dflash
from tests.conftest import unreadable_modes

runner = CliRunner()


def test_inspect_reads_header_only(spec_ckpts, tmp_path):
    # a sparse, header-only checkpoint of real size inspects instantly: no tensor data is read
    d = gemma4_31b_dflash(tmp_path)
    r = runner.invoke(app, ["inspect", str(d)])
    assert r.exit_code == 0, r.output
    for s in ("dflash", "google/gemma-4-31B-it", "[1, 17, 29, 47, 58]", "262144", "32000", "fc.weight", "5376x26880"):
        assert s in r.output, s
    r = runner.invoke(app, ["inspect", str(spec_ckpts["eagle3-qwen3-bf16-pruned"]), "--json"])
    j = json.loads(r.output)
    assert j["algorithm"] == "eagle3" and j["draft_vocab_size"] == 40 and j["tensors"]["t2d"]["dtype"] == "BOOL"


def test_audit_exit_codes_and_json(spec_ckpts, verifiers, tmp_path):
    ok = runner.invoke(app, ["audit", str(spec_ckpts["eagle3-llama-f32"]), "--verifier", str(verifiers["llama"])])
    assert ok.exit_code == 0 and "OK" in ok.output
    bad = runner.invoke(app, ["audit", str(gemma4_31b_dflash(tmp_path)), "--json"])
    assert bad.exit_code == 1
    j = json.loads(bad.output)
    assert j["exit_code"] == 1 and any("speculative_tokens 8" in e["message"] for e in j["errors"])
    assert any(w["rule"] == "verifier.binding" for w in j["warnings"])
    unreadable = runner.invoke(app, ["audit", str(tmp_path / "missing")])
    assert unreadable.exit_code == 2 and "Traceback" not in unreadable.output


def test_convert_round_trip_cli(spec_ckpts, tmp_path):
    src = spec_ckpts["peagle-qwen3-bf16-pruned"]
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "o"), "--to", "orbax", "--check"])
    assert r.exit_code == 0, r.output
    assert "bit-exact" in r.output
    r = runner.invoke(app, ["convert", str(tmp_path / "o"), str(tmp_path / "s"), "--to", "speculators", "--check",
                            "--max-shard-size", "20KB"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "s" / "model.safetensors.index.json").exists()
    # existing destination is refused without --overwrite, with a message and no traceback
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "s"), "--to", "speculators"])
    assert r.exit_code == 2 and "destination exists" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "s"), "--to", "speculators", "--overwrite", "--check"])
    assert r.exit_code == 0, r.output


def test_convert_bad_source_message(tmp_path):
    (tmp_path / "x").mkdir()
    r = runner.invoke(app, ["convert", str(tmp_path / "x"), str(tmp_path / "y"), "--to", "orbax"])
    assert r.exit_code == 2 and "not a speculators checkpoint" in r.output
    assert not (tmp_path / "y").exists()


def test_convert_bad_format(spec_ckpts, tmp_path):
    r = runner.invoke(app, ["convert", str(spec_ckpts["mtp-qwen3-f32"]), str(tmp_path / "y"), "--to", "gguf"])
    assert r.exit_code == 2 and "--to must be" in r.output


def test_specjax_without_arguments_runs_the_default_model():
    r = runner.invoke(app, [])
    assert r.exit_code == 0, r.output
    assert "SmolLM2-135M-Instruct" in r.output and "Fibonacci" in r.output
    assert "def " in r.output  # the model answered the code prompt with code


def test_audit_prints_rule_names_literally(tmp_path):
    r = runner.invoke(app, ["audit", str(gemma4_31b_dflash(tmp_path))])
    assert "[dflash.speculative_tokens]" in r.output and "[verifier.binding]" in r.output


def test_converted_checkpoints_are_readable_by_others(spec_ckpts, tmp_path, umask022):
    # tempfile makes 0700 dirs / 0600 files: vLLM in a container, or another user, could not read them
    src = spec_ckpts["eagle3-qwen3-bf16-pruned"]
    for args in ([str(src), str(tmp_path / "o"), "--to", "orbax"],
                 [str(tmp_path / "o"), str(tmp_path / "s"), "--to", "speculators"],
                 [str(src), str(tmp_path / "sh"), "--to", "speculators", "--max-shard-size", "20KB", "--check"]):
        r = runner.invoke(app, ["convert", *args])
        assert r.exit_code == 0, r.output
        assert unreadable_modes(tmp_path / args[1]) == []


def _flip_last_byte(d):
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))


def test_failed_check_writes_nothing(spec_ckpts, tmp_path, monkeypatch):
    import bridge.roundtrip as rt

    real = rt.save_checkpoint

    def save_corrupted(out, *a, **kw):  # the writer loses a bit: the check must catch it
        _flip_last_byte(real(out, *a, **kw))

    monkeypatch.setattr(rt, "save_checkpoint", save_corrupted)
    src = spec_ckpts["eagle3-llama-f32"]
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "s"), "--to", "speculators", "--check"])
    assert r.exit_code == 1, r.output
    assert "--check failed" in r.output and "bytes differ" in r.output and "nothing was written" in r.output
    assert str(tmp_path / "s") in r.output and "Traceback" not in r.output
    assert os.listdir(tmp_path) == []  # no DST, no temp dir beside it
    # with --overwrite a failed check keeps the old DST as it was
    old = tmp_path / "old"
    shutil.copytree(src, old)
    r = runner.invoke(app, ["convert", str(src), str(old), "--to", "speculators", "--check", "--overwrite"])
    assert r.exit_code == 1, r.output
    assert os.listdir(tmp_path) == ["old"] and (old / "config.py").exists()


# Orbax's restore closes its event loop at the first failed read; the reads still in flight then
# print "RuntimeError: Event loop is closed" tracebacks, after the error, from tensorstore threads
CORRUPT_ORBAX_WRITE = """
import sys
import time
from pathlib import Path

import bridge.roundtrip as rt

real = rt.save_orbax


def save_corrupted(out, *a, **kw):
    out = real(out, *a, **kw)
    for f in Path(out, "params").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(b"garbage" * 10)
    return out


rt.save_orbax = save_corrupted
from specjax.cli import app

sys.argv[0] = "specjax"
try:
    app()
finally:
    time.sleep(1)  # let the reads still in flight finish, as in a process that goes on after the error
"""


def test_failed_check_of_an_unreadable_orbax_output_is_one_message(spec_ckpts, tmp_path):
    src, dst = spec_ckpts["eagle3-llama-f32"], tmp_path / "out" / "o"
    r = subprocess.run([sys.executable, "-c", CORRUPT_ORBAX_WRITE, "convert", str(src), str(dst), "--to", "orbax",
                        "--check"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert r.returncode == 2, r.stderr
    assert "could not read the output back" in r.stderr and "nothing was written" in r.stderr, r.stderr
    for s in ("Traceback", "asyncio", "Event loop", "never retrieved", ".tmp", "tensorstore_spec"):
        assert s not in r.stderr, r.stderr
    assert str(dst) in r.stderr
    assert os.listdir(tmp_path / "out") == []  # no DST, no temp dir beside it


def test_unread_tensorstore_errors_are_dropped_from_asyncio_logs_whether_future_or_task():
    """asyncio logs an orphaned tensorstore read as "Future exception was never retrieved" or, when
    the collector reaches the task awaiting it first, "Task exception was never retrieved" (seen
    once in CI): both are dropped once an Orbax read was set up; any other asyncio error still
    shows."""
    import asyncio
    import gc
    import logging

    from bridge.orbax_io import _checkpointer

    _checkpointer()  # installs the filters
    ts_error = ValueError("OUT_OF_RANGE: Error reading [tensorstore_spec='{}']")

    async def fails(e):
        raise e

    def orphan(make):
        loop = asyncio.new_event_loop()
        try:
            obj = make(loop)
            loop.run_until_complete(asyncio.sleep(0.01))
            del obj
            gc.collect()
        finally:
            loop.close()

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("asyncio")
    log.addHandler(handler)
    try:
        def failed_future(loop, e):
            f = loop.create_future()
            f.set_exception(e)
            return f

        orphan(lambda loop: loop.create_task(fails(ts_error)))
        orphan(lambda loop: failed_future(loop, ts_error))
        assert records == []
        orphan(lambda loop: loop.create_task(fails(ValueError("something else"))))
        assert len(records) == 1 and str(records[0].msg).startswith("Task exception was never retrieved")
    finally:
        log.removeHandler(handler)

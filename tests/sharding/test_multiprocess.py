"""A real multi-process run: two processes on 127.0.0.1 (gloo CPU collectives), 2 CPU devices
each, load one checkpoint sharded over all 4 devices and give the logits (and greedy tokens) of
a single process. The test starts and stops the processes itself, with a timeout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.sharding import tiny

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("mp_worker.py")
TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECJAX_", "JAX_COORDINATOR"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1",
               XLA_FLAGS=f"--xla_cpu_multi_thread_eigen=false {os.environ.get('XLA_FLAGS', '')}".strip())
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    return env


def run_workers(worker: Path, args, timeout_s: int, n: int = 2) -> list[str]:
    """Start ``n`` processes of ``worker`` (``args(i, port)``: its command-line arguments) with one
    free coordinator port, wait for all of them (killing every one on a timeout or failure) and
    fail the test, with the tail of its log, if any exits non-zero. Returns their logs."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(worker), *map(str, args(i, port))], env=_env(), cwd=str(ROOT),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(n)]
    logs = []
    try:
        for p in procs:
            try:
                logs.append(p.communicate(timeout=timeout_s)[0])
            except subprocess.TimeoutExpired:
                pytest.fail(f"a worker did not finish within {timeout_s}s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"worker {i} exited {p.returncode}:\n" + "\n".join(logs[i].splitlines()[-40:])
    return logs


def test_two_processes_load_sharded_and_match_one_process(tmp_path):
    target = tiny.write_target(tmp_path / "target")
    ids = np.random.default_rng(0).integers(3, tiny.V, (4, 9)).astype(np.int32)
    out = tmp_path / "out"
    out.mkdir()
    (out / "ids.json").write_text(json.dumps(ids.tolist()))
    run_workers(WORKER, lambda i, port: [i, 2, port, target, out], TIMEOUT_S)

    # the same computation in this (single-device) process
    from specjax.decode.generate import generate_ids
    from specjax.models.hf import load_hf_dir

    ref = load_hf_dir(target)
    want = np.asarray(ref(ids).logits)
    got = np.load(out / "logits.npy")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    want_tokens = generate_ids(ref, ids[:3, :5].tolist(), max_new_tokens=4, eos_token_ids=[]).tokens

    seen = [json.loads((out / f"proc{i}.json").read_text()) for i in range(2)]
    assert [s["process_index"] for s in seen] == [0, 1]
    assert [s["main"] for s in seen] == [True, False]
    for s in seen:
        assert (s["process_count"], s["devices"], s["local_devices"]) == (2, 4, 2)
        assert s["tokens"] == want_tokens
        q = s["specs"]["model.layers.0.self_attn.q_proj.kernel"]
        assert q[0] == ["fsdp", "tensor"] and q[1] == 2 and q[2] == [tiny.H // 2, tiny.NH * tiny.HD // 2]
        assert s["specs"]["model.norm.scale"][0] == []
        # each process read only its half of a tensor split over processes (fsdp spans them)
        full = tiny.H * tiny.NH * tiny.HD * 4
        assert s["bytes_read"]["model.layers.0.self_attn.q_proj.kernel"] == full // 2
        assert s["bytes_read"]["lm_head.kernel"] == tiny.H * tiny.V * 4 // 2

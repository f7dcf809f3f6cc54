"""The speculative loop on 8 fake CPU devices: runs spec_mesh_suite.py in ONE subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the device count is fixed before jax
starts; the rest of the suite keeps one device in this process).

``--xla_backend_optimization_level=0`` halves XLA:CPU compile time (a dozen loop programs compile
here; the runs themselves are tiny). Single-device references and sharded runs are compiled
alike in the same process, so the equality checks are unaffected."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITE = Path(__file__).with_name("spec_mesh_suite.py")
TIMEOUT_S = 420


def test_speculative_loop_on_eight_devices():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
    for k in [k for k in env if k.startswith(("SPECJAX_COORDINATOR", "SPECJAX_NUM_PROCESSES", "SPECJAX_PROCESS_ID",
                                              "SPECJAX_MESH", "SPECJAX_CACHE_DIR"))]:
        env.pop(k)
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                            "-o", "addopts=", "-rfEsxX", "--durations=8", str(SUITE)], cwd=str(ROOT), env=env,
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or "")[-4000:]
        raise AssertionError(f"8-device speculative suite did not finish in {TIMEOUT_S}s:\n{tail}") from e
    out = r.stdout + r.stderr
    assert r.returncode == 0, "8-device speculative suite failed:\n" + out[-8000:]
    summary = [line for line in out.splitlines() if line.strip()][-1]
    assert "passed" in summary and "skipped" not in summary and "failed" not in summary, out[-2000:]

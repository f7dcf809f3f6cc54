"""Runs mesh8_suite.py in a subprocess with 8 fake CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``): the rest of the suite keeps its
single device in this process, and the device count is fixed before jax starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITE = Path(__file__).with_name("mesh8_suite.py")
TIMEOUT_S = 420


def test_eight_device_suite():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    for k in [k for k in env if k.startswith(("SPECJAX_COORDINATOR", "SPECJAX_NUM_PROCESSES", "SPECJAX_PROCESS_ID",
                                              "SPECJAX_MESH"))]:
        env.pop(k)
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                            "-o", "addopts=", "-rfEsxX", str(SUITE)], cwd=str(ROOT), env=env, capture_output=True,
                           text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"8-device suite did not finish in {TIMEOUT_S}s:\n{(e.stdout or '')[-4000:]}") from e
    out = r.stdout + r.stderr
    assert r.returncode == 0, "8-device suite failed:\n" + out[-8000:]
    summary = [line for line in out.splitlines() if line.strip()][-1]
    assert "passed" in summary and "skipped" not in summary, out[-2000:]

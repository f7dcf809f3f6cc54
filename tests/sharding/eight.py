"""Running a script or a pytest suite in a subprocess with 8 fake CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``): the device count is fixed before jax
starts, and the rest of the suite keeps one device in this process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_DROP = ("SPECJAX_COORDINATOR", "SPECJAX_NUM_PROCESSES", "SPECJAX_PROCESS_ID", "SPECJAX_MESH", "SPECJAX_CACHE_DIR",
         "JAX_COORDINATOR")


def run_eight(args: list[str], *, what: str, timeout_s: int, xla_flags: str = "") -> str:
    """``python ARGS`` from the repository root with 8 CPU devices and no multi-process or mesh
    settings inherited; fails with the tail of the output on a timeout or a non-zero exit.
    Returns stdout + stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP)}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {xla_flags} {os.environ.get('XLA_FLAGS', '')}".strip())
    try:
        r = subprocess.run([sys.executable, *args], cwd=str(ROOT), env=env, capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{what} did not finish in {timeout_s}s:\n{(e.stdout or '')[-4000:]}") from e
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{what} failed:\n" + out[-8000:]
    return out


def run_eight_suite(suite: Path, *, what: str, timeout_s: int, xla_flags: str = "") -> None:
    """A pytest file under 8 devices; every test must pass (none skipped or failed; strict xfails allowed)."""
    out = run_eight(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", "-o", "addopts=", "-rfEsxX",
                     "--durations=8", str(suite)], what=what, timeout_s=timeout_s, xla_flags=xla_flags)
    summary = [line for line in out.splitlines() if line.strip()][-1]  # "16 passed, 1 xfailed in 26.1s"
    assert re.search(r"\d+ passed", summary) and not re.search(r"\d+ (failed|skipped|errors?)\b", summary), out[-2000:]

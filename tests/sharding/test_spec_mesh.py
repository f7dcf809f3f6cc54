"""The speculative loop on 8 fake CPU devices: runs spec_mesh_suite.py in ONE subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the device count is fixed before jax
starts; the rest of the suite keeps one device in this process).

``--xla_backend_optimization_level=0`` halves XLA:CPU compile time (a dozen loop programs compile
here; the runs themselves are tiny). Single-device references and sharded runs are compiled
alike in the same process, so the equality checks are unaffected."""

from __future__ import annotations

from pathlib import Path

from tests.sharding.eight import run_eight_suite

SUITE = Path(__file__).with_name("spec_mesh_suite.py")
TIMEOUT_S = 420


def test_speculative_loop_on_eight_devices():
    run_eight_suite(SUITE, what="8-device speculative suite", timeout_s=TIMEOUT_S,
                    xla_flags="--xla_backend_optimization_level=0")

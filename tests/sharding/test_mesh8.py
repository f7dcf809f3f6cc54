"""Runs mesh8_suite.py in a subprocess with 8 fake CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``): the rest of the suite keeps its
single device in this process, and the device count is fixed before jax starts."""

from __future__ import annotations

from pathlib import Path

from tests.sharding.eight import run_eight_suite

SUITE = Path(__file__).with_name("mesh8_suite.py")
TIMEOUT_S = 420


def test_eight_device_suite():
    run_eight_suite(SUITE, what="8-device suite", timeout_s=TIMEOUT_S)

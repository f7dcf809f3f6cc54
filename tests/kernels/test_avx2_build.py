"""The CPU kernels built for a CPU without AVX-512 (``SPECJAX_KERNEL_ARCH=haswell``: AVX2 and FMA,
what most laptops and AMD Zen 2/3 servers have), where they take their own code paths: the matmul
kernels' 8-column strips, the 8-lane halves of the attention's exp and the argmax's lanes, the
k-pair kernel's two float32 FMAs a pair. The same kernel tests run in a subprocess on that build
(this host's own build runs them in the main suite); the build must not use vdpbf16ps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specjax import kernels
from specjax.models import panels

ROOT = Path(__file__).resolve().parents[2]
TESTS = [
    "tests/kernels/test_native_ops.py",
    "tests/models/test_panels.py::test_kernel_matches_float64",
    "tests/models/test_panels.py::test_bf16_panels_give_the_float32_kernels_bits",
    "tests/models/test_panels.py::test_kernel_rows_do_not_depend_on_the_other_rows",
    "tests/models/test_panels.py::test_bf16_dot_kernel_matches_bf16_products",
    "tests/models/test_panels.py::test_decode_attention_equals_masked_attention",
    "tests/models/test_panels.py::test_range_attention_on_a_seq_major_draft_cache_equals_cache_mask",
    "tests/models/test_rows_alike.py",
]


@pytest.mark.skipif(not kernels.available() or not (panels.host_has_flag("avx2") and panels.host_has_flag("fma")),
                    reason="CPU kernels unavailable, or the CPU cannot run an AVX2 build")
def test_kernels_built_for_avx2_pass_the_kernel_tests():
    env = dict(os.environ, SPECJAX_KERNEL_ARCH="haswell")
    probe = subprocess.run([sys.executable, "-c", "from specjax import kernels; assert kernels.available('cpu'), "
                            "kernels.status(); print(kernels.dpbf16(), kernels.amx_tiles())"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split() == ["False", "False"], probe.stdout
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *TESTS],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and " failed" not in res.stdout, res.stdout[-2000:]

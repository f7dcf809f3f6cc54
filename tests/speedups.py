"""How the suite's Python processes (the pytest workers, the 8-device subprocess suites, the
notebook kernels) spend less time collecting garbage and compiling, measured at XLA:CPU -O0 on
the 2-core CI machine. Nothing here changes what the tests check (the older emitters may round
elementwise math differently in the last bits; every assertion holds); :func:`apply` is called once
per process before JAX compiles anything (tests/conftest.py, tests/notebooks/runner.py)."""

from __future__ import annotations

import gc
import os

# Python's cyclic collector, at its default first threshold (700 allocations), ran about 3000 times
# in 30 s of tracing and compiling (tests/decode/test_tree_loop.py's greedy tests): 3.0 s, a tenth of
# the run, most of it walking the large heap torch, jax and the test models leave. Collecting the
# youngest generation every 50,000 allocations instead ran 32 collections, 0.6 s. Reference cycles
# (traced jaxprs) are still freed, a little later; release_caches() collects at each file's end.
GC_THRESHOLDS = (50_000, 20, 10)

# XLA:CPU's MLIR fusion emitters pay a fixed cost per compile that dominates the suite's small
# programs (about 10,000 eager ops, and most jitted steps of the tiny models); its older elemental
# emitters compile those much faster but are slower on big unrolled loops. Backend compile seconds,
# new -> old emitters: an eager op 0.026 -> about 0.012, a tiny model's train step (62 KB of
# StableHLO bytecode) 1.9 -> 1.0, a tiny tree loop (142 KB) 2.5 -> 2.3, but SmolLM2's generate loop
# (174 KB) 2.4 -> 3.7 and its tree loop (746 KB) 17.7 -> 40.1. So CPU programs under
# SMALL_PROGRAM_BYTES compile with the old emitters; SPECJAX_TEST_SMALL_PROGRAM_BYTES=0 turns it off.
SMALL_PROGRAM_BYTES = int(os.environ.get("SPECJAX_TEST_SMALL_PROGRAM_BYTES", "150000"))

_applied = False


def _small_cpu_programs_on_elemental_emitters(limit: int) -> None:
    from jax._src import compiler
    from jax._src.interpreters import mlir

    compile_ = compiler.backend_compile_and_load

    def backend_compile_and_load(backend, module, executable_devices, options, host_callbacks):
        if getattr(backend, "platform", None) == "cpu" and len(mlir.module_to_bytecode(module)) < limit:
            options.env_option_overrides = [*options.env_option_overrides, ("xla_cpu_use_fusion_emitters", False)]
        return compile_(backend, module, executable_devices, options, host_callbacks)

    compiler.backend_compile_and_load = backend_compile_and_load


def apply() -> None:
    """Set the collector's thresholds and route small CPU programs to the elemental emitters (once)."""
    global _applied
    if _applied:
        return
    _applied = True
    gc.set_threshold(*GC_THRESHOLDS)
    if SMALL_PROGRAM_BYTES > 0:
        _small_cpu_programs_on_elemental_emitters(SMALL_PROGRAM_BYTES)


def release_caches() -> None:
    """JAX's compiled programs and traces, and the garbage they keep, freed (a test file's end):
    a pytest worker otherwise holds every program of every file it ran."""
    import sys

    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()

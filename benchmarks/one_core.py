"""One CPU core for a benchmark process, set before jax or torch is imported.

``--xla_cpu_multi_thread_eigen=false`` alone does not make XLA single-threaded: its CPU runtime
still runs fused dots on a pool of its own (measured: the EAGLE-3 train step took 0.91 s of wall
time for 1.72 s of CPU time). Pinning the process to one core gives both sides of a comparison
the same single core, whatever threads they start.

    import one_core; PINNED = one_core.pin()   # first thing in a benchmark script
"""

from __future__ import annotations

import os

ENV = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
       "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false"}


def pin() -> dict:
    """Set ``ENV`` (XLA flags appended to any given), pin this process and its children to its
    lowest allowed core; returns what was set, for the benchmark's JSON line."""
    for k, v in ENV.items():
        os.environ[k] = f"{os.environ.get(k, '')} {v}".strip() if k == "XLA_FLAGS" else v
    core = None
    if hasattr(os, "sched_setaffinity"):
        core = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
    return {"core": core, "XLA_FLAGS": os.environ["XLA_FLAGS"], "OMP_NUM_THREADS": "1"}

#!/usr/bin/env bash
# The test command: set up .venv with the test references (torch CPU, speculators 0.9.0,
# transformers 5.19.0), then run the whole suite.  Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh" test
cd "$ROOT"
export JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# No persistent compilation cache in the suite: twice in a row (2026-12-03) a worker died in XLA:CPU's
# executable serialization while writing a SmolLM2 decode loop to it (a segfault inside
# `executable.serialize()`, jax 0.10.2), so the suite compiles every program in each process instead.
unset JAX_COMPILATION_CACHE_DIR
export SPECJAX_COMPILATION_CACHE=0
# XLA:CPU compiles the suite's programs at LLVM -O0: most tests run tiny models, so compiling dominates
# them (tests/decode/test_speculative.py 130 -> 84 s); matmuls still run in the precompiled
# Eigen/oneDNN kernels and the native CPU kernels are built by g++ as usual, so even the SmolLM2
# end-to-end tests got faster.  Every test and subprocess compiles alike (tests/sharding/eight.py and
# the multi-process tests pass these flags on); SPECJAX_TEST_XLA_FLAGS="" tests the optimised codegen.
export XLA_FLAGS="${SPECJAX_TEST_XLA_FLAGS---xla_backend_optimization_level=0} ${XLA_FLAGS:-}"
# --max-worker-restart=0: a worker that dies (a segfault in native code) fails the run at once and names its
# test; with restarts, xdist's loadfile scheduler can wait forever for the replacement (pytest-xdist #784)
exec "$ROOT/.venv/bin/python" -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 --durations=15 "$@"

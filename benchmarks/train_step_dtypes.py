"""The EAGLE-3 TTT train step (SmolLM2-sized one-layer draft, 3 TTT steps, draft vocabulary 8192)
with bf16 products over float32 master weights against float32 throughout, on both cores, one
process, the two steps interleaved (best of --repeats timings of --steps steps each). The main
recipe's `trainer.compute_dtype: bfloat16` is a TPU habit; this measures what it does on this CPU,
where XLA runs a bf16 x bf16 -> f32 dot on its native bf16 path. Prints one JSON line:

    {"bf16_s_per_step", "f32_s_per_step", "ratio" (bf16 / f32), ...}

    .venv/bin/python benchmarks/train_step_dtypes.py [--tokens 320] [--optimizer muon|adamw] [--steps 5]

The packed row is benchmarks/eagle3_row.py's, as train_step.py's (speculators' collate: the test venv).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=320)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--optimizer", default="muon", choices=["muon", "adamw"])
    ap.add_argument("--ns-steps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()

    import jax
    from flax import nnx

    from eagle3_row import SMOL, jax_batch, make_batch, smol_draft  # not train_step: importing it pins the process to one core
    from specjax.train.algorithms.base import trainable_filter_for
    from specjax.train.config import load_recipe
    from specjax.train.export import init_draft
    from specjax.train.optim import build_optimizer
    from specjax.train.step import TRACE_COUNT, make_step_fns

    V, H, Vd = SMOL["vocab_size"], SMOL["hidden_size"], args.draft_vocab
    target, doc, t2d, d2t = smol_draft(Vd)
    batch = make_batch(args.tokens, H, V)
    sides, losses = {}, {}
    for compute in ("bfloat16", "float32"):
        _, model = init_draft(doc, target, seed=0, t2d=t2d, d2t=d2t)
        rcfg = load_recipe(None, [f"optimizer.optimizer={args.optimizer}", "scheduler.scheduler_type=none",
                                  f"trainer.compute_dtype={compute}"])
        graphdef, params, frozen = nnx.split(model, nnx.All(nnx.Param, trainable_filter_for("eagle3")), ...)
        tx, _ = build_optimizer(params, optimizer=args.optimizer, lr=1e-4, weight_decay=0.01, muon_lr=1e-4,
                                muon_momentum=0.95, muon_weight_decay=0.1, muon_ns_steps=args.ns_steps,
                                muon_adjust_lr_fn="match_rms_adamw", scheduler_type="none", warmup=0, total=1)
        state = tx.init(params)
        fns = make_step_fns(graphdef, frozen, tx, rcfg)
        jb = jax_batch(batch)
        for _ in range(2):  # compile, warm up
            params, state, m = fns.train_step(params, state, jb)
        jax.block_until_ready(params)
        losses[compute] = float(m["loss"][0])
        sides[compute] = [fns, params, state, jb, []]
    for _ in range(args.repeats):
        for side in sides.values():
            fns, params, state, jb, times = side
            t = time.perf_counter()
            for _ in range(args.steps):
                params, state, _ = fns.train_step(params, state, jb)
            jax.block_until_ready(params)
            times.append((time.perf_counter() - t) / args.steps)
            side[1], side[2] = params, state
    b, f = min(sides["bfloat16"][4]), min(sides["float32"][4])
    print(json.dumps({
        "benchmark": "eagle3_train_step_dtypes", "tokens": args.tokens, "draft_vocab": Vd, "optimizer": args.optimizer,
        "ns_steps": args.ns_steps if args.optimizer == "muon" else None, "threads": "all",
        "bf16_s_per_step": round(b, 4), "f32_s_per_step": round(f, 4), "ratio": round(b / f, 3),
        "all_s_per_step": {k: [round(x, 4) for x in v[4]] for k, v in sides.items()},
        "loss_after_2_steps": {k: round(v, 5) for k, v in losses.items()}, "compiles": TRACE_COUNT["train_step"],
    }))


if __name__ == "__main__":
    main()

"""EAGLE-3 TTT train step, specjax vs speculators 0.9.0, side by side in one run.

Both train the same SmolLM2-sized draft (hidden 576, 9/3 heads, intermediate 1536, verifier
vocab 49152, one layer, 3 TTT steps, norm_before_fc + norm_output as the TrainConfig defaults)
from identical initial parameters on the same fixed packed row (random hidden states, several
documents), with the same optimizer (AdamW, lr 1e-4, wd 0.01, grad clip 1.0) and bf16 compute
over float32 master weights (speculators: ``torch.autocast("cpu", bfloat16)``, eager kl_div loss,
sdpa attention; specjax: the jitted trainer step). One core each: the process is pinned to one
core (``one_core.py``; XLA's CPU runtime otherwise runs fused dots on a pool of its own) and
``torch.set_num_threads(1)``. Seconds are CPU seconds of the process per step (wall seconds are
reported too; on a shared machine they include waiting). Prints one JSON line:

    {"specjax_s_per_step", "speculators_s_per_step", "ratio" (specjax / speculators), ...}

    .venv/bin/python benchmarks/train_step.py [--tokens 1024] [--draft-vocab 8192] [--steps 5]
"""

from __future__ import annotations

import argparse
import sys

import one_core  # noqa: E402  (benchmarks/ is the script directory)

THREADS = one_core.pin()

import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3_row import SMOL, jax_batch, make_batch, smol_draft  # noqa: E402  (benchmarks/ is the script directory)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compute", default="bfloat16", help="specjax compute dtype (bfloat16 | float32)")
    args = ap.parse_args()

    import jax
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    from specjax.train.config import load_recipe
    from specjax.train.export import init_draft
    from specjax.train.step import TRACE_COUNT, make_step_fns
    from specjax.train.algorithms.base import FROZEN, trainable_filter_for
    from specjax.train.optim import build_optimizer
    from flax import nnx

    V, H, Vd = SMOL["vocab_size"], SMOL["hidden_size"], args.draft_vocab
    target, doc, t2d, d2t = smol_draft(Vd)
    _, model = init_draft(doc, target, seed=0, t2d=t2d, d2t=d2t)
    batch = make_batch(args.tokens, H, V)

    # ---------------- speculators (PyTorch, one thread on the pinned core)
    import speculators.models  # noqa: F401
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from specjax.train.export import model_flat

    with tempfile.TemporaryDirectory() as tmp:
        cfg_doc = dict(doc)
        cfg_doc["speculators_config"] = dict(doc["speculators_config"], verifier={"architectures": ["LlamaForCausalLM"],
                                                                                 "name_or_path": None})
        (Path(tmp) / "config.json").write_text(json.dumps(cfg_doc))
        scfg = Eagle3SpeculatorConfig.from_pretrained(tmp)
    scfg.transformer_layer_config._attn_implementation = "sdpa"
    tm = Eagle3DraftModel(scfg)
    sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in model_flat(model).items()}
    tm.load_state_dict(sd, strict=True)
    tm.float().train()
    for n, p in tm.named_parameters():
        p.requires_grad_(not any(f in n.split(".")[0] for f in FROZEN))
    opt = torch.optim.AdamW([p for p in tm.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01)
    loss_cfg = resolve_loss_config("kl_div", "eager")

    def torch_step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss, _ = tm(**batch, ttt_steps=3, ttt_step_loss_decay=1.0, loss_config=loss_cfg)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tm.parameters(), 1.0)
        opt.step()
        return float(loss)

    for _ in range(args.warmup):
        torch_step()
    t, c = time.perf_counter(), time.process_time()
    tl = [torch_step() for _ in range(args.steps)]
    t_torch, c_torch = (time.perf_counter() - t) / args.steps, (time.process_time() - c) / args.steps

    # ---------------- specjax (JAX, on the pinned core)
    rcfg = load_recipe(None, ["optimizer.optimizer=adamw", "optimizer.lr=1e-4", "scheduler.scheduler_type=none",
                              f"trainer.compute_dtype={args.compute}"])
    graphdef, params, frozen = nnx.split(model, nnx.All(nnx.Param, trainable_filter_for("eagle3")), ...)
    tx, _ = build_optimizer(params, optimizer="adamw", lr=1e-4, weight_decay=0.01, muon_lr=1e-4, muon_momentum=0.95,
                            muon_weight_decay=0.1, muon_ns_steps=5, muon_adjust_lr_fn="match_rms_adamw",
                            scheduler_type="none", warmup=0, total=1)
    opt_state = tx.init(params)
    fns = make_step_fns(graphdef, frozen, tx, rcfg)
    jb = jax_batch(batch)
    jl = []
    for _ in range(args.warmup):
        params, opt_state, m = fns.train_step(params, opt_state, jb)
        jax.block_until_ready(params)
    t, c = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        params, opt_state, m = fns.train_step(params, opt_state, jb)
        jl.append(float(m["loss"][0]))
    jax.block_until_ready(params)
    t_jax, c_jax = (time.perf_counter() - t) / args.steps, (time.process_time() - c) / args.steps
    print(json.dumps({
        "benchmark": "eagle3_ttt_train_step", "tokens": args.tokens, "draft_vocab": Vd, "verifier_vocab": V,
        "hidden": H, "ttt_steps": 3, "optimizer": "adamw", "threads": 1, "pinned": THREADS, "compute": f"speculators bf16 autocast, specjax {args.compute}; f32 master",
        "specjax_s_per_step": round(c_jax, 4), "speculators_s_per_step": round(c_torch, 4),
        "ratio": round(c_jax / c_torch, 3), "wall_s_per_step": {"specjax": round(t_jax, 4), "speculators": round(t_torch, 4)},
        "timing": "CPU seconds of this process per step (robust to other load; one core each)", "compiles": TRACE_COUNT["train_step"],
        "first_loss": {"specjax": round(jl[0], 5), "speculators": round(tl[0], 5)},
    }))


if __name__ == "__main__":
    main()

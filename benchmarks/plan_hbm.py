"""HBM traffic of the Llama-3.1-8B decode programs on a TPU slice, compiled deviceless (libtpu).

Compiles each decode program (one generate step, one k=3 speculative round; on request one token-tree
round, ``--programs tree --tree PATHS``) at two target depths,
reads ``hbm_bytes`` (specjax/plan/hbm.py) and XLA's ``bytes accessed``, and extrapolates linearly to
the full depth (the layers are identical programs). Prints one JSON line: per program the bytes
per chip, their ratio to the floor (weights + KV cache per chip) and the roofline.

    TPU_ACCELERATOR_TYPE=v5litepod-8 python benchmarks/plan_hbm.py [--topology v5e:2x4] [--recipe RECIPE]
        [--programs generate,speculate,tree] [--tree "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]"]

About 10 minutes on a 2-core host (8 compiles).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.config import TargetConfig
from specjax.models.presets import target_config_for
from specjax.models.target import KVCache, build_model
from specjax.plan import plan
from specjax.plan.topology import chip_of
from specjax.train.config import load_recipe

RECIPE = "configs/eagle3-llama3.1-8b-tpu.yaml"


def floor_bytes(cfg: TargetConfig, batch: int, slots: int, tensor: int) -> float:
    """What one decode step must read per chip: the target's bf16 params (the model's own, abstract)
    without the embedding table (a step reads one row of it), plus the KV cache, split over
    ``tensor`` (the small replicated norms counted split too)."""
    state = nnx.state(build_model(cfg, param_dtype=jnp.bfloat16, abstract=True))
    weights = sum(x.size * x.dtype.itemsize for kp, x in jax.tree_util.tree_flatten_with_path(state)[0]
                  if "embed_tokens" not in jax.tree_util.keystr(kp))
    cache = jax.eval_shape(lambda: KVCache.init(cfg, batch, slots, jnp.bfloat16))
    kv = sum(x.size * x.dtype.itemsize for x in (*cache.k, *cache.v))
    return (weights + kv) / tensor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--topology", default="v5e:2x4")
    ap.add_argument("--recipe", default=RECIPE, help="a TPU recipe (default: %(default)s)")
    ap.add_argument("--programs", default="generate,speculate", help="of generate, speculate, tree")
    ap.add_argument("--tree", default=None, help="the tree program's speculative_token_tree path list")
    args = ap.parse_args()
    depths_of = {"generate": (2, 4), "speculate": (4, 6), "tree": (4, 6)}  # the default aux ids need 4 layers
    cfg = load_recipe(args.recipe)
    tc = target_config_for(cfg.target)
    chip = chip_of(args.topology)
    out = {"topology": args.topology, "target": str(cfg.target), "layers": tc.num_hidden_layers}
    for prog in args.programs.split(","):
        depths = depths_of[prog]
        for B in (1, 8):
            rows = [plan(cfg, args.topology, programs=prog, batch=B, target_overrides={"num_hidden_layers": d},
                         tree=args.tree)[0] for d in depths]
            (a, ra), (b, rb) = zip(depths, rows)
            ext = lambda f: f(ra) + (tc.num_hidden_layers - a) * (f(rb) - f(ra)) / (b - a)  # noqa: E731
            hbm, xla, flops = ext(lambda r: r.hbm_bytes), ext(lambda r: r.bytes), ext(lambda r: r.flops)
            slots = int(ra.shape.get("cache_slots", 4096))
            fl = floor_bytes(tc, B, slots, 8)
            t = max(hbm / (chip.hbm_gbps * 1e9), flops / (chip.peak_tflops * 1e12))
            out[f"{prog}_b{B}"] = {"hbm_gb": round(hbm / 1e9, 3), "xla_gb": round(xla / 1e9, 3),
                                   "floor_gb": round(fl / 1e9, 3), "hbm_over_floor": round(hbm / fl, 3),
                                   "xla_over_hbm": round(xla / hbm, 2), "roofline_ms": round(t * 1e3, 3),
                                   "tok_per_s": round(ra.tokens / t, 1), **({"nodes": ra.shape["nodes"]}
                                                                             if prog == "tree" else {})}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

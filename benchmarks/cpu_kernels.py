"""The CPU panel kernel (``specjax.kernels``, ``specjax.models.panels``) against XLA's dot, side by
side in one run, on the embedded SmolLM2-135M-Instruct (float32):

* ``layers``: the 210 linear layers of SmolLM2 (30 x q, k, v, o, gate, up, down; random weights of
  its shapes, 424 MB) chained so each product feeds the next, 10 passes per timed call, at 1, 4,
  8, 16, 32 and 64 rows (the batch, or the k+1 tokens a verify forward scores per sequence). Reports ms
  per pass, the weight stream rate in GB/s and panel / XLA.
* ``step``: one decode step of the real model (cache of 320 slots, 250 filled) at batch 1, 4,
  16, 32 and 64, the plain params against their panel view (``panels.decode_state``), and the greedy token of each.
* ``bf16dot``, beside both: the bf16-compute kernel (``decode_state(compute="bfloat16")``: bf16
  products over k-pair panels, ``vdpbf16ps``, or the AMX tiles where the CPU has them), what
  ``data prepare --compute-dtype bfloat16`` regenerates with; its tokens are compared with the
  float32 panels' (bf16 products may break a near tie differently).
* ``bf16xla``: the same bf16 arithmetic on XLA's bf16 dot over the weights in bfloat16 (the
  ``"dot"`` layout, ``panels.bf16_layout``), which a CPU with AMX tiles also runs on them (taken
  only where the kernel was built without them). Rows up to 64 (a regeneration batch).

Prints one JSON line; ``*_ratio`` = panel time / XLA time (< 1: the kernel is faster)::

    .venv/bin/python benchmarks/cpu_kernels.py [--repeats 8]

Threads: XLA's default (one per core), as ``specjax bench`` runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]


def _time(fn, args, repeats: int, per: int = 1) -> float:
    import numpy as np

    fn(*args)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn(*args)
        getattr(out, "block_until_ready", lambda: None)()
        ts.append((time.perf_counter() - t) / per)
    return float(np.median(ts))


def layers(repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.models import panels

    rng = np.random.default_rng(0)
    plain = [[jnp.asarray(rng.standard_normal(s, np.float32) * 0.02) for s in SHAPES] for _ in range(30)]
    packed = [[panels.pack(w) for w in layer] for layer in plain]
    pairs = [[panels.pack_pairs(w) for w in layer] for layer in plain]
    dots = [[panels.pack_dot(w) for w in layer] for layer in plain]
    nbytes = sum(w.size * 4 for layer in plain for w in layer)

    def body(h, ws, mm):  # each product feeds the next: no two calls overlap
        for layer in ws:
            for w in layer:
                k = {2: w.shape[0], 3: w.shape[1], 4: 2 * w.shape[1]}[w.ndim]
                y = mm(h if k == 576 else jnp.tile(h, (1, 3))[:, :k], w)
                if y.shape[1] >= 576:
                    h = h + 1e-3 * y[:, :576]
        return h

    out = {}
    for m in (1, 4, 8, 16, 32, 64):
        x = jnp.asarray(rng.standard_normal((m, 576), np.float32))
        row = {}
        for name, mm, ws in (("xla", jnp.matmul, plain), ("panel", panels.matmul, packed),
                             ("bf16dot", panels.matmul, pairs), ("bf16xla", panels.matmul, dots)):
            f = jax.jit(lambda x, ws, mm=mm: jax.lax.fori_loop(0, 10, lambda i, h: body(h, ws, mm), x))
            t = _time(f, (x, ws), repeats, per=10)
            row[f"{name}_ms"] = round(1e3 * t, 3)
            row[f"{name}_GBps"] = round(nbytes / t / 1e9, 1)  # float32 bytes of the weights, for every side
        row["ratio"] = round(row["panel_ms"] / row["xla_ms"], 3)
        row["bf16dot_over_panel"] = round(row["bf16dot_ms"] / row["panel_ms"], 3)
        row["bf16xla_over_bf16dot"] = round(row["bf16xla_ms"] / row["bf16dot_ms"], 3)
        out[f"rows_{m}"] = row
    return out


def step(repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from specjax.models import panels
    from specjax.models.loading import load_target
    from specjax.models.target import KVCache

    model = load_target("default", progress=False).model
    graphdef, state = nnx.split(model)
    view = panels.decode_state(model, state)

    def bf16_view(layout: str, rows: int):
        before = os.environ.get("SPECJAX_BF16_DOT")
        os.environ["SPECJAX_BF16_DOT"] = layout
        try:
            return panels.decode_state(model, state, compute="bfloat16", rows=rows)
        finally:
            if before is None:
                del os.environ["SPECJAX_BF16_DOT"]
            else:
                os.environ["SPECJAX_BF16_DOT"] = before

    @functools.partial(jax.jit, donate_argnums=(2,))
    def run(st, ids, cache):
        out = nnx.merge(graphdef, st)(ids, cache=cache, logits_at=jnp.zeros((ids.shape[0],), jnp.int32))
        return jnp.argmax(out.logits, -1), out.cache.rollback(cache.lengths)

    out = {}
    for b in (1, 4, 16, 32, 64):
        ids = jnp.asarray(np.arange(1, b + 1)[:, None] * 101, jnp.int32)
        box = [KVCache.init(model.config, b, 320, jnp.float32, lengths=jnp.full((b,), 250, jnp.int32))]

        def call(st):
            tok, box[0] = run(st, ids, box[0])
            return tok

        row, toks = {}, {}
        for name, st in (("xla", state), ("panel", view), ("bf16dot", bf16_view("kernel", b)),
                         ("bf16xla", bf16_view("xla", b))):
            row[f"{name}_ms"] = round(1e3 * _time(call, (st,), repeats), 3)
            toks[name] = np.asarray(call(st)).tolist()
        row["ratio"] = round(row["panel_ms"] / row["xla_ms"], 3)
        row["bf16dot_over_panel"] = round(row["bf16dot_ms"] / row["panel_ms"], 3)
        row["same_tokens"] = toks["xla"] == toks["panel"]
        row["bf16dot_same_tokens"] = toks["bf16dot"] == toks["panel"]
        row["bf16xla_over_bf16dot"] = round(row["bf16xla_ms"] / row["bf16dot_ms"], 3)
        row["bf16xla_same_tokens"] = toks["bf16xla"] == toks["panel"]
        out[f"batch_{b}"] = row
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    from specjax import kernels

    if not kernels.available():
        raise SystemExit(f"the CPU kernels are not available here: {kernels.status()}")
    print(json.dumps({"layers": layers(args.repeats), "step": step(3 * args.repeats), "kernels": kernels.status()}))


if __name__ == "__main__":
    main()

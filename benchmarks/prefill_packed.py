"""Packed vs right-padded prefill on the embedded SmolLM2-135M-Instruct (float32), side by side in
one run: a batch of chat-length prompts of ragged lengths (default 98/195/64/70 tokens, the spread
of the held-out code prompts), padded to ``--bucket`` (224: what ``specjax bench`` pads those
prompts to). Both layouts run the same ``generate_ids`` (``packed_len=None`` vs the packed row),
interleaved, best of ``--repeats``; the prefill alone is one generated token, the decode step
is (96 tokens - 1 token) / 95. Greedy outputs of the two layouts are compared token for token.
Prints one JSON line::

    {"padded": {...}, "packed": {...}, "prefill_ratio" (packed / padded), "tok_s_ratio", ...}

    .venv/bin/python benchmarks/prefill_packed.py [--lens 98,195,64,70] [--bucket 224] [--repeats 3]

Threads: XLA's default (one per core), as ``specjax bench`` runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="98,195,64,70")
    ap.add_argument("--bucket", type=int, default=224)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import numpy as np

    from specjax.decode.batch import packed_length
    from specjax.decode.generate import generate_ids
    from specjax.models.loading import load_target

    lt = load_target("default", progress=False)
    lens = [int(x) for x in args.lens.split(",")]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, lt.config.vocab_size, n).tolist() for n in lens]
    packed = packed_length(lens, args.bucket)
    if packed is None:
        raise SystemExit(f"prompts of {lens} padded to {args.bucket}: packing would not be shorter")
    layouts = {"padded": None, "packed": packed}

    def run(layout, n):
        return generate_ids(lt.model, prompts, max_new_tokens=n, eos_token_ids=[], prompt_bucket=args.bucket,
                            packed_len=layouts[layout])

    for layout in layouts:  # compile both token budgets of both layouts
        run(layout, 1), run(layout, args.new_tokens)
    best = {(lay, n): float("inf") for lay in layouts for n in (1, args.new_tokens)}
    outs = {}
    for _ in range(args.repeats):
        for lay in layouts:
            for n in (1, args.new_tokens):
                t0 = time.perf_counter()
                r = run(lay, n)
                best[lay, n] = min(best[lay, n], time.perf_counter() - t0)
                outs[lay, n] = r.tokens
    N = args.new_tokens
    res = {}
    for lay in layouts:
        pre, full = best[lay, 1], best[lay, N]
        res[lay] = {"prefill_ms": round(1e3 * pre, 1), "decode_ms_per_step": round(1e3 * (full - pre) / (N - 1), 2),
                    "seconds": round(full, 3), "tok_s": round(len(lens) * N / full, 1)}
    print(json.dumps({
        "bench": "prefill_packed", "model": "SmolLM2-135M-Instruct Q4_1 GGUF -> float32", "prompt_lens": lens,
        "padded_len": args.bucket, "rows": {"padded": len(lens) * args.bucket, "packed": packed},
        "new_tokens": N, "repeats": args.repeats, **res,
        "prefill_ratio": round(best["packed", 1] / best["padded", 1], 3),
        "tok_s_ratio": round(best["padded", N] / best["packed", N], 3),
        "identical_greedy_outputs": outs["padded", N] == outs["packed", N],
    }))


if __name__ == "__main__":
    main()

"""Speculative decoding benchmark: SmolLM2-135M-Instruct (the embedded GGUF, dequantised to
float32) target-only vs speculative, batch 4 chat prompts, greedy, in one process.

Draft: ``--draft DIR`` (a speculators checkpoint, e.g. the EAGLE-3 draft ``specjax train``
produces for SmolLM2); without it, ``self`` -- the target's own layers as the draft (an oracle:
every proposal is accepted, tau = k + 1, but the draft costs as much as the target, so it can
only exercise the loop and check measured vs predicted speedup, not win). ``--draft self:M``
uses the first M layers (cheaper, accepts less).

Prints one JSON line (``run_bench``'s report): tau, per-position acceptance, tokens/s target-only
and speculative, measured speedup, the measured draft/target cost ratio c and verify overhead v,
the seed formula's prediction tau / (k c + 1), the prediction with the measured verify cost
tau / (k c + v), and measured / predicted for both.

Threads are pinned to one (XLA: no multi-threaded Eigen, one intra-op thread) for steadier
numbers on a shared machine; both loops run interleaved per batch, compile time excluded.

    .venv/bin/python benchmarks/spec_decode.py [--draft DIR|self|self:M] [--k 3] [--batch-size 4]
        [--max-new-tokens 64] [--prompts FILE.jsonl] [--limit 8] [--plot out.png]
"""

from __future__ import annotations

import os

THREADS = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false"}
for _k, _v in THREADS.items():
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for learning a new programming language.",
    "What are the main differences between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet in a few sentences.",
    "How do I make a good cup of coffee?",
    "Why is the sky blue?",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="default")
    ap.add_argument("--draft", default="self")
    ap.add_argument("--k", type=int, default=None, help="default: the checkpoint's (3 for self)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", default=None, help="JSONL prompts (default: 8 built-in chat prompts)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()

    from specjax.decode import bench
    from specjax.decode.sampling import SamplingParams
    from specjax.decode.speculative import load_spec_draft
    from specjax.models.loading import load_target

    t0 = time.perf_counter()
    lt = load_target(args.target, progress=False)
    sd = load_spec_draft(args.draft, lt)
    load_s = time.perf_counter() - t0
    raw = bench.load_prompts(args.prompts, limit=args.limit) if args.prompts else CHAT_PROMPTS[: args.limit]
    ids = bench.encode(lt, raw, chat=True)
    tok = lt.tokenizer
    rep = bench.run_bench(lt.model, sd, ids, k=args.k, sampling=SamplingParams(temperature=args.temperature),
                          max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                          eos_token_ids=lt.eos_token_ids, pad_id=tok.pad_token_id if tok is not None else None,
                          progress=False,
                          extra={"target": "SmolLM2-135M-Instruct Q4_1 GGUF -> float32" if args.target == "default"
                                 else lt.source, "threads": THREADS["XLA_FLAGS"], "load_s": round(load_s, 2)})
    if args.plot:
        bench.plot(rep, args.plot)
        rep.data["plot"] = args.plot
    print(rep.to_json())


if __name__ == "__main__":
    main()

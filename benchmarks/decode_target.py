"""Target-only greedy decode benchmark: SmolLM2-135M-Instruct (the embedded GGUF, dequantised to
float32), batch 1 and batch 8, 128 new tokens, specjax (one jitted while_loop) vs transformers
``generate()`` (PyTorch CPU, the same GGUF through transformers' own loader), side by side in
one run. Prints one JSON line with tokens/s of both and their ratio (goal: specjax >= 1.5x).

Both sides run on one core: the process is pinned to it (``one_core.py``; XLA's CPU runtime
otherwise keeps a thread pool of its own) and torch.set_num_threads(1). EOS is disabled so every
sequence produces exactly 128 tokens; prompts in a batch have equal length (no padding on
either side). Compile time is the first call minus a warm call of the same shapes.

    .venv/bin/python benchmarks/decode_target.py [--new-tokens 128] [--repeats 2] [--batches 1,8]
"""

from __future__ import annotations

import one_core  # noqa: E402  (benchmarks/ is the script directory)

THREADS = one_core.pin()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TEXTS = [
    "The history of the printing press begins",
    "def quicksort(arr):\n    if len(arr) <= 1:",
    "Photosynthesis is the process by which plants",
    "In 1969, the first humans landed on the Moon",
    "The best way to learn a new language is",
    "Once upon a time in a quiet mountain village",
    "A neural network is a computational model that",
    "To make a good cup of coffee, you should",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    from transformers import AutoModelForCausalLM

    from specjax.decode import generate as gen
    from specjax.models.loading import DEFAULT_FILE, default_gguf_path, load_target

    N = args.new_tokens
    t0 = time.perf_counter()
    lt = load_target("default", progress=False)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = AutoModelForCausalLM.from_pretrained(default_gguf_path().parent, gguf_file=DEFAULT_FILE,
                                               dtype=torch.float32).eval()
    ref_load_s = time.perf_counter() - t0
    tok = lt.tokenizer
    enc = [tok.encode(t) for t in TEXTS]
    plen = min(len(e) for e in enc)
    prompts = [e[:plen] for e in enc]

    result = {"bench": "decode_target", "model": "SmolLM2-135M-Instruct Q4_1 GGUF -> float32", "new_tokens": N,
              "prompt_tokens": plen, "threads": {"xla": THREADS["XLA_FLAGS"], "torch": torch.get_num_threads()},
              "load_s": {"specjax": round(load_s, 2), "transformers": round(ref_load_s, 2)}}
    for B in [int(b) for b in args.batches.split(",")]:
        batch = [prompts[i % len(prompts)] for i in range(B)]

        def ours():
            return gen.generate_ids(lt.model, batch, max_new_tokens=N, eos_token_ids=[])

        t0 = time.perf_counter()
        res = ours()
        first = time.perf_counter() - t0
        ids = torch.tensor(batch)

        def theirs():
            with torch.no_grad():
                return ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N,
                                    do_sample=False, pad_token_id=2)

        with torch.no_grad():
            ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                         do_sample=False, pad_token_id=2)  # warm-up
        # interleaved repeats, best of each: load changes on a shared machine hit both sides alike
        times, rtimes = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            res = ours()
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = theirs()
            rtimes.append(time.perf_counter() - t0)
        ours_s = min(times)
        assert all(len(t) == N for t in res.tokens)
        ref_s = min(rtimes)
        ref_tokens = out[:, plen:].tolist()
        same = sum(a == b for a, b in zip(res.tokens, ref_tokens))
        result[f"batch{B}"] = {
            "specjax_tok_s": round(B * N / ours_s, 1),
            "transformers_tok_s": round(B * N / ref_s, 1),
            "ratio": round(ref_s / ours_s, 2),
            "specjax_s": round(ours_s, 3),
            "transformers_s": round(ref_s, 3),
            "compile_s": round(first - ours_s, 2),
            "identical_greedy_sequences": f"{same}/{B}",
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Token trees vs the chain, side by side in one run: SmolLM2-135M-Instruct (the embedded GGUF,
float32) target-only, the chain speculative loop (``--k``) and the tree loop for each ``--tree``
(a ``speculative_token_tree`` path list, or ``dyn:TOPK,DEPTH,NODES`` for an EAGLE-2 dynamic tree),
greedy, chat-templated prompts one batch at a time. Every side pads prompts to one bucket (one
compile each, excluded: a warm-up call per side), and the sides run interleaved per batch.

Prints one JSON line: per side tau (tokens per target forward), tokens/s, speedup over
target-only, the tree's node count and depth, and how many greedy outputs equal target-only's.

    .venv/bin/python benchmarks/tree_decode.py [--draft runs/eagle3-smollm2/best] \\
        [--prompts runs/eval/code.jsonl] [--limit 8] [--max-new-tokens 128] [--k 3] \\
        [--tree "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]" --tree dyn:4,3,12]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VLLM_TREE = "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]"


def parse_side(spec: str):
    from specjax.decode.tree_draft import DynamicTreeSpec, as_tree

    if spec.startswith("dyn:"):
        topk, depth, nodes = (int(x) for x in spec[4:].split(","))
        return DynamicTreeSpec(topk, depth, nodes)
    return as_tree(spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="runs/eagle3-smollm2/best")
    ap.add_argument("--prompts", default="runs/eval/code.jsonl")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--tree", action="append", default=None)
    a = ap.parse_args()

    from specjax.decode.bench import encode, load_prompts
    from specjax.decode.generate import bucket, generate_ids
    from specjax.decode.speculative import load_spec_draft, speculative_generate_ids
    from specjax.decode.tree_loop import tree_generate_ids
    from specjax.models.loading import load_target

    lt = load_target(None, progress=False)
    draft = load_spec_draft(a.draft, lt)
    ids = encode(lt, load_prompts(a.prompts, limit=a.limit), chat=True)
    P = bucket(max(len(p) for p in ids))
    batches = [ids[i:i + a.batch_size] for i in range(0, len(ids), a.batch_size)]
    batches = [b + [b[0]] * (a.batch_size - len(b)) for b in batches]
    kw = dict(max_new_tokens=a.max_new_tokens, prompt_bucket=P)
    sides = {"target_only": lambda b: generate_ids(lt.model, b, **kw),
             f"chain_k{a.k}": lambda b: speculative_generate_ids(lt.model, draft, b, k=a.k, lossless=True, **kw)}
    shapes = {}
    for spec in a.tree or [VLLM_TREE, "dyn:4,3,12"]:
        tree = parse_side(spec)
        shapes[spec] = {"nodes": tree.num_nodes, "depth": tree.max_depth}
        sides[spec] = lambda b, tree=tree: tree_generate_ids(lt.model, draft, b, tree=tree, **kw)
    for run in sides.values():  # compile
        run(batches[0])
    secs = {s: 0.0 for s in sides}
    toks = {s: 0 for s in sides}
    hists, outs = {s: [] for s in sides}, {s: [] for s in sides}
    for b in batches:
        for s, run in sides.items():
            t0 = time.perf_counter()
            r = run(b)
            secs[s] += time.perf_counter() - t0
            toks[s] += sum(len(t) for t in r.tokens)
            outs[s] += r.tokens
            if s != "target_only":
                hists[s].append(r.stats)
    base = toks["target_only"] / secs["target_only"]
    report = {"bench": "tree_decode", "draft": a.draft, "prompts": a.prompts, "n": len(ids),
              "max_new_tokens": a.max_new_tokens, "batch_size": a.batch_size, "prompt_bucket": P,
              "target_only": {"tok_s": round(base, 2)}}
    for s in sides:
        if s == "target_only":
            continue
        from specjax.decode.spec_stats import SpecStats

        st = SpecStats.merge(hists[s])
        tps = toks[s] / secs[s]
        report[s] = {"tau": round(st.tau, 3), "tok_s": round(tps, 2), "speedup": round(tps / base, 3),
                     "identical_greedy": f"{sum(x == y for x, y in zip(outs[s], outs['target_only']))}/{len(outs[s])}",
                     **shapes.get(s, {})}
    print(json.dumps(report))


if __name__ == "__main__":
    main()

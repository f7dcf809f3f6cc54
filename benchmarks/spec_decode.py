"""Speculative decoding benchmark: SmolLM2-135M-Instruct (the embedded GGUF, dequantised to
float32) target-only vs speculative, batch 4 chat prompts, greedy, in one process.

Draft: ``--draft DIR`` (a speculators checkpoint, e.g. the EAGLE-3 draft ``specjax train``
produces for SmolLM2); without it, ``self`` -- the target's own layers as the draft (an oracle:
every proposal is accepted, tau = k + 1, but the draft costs as much as the target, so it can
only exercise the loop and check measured vs predicted speedup, not win). ``--draft self:M``
uses the first M layers (cheaper, accepts less). ``--draft untrained-eagle3[:VD]`` builds, in
memory, an EAGLE-3 draft of the speculators defaults for SmolLM2 (one Llama layer, aux ids
[2, 15, 27], draft vocabulary VD = 32000 by default, embeddings and lm_head rows from the target,
the rest random): it accepts almost nothing, but its cost ratio c is the one a trained draft
will have, so the JSON adds ``projected_speedup`` for tau = 2.0 .. 3.5 from the measured c and v.

Prints one JSON line (``run_bench``'s report): tau, per-position acceptance, tokens/s target-only
and speculative, measured speedup, the measured draft/target cost ratio c and verify overhead v,
the seed formula's prediction tau / (k c + 1), the prediction with the measured verify cost
tau / (k c + v), and measured / predicted for both.

It also gives a per-round breakdown (``breakdown``): the micro-timed verify forward and draft
round at the loop's shapes and their shares, the measured loop time per round, and the machine's
load average before and after (the numbers are only comparable at similar load).

The process is pinned to one core (``one_core.py``) for steadier numbers on a shared machine; both loops run interleaved per batch, compile time excluded, and the
fastest of ``--repeats`` passes counts for each side.

    .venv/bin/python benchmarks/spec_decode.py [--draft DIR|self|self:M] [--k 3] [--batch-size 4]
        [--max-new-tokens 64] [--prompts FILE.jsonl] [--limit 8] [--plot out.png]

e.g. a trained draft, one prompt at a time, on held-out code prompts::

    specjax data prompts eval-code --out /tmp/eval-code.jsonl --n 16
    .venv/bin/python benchmarks/spec_decode.py --draft runs/eagle3-smollm2/best --prompts /tmp/eval-code.jsonl \
        --batch-size 1 --max-new-tokens 256 --k 3 --repeats 2

(the main job's draft, 2026-12-02, one core: tau 2.90, 54.1 -> 111.2 tok/s, 2.06x end to end and 2.24x
without the fixed costs, 0.93 and 1.01 of ``tau / (k c + v)``; 16/16 greedy outputs identical)
"""

from __future__ import annotations

import os

import one_core  # noqa: E402  (benchmarks/ is the script directory)

THREADS = one_core.pin()

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


def untrained_eagle3(lt, draft_vocab: int = 32000, seed: int = 0):
    """SmolLM2-shaped EAGLE-3 (speculators defaults), random except the verifier-owned tensors."""
    import bridge
    import numpy as np

    from specjax.decode.speculative import SpecDraft
    from specjax.models.drafts.eagle3 import Eagle3Draft
    from specjax.models.drafts.load import module_from_flat
    from specjax.models.drafts.verifier_weights import VerifierSource, fill_verifier_weights

    tc = lt.config
    n = tc.num_hidden_layers
    layer = {**tc.to_hf_dict(), "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    cfg = bridge.parse_config({
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "draft_vocab_size": draft_vocab, "norm_before_residual": True,
        "eagle_aux_hidden_state_layer_ids": [2, n // 2, n - 3],
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                     "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                               "verifier": {"architectures": [tc.architecture], "name_or_path": None}},
        "transformer_layer_config": layer})
    rng = np.random.default_rng(seed)
    H, V = tc.hidden_size, tc.vocab_size
    flat = {"fc.weight": rng.standard_normal((H, 3 * H)) / np.sqrt(3 * H), "norm.weight": np.ones(H)}
    pre = "layers.0."
    shapes = {"self_attn.q_proj.weight": (tc.num_attention_heads * tc.head_dim, 2 * H),
              "self_attn.k_proj.weight": (tc.num_key_value_heads * tc.head_dim, 2 * H),
              "self_attn.v_proj.weight": (tc.num_key_value_heads * tc.head_dim, 2 * H),
              "self_attn.o_proj.weight": (H, tc.num_attention_heads * tc.head_dim),
              "mlp.gate_proj.weight": (tc.intermediate_size, H), "mlp.up_proj.weight": (tc.intermediate_size, H),
              "mlp.down_proj.weight": (H, tc.intermediate_size)}
    for name, shp in shapes.items():
        flat[pre + name] = rng.standard_normal(shp) / np.sqrt(shp[1])
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        flat[pre + name + ".weight"] = np.ones(H)
    flat = {k: v.astype(np.float32) for k, v in flat.items()}
    sel = np.arange(draft_vocab)  # the first VD target ids (a real draft keeps the most frequent)
    t2d = np.zeros(V, bool)
    t2d[sel] = True
    flat["t2d"], flat["d2t"] = t2d, np.zeros(draft_vocab, np.int64)
    flat = fill_verifier_weights(Eagle3Draft.verifier_fill, flat, hidden_size=H, vocab_size=V, draft_vocab_size=draft_vocab,
                                 source=VerifierSource.of(lt.model), verifier_heads=False)
    module = module_from_flat(cfg, flat, dtype="float32", verifier_heads=False)
    return SpecDraft(module, cfg, f"untrained-eagle3:{draft_vocab}")


def breakdown(data: dict, load_before, load_after) -> dict:
    """Per-round costs from a ``run_bench`` report: verify vs draft (micro-timed at the loop's
    shapes), their sum against the measured loop time per round, and the target's time per token."""
    c = data["cost"]
    v_ms, d_ms, step_ms = c["verify_ms"], c["draft_round_ms"], c["target_step_ms"]
    rounds = max(int(data["rounds"]), 1)
    spec, base = data["speculative"], data["target_only"]
    return {
        "verify_ms_per_round": v_ms, "draft_ms_per_round": d_ms,
        "verify_share": round(v_ms / (v_ms + d_ms), 4), "draft_share": round(d_ms / (v_ms + d_ms), 4),
        "verify_over_step": round(v_ms / step_ms, 3),
        # wall time of the speculative runs per round: the prompts' prefills and loop overhead included
        "loop_ms_per_round_incl_prefill": round(1e3 * spec["seconds"] / rounds, 3),
        "target_only_ms_per_token": round(1e3 * base["seconds"] / max(base["tokens"], 1), 3),
        "loadavg_1m": {"before": round(load_before[0], 2), "after": round(load_after[0], 2)},
        "cpus": os.cpu_count(),
    }


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
    ap.add_argument("--repeats", type=int, default=3, help="interleaved passes; each side's fastest is kept")
    args = ap.parse_args()

    from specjax.decode import bench, bench_plot
    from specjax.decode.sampling import SamplingParams
    from specjax.decode.speculative import load_spec_draft
    from specjax.models.loading import load_target

    load_before = os.getloadavg()
    t0 = time.perf_counter()
    lt = load_target(args.target, progress=False)
    if args.draft.startswith("untrained-eagle3"):
        vd = int(args.draft.split(":", 1)[1]) if ":" in args.draft else 32000
        sd = untrained_eagle3(lt, vd)
    else:
        sd = load_spec_draft(args.draft, lt)
    load_s = time.perf_counter() - t0
    raw = bench.load_prompts(args.prompts, limit=args.limit) if args.prompts else CHAT_PROMPTS[: args.limit]
    ids = bench.encode(lt, raw, chat=True)
    tok = lt.tokenizer
    rep = bench.run_bench(lt.model, sd, ids, k=args.k, sampling=SamplingParams(temperature=args.temperature),
                          max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                          eos_token_ids=lt.eos_token_ids, pad_id=tok.pad_token_id if tok is not None else None,
                          progress=False, repeats=args.repeats,
                          extra={"target": "SmolLM2-135M-Instruct Q4_1 GGUF -> float32" if args.target == "default"
                                 else lt.source, "threads": THREADS["XLA_FLAGS"], "load_s": round(load_s, 2)})
    if args.draft.startswith("untrained-eagle3"):
        c, v, k = rep.data["cost"]["c"], rep.data["cost"]["verify_overhead"], rep.data["k"]
        rep.data["projected_speedup"] = {
            f"{tau:.1f}": {"seed_formula": round(tau / (k * c + 1), 3), "with_verify_cost": round(tau / (k * c + v), 3)}
            for tau in (2.0, 2.5, 3.0, 3.5)}
    rep.data["breakdown"] = breakdown(rep.data, load_before, os.getloadavg())
    if args.plot:
        bench_plot.plot(rep, args.plot)
        rep.data["plot"] = args.plot
    print(rep.to_json())


if __name__ == "__main__":
    main()

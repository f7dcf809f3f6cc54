"""Target-only vs speculative decoding over the same prompts, in one process.

:func:`run_bench` pads every batch to ``batch_size``. At batch > 1 it pads every prompt to one
bucket and prefills each batch's prompts back to back in one packed row of one length (the one
``generate_ids``' "auto" picks for the longest batch; see ``generate.prefill``): each loop compiles
once. Unpacked on one device (batch 1), each batch pads to its own bucket (a multiple of
``prompt_bucket``, 32 by default; one compile of each loop per bucket), so its prefill pays for
about its real length. The per-round costs come from :func:`specjax.decode.costs.measure_costs`.
Compile time is measured on a warm-up batch of each bucket and
excluded. Then per batch it times target-only generation and speculative generation back to
back (interleaved, so a change in machine load hits both alike). It reports:

* acceptance: ``tau`` (tokens committed per target forward), per-position and conditional
  acceptance rates, the tokens-per-step histogram, and the per-token ``alpha`` that the seed's
  model ``E = (1 - a^(k+1)) / (1 - a)`` maps to ``tau``;
* throughput: generated tokens per second of both (best of ``repeats`` passes), and the speedup;
* cost: :func:`measure_costs` times, at the loop's own shapes, one target decode step (T=1), one
  verify forward (T=k+1) and one draft round (``speculate``: ingest k+1 rows, propose k), giving
  the draft/target cost ratio ``c = t_draft / (k * t_step)`` and the verify overhead
  ``v = t_verify / t_step``;
* the seed's prediction ``tau / (k c + 1)`` (it charges verification like one decode step) and
  the same with the measured verify cost, ``tau / (k c + v)``, and measured / predicted;
* ``decode_only``: the speedup without each side's fixed cost (prefill, the draft's prompt
  ingest, one token; timed on the same batches stopped after one token by ``limit=1``, in the
  same compiled programs), which the formula leaves out, and its ratio to the prediction: what
  the loop itself achieves.

With ``tree`` the tree loop (:mod:`specjax.decode.tree_loop`) is a third side on the same batches,
interleaved with the other two; ``"auto"`` chooses the tree first (:mod:`specjax.decode.tree_auto`)
and the report's ``tree`` record holds the choice, the tree's acceptance, speed and round cost.

Padding sequences (to fill the last batch) are generated and timed but not counted.

With ``mesh`` (a ``jax.sharding.Mesh`` of more than one device) every loop (the tree's too) and
the cost probes run sharded: the target by ``TARGET_RULES`` (placed once, as a copy, when it is not on the mesh
already), the draft by ``DRAFT_RULES``, every batch split over ``("data", "fsdp")`` and padded to
a multiple of data x fsdp (the cost probes run at that padded batch), KV caches by batch and
heads. Multi-process: every process runs the same bench and holds the same report.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from specjax import kernels
from specjax.decode.batch import bucket, packed_length
from specjax.decode.costs import measure_costs, round_ms
from specjax.decode.generate import generate_ids
from specjax.decode.sampling import GREEDY, SamplingParams
from specjax.decode.spec_stats import SpecStats, alpha_from_tau, predicted_speedup
from specjax.decode.speculative import Pair, SpecDraft, place_pair, resolve_k, speculative_generate_ids, split_pair
from specjax.decode import tree_auto
from specjax.decode.tree import TokenTree
from specjax.decode.tree_draft import as_tree
from specjax.decode.tree_loop import tree_generate_ids
from specjax.models import panels
from specjax.sharding import TARGET_RULES, describe, mesh_of, named_shardings


class PromptFileError(ValueError):
    """A --prompts file that is missing, empty or has a line that is not a prompt."""


def load_prompts(path: str | Path, *, limit: int | None = None) -> list:
    """JSONL prompts, one per line: a JSON string, or an object with ``prompt`` / ``text`` (a
    string), ``messages`` (a chat: list of {role, content}), or ``prompt_ids`` / ``token_ids``
    (token ids). Blank lines are skipped."""
    p = Path(path)
    if not p.is_file():
        raise PromptFileError(f"prompts file {p} does not exist")
    out: list = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError as e:
            raise PromptFileError(f"{p}:{i}: not JSON ({e.msg}); expected one JSON prompt per line") from None
        if isinstance(doc, str):
            out.append(doc)
        elif isinstance(doc, dict) and isinstance(doc.get("messages"), list):
            out.append(list(doc["messages"]))
        elif isinstance(doc, dict) and isinstance(doc.get("prompt", doc.get("text")), str):
            out.append(doc.get("prompt", doc.get("text")))
        elif isinstance(doc, dict) and isinstance(doc.get("prompt_ids", doc.get("token_ids")), list):
            out.append([int(t) for t in doc.get("prompt_ids", doc.get("token_ids"))])
        else:
            raise PromptFileError(f"{p}:{i}: expected a string or an object with 'prompt', 'text', 'messages' or "
                                  f"'prompt_ids'; got {type(doc).__name__} {str(doc)[:60]!r}")
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise PromptFileError(f"prompts file {p} holds no prompts")
    return out


def encode(lt, prompts: Sequence, *, chat: bool = True) -> list[list[int]]:
    """Prompts from :func:`load_prompts` -> token ids (strings through the chat template when ``chat``)."""
    tok = lt.tokenizer
    ids = []
    for p in prompts:
        if isinstance(p, list) and (not p or isinstance(p[0], int)):
            ids.append([int(t) for t in p])
            continue
        if tok is None:
            raise PromptFileError(f"target {lt.source} has no tokenizer; use 'prompt_ids' prompts")
        if isinstance(p, list):
            ids.append(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True))
        elif chat:
            ids.append(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=True))
        else:
            ids.append(tok.encode(p))
    return ids


# ----------------------------------------------------------------------------- costs


# ----------------------------------------------------------------------------- the benchmark


@dataclass
class BenchReport:
    data: dict

    def to_json(self) -> str:
        return json.dumps(self.data)


def run_bench(target, draft: SpecDraft, prompt_ids: Sequence[Sequence[int]], *, k: int | None = None,
              sampling: SamplingParams = GREEDY, max_new_tokens: int = 64, batch_size: int = 4, seed: int = 0,
              eos_token_ids: Sequence[int] | None = None, pad_id: int | None = None, draft_sampling: str = "greedy",
              lossless: bool = False, progress: bool = True, cost_iters: int = 10, repeats: int = 1,
              prompt_bucket: int = 32, extra: dict | None = None, mesh=None, tree=None,
              tree_calibration: int = 4, compute: str = "float32") -> BenchReport:
    """Run the comparison (see the module docstring). ``target``: a ``CausalLM``; ``draft``: a
    :class:`SpecDraft`; prompts as token ids. ``repeats`` > 1 runs the whole interleaved pass again
    (same seeds, same outputs) and keeps each side's fastest pass. ``prompt_bucket``: prompts pad
    to a multiple of it (each multiple in use compiles both loops once). ``mesh``: run sharded (module
    docstring); the report gains ``"mesh"``. ``tree``: also run the tree loop on the same batches
    (a third side, interleaved; sharded with ``mesh``): a :class:`specjax.decode.tree.TokenTree`, a path list,
    a :class:`specjax.decode.tree_draft.DynamicTreeSpec`, or ``"auto"`` (calibrated on the first
    ``tree_calibration`` batches and chosen by :mod:`specjax.decode.tree_auto`); the report gains
    ``"tree"``. ``compute``: every side's matmul arithmetic on one CPU device (``"bfloat16"``:
    bf16 products, float32 sums; target-only, chain and tree alike, so they stay comparable; see
    :func:`specjax.decode.generate.generate_ids`); the report gains ``"compute"``. Returns a
    :class:`BenchReport`."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    prompts = [list(p) for p in prompt_ids]
    if not prompts:
        raise ValueError("no prompts given")
    kk = resolve_k(draft, k)
    if mesh is not None and mesh.size <= 1:
        mesh = None
    sides = _Sides(target, draft, prompts, kk, batch_size=batch_size, prompt_bucket=prompt_bucket, mesh=mesh,
                   common=dict(max_new_tokens=max_new_tokens, sampling=sampling, eos_token_ids=eos_token_ids,
                               pad_id=pad_id, mesh=mesh, compute=panels.check_compute(compute, mesh)),
                   spec_kw=dict(draft_sampling=draft_sampling, lossless=lossless))
    auto = None
    if tree is not None:
        auto = sides.set_tree(tree, seed=seed, draft_sampling=draft_sampling, calibration=tree_calibration,
                              cost_iters=cost_iters, progress=progress)
    compile_s, firsts = sides.warm(seed)
    timed = sides.timed_passes(seed, repeats, progress)
    for side in compile_s:  # the warm-up's own run is not compile time
        compile_s[side] -= sum(timed.one[side][j] for j in firsts)
    fixed = sides.fixed_costs(seed)
    # the probes' caches: the batches' mean bucket (half filled by the generation, as in the loop)
    probe_len = bucket(int(np.mean(sides.lens)))
    cost = measure_costs(sides.target, draft.module, batch=batch_size, prompt_len=probe_len,
                         max_new_tokens=max_new_tokens, k=kk, iters=cost_iters, split=sides.split, mesh=mesh,
                         compute=compute)
    data, pred_v = _report_fields(draft, kk, sampling, draft_sampling, timed, cost, batch_size=batch_size,
                                  max_new_tokens=max_new_tokens, n_prompts=len(prompts), P=sides.P, lens=sides.lens,
                                  repeats=repeats)
    data["compile_s"] = {"target_only": round(compile_s["base"], 2), "speculative": round(compile_s["spec"], 2)}
    dec = _decode_only(sides, timed, fixed, "spec")
    if dec is not None:
        data["decode_only"] = {
            "fixed_s": {"target_only": round(fixed["base"], 3), "speculative": round(fixed["spec"], 3)},
            "speedup": round(dec, 3),
            "speedup_over_predicted_with_verify_cost": round(dec / pred_v, 3)}
    if sampling.greedy:
        data["identical_greedy_outputs"] = f"{timed.same['spec']}/{len(prompts)}"
    if tree is not None:
        data["tree"] = _tree_fields(sides, timed, fixed, auto, compile_s["tree"], batch_size=batch_size,
                                    probe_len=probe_len, max_new_tokens=max_new_tokens, cost_iters=cost_iters,
                                    greedy=sampling.greedy, n_prompts=len(prompts))
    if mesh is None:  # the single-device loops run on the CPU kernels when these are available
        data["cpu_kernels"] = kernels.available()
        if data["cpu_kernels"]:  # which weights the kernels stream as bf16 (bf16-valued params)
            data["panel_dtypes"] = panels.panel_dtypes(panels.decode_state(Pair(sides.target, draft.module),
                                                                           sides.split[1], compute=compute))
    else:
        data["mesh"] = describe(mesh)
    data["compute"] = compute
    if extra:
        data.update(extra)
    return BenchReport(data)


def _decode_only(sides, timed, fixed, side: str) -> float | None:
    """Speedup of ``side`` over target-only without each side's fixed cost (module docstring)."""
    n_one = sum(n for _, n in sides.batches)
    tb, ts, nb, ns = timed.t["base"], timed.t[side], timed.n["base"], timed.n[side]
    if tb > fixed["base"] and ts > fixed[side] and min(nb, ns) > n_one:
        return ((ns - n_one) / (ts - fixed[side])) / ((nb - n_one) / (tb - fixed["base"]))
    return None


@dataclass
class _Timed:
    """The timed passes, per side ("base": target-only, "spec": the chain, "tree"): each side's
    best pass (seconds) ``t``, tokens ``n``, per-batch best times ``one``; for the speculative
    sides the greedy outputs equal to target-only's (``same``) and the merged stats."""
    t: dict
    n: dict
    one: dict
    same: dict
    stats: dict


class _Sides:
    """The sides of the bench over the same padded batches: target-only (``base``), speculative
    (``spec``) and, when a tree is set (:meth:`set_tree`), the tree loop (``tree``) on batch ``j``,
    with the modules split once (a split costs ~13 ms of host work per call on SmolLM2) and each
    batch's prompt bucket."""

    def __init__(self, target, draft: SpecDraft, prompts, k: int, *, batch_size: int, prompt_bucket: int, mesh,
                 common: dict, spec_kw: dict):
        self.draft, self.k, self.spec_kw, self.mesh = draft, k, spec_kw, mesh
        self.P = P = bucket(max(len(p) for p in prompts), prompt_bucket)
        self.batches = []
        for i in range(0, len(prompts), batch_size):
            real = prompts[i:i + batch_size]
            self.batches.append((real + [prompts[0]] * (batch_size - len(real)), len(real)))
        if mesh is not None:
            target = _on_mesh(target, mesh)  # once, so that no timed call re-places a copy
            self.split = place_pair(target, draft.module, mesh)
        else:
            self.split = split_pair(target, draft.module)
        self.target = target
        # one packed prefill length for every batch (one compile): the length generate_ids' "auto"
        # picks for the longest batch (its prompts' sum rounded up to a multiple of the bucket), so a
        # generate call on the same prompts (notebook 02) runs the bench's compiled programs
        packed = (packed_length(max(([len(p) for p in b] for b, _ in self.batches), key=sum), P)
                  if mesh is None else None)
        # unpacked on one device (batch 1): each batch pads to its own bucket (a multiple of
        # prompt_bucket), one compile per bucket, so a prefill pays for about its real length at full
        # GEMM rows (on 2 cores this beats one bucket for all with a chunked prefill: 16 held-out code
        # prompts of 64-195 tokens, prefill + first token 2.8 s vs 3.4 s)
        own = packed is None and mesh is None
        self.lens = [bucket(max(len(p) for p in b), prompt_bucket) if own else P for b, _ in self.batches]
        self.common = {**common, "packed_len": packed}
        self.tsplit = nnx.split(target) if mesh is None else None
        self.sides = ["base", "spec"]
        self.tree = None
        self.tree_cost = None  # (target step ms, TreeCost) measured while choosing the tree
        self.tree_kw: dict = {}

    def run(self, side: str, j: int, s: int, **over):
        if side == "base":
            return generate_ids(self.target, self.batches[j][0], seed=s, prompt_bucket=self.lens[j],
                                split=self.tsplit, **{**self.common, **over})
        if side == "spec":
            return speculative_generate_ids(self.target, self.draft, self.batches[j][0], k=self.k, seed=s,
                                            split=self.split, prompt_bucket=self.lens[j],
                                            **{**self.spec_kw, **self.common, **over})
        return self.run_tree(self.tree, j, s, **{**self.tree_kw, **over})

    def run_tree(self, tree, j: int, s: int, **over):
        return tree_generate_ids(self.target, self.draft, self.batches[j][0], tree=tree, seed=s, split=self.split,
                                 prompt_bucket=self.lens[j], **{**self.common, **over})

    def set_tree(self, tree, *, seed: int, draft_sampling: str, calibration: int, cost_iters: int, progress: bool):
        """Add the tree side. ``"auto"``: decode the first ``calibration`` batches with a spine tree,
        choose by :func:`specjax.decode.tree_auto.choose_tree`; returns that record (else None)."""
        self.sides.append("tree")
        if not (isinstance(tree, str) and tree.strip() == "auto"):
            self.tree = as_tree(tree)
            if isinstance(self.tree, TokenTree):
                self.tree_kw = {"draft_sampling": draft_sampling}
            return None
        cal = tree_auto.calibration_tree(max(self.k + 2, 5), 4)
        hits, n_cal = [], min(max(calibration, 1), len(self.batches))
        t0 = time.perf_counter()
        for j in _progress(range(n_cal), progress, "tree calibration"):
            r = self.run_tree(cal, j, seed + j)
            hits.append(r.node_hits[: self.batches[j][1]])
        p, reached = tree_auto.rank_acceptance(cal, np.concatenate(hits))
        cal_s = time.perf_counter() - t0
        trees = tree_auto.candidates(p)
        t0 = time.perf_counter()
        step_ms, costs = tree_auto.measure_tree_costs(
            self.target, self.draft.module, [t for t, _ in trees], batch=len(self.batches[0][0]),
            prompt_len=bucket(int(np.mean(self.lens))), max_new_tokens=self.common["max_new_tokens"],
            iters=cost_iters, split=self.split, mesh=self.mesh, compute=self.common["compute"])
        best, scored = tree_auto.choose_tree(p, step_ms, costs, trees)
        self.tree, self.tree_cost = best.tree, (step_ms, best.cost)
        return {"calibration": {"tree": {"depth": cal.max_depth, "width": p.shape[1]}, "batches": n_cal,
                                "rounds_reaching_depth": reached.tolist(),
                                "rank_acceptance": [[round(float(x), 4) for x in row] for row in p],
                                "seconds": round(cal_s, 2)},
                "target_step_ms": round_ms(step_ms), "candidates": [c.to_json() for c in scored],
                "cost_seconds": round(time.perf_counter() - t0, 2), "picked": best.to_json(),
                "pick_rule": "the smallest tree predicted within 2% of the best predicted speedup"}

    def warm(self, seed: int):
        """One batch of each bucket through every side (compiles them): seconds per side and the
        batches run (their timed runs are taken off by the caller)."""
        firsts = [self.lens.index(n) for n in sorted(set(self.lens))]
        secs = {side: 0.0 for side in self.sides}
        for j in firsts:
            for side in self.sides:
                t0 = time.perf_counter()
                self.run(side, j, seed + j)
                secs[side] += time.perf_counter() - t0
        return secs, firsts

    def timed_passes(self, seed: int, repeats: int, progress: bool) -> _Timed:
        """Per batch, every side back to back (a load change hits them alike); ``repeats`` whole
        passes, each side's fastest kept."""
        from tqdm.auto import tqdm

        nb = len(self.batches)
        best = {side: float("inf") for side in self.sides}
        one = {side: [float("inf")] * nb for side in self.sides}
        bar = tqdm(total=sum(n for _, n in self.batches) * repeats, desc="bench", unit="prompt",
                   disable=not progress, leave=False)
        for _ in range(repeats):
            t = {side: 0.0 for side in self.sides}
            n = {side: 0 for side in self.sides}
            same = {side: 0 for side in self.sides[1:]}
            stats: dict = {side: [] for side in self.sides[1:]}
            for j, (_, n_real) in enumerate(self.batches):
                out = {}
                for side in self.sides:
                    t0 = time.perf_counter()
                    out[side] = self.run(side, j, seed + j)
                    dt = time.perf_counter() - t0
                    t[side] += dt
                    one[side][j] = min(one[side][j], dt)
                    n[side] += sum(len(x) for x in out[side].tokens[:n_real])
                for side in self.sides[1:]:
                    r = out[side]
                    same[side] += sum(a == c for a, c in zip(out["base"].tokens[:n_real], r.tokens[:n_real]))
                    stats[side].append(SpecStats(r.stats.k, r.stats.hist[:n_real], r.stats.lossy))
                bar.update(n_real)
            best = {side: min(best[side], t[side]) for side in self.sides}
        bar.close()
        return _Timed(best, n, one, same, {side: SpecStats.merge(v) for side, v in stats.items()})

    def fixed_costs(self, seed: int) -> dict:
        """Each side's fixed cost (prefill, the draft's prompt ingest, one token), which the formula
        leaves out: the same batches stopped after one token by a runtime limit (the programs
        compiled above, with their caches and prefill: nothing to compile); best of two
        interleaved passes per batch (a single short call is at the mercy of a load spike)."""
        nb = len(self.batches)
        f = {side: [float("inf")] * nb for side in self.sides}
        for _ in range(2):
            for j in range(nb):
                for side in self.sides:
                    t0 = time.perf_counter()
                    self.run(side, j, seed + j, limit=1)
                    f[side][j] = min(f[side][j], time.perf_counter() - t0)
        return {side: sum(v) for side, v in f.items()}


def _progress(it, on: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, disable=not on, leave=False)


def _tree_fields(sides: _Sides, timed: _Timed, fixed: dict, auto: dict | None, compile_s: float, *,
                 batch_size: int, probe_len: int, max_new_tokens: int, cost_iters: int, greedy: bool,
                 n_prompts: int) -> dict:
    """The report's ``tree`` record: the tree, its acceptance, speed (vs target-only and the
    chain), its measured round cost and predicted speedup, and ``auto``'s choice."""
    st = timed.stats["tree"]
    if sides.tree_cost is not None:
        step_ms, c = sides.tree_cost
    else:
        step_ms, (c,) = tree_auto.measure_tree_costs(sides.target, sides.draft.module, [sides.tree],
                                                     batch=batch_size, prompt_len=probe_len,
                                                     max_new_tokens=max_new_tokens, iters=cost_iters,
                                                     split=sides.split, mesh=sides.mesh,
                                                     compute=sides.common["compute"])
    tps = {side: timed.n[side] / timed.t[side] for side in ("base", "spec", "tree")}
    pred = st.tau * step_ms / (c.draft_ms + c.verify_ms)
    out = {**tree_auto.describe_tree(sides.tree), "tau": round(st.tau, 4),
           "per_depth_acceptance": [round(x, 4) for x in st.per_position],
           "tokens_per_step": st.tokens_per_step(), "rounds": st.rounds,
           "speculative": {"tokens": timed.n["tree"], "seconds": round(timed.t["tree"], 3),
                           "tok_s": round(tps["tree"], 2)},
           "speedup": round(tps["tree"] / tps["base"], 3), "speedup_over_chain": round(tps["tree"] / tps["spec"], 3),
           "cost": {"target_step_ms": round_ms(step_ms), "verify_ms": round_ms(c.verify_ms),
                    "draft_ms": round_ms(c.draft_ms), "verify_overhead": round(c.verify_ms / step_ms, 4)},
           "predicted_speedup": round(pred, 3), "speedup_over_predicted": round(tps["tree"] / tps["base"] / pred, 3),
           "compile_s": round(compile_s, 2)}
    dec = _decode_only(sides, timed, fixed, "tree")
    if dec is not None:
        out["decode_only"] = {"fixed_s": round(fixed["tree"], 3), "speedup": round(dec, 3)}
    if greedy:
        out["identical_greedy_outputs"] = f"{timed.same['tree']}/{n_prompts}"
    if auto is not None:
        out["auto"] = auto
    return out


def _report_fields(draft: SpecDraft, k: int, sampling: SamplingParams, draft_sampling: str, timed: _Timed,
                   cost: dict, *, batch_size: int, max_new_tokens: int, n_prompts: int, P: int, lens: list,
                   repeats: int) -> tuple[dict, float]:
    """The report's acceptance, throughput, cost and prediction fields, and the predicted speedup
    with the measured verify cost (unrounded)."""
    st = timed.stats["spec"]
    tps_base, tps_spec = timed.n["base"] / timed.t["base"], timed.n["spec"] / timed.t["spec"]
    speedup = tps_spec / tps_base
    pred = predicted_speedup(st.tau, k, cost["c"])
    pred_v = st.tau / (k * cost["c"] + cost["verify_overhead"])
    return {
        "bench": "spec_decode", "draft": draft.source, "algorithm": draft.algorithm, "k": k,
        "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
        "draft_sampling": "greedy" if sampling.greedy else draft_sampling, "batch_size": batch_size,
        "max_new_tokens": max_new_tokens, "prompts": n_prompts, "prompt_bucket": P,
        "prompt_buckets": sorted(set(lens)),
        "repeats": repeats,
        "tau": round(st.tau, 4), "alpha": round(alpha_from_tau(st.tau, k), 4),
        "per_position_acceptance": [round(x, 4) for x in st.per_position],
        "conditional_acceptance": [None if x is None else round(x, 4) for x in st.conditional],
        "tokens_per_step": st.tokens_per_step(), "rounds": st.rounds, "lossy": st.lossy,
        "target_only": {"tokens": timed.n["base"], "seconds": round(timed.t["base"], 3), "tok_s": round(tps_base, 2)},
        "speculative": {"tokens": timed.n["spec"], "seconds": round(timed.t["spec"], 3), "tok_s": round(tps_spec, 2)},
        "speedup": round(speedup, 3),
        "cost": {**{k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in cost.items()}},
        "predicted_speedup": round(pred, 3),
        "speedup_over_predicted": round(speedup / pred, 3),
        "predicted_speedup_with_verify_cost": round(pred_v, 3),
        "speedup_over_predicted_with_verify_cost": round(speedup / pred_v, 3),
    }, pred_v


def _on_mesh(target, mesh):
    """``target`` itself when its params already live on ``mesh``, else a copy placed by
    ``TARGET_RULES`` (the module passed in is not touched)."""
    if mesh_of(target) == mesh:
        return target
    graphdef, state = nnx.split(target)
    return nnx.merge(graphdef, jax.device_put(state, named_shardings(state, TARGET_RULES, mesh)))

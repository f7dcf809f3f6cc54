"""Target-only vs speculative decoding over the same prompts, in one process.

:func:`run_bench` pads every batch to ``batch_size``. At batch > 1 it pads every prompt to one
bucket and prefills each batch's prompts back to back in one packed row of one length (the one
``generate_ids``' "auto" picks for the longest batch; see ``generate.prefill``): each loop compiles
once. Unpacked on one device (batch 1),
each batch pads to its own bucket (a multiple of 32; one compile per bucket), so its prefill pays
for about its real length. Compile time is measured on a warm-up batch of each bucket and
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

Padding sequences (to fill the last batch) are generated and timed but not counted.

With ``mesh`` (a ``jax.sharding.Mesh`` of more than one device) both loops and the cost probes
run sharded: the target by ``TARGET_RULES`` (placed once, as a copy, when it is not on the mesh
already), the draft by ``DRAFT_RULES``, every batch split over ``("data", "fsdp")`` and padded to
a multiple of data x fsdp (the cost probes run at that padded batch), KV caches by batch and
heads. Multi-process: every process runs the same bench and holds the same report.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.decode.batch import bucket, packed_length
from specjax.decode.generate import generate_ids
from specjax.decode.sampling import GREEDY, SamplingParams
from specjax.decode.spec_stats import SpecStats, alpha_from_tau, predicted_speedup
from specjax.decode.speculative import Pair, SpecDraft, place_pair, resolve_k, speculative_generate_ids, split_pair
from specjax.models import panels
from specjax.models.drafts.common import greedy
from specjax.models.layers import first_argmax
from specjax.models.target import KVCache


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


def _best_interleaved(calls, iters: int) -> list[float]:
    """calls: [(fn, args)]; each compiled + warmed, then timed round-robin ``iters`` times (a load
    change hits all of them alike); best time of each."""
    for fn, args in calls:
        jax.block_until_ready(fn(*args))
    best = [float("inf")] * len(calls)
    for _ in range(iters):
        for i, (fn, args) in enumerate(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def measure_costs(target, draft, *, batch: int, prompt_len: int, max_new_tokens: int, k: int, iters: int = 5,
                  split=None, mesh=None) -> dict:
    """Seconds of one target decode step, one verify forward and one draft round at the
    speculative loop's shapes (caches of the loop's sizes, half full), as the on-device loop pays
    them: each probe runs R and 2R rounds in one call, best of ``iters`` (interleaved), and a
    round is the difference per R (host dispatch cancels).
    ``mesh``: inputs and caches placed as the sharded loop places them (batch over data/fsdp,
    heads over tensor; ``batch`` is padded to a multiple of data x fsdp), params as in ``split``
    (default :func:`specjax.decode.speculative.place_pair`)."""
    from specjax.decode.generate import pin_cache

    if mesh is not None:
        from specjax import sharding as shd

        batch = shd.pad_batch(batch, mesh)
        if split is None:
            split = place_pair(target, draft, mesh)
    graphdef, state = split if split is not None else split_pair(target, draft)
    if mesh is None:  # the weights the single-device loop runs on (speculative_generate_ids)
        state = panels.decode_state(Pair(target, draft), state)
    cfg = target.config
    S = prompt_len + max_new_tokens
    fill_host = np.full((batch,), prompt_len + max_new_tokens // 2, np.int32)
    fill = jnp.asarray(fill_host)
    dtype = target.model.embed_tokens.embedding[...].dtype
    tcache = KVCache.init(cfg, batch, S, dtype, lengths=fill)
    taps = tuple(draft.tap_ids(cfg.num_hidden_layers))

    def put(x, ndim=None):
        if mesh is None:
            return x
        return shd.put(np.asarray(x), shd.batch_sharding(mesh, np.ndim(x) if ndim is None else ndim))

    if mesh is not None:
        tcache = jax.tree.map(lambda x, sh: shd.put(np.asarray(x), sh), tcache, shd.kv_cache_sharding(mesh, tcache))
        fill = put(fill)

    # Each probe runs `reps` rounds in one call (a traced trip count: one compile), every round
    # fed by the previous one's tokens, and a round costs the difference between 2R and R rounds
    # per R: what the on-device loop pays per round, without the per-call host work (flattening
    # ~300 param leaves, 1-3 ms for SmolLM2: as much as a whole draft round). The target's cache
    # is donated and handed back (lengths reset), so it is updated in place as in the loop. The
    # target probes are compiled per target (not per pair): another draft reuses them.
    tgraph, tstate = _target_split(graphdef, state)
    step = functools.partial(_probe_step, tgraph)
    verify = functools.partial(_probe_verify, tgraph)

    def cycled(fn, ids):
        box = [jax.tree.map(jnp.copy, tcache)]

        def call(reps):
            out, box[0] = fn(tstate, ids, box[0], reps)
            return out
        return call

    ids1 = put(np.ones((batch, 1), np.int32))
    idsk = put(np.ones((batch, k + 1), np.int32))
    run_step, run_verify = cycled(step, ids1), cycled(verify, idsk)
    # the draft round's target rows (their values do not change its cost)
    aux = tuple(put(np.ones((batch, k + 1, cfg.hidden_size), np.dtype(dtype)), 3) for _ in taps)

    @jax.jit
    def draft_round(state, aux, ids, pos, nv, fill, reps):
        d = nnx.merge(graphdef, state).draft
        dcache = pin_cache(d.init_cache(batch, S + 2 * (k + 1), dtype, lengths=fill), mesh)
        rows = d.aux_from_taps(aux)

        def body(_, ids):
            prop = d.speculate(dcache, rows, ids, pos, n_valid=nv, k=k, sample=greedy)
            return jnp.concatenate([prop.tokens[:, :1].astype(ids.dtype), ids[:, 1:]], axis=1)
        return jax.lax.fori_loop(0, reps, body, ids)

    pos = put(fill_host[:, None] + np.arange(k + 1, dtype=np.int32)[None])
    nv = put(np.full((batch,), k + 1, np.int32))
    R = 3
    timed = _best_interleaved([(run_step, (R,)), (run_step, (2 * R,)), (run_verify, (R,)), (run_verify, (2 * R,)),
                               (draft_round, (state, aux, idsk, pos, nv, fill, R)),
                               (draft_round, (state, aux, idsk, pos, nv, fill, 2 * R))], iters)
    # (a difference lost in timing noise falls back to the 2R call's mean, host work included)
    t_step, t_verify, t_draft = ((timed[i + 1] - timed[i]) / R if timed[i + 1] > timed[i] else timed[i + 1] / (2 * R)
                                 for i in (0, 2, 4))
    return {"target_step_ms": round(1e3 * t_step, 3), "verify_ms": round(1e3 * t_verify, 3),
            "draft_round_ms": round(1e3 * t_draft, 3), "c": t_draft / (k * t_step),
            "verify_overhead": t_verify / t_step}


def _target_split(pair_graphdef, pair_state):
    """The target's own ``(graphdef, state)`` out of a pair's split (the same arrays)."""
    pair = nnx.merge(pair_graphdef, pair_state)
    return nnx.split(pair.target)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
def _probe_step(graphdef, state, ids, cache, reps):
    """``reps`` target decode steps (1 token, the last logit), each fed the previous argmax."""
    t = nnx.merge(graphdef, state)

    def body(_, c):
        ids, cache = c
        out = t(ids, cache=cache, logits_at=jnp.zeros((ids.shape[0],), jnp.int32))
        return first_argmax(out.logits)[:, None], out.cache.rollback(cache.lengths)
    return jax.lax.fori_loop(0, reps, body, (ids, cache))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
def _probe_verify(graphdef, state, ids, cache, reps):
    """``reps`` verify forwards ([B, k+1] tokens, every logit). The loop's verify also hands the
    draft's taps out (a few [B, k+1, H] rows): left out here, so one compile serves every draft."""
    t = nnx.merge(graphdef, state)

    def body(_, c):
        ids, cache = c
        out = t(ids, cache=cache)
        return first_argmax(out.logits), out.cache.rollback(cache.lengths)
    return jax.lax.fori_loop(0, reps, body, (ids, cache))


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
              prompt_bucket: int = 32, extra: dict | None = None, mesh=None) -> BenchReport:
    """Run the comparison (see the module docstring). ``target``: a ``CausalLM``; ``draft``: a
    :class:`SpecDraft`; prompts as token ids. ``repeats`` > 1 runs the whole interleaved pass again
    (same seeds, same outputs) and keeps each side's fastest pass. ``prompt_bucket``: prompts pad
    to a multiple of it (each multiple in use compiles both loops once). ``mesh``: run sharded (module
    docstring); the report gains ``"mesh"``. Returns a :class:`BenchReport`."""
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    prompts = [list(p) for p in prompt_ids]
    if not prompts:
        raise ValueError("no prompts given")
    kk = resolve_k(draft, k)
    P = bucket(max(len(p) for p in prompts), prompt_bucket)
    batches = []
    for i in range(0, len(prompts), batch_size):
        real = prompts[i:i + batch_size]
        batches.append((real + [prompts[0]] * (batch_size - len(real)), len(real)))
    if mesh is not None and mesh.size <= 1:
        mesh = None
    if mesh is not None:
        target = _on_mesh(target, mesh)  # once, so that no timed call re-places a copy
        split = place_pair(target, draft.module, mesh)
    else:
        split = split_pair(target, draft.module)
    # one packed prefill length for every batch (one compile): the length generate_ids' "auto"
    # picks for the longest batch (its prompts' sum rounded up to a multiple of the bucket), so a
    # generate call on the same prompts (notebook 02) runs the bench's compiled programs
    packed = packed_length(max(([len(p) for p in b] for b, _ in batches), key=sum), P) if mesh is None else None
    # unpacked on one device (batch 1): each batch pads to its own bucket (a multiple of 32), one
    # compile per bucket, so a prefill pays for about its real length at full GEMM rows (on 2 cores
    # this beats one bucket for all with a chunked prefill: 16 held-out code prompts of 64-195
    # tokens, prefill + first token 2.8 s vs 3.4 s)
    own = packed is None and mesh is None
    lens = [bucket(max(len(p) for p in b), prompt_bucket) if own else P for b, _ in batches]
    common = dict(max_new_tokens=max_new_tokens, sampling=sampling, eos_token_ids=eos_token_ids, pad_id=pad_id,
                  mesh=mesh, packed_len=packed)

    # both sides get their modules split once (a split costs ~13 ms of host work per call on SmolLM2)
    tsplit = nnx.split(target) if mesh is None else None

    def base(j, s, **over):
        return generate_ids(target, batches[j][0], seed=s, prompt_bucket=lens[j], split=tsplit, **{**common, **over})

    def spec(j, s, **over):
        return speculative_generate_ids(target, draft, batches[j][0], k=kk, seed=s, draft_sampling=draft_sampling,
                                        lossless=lossless, split=split, prompt_bucket=lens[j], **{**common, **over})

    # warm-up: one batch of each bucket compiles both loops (its timed run is taken off below)
    firsts = [lens.index(n) for n in sorted(set(lens))]
    compile_base = compile_spec = 0.0
    for j in firsts:
        t0 = time.perf_counter()
        base(j, seed + j)
        compile_base += time.perf_counter() - t0
        t0 = time.perf_counter()
        spec(j, seed + j)
        compile_spec += time.perf_counter() - t0
    best_base = best_spec = float("inf")
    one_base, one_spec = [float("inf")] * len(batches), [float("inf")] * len(batches)
    bar = tqdm(total=len(prompts) * repeats, desc="bench", unit="prompt", disable=not progress, leave=False)
    for rep in range(repeats):
        t_base = t_spec = 0.0
        n_base = n_spec = 0
        stats: list[SpecStats] = []
        same = 0
        for j, (b, n_real) in enumerate(batches):
            t0 = time.perf_counter()
            rb = base(j, seed + j)
            t1 = time.perf_counter()
            rs = spec(j, seed + j)
            t2 = time.perf_counter()
            t_base += t1 - t0
            t_spec += t2 - t1
            one_base[j], one_spec[j] = min(one_base[j], t1 - t0), min(one_spec[j], t2 - t1)
            n_base += sum(len(t) for t in rb.tokens[:n_real])
            n_spec += sum(len(t) for t in rs.tokens[:n_real])
            same += sum(a == c for a, c in zip(rb.tokens[:n_real], rs.tokens[:n_real]))
            stats.append(SpecStats(rs.stats.k, rs.stats.hist[:n_real], rs.stats.lossy))
            bar.update(n_real)
        best_base, best_spec = min(best_base, t_base), min(best_spec, t_spec)
    bar.close()
    t_base, t_spec = best_base, best_spec
    compile_base -= sum(one_base[j] for j in firsts)
    compile_spec -= sum(one_spec[j] for j in firsts)
    st = SpecStats.merge(stats)
    # the fixed cost of each side (prefill, the draft's prompt ingest, one token), which the
    # formula leaves out: the same batches stopped after one token by a runtime limit (the
    # programs compiled above, with their caches and prefill: nothing to compile); best of two
    # interleaved passes per batch (a single short call is at the mercy of a load spike)
    fb, fs = [float("inf")] * len(batches), [float("inf")] * len(batches)
    for _ in range(2):
        for j in range(len(batches)):
            t0 = time.perf_counter()
            base(j, seed + j, limit=1)
            t1 = time.perf_counter()
            spec(j, seed + j, limit=1)
            fb[j], fs[j] = min(fb[j], t1 - t0), min(fs[j], time.perf_counter() - t1)
    fix_base, fix_spec = sum(fb), sum(fs)
    n_one = sum(n for _, n in batches)
    # the probes' caches: the batches' mean bucket (half filled by the generation, as in the loop)
    cost = measure_costs(target, draft.module, batch=batch_size, prompt_len=bucket(int(np.mean(lens))),
                         max_new_tokens=max_new_tokens, k=kk,
                         iters=cost_iters, split=split, mesh=mesh)
    tps_base, tps_spec = n_base / t_base, n_spec / t_spec
    speedup = tps_spec / tps_base
    pred = predicted_speedup(st.tau, kk, cost["c"])
    pred_v = st.tau / (kk * cost["c"] + cost["verify_overhead"])
    data: dict[str, Any] = {
        "bench": "spec_decode", "draft": draft.source, "algorithm": draft.algorithm, "k": kk,
        "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
        "draft_sampling": "greedy" if sampling.greedy else draft_sampling, "batch_size": batch_size,
        "max_new_tokens": max_new_tokens, "prompts": len(prompts), "prompt_bucket": P,
        "prompt_buckets": sorted(set(lens)),
        "repeats": repeats,
        "tau": round(st.tau, 4), "alpha": round(alpha_from_tau(st.tau, kk), 4),
        "per_position_acceptance": [round(x, 4) for x in st.per_position],
        "conditional_acceptance": [None if x is None else round(x, 4) for x in st.conditional],
        "tokens_per_step": st.tokens_per_step(), "rounds": st.rounds, "lossy": st.lossy,
        "target_only": {"tokens": n_base, "seconds": round(t_base, 3), "tok_s": round(tps_base, 2)},
        "speculative": {"tokens": n_spec, "seconds": round(t_spec, 3), "tok_s": round(tps_spec, 2)},
        "speedup": round(speedup, 3),
        "cost": {**{k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in cost.items()}},
        "predicted_speedup": round(pred, 3),
        "speedup_over_predicted": round(speedup / pred, 3),
        "predicted_speedup_with_verify_cost": round(pred_v, 3),
        "speedup_over_predicted_with_verify_cost": round(speedup / pred_v, 3),
        "compile_s": {"target_only": round(compile_base, 2), "speculative": round(compile_spec, 2)},
    }
    if t_base > fix_base and t_spec > fix_spec and min(n_base, n_spec) > n_one:
        dec = ((n_spec - n_one) / (t_spec - fix_spec)) / ((n_base - n_one) / (t_base - fix_base))
        data["decode_only"] = {
            "fixed_s": {"target_only": round(fix_base, 3), "speculative": round(fix_spec, 3)},
            "speedup": round(dec, 3), "speedup_over_predicted_with_verify_cost": round(dec / pred_v, 3)}
    if sampling.greedy:
        data["identical_greedy_outputs"] = f"{same}/{len(prompts)}"
    if mesh is None:  # the single-device loops run on the CPU kernels when these are available
        from specjax import kernels

        data["cpu_kernels"] = kernels.available()
        if data["cpu_kernels"]:  # which weights the kernels stream as bf16 (bf16-valued params)
            data["panel_dtypes"] = panels.panel_dtypes(panels.decode_state(Pair(target, draft.module), split[1]))
    else:
        from specjax.sharding import describe

        data["mesh"] = describe(mesh)
    if extra:
        data.update(extra)
    return BenchReport(data)


def _on_mesh(target, mesh):
    """``target`` itself when its params already live on ``mesh``, else a copy placed by
    ``TARGET_RULES`` (the module passed in is not touched)."""
    from specjax.sharding import TARGET_RULES, mesh_of, named_shardings

    if mesh_of(target) == mesh:
        return target
    graphdef, state = nnx.split(target)
    return nnx.merge(graphdef, jax.device_put(state, named_shardings(state, TARGET_RULES, mesh)))


def plot(report: BenchReport | dict, path: str | Path) -> Path:
    """PNG: per-position acceptance (bars: P(accepted), line: conditional) and the histogram of
    tokens committed per target forward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = report.data if isinstance(report, BenchReport) else report
    k = d["k"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    pos = np.arange(1, k + 1)
    a1.bar(pos, d["per_position_acceptance"], color="#4c72b0", label="P(accepted)")
    cond = [np.nan if x is None else x for x in d["conditional_acceptance"]]
    a1.plot(pos, cond, "o-", color="#dd8452", label="P(accepted | previous accepted)")
    a1.set_xlabel("draft position")
    a1.set_ylabel("acceptance rate")
    a1.set_ylim(0, 1.25)
    a1.set_xticks(pos)
    a1.legend(loc="upper center", fontsize=8, ncol=2)
    a1.set_title(f"{d['algorithm']} draft, k={k}, tau={d['tau']:.2f}")
    tps = {int(j): n for j, n in d["tokens_per_step"].items()}
    xs = np.arange(1, k + 2)
    a2.bar(xs, [tps.get(int(x), 0) for x in xs], color="#55a868")
    a2.set_xlabel("tokens committed per target forward")
    a2.set_ylabel("rounds")
    a2.set_xticks(xs)
    a2.set_title(f"speedup {d['speedup']:.2f}x (predicted {d['predicted_speedup']:.2f}x)")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

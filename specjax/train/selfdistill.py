"""Self-distillation data: the target writes the assistant turns itself (batched, greedy or
sampled) and, in the same pass, records the hidden states the draft trains on.

The row of a regenerated turn is ``render(history, add_generation_prompt=True) + generated ids``
with the loss mask on the generated ids: exactly the tokens the target emitted (no decode /
re-encode drift). Its hidden states come from the same forwards that generated it: the prompt
prefill (taps over the prompt) and one decode step per generated token (taps over the token fed
at that step), plus one extra step that feeds the final token. They equal a separate prefill
over the whole row up to float rounding (checked in tests), so no second pass is needed.

The loop is the generate loop (:func:`specjax.decode.generate.generate_padded` with ``tap_ids``:
it records each fed token's taps and runs one step past the last token). Shapes: one ``jax.jit``
(prefill + ``lax.while_loop``) per ``(batch, prompt bucket, max_new_tokens)``; the leading tokens
every prompt shares (the chat template's system turn) are prefilled once per batch and copied
into every row, the rest of each prompt is right-padded to a multiple of ``prompt_bucket``, and
each batch's KV cache holds its own bucket +
``max_new_tokens`` slots (one compile per bucket: prompts run sorted by length, so short batches
do not pay for the longest prompt's cache).
On a single-device CPU the forwards run in the panel view of the params
(:func:`specjax.models.panels.decode_state`: the native matmul and decode-attention kernels, as
the generate loop does); at most ``panels.MAX_ROWS`` rows a step take that path
(``panels.MAX_ROWS_BF16`` with ``compute="bfloat16"``), so a batch of 16 (32 in bf16) streams the
weights once per step where XLA's dot would re-read them at a stride. On a CPU with AMX tiles the
bf16 kernel runs on them and takes any number of rows, the prefill's too (where the kernel was built
without them, more than ``panels.BF16_KERNEL_ROWS_AMX`` (8) rows multiply on XLA's bf16 dot, which
does: :func:`specjax.models.panels.bf16_layout`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.decode.batch import bucket, overlapped
from specjax.decode.generate import generate_padded
from specjax.decode.sampling import SamplingParams
from specjax.models import panels


@dataclass
class Generated:
    prompt_ids: list[int]
    token_ids: list[int]  # generated (EOS included when it stopped the turn)
    stop_reason: str  # "eos" | "length"
    hidden_states: np.ndarray | None  # [len(prompt) + len(generated), L, H] or None without taps


def _padded_batch(prompts: Sequence[Sequence[int]], lens: list[int], idx: list[int], *, batch_size: int,
                  prompt_bucket: int, pad_id: int, max_new_tokens: int, prefix: int = 0):
    """One batch's host arrays (ids [B, P], prompt lengths, limits [B]; B = batch_size: one compile) and P:
    the shared ``prefix`` plus the longest rest rounded up to ``prompt_bucket``."""
    B = batch_size  # fixed batch shape: one decode compile
    P = prefix + bucket(max(lens[i] for i in idx) - prefix, prompt_bucket)
    ids = np.full((B, P), pad_id, np.int32)
    plen = np.ones((B,), np.int32)
    limits = np.zeros((B,), np.int32)
    for r, i in enumerate(idx):
        ids[r, : lens[i]] = prompts[i]
        plen[r] = lens[i]
        limits[r] = max_new_tokens
    ids[len(idx):], plen[len(idx):] = ids[0], plen[0]  # filler rows (limit 0: done at once) copy row 0
    return ids, plen, limits, P


def shared_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
    """The number of leading tokens every prompt shares (a chat template's system turn), at most
    the shortest prompt's length - 1 (every prompt keeps a token of its own to prefill); 0 for
    fewer than two prompts."""
    if len(prompts) < 2:
        return 0
    common = len(os.path.commonprefix([list(p) for p in prompts]))  # element-wise on lists too
    return max(min(common, min(len(p) for p in prompts) - 1), 0)


def _batch_results(out, prompts: Sequence[Sequence[int]], lens: list[int], idx: list[int],
                   taps: tuple[int, ...]) -> list[Generated]:
    """One batch's loop output as a :class:`Generated` per prompt (prompt and continuation taps joined)."""
    toks, num, eos_hit = (np.asarray(a) for a in out[:3])
    phs, ghs = (np.asarray(jax.device_get(a)) for a in out[3:]) if taps else (None, None)
    batch_res = []
    for r, i in enumerate(idx):
        g = toks[r, : num[r]].tolist()
        hs = None
        if taps:
            hs = np.concatenate([phs[r, : lens[i]], ghs[r, : num[r]]], axis=0)
        batch_res.append(Generated(list(map(int, prompts[i])), g, "eos" if eos_hit[r] else "length", hs))
    return batch_res


def generate_with_hidden_states(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 256,
                                taps: Sequence[int] = (), sampling: SamplingParams = SamplingParams(), seed: int = 0,
                                eos_token_ids: Sequence[int] = (), pad_id: int = 0, batch_size: int = 32,
                                prompt_bucket: int = 64, out_dtype=jnp.bfloat16, max_prompt_len: int | None = None,
                                progress: bool = True, on_batch: Callable[[list[int], list[Generated]], None] | None = None,
                                desc: str = "generating", compute: str = "float32",
                                share_prefix: bool = True) -> list[Generated]:
    """Generate a continuation of every prompt (token ids) and, when ``taps`` are given, the
    hidden states at those layer ids for prompt + continuation. Prompts are processed in
    batches of similar length; ``on_batch(indices, results)`` is called after each batch (so a
    caller can write files and resume). ``compute="bfloat16"``: the matmuls in bf16 with float32
    accumulation (:func:`specjax.models.panels.decode_state`; on the CPU kernels, else float32).
    ``share_prefix``: the leading tokens every prompt shares (:func:`shared_prefix_len`: a chat
    template's system turn) are prefilled once per batch and copied into every row
    (:func:`specjax.decode.prefill.shared_prefix_prefill`). Returns results in prompt order."""
    from tqdm.auto import tqdm

    cfg = model.config
    ctx = int(cfg.max_position_embeddings)
    lens = [len(p) for p in prompts]
    if any(n == 0 for n in lens):
        raise ValueError(f"prompt {lens.index(0)} is empty")
    prefix = shared_prefix_len(prompts) if share_prefix else 0
    Pmax = prefix + bucket((max_prompt_len or max(lens)) - prefix, prompt_bucket)
    if Pmax + max_new_tokens > ctx:
        raise ValueError(f"prompts up to {Pmax} tokens + {max_new_tokens} new tokens exceed the context {ctx}")
    graphdef, params = nnx.split(model)
    params = panels.decode_state(model, params, compute=compute, rows=batch_size)
    cache_dtype = jnp.dtype(model.model.embed_tokens.embedding[...].dtype)
    order = sorted(range(len(prompts)), key=lambda i: (lens[i], i))
    eos = jnp.asarray(list(eos_token_ids), jnp.int32)
    results: list[Generated | None] = [None] * len(prompts)
    key = jax.random.key(seed)
    bar = tqdm(total=len(prompts), unit="prompt", desc=desc, disable=not progress, dynamic_ncols=True)
    t0, ntok = time.perf_counter(), 0
    taps_t = tuple(int(t) for t in taps)

    def finish(idx, out):
        nonlocal ntok
        batch_res = _batch_results(out, prompts, lens, idx, taps_t)
        for i, res in zip(idx, batch_res):
            results[i] = res
            ntok += lens[i] + len(res.token_ids)
        if on_batch is not None:
            on_batch(idx, batch_res)
        bar.update(len(idx))
        bar.set_postfix_str(f"{ntok / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")

    def start(idx):
        nonlocal key
        ids, plen, limits, P = _padded_batch(prompts, lens, idx, batch_size=batch_size, prompt_bucket=prompt_bucket,
                                             pad_id=pad_id, max_new_tokens=max_new_tokens, prefix=prefix)
        key, sub = jax.random.split(key)
        return generate_padded(graphdef, params, jnp.asarray(ids), jnp.asarray(plen), jnp.asarray(limits), sub, eos,
                               max_new_tokens=max_new_tokens, max_len=P + max_new_tokens, sampling=sampling,
                               pad_id=pad_id, cache_dtype=cache_dtype, tap_ids=taps_t, capture_dtype=out_dtype,
                               shared_prefix=prefix)

    # batch n + 1 is dispatched before batch n's results are copied to the host and handed to
    # on_batch (where callers write them): the writes overlap the device's work
    overlapped([order[b0: b0 + batch_size] for b0 in range(0, len(order), batch_size)], start, finish)
    bar.close()
    return results  # type: ignore[return-value]

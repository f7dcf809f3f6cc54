"""Offline acceptance of an EAGLE-3 draft under greedy speculative decoding, measured exactly
without a decode engine.

For greedy decoding the target's output does not depend on the draft, so the target's greedy
continuation of each prompt (with its hidden states, captured while generating) fixes everything.
At a verify step that starts after position ``p`` the draft sees the context rows ``j <= p``
(aux ``g_j``, token ``x_{j+1}``) and chains ``k`` proposals; the target accepts the leading
proposals that equal its own next tokens. With teacher forcing, the TTT forward gives at every row
``j`` the draft's step-``s`` prediction given correct earlier steps, which is all that matters:
a chain stops at its first wrong token. So ``A[j]`` = leading correct steps at row ``j`` (draft
ids mapped through ``d2t``), and the decode walk ``j -> j + A[j] + 1`` from the first generated
token gives the tokens committed per target forward, ``tau = mean(A + 1)`` over verify steps, and
per-position acceptance rates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from specjax.models.drafts.common import d2t_of
from specjax.train.fast_eagle3 import ttt_forward
from specjax.train.selfdistill import generate_with_hidden_states


@dataclass
class AcceptanceReport:
    tau: float  # tokens committed per verify step (accepted + bonus)
    per_position: list[float]  # P(accept >= i) over verify steps, i = 1..k
    steps: int
    tokens: int
    prompts: int
    k: int

    def as_dict(self) -> dict:
        return {"tau": round(self.tau, 4), "per_position": [round(x, 4) for x in self.per_position],
                "verify_steps": self.steps, "generated_tokens": self.tokens, "prompts": self.prompts, "k": self.k}


def _accept_lengths(draft, hs, ids, k: int, d2t):
    """hs [T, L, H] (aux layers then the last), ids [T] -> A [T-1]: leading correct steps per row."""
    T = ids.shape[0]
    aux = hs[:, :-1].reshape(T, -1)
    x = jnp.asarray(aux[:-1][None], jnp.float32)
    inp = jnp.asarray(ids[1:][None], jnp.int32)
    doc = jnp.zeros((1, T - 1), jnp.int32)
    pos = jnp.arange(1, T, dtype=jnp.int32)[None]
    out = ttt_forward(draft, x, inp, doc, pos, None, ttt_steps=k)
    pred = jnp.argmax(out.logits[:, 0], axis=-1)  # [k, T-1] draft ids
    if d2t is not None:
        pred = pred + jnp.asarray(d2t)[pred]
    pred = np.asarray(pred)
    n = T - 1
    A = np.zeros(n, np.int64)
    alive = np.ones(n, bool)
    for s in range(k):
        tgt = np.full(n, -1, np.int64)
        # row j step s predicts x_{j+2+s}
        m = n - 1 - s
        if m > 0:
            tgt[:m] = ids[2 + s: 2 + s + m]
        ok = alive & (pred[s] == tgt)
        A += ok
        alive = ok
    return A


def evaluate_acceptance(draft, target, prompts: Sequence[Sequence[int]], *, aux_layer_ids: Sequence[int], k: int = 3,
                        max_new_tokens: int = 128,
                        batch_size: int = 16, eos_token_ids: Sequence[int] | None = None,
                        progress: bool = False) -> AcceptanceReport:
    """``draft``: an ``Eagle3Draft`` module; ``target``: a ``LoadedTarget``; prompts: token ids;
    ``aux_layer_ids``: the draft's ``eagle_aux_hidden_state_layer_ids``."""
    n = target.config.num_hidden_layers
    aux = [int(i) for i in aux_layer_ids]
    eos = target.eos_token_ids if eos_token_ids is None else tuple(eos_token_ids)
    res = generate_with_hidden_states(target.model, prompts, max_new_tokens=max_new_tokens, taps=aux + [n],
                                      eos_token_ids=eos, batch_size=batch_size, out_dtype=jnp.float32,
                                      progress=progress, desc="target greedy")
    d2t = d2t_of(draft)
    lengths, steps, tokens = [], 0, 0
    for r in res:
        ids = np.asarray(r.prompt_ids + r.token_ids, np.int64)
        P, G = len(r.prompt_ids), len(r.token_ids)
        if G < 2:
            continue
        A = _accept_lengths(draft, r.hidden_states, ids, k, d2t)
        j = P - 1  # row P-1: (g_{P-1}, x_P) proposes x_{P+1}...; x_P came from the prefill
        end = len(ids) - 1  # last row whose successor exists
        committed = 1
        while j < end:
            a = int(min(A[j], end - j - 1)) if j < len(A) else 0
            lengths.append(a)
            steps += 1
            j += a + 1
            committed += a + 1
        tokens += G
    L = np.asarray(lengths)
    tau = float(np.mean(L + 1)) if len(L) else 0.0
    per = [float(np.mean(L >= i)) if len(L) else 0.0 for i in range(1, k + 1)]
    return AcceptanceReport(tau, per, steps, tokens, len(prompts), k)

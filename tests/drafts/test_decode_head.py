"""The decode path computes the draft head only where it is used.

``speculate`` / ``propose`` feed only each sequence's last real context row into the chain
(EAGLE-3, P-EAGLE, MTP) and only the k drafted slots of a block (DFlash, DSpark): the other
rows write their K/V and stop. These tests check (1) that ``extend(rows=...)`` gives exactly the
selected rows of the all-row ``extend`` and the same cache, (2) that in the traced decode entry
no ``lm_head`` product has more rows than are used, and (3) that a block proposal of k tokens is
the prefix of the full block's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models.drafts import load_draft
from specjax.models.drafts.common import last_rows
from tests.drafts.conftest import TOL, rel_err
from tests.drafts.test_inference import SWA, one_doc

CHAIN = {
    "eagle3-2layers": ("eagle3", "llama", {"draft_vocab": 40, "norm_output": True, "num_layers": 2}),
    "eagle3-swa": ("eagle3", "qwen3", {"norm_output": True, "fc_norm": True, **SWA}),
    "eagle3-1layer": ("eagle3", "llama", {"draft_vocab": 40, "norm_before_fc": True}),
    "peagle": ("peagle", "qwen3", {"draft_vocab": 40, **SWA}),
    "mtp": ("mtp", "qwen3", {}),
}


def _chain_inputs(algo, draft):
    b = one_doc(algo, draft, T=14, seed=5)
    if algo == "mtp":
        return b["hidden_states"][:, :12], b["input_ids"][:, 1:13], b["position_ids"][:, :12]
    return b["hidden_states"][:, :12], b["input_ids"][:, :12], b["position_ids"][:, :12]


@pytest.mark.parametrize("case", list(CHAIN))
def test_extend_rows_equal_all_rows(draft_ckpt, verifiers, case):
    algo, fam, kw = CHAIN[case]
    draft = load_draft(draft_ckpt(algo, fam, **kw), verifiers[fam])
    aux, ids, pos = _chain_inputs(algo, draft)
    # two sequences, ragged: 12 and 5 real rows, written after 3 earlier context rows
    cat = lambda x: jnp.concatenate([x, x])  # noqa: E731
    c0 = draft.extend(draft.init_cache(2, 32), cat(aux[:, :3]), cat(ids[:, :3]), cat(pos[:, :3])).cache
    aux, ids, pos = cat(aux[:, 3:]), cat(ids[:, 3:]), cat(pos[:, 3:])
    nv = jnp.asarray([9, 5])
    full = draft.extend(c0, aux, ids, pos, nv)
    rows = jnp.asarray([[8, 2], [4, 0]])  # any rows, any order
    part = draft.extend(c0, aux, ids, pos, nv, rows=rows)
    assert part.logits.shape == (2, 2, full.logits.shape[-1])
    for b in range(2):
        assert rel_err(part.logits[b], full.logits[b, rows[b]]) <= TOL
        assert rel_err(part.hidden[b], full.hidden[b, rows[b]]) <= TOL
    for a, c in zip(jax.tree.leaves(part.cache), jax.tree.leaves(full.cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    last = draft.extend(c0, aux, ids, pos, nv, rows=last_rows(nv, aux.shape[1]))
    for b in range(2):
        assert rel_err(last.logits[b, 0], full.logits[b, int(nv[b]) - 1]) <= TOL


def _dots(jaxpr, out=None):
    """Every dot_general (in nested jaxprs too): (lhs shape, rhs shape, out shape)."""
    out = [] if out is None else out
    for eq in jaxpr.eqns:
        if eq.primitive.name == "dot_general":
            out.append((tuple(eq.invars[0].aval.shape), tuple(eq.invars[1].aval.shape),
                        tuple(eq.outvars[0].aval.shape)))
        for p in eq.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    _dots(sub, out)
    return out


def _head_rows(draft, fn, *args):
    """Rows of every lm_head product in ``fn(*args)``'s trace (products with the lm_head's
    [H, Vd] kernel as their right operand)."""
    kshape = tuple(draft.lm_head.kernel[...].shape)
    dots = _dots(jax.make_jaxpr(fn)(*args).jaxpr)
    return [int(np.prod(o[:-1])) for lhs, rhs, o in dots if rhs == kshape]


@pytest.mark.parametrize("case", ["eagle3-2layers", "eagle3-1layer", "peagle", "mtp"])
def test_speculate_head_only_on_used_rows(draft_ckpt, verifiers, case):
    algo, fam, kw = CHAIN[case]
    draft = load_draft(draft_ckpt(algo, fam, **kw), verifiers[fam])
    aux, ids, pos = _chain_inputs(algo, draft)
    B, n, k = 1, ids.shape[1], 3
    cache = draft.init_cache(B, 32)
    rows = _head_rows(draft, lambda c, a, i, p: draft.speculate(c, a, i, p, k=k).tokens, cache, aux, ids, pos)
    # chain: one row at extend, one per later step (in a scan body: traced once); P-EAGLE: the
    # parallel pass over k - 1 mask rows
    assert rows, "no lm_head product found"
    assert max(rows) <= B * max(1, k - 1 if algo == "peagle" else 1), rows
    assert all(r < B * n for r in rows)


@pytest.mark.parametrize("algo,fam,kw", [
    ("dflash", "qwen3", {"draft_vocab": 40}),
    ("dflash", "llama", {**SWA, "sample_from_anchor": True}),
    ("dspark", "qwen3", {"markov_head_type": "rnn", "draft_vocab": 40}),
    ("dspark", "qwen3", {"markov_head_type": "gated", "sample_from_anchor": False, **SWA}),
])
def test_block_k_is_prefix(draft_ckpt, verifiers, algo, fam, kw):
    draft = load_draft(draft_ckpt(algo, fam, **kw), verifiers[fam])
    b = one_doc(algo, draft, T=16, seed=6)
    aux, pos, ids = b["hidden_states"][:, :10], b["position_ids"][:, :10], b["input_ids"][:, 1:11]
    full = draft.speculate(draft.init_cache(1, 32), aux, ids, pos)
    kmax = full.tokens.shape[1]
    assert kmax == draft.num_block_tokens()
    for k in range(1, kmax + 1):
        part = draft.speculate(draft.init_cache(1, 32), aux, ids, pos, k=k)
        np.testing.assert_array_equal(np.asarray(part.tokens), np.asarray(full.tokens[:, :k]))
        assert rel_err(part.logits, full.logits[:, :k]) <= TOL
    key = jax.random.key(3)
    gumbel = lambda lg, kk: jnp.argmax(lg + jax.random.gumbel(kk, lg.shape), -1).astype(jnp.int32)  # noqa: E731
    fs = draft.speculate(draft.init_cache(1, 32), aux, ids, pos, sample=gumbel, key=key)
    ps = draft.speculate(draft.init_cache(1, 32), aux, ids, pos, k=2, sample=gumbel, key=key)
    np.testing.assert_array_equal(np.asarray(ps.tokens), np.asarray(fs.tokens[:, :2]))
    rows = _head_rows(draft, lambda c, a, i, p: draft.speculate(c, a, i, p, k=2).tokens,
                      draft.init_cache(1, 32), aux, ids, pos)
    first = 0 if draft.sample_from_anchor else 1
    assert rows and max(rows) <= first + 2, rows
    with pytest.raises(Exception, match="asked for"):
        draft.speculate(draft.init_cache(1, 32), aux, ids, pos, k=kmax + 1)

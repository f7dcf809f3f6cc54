"""Loss parity with speculators 0.9.0 for P-EAGLE, DSpark and MTP (eager losses, float32, CPU):
the same parameters, the same packed row and the same random choices (COD elements / anchors drawn
by speculators' own functions and passed to both) give the loss and every metric within 1e-5
relative and the gradients of a few parameters within 1e-4. P-EAGLE is also checked with the
elements padded to a static budget (the trainer's layout): padding changes nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax.models.drafts import load_draft
from specjax.train.cod import cod_sample, cod_budget, num_elements, pad_elements
from specjax.train.losses import parse_loss_spec
from specjax.train.objectives import dspark_objective, mtp_objective, mtp_step_weights, peagle_objective
from tests.refs.spec_forward import cod_elements, load_reference, packed_batch
from tests.train.test_loss_parity import GRAD_PARAMS, LOSS_TOL, _check_grads, _ours_grad, _ref_run, block_reference

MAX_REL = {}  # case -> (loss rel, worst metric rel, grad rel): printed by -s for the report


def _compare(case, loss_v, ref_loss, m, ref_m, g, ref_g, names):
    rel = abs(loss_v - ref_loss) / abs(ref_loss)
    assert rel <= LOSS_TOL, (loss_v, ref_loss)
    ref_m.pop("error_records", None)
    worst = 0.0
    for k, v in ref_m.items():
        assert k in m, (k, sorted(m))
        err = abs(m[k] - v) / max(abs(v), 1.0)
        worst = max(worst, err)
        assert err <= LOSS_TOL, (k, m[k], v)
    errs = _check_grads(g, ref_g, names)
    MAX_REL[case] = (rel, worst, max(errs.values()))
    print(case, MAX_REL[case])


PEAGLE_CASES = {
    "kl-llama": ("llama", {}, "kl_div", 4, None),
    "compound-qwen3-vocab-anchors": ("qwen3", {"draft_vocab": 40, "fc_norm": True}, '{"ce": 0.3, "tv": 0.7}', 5, 6),
}


@pytest.mark.parametrize("case", list(PEAGLE_CASES))
@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
def test_peagle_loss_metrics_grads(spec_draft, verifiers, case, padded):
    import speculators.models.peagle.core as pcore

    fam, kw, loss, depths, max_anchors = PEAGLE_CASES[case]
    ck = spec_draft("peagle", fam, num_depths=depths, **kw)
    ref_model = load_reference(ck, "sdpa")
    tl = ref_model.config.transformer_layer_config
    batch = packed_batch("peagle", hidden=tl.hidden_size, num_aux=3, vocab=tl.vocab_size, seed=7,
                         avoid_token=ref_model.config.mask_token_id)
    anchor_pos, depth = cod_elements(batch["loss_mask"], seed=1, num_depths=depths, max_anchors=max_anchors)
    assert int(depth.max()) >= 2  # a few depths really sampled
    old = pcore.generate_cod_sample_indices
    pcore.generate_cod_sample_indices = lambda **_k: (anchor_pos, depth)
    try:
        ref_loss, ref_m, ref_g = _ref_run(ref_model, batch, {"num_depths": depths, "max_anchors": max_anchors}, loss)
    finally:
        pcore.generate_cod_sample_indices = old
    T = batch["input_ids"].shape[1]
    n = num_elements(T, max_anchors, depths) if padded else anchor_pos.shape[0]
    assert n >= anchor_pos.shape[0]
    ap, dp, ok = pad_elements(anchor_pos.numpy(), depth.numpy(), n)
    draft = load_draft(ck, verifiers[fam])
    inp = {k: jnp.asarray(v.numpy()) for k, v in batch.items()}
    spec = parse_loss_spec(loss)

    def fn(m):
        out = m(inp["hidden_states"], inp["input_ids"], inp["document_ids"], inp["position_ids"], inp["loss_mask"],
                inp["verifier_last_hidden_states"], anchor_pos=jnp.asarray(ap), depth=jnp.asarray(dp))
        lm = out.loss_mask * jnp.asarray(ok)[None].astype(out.loss_mask.dtype)
        return peagle_objective(out.logits, out.targets, lm, jnp.asarray(dp)[None], num_depths=depths, loss_spec=spec)

    loss_v, m, g = _ours_grad(draft, fn)
    names = dict(GRAD_PARAMS, **{"mask_hidden": (("mask_hidden",), False),
                                 "embed_tokens.weight": (("embed_tokens", "embedding"), False)})
    _compare(f"peagle-{case}-{'padded' if padded else 'exact'}", loss_v, ref_loss, m, ref_m, g, ref_g, names)
    assert "embed_tokens.weight" in ref_g  # P-EAGLE trains its embedding, and the gradient matched


DSPARK_CASES = {
    "kl-vanilla": ("qwen3", {}, "kl_div", {"per_position_loss_weight": "fixed-exp-decay", "dflash_decay_gamma": 4.0}),
    "ce-dpace-gated-vocab": ("qwen3", {"draft_vocab": 40, "markov_head_type": "gated"}, "ce",
                             {"per_position_loss_weight": "dpace", "dpace_alpha": 0.5}),
    "compound-rnn-llama-alpha": ("llama", {"markov_head_type": "rnn", "confidence_head_with_markov": False},
                                 '{"kl_div": 0.5, "tv": 0.5}',
                                 {"per_position_loss_weight": "fixed-exp-decay", "dflash_decay_gamma": 2.0,
                                  "confidence_head_alpha": 0.7}),
}


@pytest.mark.parametrize("case", list(DSPARK_CASES))
def test_dspark_loss_metrics_grads(spec_draft, verifiers, case):
    from speculators.losses import resolve_loss_config

    fam, kw, loss, fwd = DSPARK_CASES[case]
    ck, batch, anchors, valid, ref_loss, ref_m, ref_g = block_reference(
        spec_draft, "dspark", fam, kw, loss, fwd, {"tv_loss_fn": resolve_loss_config("tv", "eager")["tv"][0]})
    draft = load_draft(ck, verifiers[fam])
    inp = {k: jnp.asarray(v.numpy()) for k, v in batch.items()}
    spec = parse_loss_spec(loss)

    def fn(m):
        out = m(**inp, anchor_positions=jnp.asarray(anchors.numpy()), anchor_valid=jnp.asarray(valid.numpy()))
        return dspark_objective(out.logits, out.targets, out.confidence, out.loss_mask, block_size=m.block_size,
                                loss_spec=spec, per_position_loss_weight=fwd["per_position_loss_weight"],
                                gamma=fwd.get("dflash_decay_gamma", 4.0), dpace_alpha=fwd.get("dpace_alpha", 0.5),
                                sample_from_anchor=m.sample_from_anchor,
                                confidence_head_alpha=fwd.get("confidence_head_alpha", 1.0))

    loss_v, m, g = _ours_grad(draft, fn)
    assert {"accept_len", "accept_rate", "confidence_loss", "eal", "position_0_acc"} <= set(ref_m)
    names = {"fc.weight": GRAD_PARAMS["fc.weight"],
             "layers.0.self_attn.k_proj.weight": (("layers", 0, "self_attn", "k_proj", "kernel"), True),
             "layers.1.mlp.up_proj.weight": (("layers", 1, "mlp", "up_proj", "kernel"), True),
             "markov_head.markov_w1.weight": (("markov_head", "markov_w1", "embedding"), False),
             "markov_head.markov_w2.weight": (("markov_head", "markov_w2", "kernel"), True),
             "confidence_head.proj.weight": (("confidence_head", "proj", "kernel"), True)}
    _compare(f"dspark-{case}", loss_v, ref_loss, m, ref_m, g, ref_g, names)


@pytest.mark.parametrize("steps,beta", [(3, 0.6), (2, 0.3)])
def test_mtp_loss_metrics_grads(spec_draft, verifiers, steps, beta):
    from speculators.models.mtp.core import compute_step_weights

    ck = spec_draft("mtp", "qwen3", num_speculative_steps=steps)
    ref_model = load_reference(ck, "sdpa")
    tl = ref_model.config.transformer_layer_config
    batch = packed_batch("mtp", hidden=tl.hidden_size, num_aux=3, vocab=tl.vocab_size, seed=11)
    w = compute_step_weights(beta, steps)
    assert np.allclose(w, mtp_step_weights(beta, steps), rtol=0, atol=0)
    ref_loss, ref_m, ref_g = _mtp_ref(ref_model, batch, w)
    draft = load_draft(ck, verifiers["qwen3"])
    inp = {k: jnp.asarray(v.numpy()) for k, v in batch.items()}

    def fn(m):
        out = m(inp["input_ids"], inp["hidden_states"], position_ids=inp["position_ids"], loss_mask=inp["loss_mask"])
        return mtp_objective(out.logits, out.labels, step_weights=mtp_step_weights(beta, steps))

    loss_v, m, g = _ours_grad(draft, fn)
    p = ("mtp_layers", 0)
    names = {"mtp_layers.0.input_proj.weight": ((*p, "input_proj", "kernel"), True),
             "mtp_layers.0.self_attn.q_proj.weight": ((*p, "self_attn", "q_proj", "kernel"), True),
             "mtp_layers.0.mlp.down_proj.weight": ((*p, "mlp", "down_proj", "kernel"), True),
             "mtp_layers.0.hidden_layernorm.weight": ((*p, "hidden_layernorm", "scale"), False),
             "mtp_layers.0.final_layernorm.weight": ((*p, "final_layernorm", "scale"), False)}
    assert {f"loss_step_{k}" for k in range(steps)} <= set(ref_m)
    _compare(f"mtp-{steps}-{beta}", loss_v, ref_loss, m, ref_m, g, ref_g, names)


def _mtp_ref(model, batch, step_weights):
    from speculators.train.utils import normalize_counted_metrics

    model.zero_grad(set_to_none=True)
    _, total, metrics = model(**batch, step_weights=step_weights)
    total.backward()
    grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return float(total), normalize_counted_metrics({k: float(v) for k, v in metrics.items()}), grads


# ----------------------------------------------------------------------------- COD sampling contract


def _reference_counts(lm: np.ndarray, seeds: int, depths: int, r: float = 0.7, rmin: float = 0.2):
    out = []
    for d in range(1, depths):
        k = int(max(0, seeds - d) * max(r ** d, rmin))
        if k <= 0:
            break
        out.append(k)
    return out


def test_cod_sample_matches_speculators_rules():
    rng = np.random.default_rng(0)
    T, D = 40, 6
    lm = (rng.random((3, T)) < 0.6).astype(np.int64)
    lm[2] = 0
    lm[2, 30:] = 1  # a short valid run: the pool empties before the budget does
    for max_anchors in (None, 8):
        ap, dp, ok = cod_sample(jax.random.key(3), jnp.asarray(lm), num_depths=D, max_anchors=max_anchors)
        ap, dp, ok = np.asarray(ap), np.asarray(dp), np.asarray(ok)
        assert ap.shape == (3, num_elements(T, max_anchors, D)) and ap.shape[1] == sum(cod_budget(T, max_anchors, D))
        for b in range(3):
            valid = set(np.nonzero(lm[b] == 1)[0].tolist())
            a, d = ap[b][ok[b]], dp[b][ok[b]]
            assert (a[:T] == np.arange(T)).all() and (d[:T] == 0).all()  # depth 0: every position
            n_seeds = min(len(valid), max_anchors or T)
            prev = None
            for depth in range(1, D):
                sel = np.sort(a[d == depth] + depth)  # sampled original positions, ascending
                want = _reference_counts(lm[b], n_seeds, D)
                cap = want[depth - 1] if depth - 1 < len(want) else 0
                if depth == 1:
                    assert set(sel.tolist()) <= valid and len(sel) == min(cap, n_seeds)
                else:
                    pool = {(p + 1) % T for p in prev} - {0}
                    pool &= valid
                    assert set(sel.tolist()) <= pool and len(sel) == min(cap, len(pool)), (b, depth)
                prev = sel.tolist()
            # padding elements: anchor -1 depth 1, so anchor + depth = 0 stays in range
            assert (ap[b][~ok[b]] == -1).all() and (dp[b][~ok[b]] == 1).all()
    # the draw depends on the key and not on anything else
    a1 = np.asarray(cod_sample(jax.random.key(3), jnp.asarray(lm), num_depths=D, max_anchors=8)[0])
    a2 = np.asarray(cod_sample(jax.random.key(4), jnp.asarray(lm), num_depths=D, max_anchors=8)[0])
    assert not np.array_equal(a1, a2)

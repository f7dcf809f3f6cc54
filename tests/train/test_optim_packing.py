"""Optimizers and schedules vs torch / transformers, and packing vs speculators' sampler and collator."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from specjax.train.optim import build_optimizer, lr_lambda, muon_label
from specjax.train.packing import collate, multipack_batches, shift_eagle3


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {"fc": {"kernel": rng.standard_normal((12, 8)).astype(np.float32)},
            "layers": {0: {"mlp": {"down_proj": {"kernel": rng.standard_normal((16, 8)).astype(np.float32)}}}},
            "norm": {"scale": (1 + 0.1 * rng.standard_normal(8)).astype(np.float32)},
            "lm_head": {"kernel": rng.standard_normal((8, 5)).astype(np.float32)}}


@pytest.mark.parametrize("kind,adjust,ns", [("adamw", "match_rms_adamw", 5), ("muon", "match_rms_adamw", 5),
                                             ("muon", "original", 5), ("muon", "match_rms_adamw", 3)])
def test_optimizer_matches_torch(kind, adjust, ns):
    """ns: Newton-Schulz steps (torch's default 5; the main recipe runs 3)."""
    params = _params()
    rng = np.random.default_rng(1)
    grads = [jax.tree.map(lambda p: (3.0 * rng.standard_normal(p.shape)).astype(np.float32), params) for _ in range(4)]
    tx, _ = build_optimizer(params, optimizer=kind, lr=2e-2, weight_decay=0.01, muon_lr=3e-2, muon_momentum=0.95,
                            muon_weight_decay=0.1, muon_ns_steps=ns, muon_adjust_lr_fn=adjust, scheduler_type="linear",
                            warmup=1, total=5)
    p = jax.tree.map(jnp.asarray, params)
    st = tx.init(p)
    for g in grads:
        u, st = tx.update(jax.tree.map(jnp.asarray, g), st, p)
        p = optax.apply_updates(p, u)
    # torch: kernels are [in, out] here, torch weights [out, in]
    names = {"fc": ("fc", "kernel"), "down": ("layers", 0, "mlp", "down_proj", "kernel"), "norm": ("norm", "scale"),
             "lm_head": ("lm_head", "kernel")}

    def get(t, path):
        for k in path:
            t = t[k]
        return t

    tp = {n: torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(get(params, pa).T))) for n, pa in names.items()}
    if kind == "adamw":
        opts = [torch.optim.AdamW(tp.values(), lr=2e-2, weight_decay=0.01)]
    else:
        mu = [n for n, pa in names.items() if muon_label(pa, get(params, pa).shape) == "muon"]
        assert sorted(mu) == ["down", "fc"]
        opts = [torch.optim.Muon([tp[n] for n in mu], lr=3e-2, weight_decay=0.1, momentum=0.95, ns_steps=ns,
                                 adjust_lr_fn=adjust),
                torch.optim.AdamW([tp[n] for n in names if n not in mu], lr=2e-2, weight_decay=0.01)]
    from transformers import get_linear_schedule_with_warmup

    scheds = [get_linear_schedule_with_warmup(o, 1, 5) for o in opts]
    for g in grads:
        for n, pa in names.items():
            tp[n].grad = torch.from_numpy(np.ascontiguousarray(get(g, pa).T))
        torch.nn.utils.clip_grad_norm_(list(tp.values()), 1.0)
        for o in opts:
            o.step()
        for s in scheds:
            s.step()
    for n, pa in names.items():
        ours = np.asarray(get(p, pa)).T
        ref = tp[n].detach().numpy()
        tol = 2e-3 if kind == "muon" and n in ("fc", "down") else 1e-5  # Newton-Schulz runs in bf16 in both
        np.testing.assert_allclose(ours, ref, rtol=tol, atol=tol, err_msg=n)


@pytest.mark.parametrize("kind,warmup,total", [("linear", 3, 20), ("linear", 0, 7), ("cosine", 4, 30), ("none", 0, 5)])
def test_schedules_match_transformers(kind, warmup, total):
    from transformers import get_constant_schedule, get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    s = {"linear": lambda: get_linear_schedule_with_warmup(opt, warmup, total),
         "cosine": lambda: get_cosine_schedule_with_warmup(opt, warmup, total),
         "none": lambda: get_constant_schedule(opt)}[kind]()
    f = lr_lambda(kind, warmup, total)
    for step in range(total + 3):
        assert abs(float(f(step)) - opt.param_groups[0]["lr"]) < 1e-6, step
        opt.step()
        s.step()


@pytest.mark.parametrize("seed,epoch,total", [(0, 0, 64), (42, 3, 100), (7, 1, 37)])
def test_multipack_matches_speculators(seed, epoch, total):
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = np.random.default_rng(seed).integers(3, 60, 40)
    ref = MultipackDistributedBatchSamplerV2(total, lengths, num_replicas=1, rank=0, seed=seed)
    ref.set_epoch(epoch)
    ours = multipack_batches(lengths, total, seed=seed, epoch=epoch)
    assert [b.tolist() for b in ours] == [np.asarray(b).tolist() for b in ref]


def test_collate_matches_speculators():
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    rng = np.random.default_rng(0)
    samples = []
    for n in (7, 12, 30):
        samples.append({"hidden_states": rng.standard_normal((n, 6)).astype(np.float32),
                        "input_ids": rng.integers(0, 50, n), "verifier_last_hidden_states":
                        rng.standard_normal((n, 2)).astype(np.float32), "loss_mask": rng.integers(0, 2, n),
                        "position_ids": np.arange(n)})
    for pre, pre_ref in ((shift_eagle3, shift_batch), (None, None)):
        ours = collate(samples, 40, hidden_size=2, num_aux=3, preprocess=pre)
        ts = [{k: torch.from_numpy(np.asarray(v)) for k, v in s.items()} | {"lengths": torch.tensor([len(s["input_ids"])])}
              for s in samples]
        ref = CollateFn(40, 2, num_target_layers=3, dtype=torch.float32, preprocess=pre_ref)(ts)
        for k in ("hidden_states", "input_ids", "verifier_last_hidden_states", "loss_mask", "position_ids",
                  "document_ids"):
            np.testing.assert_array_equal(ours[k], ref[k].numpy(), err_msg=k)

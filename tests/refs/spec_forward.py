"""Reference forwards: run speculators 0.9.0 (PyTorch, CPU, float32) on a checkpoint
built by ``tests.refs.speculators_ckpts.build`` and return what it computed as numpy.

The inputs are one packed row exactly as speculators' trainer hands it to the model:
per-sample dicts (aux hidden states, token ids, last verifier hidden state, loss mask)
go through speculators' own ``CollateFn`` with the algorithm's preprocess
(``shift_batch`` for EAGLE-3 / P-EAGLE, ``shift_batch_mtp`` for MTP, none for the
DFlash family), so document ids, padding and (1-based or 0-based) position ids are the
reference's. Random choices the reference makes inside its forward (DFlash/DSpark
anchors, P-EAGLE COD elements) are drawn once with speculators' own functions under a
torch seed, then fixed for the forward and returned with the inputs, so a port can
take them as explicit inputs.

What comes back (``RefRun``):
  inputs   the forward's tensor inputs (numpy), plus ``anchor_positions``/``anchor_valid``
           (dflash, dspark) or ``anchor_pos``/``depth`` (peagle)
  logits   eagle3: [S, T, Vd] one row per TTT step (full length, before alignment);
           peagle: [1, N, Vd]; dflash: [1, A*B, Vd]; dspark: [1, A*B, Vd] (after the Markov
           bias); mtp: [K, Tv, V] one row per step
  hidden   eagle3: [S, T, H] the hidden state each step feeds to the next (post-norm when
           norm_output); dflash/dspark: [1, A*B, H] post-norm backbone output;
           mtp: [K, Tv, H] each step's output; peagle: [1, N, H] post-norm
  extra    targets, loss (eager losses), aligned loss masks, confidence logits, draft tokens

Run as a script to print one summary per algorithm.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

DEFAULT_LENGTHS = (9, 6, 11)  # three documents ...
DEFAULT_TOTAL = 30  # ... plus 4 padding positions


@dataclass
class RefRun:
    algo: str
    inputs: dict[str, np.ndarray]
    logits: np.ndarray
    hidden: np.ndarray | None
    extra: dict[str, Any] = field(default_factory=dict)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


# ----------------------------------------------------------------------------- loading


def load_reference(ckpt: str | Path, attn: str = "sdpa"):
    """speculators' own loader (``from_pretrained`` + verifier weights), eval, float32,
    with the draft attention implementation forced to ``attn`` (sdpa or eager)."""
    import speculators.models  # noqa: F401  (registers the algorithms)
    from speculators.config import SpeculatorModelConfig
    from speculators.model import SpeculatorModel

    cfg = SpeculatorModelConfig.from_pretrained(str(ckpt))
    cfg.transformer_layer_config._attn_implementation = attn  # noqa: SLF001
    model = SpeculatorModel.from_pretrained(str(ckpt), config=cfg)
    return model.float().eval()


# ----------------------------------------------------------------------------- inputs


def _samples(rng: np.random.Generator, lengths, *, hidden: int, num_aux: int, vocab: int, avoid: int | None):
    out = []
    for n in lengths:
        ids = rng.integers(3, vocab, size=n)
        if avoid is not None:
            ids[ids == avoid] = 3
        prompt = int(rng.integers(1, max(2, n // 2)))
        lm = np.zeros(n, np.int64)
        lm[prompt:] = 1
        lm[rng.random(n) < 0.15] = 0  # a few holes, as multi-turn masks have
        out.append({
            "hidden_states": torch.from_numpy(rng.standard_normal((n, num_aux * hidden)).astype(np.float32)),
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "verifier_last_hidden_states": torch.from_numpy(rng.standard_normal((n, hidden)).astype(np.float32)),
            "loss_mask": torch.from_numpy(lm),
            "lengths": torch.tensor([n], dtype=torch.long),
            "position_ids": torch.arange(n, dtype=torch.long),
        })
    return out


def packed_batch(algo: str, *, hidden: int, num_aux: int, vocab: int, lengths=DEFAULT_LENGTHS,
                 total_len: int = DEFAULT_TOTAL, seed: int = 0, avoid_token: int | None = None) -> dict[str, torch.Tensor]:
    """One packed row through speculators' CollateFn and the algorithm's preprocess.

    ``total_len`` is the collator's ``max_len`` (the packed row length *after* the
    per-sample shift); samples that do not fit are truncated as speculators does."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.models.mtp.data import shift_batch_mtp
    from speculators.train.data import CollateFn

    rng = np.random.default_rng(seed)
    pre = {"eagle3": shift_batch, "peagle": shift_batch, "mtp": shift_batch_mtp}.get(algo)
    coll = CollateFn(total_len, hidden, num_target_layers=num_aux, dtype=torch.float32, preprocess=pre)
    batch = coll(_samples(rng, lengths, hidden=hidden, num_aux=num_aux, vocab=vocab, avoid=avoid_token))
    batch.pop("error_records", None)
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}


def _model_dims(model):
    tl = model.config.transformer_layer_config
    ids = getattr(model.config, "eagle_aux_hidden_state_layer_ids", None) or getattr(
        model.config, "aux_hidden_state_layer_ids", None)
    return tl.hidden_size, (len(ids) if ids else 3), tl.vocab_size


# ----------------------------------------------------------------------------- capture helpers


@contextlib.contextmanager
def _patched(module, name: str, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _capture_metrics(module, store: list):
    """Wrap ``module.compute_metrics`` so every call's arguments are recorded."""
    orig = module.compute_metrics

    def wrapped(*args, **kw):
        store.append((args, kw))
        return orig(*args, **kw)

    return _patched(module, "compute_metrics", wrapped)


def _hook_outputs(mod: torch.nn.Module, store: list):
    return mod.register_forward_hook(lambda _m, _i, out: store.append(out[0] if isinstance(out, tuple) else out))


# ----------------------------------------------------------------------------- forwards


def run_eagle3(model, batch, *, ttt_steps: int = 3, loss: str = "kl_div") -> RefRun:
    import speculators.models.eagle3.core as core
    from speculators.losses import resolve_loss_config

    calls: list = []
    normed: list = []
    last: list = []
    h1 = _hook_outputs(model.norm, normed)
    h2 = _hook_outputs(model.layers[-1], last)
    try:
        with _capture_metrics(core, calls), torch.no_grad():
            tokens, total, metrics = model(**batch, ttt_steps=ttt_steps, loss_config=resolve_loss_config(loss, "eager"))
    finally:
        h1.remove()
        h2.remove()
    logits = np.stack([_np(a[0][0]) for a, _ in calls])  # [S, T, Vd]
    # norm is applied once per step (targets use verifier_norm, a different module)
    feed = normed if model.config.norm_output else last
    hidden = np.stack([_np(h[0]) for h in feed])
    return RefRun("eagle3", {k: _np(v) for k, v in batch.items()}, logits, hidden, {
        "targets": _np(calls[0][0][1][0]),
        "pre_norm": np.stack([_np(h[0]) for h in last]),
        "post_norm": np.stack([_np(h[0]) for h in normed]),
        "loss": float(total), "metrics": {k: float(v) for k, v in metrics.items()},
        "draft_tokens": np.stack([_np(t[0]) for t in tokens]),
    })


def cod_elements(loss_mask: torch.Tensor, *, seed: int, num_depths: int, max_anchors: int | None = None,
                 down_sample_ratio: float = 0.7, down_sample_ratio_min: float = 0.2):
    """P-EAGLE's COD sampling, drawn with speculators' function under a torch seed."""
    from speculators.models.peagle.data import generate_cod_sample_indices

    torch.manual_seed(seed)
    return generate_cod_sample_indices(
        seq_length=loss_mask.shape[1], loss_mask=loss_mask, num_depths=num_depths,
        down_sample_ratio=down_sample_ratio, down_sample_ratio_min=down_sample_ratio_min, max_anchors=max_anchors)


def run_peagle(model, batch, *, seed: int = 0, num_depths: int = 4, max_anchors: int | None = None,
               loss: str = "kl_div", anchor_pos=None, depth=None) -> RefRun:
    import speculators.models.peagle.core as core
    from speculators.losses import resolve_loss_config

    if anchor_pos is None:
        anchor_pos, depth = cod_elements(batch["loss_mask"], seed=seed, num_depths=num_depths, max_anchors=max_anchors)
    anchor_pos, depth = torch.as_tensor(anchor_pos), torch.as_tensor(depth)
    calls: list = []
    normed: list = []
    h = _hook_outputs(model.norm, normed)
    try:
        with _capture_metrics(core, calls), _patched(core, "generate_cod_sample_indices",
                                                     lambda **_kw: (anchor_pos, depth)), torch.no_grad():
            _, total, metrics = model(**batch, loss_config=resolve_loss_config(loss, "eager"), num_depths=num_depths)
    finally:
        h.remove()
    kw = calls[0][1]
    inputs = {k: _np(v) for k, v in batch.items()}
    inputs.update(anchor_pos=_np(anchor_pos), depth=_np(depth))
    return RefRun("peagle", inputs, _np(kw["logits"]), _np(normed[0]), {
        "targets": _np(kw["targets"]), "loss": float(total), "metrics": {k: float(v) for k, v in metrics.items()}})


def anchors(loss_mask: torch.Tensor, *, seed: int, max_anchors: int, block_size: int):
    """DFlash/DSpark anchors, drawn with speculators' ``select_anchors`` under a torch seed."""
    from speculators.models.dflash.utils import select_anchors

    torch.manual_seed(seed)
    return select_anchors(loss_mask, max_anchors, block_size)


def _run_dflash_family(algo, model, batch, *, seed, max_anchors, loss, anchor_positions, anchor_valid, **fwd):
    import importlib

    import speculators.models.dflash.core as dcore
    from speculators.losses import resolve_loss_config

    core = importlib.import_module(f"speculators.models.{algo}.core")
    if anchor_positions is None:
        anchor_positions, anchor_valid = anchors(batch["loss_mask"], seed=seed, max_anchors=max_anchors,
                                                 block_size=model.block_size)
    anchor_positions = torch.as_tensor(anchor_positions, dtype=torch.long)
    anchor_valid = torch.as_tensor(anchor_valid, dtype=torch.bool)
    calls: list = []
    normed: list = []
    h = _hook_outputs(model.norm, normed)
    try:
        with _capture_metrics(core, calls), _patched(dcore, "select_anchors", lambda *_a, **_k: (anchor_positions, anchor_valid)), \
                torch.no_grad():
            _, total, metrics = model(**batch, loss_config=resolve_loss_config(loss, "eager"),
                                      max_anchors=int(anchor_positions.shape[0]), **fwd)
    finally:
        h.remove()
    args = calls[0][0]
    inputs = {k: _np(v) for k, v in batch.items()}
    inputs.update(anchor_positions=_np(anchor_positions), anchor_valid=_np(anchor_valid))
    extra = {"loss": float(total), "metrics": {k: float(v) for k, v in metrics.items()}}
    if algo == "dflash":
        extra.update(targets=_np(args[1]), aligned_loss_mask=_np(args[2]))
    else:
        extra.update(targets=_np(args[1]), confidence_logits=None if args[2] is None else _np(args[2]),
                     aligned_loss_mask=_np(args[3]))
    return RefRun(algo, inputs, _np(args[0]), _np(normed[0]), extra)


def run_dflash(model, batch, *, seed: int = 0, max_anchors: int = 6, loss: str = "ce",
               anchor_positions=None, anchor_valid=None) -> RefRun:
    return _run_dflash_family("dflash", model, batch, seed=seed, max_anchors=max_anchors, loss=loss,
                              anchor_positions=anchor_positions, anchor_valid=anchor_valid)


def run_dspark(model, batch, *, seed: int = 0, max_anchors: int = 6, loss: str = "kl_div",
               anchor_positions=None, anchor_valid=None) -> RefRun:
    from speculators.losses import resolve_loss_config

    return _run_dflash_family("dspark", model, batch, seed=seed, max_anchors=max_anchors, loss=loss,
                              anchor_positions=anchor_positions, anchor_valid=anchor_valid,
                              tv_loss_fn=resolve_loss_config("tv", "eager")["tv"][0])


def run_mtp(model, batch, *, step_weights=None) -> RefRun:
    outs: list = []
    h = _hook_outputs(model.mtp_layers[0], outs)
    try:
        with torch.no_grad():
            logits, total, metrics = model(**batch, step_weights=step_weights)
    finally:
        h.remove()
    return RefRun("mtp", {k: _np(v) for k, v in batch.items()}, np.stack([_np(x[0]) for x in logits]),
                  np.stack([_np(x[0]) for x in outs]),
                  {"loss": float(total), "metrics": {k: float(v) for k, v in metrics.items()}})


RUNNERS = {"eagle3": run_eagle3, "peagle": run_peagle, "dflash": run_dflash, "dspark": run_dspark, "mtp": run_mtp}


def reference(algo: str, ckpt: str | Path, *, attn: str = "sdpa", seed: int = 0, lengths=DEFAULT_LENGTHS,
              total_len: int = DEFAULT_TOTAL, model=None, **fwd) -> RefRun:
    """Load ``ckpt`` with speculators, build a packed row, run the forward, return numpy."""
    model = model if model is not None else load_reference(ckpt, attn)
    hidden, num_aux, vocab = _model_dims(model)
    avoid = getattr(model.config, "mask_token_id", None)
    batch = packed_batch(algo, hidden=hidden, num_aux=num_aux, vocab=vocab, lengths=lengths,
                         total_len=total_len, seed=seed, avoid_token=avoid)
    if algo in ("peagle", "dflash", "dspark"):
        fwd.setdefault("seed", seed)
    return RUNNERS[algo](model, batch, **fwd)


if __name__ == "__main__":
    import tempfile

    from tests.refs.speculators_ckpts import build, make_verifier

    root = Path(tempfile.mkdtemp())
    make_verifier(root / "v-llama", "llama")
    make_verifier(root / "v-qwen3", "qwen3")
    for algo, fam, kw in [("eagle3", "llama", {"draft_vocab": 40}), ("peagle", "llama", {}),
                          ("dflash", "qwen3", {"draft_vocab": 40}), ("dspark", "qwen3", {}), ("mtp", "qwen3", {})]:
        ck = build(algo, root / f"{algo}-{fam}", root / f"v-{fam}", **kw)
        for attn in ("sdpa", "eager"):
            r = reference(algo, ck, attn=attn)
            print(f"{algo:7s} {attn:5s} logits {r.logits.shape} hidden {None if r.hidden is None else r.hidden.shape}"
                  f" finite={np.isfinite(r.logits).all()} loss={r.extra['loss']:.6f}",
                  {k: v.shape for k, v in r.inputs.items()})

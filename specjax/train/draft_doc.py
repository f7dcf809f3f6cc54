"""What a recipe means as a speculators checkpoint config: the ``config.json`` object a run
exports (every key explicit), built once from the typed recipe and the target (the algorithm's
fields and checks are its adapter's, :mod:`specjax.train.algorithms`), and speculators'
``mask_token_id`` resolution."""

from __future__ import annotations

from specjax.train import algorithms
from specjax.train.config import TrainConfig
from specjax.train.errors import TrainError
from specjax.train.export import speculators_config, verifier_name


def resolve_mask_token_id(target) -> int:
    """speculators' ``resolve_mask_token_id`` without adding tokens: tokenizer mask -> pad/eos/unk
    -> the config's first EOS id."""
    tok = target.tokenizer
    if tok is not None:
        for name in ("<|MASK|>", "<mask>", "[MASK]"):
            t = tok.token_to_id(name)
            if t is not None:
                return int(t)
        for t in (tok.pad_token_id, tok.eos_token_id, tok.token_to_id(tok.unk_token)):
            if t is not None:
                return int(t)
    if target.config.eos_token_ids:
        return int(target.config.eos_token_ids[0])
    raise TrainError("cannot resolve mask_token_id; set draft.mask_token_id", key="draft.mask_token_id")


def draft_config_doc(cfg: TrainConfig, target, *, aux_layer_ids, draft_vocab_size: int) -> dict:
    """The speculators ``config.json`` object for the draft ``cfg`` trains on ``target``."""
    algo = algorithms.get(cfg.speculator_type)(cfg)
    algo.check_target(target, draft_vocab_size)
    d = cfg.draft
    mask_id = d.mask_token_id if d.mask_token_id is not None else (
        resolve_mask_token_id(target) if algo.needs_mask_token else None)
    extra, spec_tokens = algo.config_fields(mask_id)
    return speculators_config(algo.name, layer=algo.layer_config(target), draft_vocab_size=draft_vocab_size,
                              aux_layer_ids=aux_layer_ids, speculative_tokens=spec_tokens,
                              verifier=verifier_name(target, cfg.verifier_name_or_path),
                              verifier_arch=target.config.architecture, **extra)

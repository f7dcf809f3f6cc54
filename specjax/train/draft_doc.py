"""What a recipe means as a speculators checkpoint config: the ``config.json`` object a run
exports (every key explicit), built once from the typed recipe and the target, plus the checks
that belong to that translation (MTP's target family and full vocabulary) and speculators'
``mask_token_id`` resolution."""

from __future__ import annotations

from specjax.train.config import TrainConfig
from specjax.train.errors import TrainError
from specjax.train.export import draft_layer_config, mtp_layer_config, speculators_config, verifier_name


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


def check_mtp_target(target, draft_vocab_size: int) -> None:
    """MTP mirrors the target's own decoder layer over its full vocabulary (speculators 0.9.0:
    ``mtp_model_classes``, ``Vocab reduction is not supported for MTP speculators``)."""
    mt = target.config.to_hf_dict().get("model_type")
    if mt != "qwen3":
        raise TrainError(f"speculator_type mtp mirrors the target's own decoder layer, and this target's layers "
                         f"(model_type {mt!r}) have no MTP layer to mirror: speculators 0.9.0 has MTP layers for "
                         "qwen3, qwen3_next, qwen3_5_text and qwen3_5_moe_text, specjax for qwen3 (dense); "
                         "train eagle3 / peagle / dflash / dspark for this target", path=str(target.source),
                         key="speculator_type")
    V = target.config.vocab_size
    if draft_vocab_size != V:
        raise TrainError(f"draft.draft_vocab_size {draft_vocab_size}: MTP predicts over the target's full vocabulary "
                         f"({V}); leave draft.draft_vocab_size unset (speculators: vocab reduction is not supported "
                         "for MTP)", key="draft.draft_vocab_size")


def draft_config_doc(cfg: TrainConfig, target, *, aux_layer_ids, draft_vocab_size: int) -> dict:
    """The speculators ``config.json`` object for the draft ``cfg`` trains on ``target``."""
    algo, d, tc = cfg.speculator_type, cfg.draft, target.config
    if algo == "mtp":
        check_mtp_target(target, draft_vocab_size)
        layer = mtp_layer_config(tc)
    else:
        layer = draft_layer_config(tc, draft_arch=d.draft_arch, num_layers=d.num_layers,
                                   sliding_window=d.sliding_window, full_attention_indices=d.full_attention_indices)
    mask_id = d.mask_token_id if d.mask_token_id is not None else (
        resolve_mask_token_id(target) if algo in ("peagle", "dflash", "dspark") else None)
    if algo in ("eagle3", "peagle"):
        # P-EAGLE always trains its embedding (speculators' from_training_args never passes the flag)
        extra = dict(norm_before_residual=d.norm_before_residual, norm_before_fc=d.norm_before_fc,
                     fc_norm=d.fc_norm, norm_output=d.norm_output,
                     embed_requires_grad=True if algo == "peagle" else d.embed_requires_grad)
        spec_tokens = cfg.loss.ttt_steps
        if algo == "peagle":
            extra["mask_token_id"] = mask_id
            spec_tokens = cfg.peagle.num_depths
    elif algo == "mtp":
        extra = {}
        spec_tokens = cfg.mtp.num_speculative_steps
    else:
        f = cfg.dflash
        extra = dict(block_size=f.block_size, mask_token_id=mask_id, sample_from_anchor=f.sample_from_anchor,
                     sliding_window_non_causal=d.sliding_window_non_causal)
        if algo == "dspark":
            k = cfg.dspark
            extra.update(markov_rank=k.markov_rank, markov_head_type=k.markov_head_type,
                         enable_confidence_head=k.enable_confidence_head,
                         confidence_head_with_markov=k.confidence_head_with_markov)
        spec_tokens = f.block_size if f.sample_from_anchor else f.block_size - 1
    return speculators_config(algo, layer=layer, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids,
                              speculative_tokens=spec_tokens,
                              verifier=verifier_name(target, cfg.verifier_name_or_path),
                              verifier_arch=tc.architecture, **extra)

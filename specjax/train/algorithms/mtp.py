"""MTP training: the target's own decoder layer mirrored as a draft over its full vocabulary
(speculators' ``shift_batch_mtp``: the verifier's last hidden state is the input; the packed row
is not shifted), ``num_speculative_steps`` chained steps weighted by ``step_weight_beta``."""

from __future__ import annotations

from specjax.train.algorithms.base import TrainAlgorithm
from specjax.train.errors import TrainError
from specjax.train.export import mtp_layer_config
from specjax.train.mtp_init import apply_mtp_init
from specjax.train.objectives import mtp_objective, mtp_step_weights


class MTP(TrainAlgorithm):
    name = "mtp"
    sections = ("mtp",)
    reads_target_layers = True  # mtp.init copies the target's own tensors

    def __init__(self, cfg):
        super().__init__(cfg)
        self.step_weights = mtp_step_weights(cfg.mtp.step_weight_beta, cfg.mtp.num_speculative_steps)

    def check_target(self, target, draft_vocab_size):
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
        if draft_vocab_size != V and not self.draft_class().vocab_reduction:
            raise TrainError(f"draft.draft_vocab_size {draft_vocab_size}: MTP predicts over the target's full "
                             f"vocabulary ({V}); leave draft.draft_vocab_size unset (speculators: vocab reduction is "
                             "not supported for MTP)", key="draft.draft_vocab_size")

    def layer_config(self, target):
        return mtp_layer_config(target.config)

    def config_fields(self, mask_token_id):
        return {}, self.cfg.mtp.num_speculative_steps

    def flat_hook(self, target):
        return lambda flat: apply_mtp_init(flat, target, self.cfg.mtp.init)

    def loss(self, model, batch, cdt):
        y = batch["verifier_last_hidden_states"].astype(cdt)
        out = model(batch["input_ids"], y, position_ids=batch["position_ids"], loss_mask=batch["loss_mask"])
        return mtp_objective(out.logits, out.labels, step_weights=self.step_weights)


ALGORITHM = MTP

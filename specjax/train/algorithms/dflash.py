"""DFlash training: anchors drawn from the batch rng (:func:`select_anchors`), one block forward
per anchor, the per-position weighted block objective (DPACE by default)."""

from __future__ import annotations

from specjax.train.algorithms.base import TrainAlgorithm
from specjax.train.objectives import dflash_objective, select_anchors


class DFlash(TrainAlgorithm):
    name = "dflash"
    sections = ("dflash",)
    recipe_defaults = {"draft.num_layers": 5, "dflash.per_position_loss_weight": "dpace", "dflash.block_size": 16,
                       "loss.loss_fn": "ce"}
    needs_mask_token = True

    @classmethod
    def validate(cls, cfg) -> None:
        f = cfg.dflash
        if f.per_position_loss_weight == "dpace":
            if cfg.loss.loss_fn != "ce":
                raise ValueError("dflash.per_position_loss_weight=dpace requires loss.loss_fn=ce")
            if not 0.0 < f.dpace_alpha <= 1.0:
                raise ValueError(f"dflash.dpace_alpha must be in (0, 1], got {f.dpace_alpha}")

    def config_fields(self, mask_token_id):
        f, d = self.cfg.dflash, self.cfg.draft
        extra = dict(block_size=f.block_size, mask_token_id=mask_token_id, sample_from_anchor=f.sample_from_anchor,
                     sliding_window_non_causal=d.sliding_window_non_causal)
        return extra, (f.block_size if f.sample_from_anchor else f.block_size - 1)

    def block_forward(self, model, batch, cdt):
        f = self.cfg.dflash
        anchors, valid = select_anchors(batch["rng"], batch["loss_mask"], self.cfg.data.max_anchors, f.block_size)
        out = model(batch["hidden_states"].astype(cdt), batch["input_ids"], batch["loss_mask"],
                    batch["verifier_last_hidden_states"].astype(cdt), batch["document_ids"], batch["position_ids"],
                    anchor_positions=anchors, anchor_valid=valid)
        kw = dict(block_size=f.block_size, loss_spec=self.loss_spec, per_position_loss_weight=f.per_position_loss_weight,
                  gamma=f.dflash_decay_gamma, dpace_alpha=f.dpace_alpha, sample_from_anchor=f.sample_from_anchor)
        return out, kw

    def loss(self, model, batch, cdt):
        out, kw = self.block_forward(model, batch, cdt)
        return dflash_objective(out.logits, out.targets, out.loss_mask, **kw)


ALGORITHM = DFlash

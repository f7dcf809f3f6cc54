"""P-EAGLE training: COD elements (anchor, depth) drawn from the batch rng
(:func:`specjax.train.cod.cod_sample`), one parallel forward over them, per-depth objective.
P-EAGLE always trains its embedding (speculators' ``from_training_args`` never passes the flag;
the draft class says so: ``PEagleDraft.embed_trainable``)."""

from __future__ import annotations

from specjax.train.algorithms.base import TrainAlgorithm
from specjax.train.algorithms.eagle3 import eagle_fields
from specjax.train.cod import cod_sample
from specjax.train.objectives import peagle_objective
from specjax.train.packing import shift_eagle3


class PEagle(TrainAlgorithm):
    name = "peagle"
    sections = ("peagle",)
    shift_batch = staticmethod(shift_eagle3)  # speculators shifts P-EAGLE rows as EAGLE-3's
    needs_mask_token = True

    def config_fields(self, mask_token_id):
        extra = eagle_fields(self.cfg, embed_requires_grad=self.draft_class().embed_trainable)
        return dict(extra, mask_token_id=mask_token_id), self.cfg.peagle.num_depths

    def loss(self, model, batch, cdt):
        pe = self.cfg.peagle
        anchor_pos, depth, ok = cod_sample(batch["rng"], batch["loss_mask"], num_depths=pe.num_depths,
                                           max_anchors=self.cfg.data.max_anchors, ratio=pe.down_sample_ratio,
                                           ratio_min=pe.down_sample_ratio_min)
        out = model(batch["hidden_states"].astype(cdt), batch["input_ids"], batch["document_ids"],
                    batch["position_ids"], batch["loss_mask"], batch["verifier_last_hidden_states"].astype(cdt),
                    anchor_pos=anchor_pos, depth=depth)
        return peagle_objective(out.logits, out.targets, out.loss_mask * ok.astype(out.loss_mask.dtype), depth,
                                num_depths=pe.num_depths, loss_spec=self.loss_spec)


ALGORITHM = PEagle

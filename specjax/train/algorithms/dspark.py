"""DSpark training: DFlash's anchors and block forward, plus the Markov head and the confidence
head's objective."""

from __future__ import annotations

from specjax.train.algorithms.dflash import DFlash
from specjax.train.objectives import dspark_objective


class DSpark(DFlash):
    name = "dspark"
    sections = ("dflash", "dspark")
    recipe_defaults = {"draft.num_layers": 5, "dflash.sample_from_anchor": True}

    @classmethod
    def validate(cls, cfg) -> None:
        super().validate(cfg)
        k = cfg.dspark
        if k.enable_confidence_head and k.confidence_head_with_markov and k.markov_rank == 0:
            raise ValueError("dspark.confidence_head_with_markov=true requires dspark.markov_rank > 0 (found 0); set "
                             "dspark.confidence_head_with_markov=false or a positive markov_rank")

    def config_fields(self, mask_token_id):
        extra, spec_tokens = super().config_fields(mask_token_id)
        k = self.cfg.dspark
        extra.update(markov_rank=k.markov_rank, markov_head_type=k.markov_head_type,
                     enable_confidence_head=k.enable_confidence_head,
                     confidence_head_with_markov=k.confidence_head_with_markov)
        return extra, spec_tokens

    def loss(self, model, batch, cdt):
        out, kw = self.block_forward(model, batch, cdt)
        return dspark_objective(out.logits, out.targets, out.confidence, out.loss_mask,
                                confidence_head_alpha=self.cfg.dspark.confidence_head_alpha, **kw)


ALGORITHM = DSpark

"""EAGLE-3 training: the training-time test (``ttt_steps`` chained steps over the packed row,
:func:`specjax.train.fast_eagle3.ttt_forward`) and its per-step KL / CE objective."""

from __future__ import annotations

from specjax.train.algorithms.base import TrainAlgorithm
from specjax.train.fast_eagle3 import ttt_forward
from specjax.train.objectives import accept_estimate, eagle3_objective
from specjax.train.packing import shift_eagle3


def eagle_fields(cfg, *, embed_requires_grad: bool) -> dict:
    """The EAGLE family's ``config.json`` norm and embedding flags (EAGLE-3 and P-EAGLE)."""
    d = cfg.draft
    return dict(norm_before_residual=d.norm_before_residual, norm_before_fc=d.norm_before_fc,
                fc_norm=d.fc_norm, norm_output=d.norm_output, embed_requires_grad=embed_requires_grad)


class Eagle3(TrainAlgorithm):
    name = "eagle3"
    proposal_length_settable = True
    recipe_defaults = {"draft.draft_arch": "llama", "draft.norm_before_fc": True, "draft.norm_output": True}
    shift_batch = staticmethod(shift_eagle3)

    def config_fields(self, mask_token_id):
        d = self.cfg.draft
        return (eagle_fields(self.cfg, embed_requires_grad=d.embed_requires_grad),
                d.speculative_tokens if d.speculative_tokens is not None else self.cfg.loss.ttt_steps)

    def loss(self, model, batch, cdt):
        c = self.cfg.loss
        out = ttt_forward(model, batch["hidden_states"].astype(cdt), batch["input_ids"], batch["document_ids"],
                          batch["position_ids"], batch["verifier_last_hidden_states"].astype(cdt),
                          ttt_steps=c.ttt_steps, stack=False)
        return eagle3_objective(out.logits, out.targets, batch["loss_mask"], loss_spec=self.loss_spec,
                                ttt_step_loss_decay=c.ttt_step_loss_decay)

    def record_fields(self, metrics):
        return {"accept_est": round(accept_estimate(metrics, self.cfg.loss.ttt_steps), 4)}

    def postfix(self, metrics, record):
        return {"acc0": f"{metrics.get('full_acc_0', 0):.2f}", "tau~": f"{record['accept_est']:.2f}"}


ALGORITHM = Eagle3

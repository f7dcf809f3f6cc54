"""What ``specjax train`` asks of a draft algorithm: :class:`TrainAlgorithm`.

An adapter is built from the typed recipe (``TrainAlgorithm(cfg)``). Class-level facts (recipe
defaults, sections, the packing shift) are read before a recipe exists; everything else is a
method. :mod:`specjax.train.step`, :mod:`specjax.train.trainer` and
:mod:`specjax.train.draft_doc` call only these methods and never compare algorithm names."""

from __future__ import annotations

from typing import Any, Callable, ClassVar

from specjax.models.drafts.registry import draft_class
from specjax.train.export import draft_layer_config
from specjax.train.losses import parse_loss_spec

#: top-level params speculators freezes (``requires_grad=False``) in every draft
FROZEN = ("embed_tokens", "lm_head", "verifier_lm_head", "verifier_norm")


def trainable_filter_for(algo: str):
    """Which params an algorithm trains: everything but :data:`FROZEN`, except ``embed_tokens`` for
    a draft class with ``embed_trainable`` (P-EAGLE: its config's ``embed_requires_grad`` is always
    True; EAGLE-3 looks its embedding up under no_grad)."""
    trains_embed = draft_class(algo).embed_trainable
    frozen = tuple(f for f in FROZEN if not (trains_embed and f == "embed_tokens"))
    return lambda path, _value: not any(str(p) in frozen for p in path)


# recipe keys an algorithm may leave unset, and what they default to unless it says otherwise
BASE_DEFAULTS: dict[str, Any] = {
    "draft.draft_arch": "qwen3", "draft.norm_before_fc": False, "draft.norm_output": False, "draft.num_layers": 1,
    "dflash.per_position_loss_weight": "fixed-exp-decay", "dflash.block_size": 8, "dflash.sample_from_anchor": False,
    "loss.loss_fn": "kl_div",
}


class TrainAlgorithm:
    name: ClassVar[str] = ""
    #: recipe sections this algorithm reads beyond the common ones (part of its resume identity)
    sections: ClassVar[tuple[str, ...]] = ()
    #: recipe defaults that differ from :data:`BASE_DEFAULTS` (dotted keys)
    recipe_defaults: ClassVar[dict[str, Any]] = {}
    #: the packed row's shift before collation (speculators' ``shift_batch``), or None
    shift_batch: ClassVar[Callable | None] = None
    #: the draft's config carries ``mask_token_id`` (resolved from the target's tokenizer when unset)
    needs_mask_token: ClassVar[bool] = False
    #: building the draft reads the target's decoder weights (not only its embedding and head)
    reads_target_layers: ClassVar[bool] = False
    #: ``draft.speculative_tokens`` may set the exported proposal length (else it follows speculators' rule)
    proposal_length_settable: ClassVar[bool] = False

    def __init__(self, cfg):
        self.cfg = cfg
        self.loss_spec = parse_loss_spec(cfg.loss.loss_fn)

    # ------------------------------------------------------------- recipe
    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {**BASE_DEFAULTS, **cls.recipe_defaults}

    @classmethod
    def validate(cls, cfg) -> None:
        """Raise ``ValueError`` for settings this algorithm cannot train (after defaults)."""

    @classmethod
    def draft_class(cls) -> type:
        return draft_class(cls.name)

    # ------------------------------------------------------------- the draft's config.json
    def check_target(self, target, draft_vocab_size: int) -> None:
        """Raise :class:`~specjax.train.errors.TrainError` if this algorithm cannot train a draft
        for ``target`` with this vocabulary (before any vocabulary work)."""

    def layer_config(self, target) -> dict:
        d = self.cfg.draft
        return draft_layer_config(target.config, draft_arch=d.draft_arch, num_layers=d.num_layers,
                                  sliding_window=d.sliding_window, full_attention_indices=d.full_attention_indices)

    def config_fields(self, mask_token_id: int | None) -> tuple[dict, int]:
        """``(extra speculators_config fields, speculative_tokens)``."""
        raise NotImplementedError

    def flat_hook(self, target) -> Callable[[dict], dict] | None:
        """A function replacing initial tensors (PyTorch layout) before the draft module is built."""
        return None

    # ------------------------------------------------------------- the step
    def loss(self, model, batch: dict, cdt) -> tuple[Any, dict]:
        """The differentiated loss and the metric sums of one batch: ``model`` is the merged draft
        (params in the compute dtype ``cdt``), ``batch`` the device batch (``rng`` a typed key)."""
        raise NotImplementedError

    # ------------------------------------------------------------- progress
    def record_fields(self, metrics: dict) -> dict:
        """Extra fields of a ``metrics.jsonl`` record (train and validation) from its metrics."""
        return {}

    def postfix(self, metrics: dict, record: dict) -> dict:
        """The progress bar's algorithm-specific figures."""
        for key, label in (("accept_len", "accept_len"), ("eal", "eal"), ("full_acc", "acc"), ("acc_step_0", "acc0")):
            if key in metrics:
                return {label: f"{metrics[key]:.2f}"}
        return {}

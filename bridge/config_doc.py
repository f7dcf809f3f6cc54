"""The one writer of a speculators ``config.json`` document (every key explicit).

Training exports (``specjax.train``) and the third-party converters (``bridge.external``) both
build their ``config.json`` object here, so the keys, their defaults and their order live in
one place. The document is what speculators 0.9.0's ``SpeculatorModelConfig.save_pretrained``
writes:

==========================  =========================================================
key                         value
==========================  =========================================================
architectures               ``[architecture]`` (the algorithm's draft class by default)
auto_map                    ``{"": "config.<Algorithm>SpeculatorConfig"}``
dtype                       the weights' dtype name
<algorithm fields>          :data:`ALGORITHM_FIELDS` (defaults and casts per algorithm)
speculators_config          algorithm, one greedy proposal method, the verifier
speculators_model_type      the algorithm
speculators_version         ``0.9.0`` (``0.9.0+specjax`` for converted checkpoints)
tie_word_embeddings         false
transformer_layer_config    the draft decoder's transformers config
transformers_version        the transformers release whose serialisation this follows
==========================  =========================================================

Keys come out sorted, the order :func:`bridge.schema.dumps_config` (and transformers) writes.
"""

from __future__ import annotations

from typing import Any, Callable

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format is written
CONVERTED_VERSION_STAMP = SPECULATORS_VERSION + "+specjax"  # converted checkpoints: marked as written by specjax
TRANSFORMERS_VERSION = "5.19.0"  # the transformers version whose serialisation is reproduced

DRAFT_ARCH = {"eagle3": "Eagle3DraftModel", "dflash": "DFlashDraftModel", "peagle": "PEagleDraftModel",
              "dspark": "DSparkDraftModel", "mtp": "MTPDraftModel"}
CONFIG_CLASS = {"eagle3": "Eagle3SpeculatorConfig", "dflash": "DFlashSpeculatorConfig",
                "peagle": "PEagleSpeculatorConfig", "dspark": "DSparkSpeculatorConfig", "mtp": "MTPSpeculatorConfig"}

REQUIRED = object()  # a field with no default: the caller must give it


def _ids(v):
    return None if v is None else list(v)


def _opt_int(v):
    return None if v is None else int(v)


# (key, cast, default) per algorithm; ``aux_layer_ids`` below is written under the algorithm's aux key
_EAGLE3 = (("draft_vocab_size", int, REQUIRED), ("eagle_aux_hidden_state_layer_ids", _ids, None),
           ("embed_requires_grad", bool, False), ("fc_norm", bool, False), ("norm_before_fc", bool, False),
           ("norm_before_residual", bool, True), ("norm_output", bool, False), ("target_hidden_size", _opt_int, None))
_DFLASH = (("aux_hidden_state_layer_ids", _ids, None), ("block_size", int, REQUIRED),
           ("draft_vocab_size", int, REQUIRED), ("mask_token_id", int, REQUIRED),
           ("sample_from_anchor", bool, False), ("sliding_window_non_causal", bool, False),
           ("target_hidden_size", _opt_int, None))
ALGORITHM_FIELDS: dict[str, tuple[tuple[str, Callable[[Any], Any], Any], ...]] = {
    "eagle3": _EAGLE3,
    # P-EAGLE always trains its embedding (speculators' from_training_args never passes the flag)
    "peagle": tuple((k, c, True if k == "embed_requires_grad" else d) for k, c, d in _EAGLE3)
    + (("mask_token_id", int, REQUIRED),),
    "dflash": _DFLASH,
    "dspark": tuple((k, c, True if k == "sample_from_anchor" else d) for k, c, d in _DFLASH)
    + (("markov_rank", int, 256), ("markov_head_type", str, "vanilla"), ("enable_confidence_head", bool, True),
       ("confidence_head_with_markov", bool, True)),
    # full vocabulary, no aux layers, one MTP layer (MTPSpeculatorConfig)
    "mtp": (("num_nextn_predict_layers", int, 1),),
}
AUX_KEY = {"eagle3": "eagle_aux_hidden_state_layer_ids", "peagle": "eagle_aux_hidden_state_layer_ids",
           "dflash": "aux_hidden_state_layer_ids", "dspark": "aux_hidden_state_layer_ids"}


def proposal_block(algorithm: str, *, speculative_tokens: int, verifier_name_or_path,
                   verifier_architectures) -> dict:
    """``speculators_config``: one greedy proposal method and the verifier."""
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                              "speculative_tokens": int(speculative_tokens), "verifier_accept_k": 1}],
        "verifier": {"architectures": list(verifier_architectures), "name_or_path": verifier_name_or_path},
    }


def algorithm_fields(algorithm: str, given: dict[str, Any]) -> dict[str, Any]:
    """The algorithm's own top-level keys from ``given`` (cast), defaults where absent."""
    if algorithm not in ALGORITHM_FIELDS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {sorted(ALGORITHM_FIELDS)}")
    table = ALGORITHM_FIELDS[algorithm]
    unknown = sorted(set(given) - {k for k, _, _ in table})
    if unknown:
        raise ValueError(f"field(s) {unknown} are not {algorithm} config keys; expected some of "
                         f"{[k for k, _, _ in table]}")
    out = {}
    for key, cast, default in table:
        if key in given:
            out[key] = cast(given[key])
        elif default is REQUIRED:
            raise ValueError(f"{algorithm} config needs {key!r}")
        else:
            out[key] = default
    return out


def speculators_config_doc(algorithm: str, transformer_layer_config: dict, *, speculative_tokens: int,
                           verifier_name_or_path, verifier_architectures, dtype: str = "bfloat16",
                           architecture: str | None = None, speculators_version: str = SPECULATORS_VERSION,
                           draft_vocab_size: int | None = None, aux_layer_ids=None,
                           **fields) -> dict:
    """A complete speculators ``config.json`` object for ``algorithm``.

    ``draft_vocab_size`` and ``aux_layer_ids`` are written where the algorithm has them (MTP
    predicts over the full vocabulary from no aux layers and ignores both); ``aux_layer_ids``
    goes under the algorithm's own key (:data:`AUX_KEY`). ``fields`` are the algorithm's other
    keys (:data:`ALGORITHM_FIELDS`); an unknown one is a ``ValueError``."""
    given = dict(fields)
    names = {k for k, _, _ in ALGORITHM_FIELDS.get(algorithm, ())}
    if draft_vocab_size is not None and "draft_vocab_size" in names:
        given["draft_vocab_size"] = draft_vocab_size
    if aux_layer_ids is not None and algorithm in AUX_KEY:
        given[AUX_KEY[algorithm]] = aux_layer_ids
    own = algorithm_fields(algorithm, given)
    doc = {
        "architectures": [architecture or DRAFT_ARCH[algorithm]],
        "auto_map": {"": f"config.{CONFIG_CLASS[algorithm]}"},
        "dtype": dtype,
        **own,
        "speculators_config": proposal_block(algorithm, speculative_tokens=speculative_tokens,
                                             verifier_name_or_path=verifier_name_or_path,
                                             verifier_architectures=verifier_architectures),
        "speculators_model_type": algorithm,
        "speculators_version": speculators_version,
        "tie_word_embeddings": False,
        "transformer_layer_config": transformer_layer_config,
        "transformers_version": TRANSFORMERS_VERSION,
    }
    return dict(sorted(doc.items()))

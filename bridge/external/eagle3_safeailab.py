"""SafeAILab EAGLE-3 (github.com/SafeAILab/EAGLE) -> speculators eagle3.

Mirrors speculators 0.9.0 ``convert/eagle/eagle3_converter.py`` (REFERENCE 6.1), which
saves through the legacy ``Eagle3Speculator`` module:

* tensors: ``midlayer.*`` -> ``layers.0.*``, everything else 1:1; only the legacy module's
  tensors are kept (``embed_tokens`` only if the source has it; ``t2d``/``d2t`` only if the
  source has ``t2d``); floats cast to the source config's ``torch_dtype`` (float32 when
  the config has none: speculators reads no other key), ``d2t`` int64, ``t2d`` bool;
* config: a ``LlamaConfig`` from the EAGLE config with speculators' fallbacks, vocab size
  from ``t2d`` (else the verifier's, searched recursively), ``max_position_embeddings`` =
  max(draft, verifier), ``speculative_tokens`` 3, ``architectures ["Eagle3Speculator"]``;
* flags: the source records none of them, so ``norm_before_residual`` comes only from the
  caller (default False, as in SafeAILab's own midlayer); ``norm_before_fc`` / ``fc_norm``
  / ``norm_output`` are the caller's value OR-ed with the EAGLE config's.

Where speculators silently writes a broken draft, this converter refuses instead: a
tensor the module needs is missing (speculators saves its random init) or mis-shaped.
"""

from __future__ import annotations

from bridge.external.common import (
    BOOL, DTYPE_NAMES, IDS, NAME_OF_DTYPE, Option, Plan, cast, config_doc, require, resolve_options,
)
from bridge.contract import expected_tensors
from bridge.external.errors import ExternalSourceError
from bridge.external.hf_config import layer_config_dict
from bridge.hf_values import rope_parameters
from bridge.external.source import Source, Verifier, find_vocab_size
from bridge.schema import parse_config

KIND = "eagle3-safeailab"
ALGORITHM = "eagle3"
OPTIONS = {
    "norm_before_residual": Option(**BOOL, default=False,
                                   help="first layer's residual is the normed hidden (drafts trained by speculators)"),
    "norm_before_fc": Option(**BOOL, default=False,
                             help="RMSNorm over the concatenated aux states (OR-ed with config)"),
    "fc_norm": Option(**BOOL, default=False, help="per-aux-layer RMSNorm, Eagle 3.1 (OR-ed with config)"),
    "norm_output": Option(**BOOL, default=False, help="feed post-norm hidden back across steps (OR-ed with config)"),
    "eagle_aux_hidden_state_layer_ids": Option(**IDS, help="verifier layers the draft reads (written to the config)"),
}
PREFIX = "midlayer."


def detect(config: dict | None, names: list[str]) -> str | None:
    n = sum(1 for k in names if k.startswith(PREFIX))
    return f"{n} midlayer.* tensors (SafeAILab EAGLE-3 layout)" if n else None


def _source_name(name: str) -> str:
    return PREFIX + name[len("layers.0."):] if name.startswith("layers.0.") else name


def _vocab(src: Source, verifier: Verifier) -> tuple[bool, int]:
    """Whether the source prunes the vocabulary (it has ``t2d``), and the verifier vocabulary size:
    ``t2d``'s length, else the verifier config's."""
    reduce_vocab = src.has("t2d")
    if reduce_vocab:
        vocab = src.shape("t2d")[0]
    else:
        vocab = find_vocab_size(verifier.config)
        if vocab is None:
            raise ExternalSourceError("no t2d in the source and no vocab_size in the verifier config",
                                      path=str(verifier.path / "config.json"), key="vocab_size")
    return reduce_vocab, vocab


def _weights_dtype(src: Source, ec: dict, notes: list[str]):
    """The float dtype the weights are written in: the source config's ``torch_dtype``, float32
    without one (speculators reads no other key). Returns ``(torch_dtype, weights_dtype)``."""
    torch_dtype = ec.get("torch_dtype")
    if torch_dtype is None:
        weights_dtype = DTYPE_NAMES["float32"]
        if ec.get("dtype") is not None:
            notes.append(f"source config has dtype={ec['dtype']!r} but no torch_dtype; speculators 0.9.0 reads only "
                         "torch_dtype, so weights are written as float32 (as it does)")
    elif torch_dtype in DTYPE_NAMES:
        weights_dtype = DTYPE_NAMES[torch_dtype]
    else:
        raise ExternalSourceError(f"torch_dtype {torch_dtype!r} is not a float dtype; expected one of "
                                  f"{sorted(DTYPE_NAMES)}", path=str(src.path / "config.json"), key="torch_dtype")
    return torch_dtype, weights_dtype


def _layer(ec: dict, verifier: Verifier, vocab: int, torch_dtype) -> dict:
    """The draft layer as speculators builds it: a ``LlamaConfig`` from the EAGLE config with its
    fallbacks, the longer of the draft's and verifier's context."""
    kw = dict(
        vocab_size=vocab, hidden_size=ec.get("hidden_size", 4096), intermediate_size=ec.get("intermediate_size", 11008),
        num_hidden_layers=ec.get("num_hidden_layers", 1), num_attention_heads=ec.get("num_attention_heads", 32),
        num_key_value_heads=ec.get("num_key_value_heads", 8), hidden_act=ec.get("hidden_act", "silu"),
        max_position_embeddings=max(ec.get("max_position_embeddings", 4096),
                                    verifier.get("max_position_embeddings", 4096)),
        initializer_range=ec.get("initializer_range", 0.02), rms_norm_eps=ec.get("rms_norm_eps", 1e-6),
        use_cache=True, attention_bias=ec.get("attention_bias", False), mlp_bias=ec.get("mlp_bias", False),
        tie_word_embeddings=False, head_dim=ec.get("head_dim"), rope_parameters=rope_parameters(ec),
    )
    if torch_dtype is not None:
        kw["dtype"] = torch_dtype
    layer, _ = layer_config_dict("llama", kw)
    return layer


def _flags(opts: dict, ec: dict) -> tuple[dict, dict]:
    """The norm flags (the caller's OR-ed with the EAGLE config's; norm_before_fc and fc_norm
    exclusive). Returns ``(flags, resolved options)``."""
    flags = {k: opts[k] or bool(ec.get(k, False)) for k in ("norm_before_fc", "fc_norm", "norm_output")}
    if flags["norm_before_fc"] and flags["fc_norm"]:
        raise ExternalSourceError("norm_before_fc and fc_norm are mutually exclusive (speculators' config "
                                  "validator); check the options and the source config", key="fc_norm")
    resolved = {"norm_before_residual": opts["norm_before_residual"], **flags,
                "eagle_aux_hidden_state_layer_ids": opts["eagle_aux_hidden_state_layer_ids"]}
    return flags, resolved


def _wanted(src: Source, exp: dict, reduce_vocab: bool) -> dict:
    """The legacy module's tensors, name -> the shape the tensor contract gives for this config;
    t2d/d2t only where the source has them (deviation, bridge/external/__init__.py: the optional
    norms the flags need are kept, as the contract lists them)."""
    names = [n for n, spec in exp.items() if spec.required and n not in ("t2d", "d2t")]
    if src.has("embed_tokens.weight"):
        names.append("embed_tokens.weight")
    if reduce_vocab:
        names += ["d2t", "t2d"]
    return {n: exp[n].shape if n in exp else None for n in names}  # None: not in the contract, refused on save


def plan(src: Source, verifier: Verifier, options: dict) -> Plan:
    """The speculators eagle3 config and tensors for a SafeAILab EAGLE-3 source."""
    opts = resolve_options(KIND, OPTIONS, options)
    ec = src.config
    if ec is None:
        raise ExternalSourceError("SafeAILab EAGLE-3 source has no config.json (it defines the draft layer)",
                                  path=str(src.path / "config.json"))
    notes: list[str] = []
    reduce_vocab, vocab = _vocab(src, verifier)
    torch_dtype, weights_dtype = _weights_dtype(src, ec, notes)
    layer = _layer(ec, verifier, vocab, torch_dtype)
    flags, resolved = _flags(opts, ec)

    Vd = ec.get("draft_vocab_size", 32000)
    config = config_doc(
        ALGORITHM, layer, dtype=NAME_OF_DTYPE[weights_dtype], speculative_tokens=3, verifier=verifier,
        architectures=verifier.get("architectures", ["LlamaForCausalLM"]), architecture="Eagle3Speculator",
        draft_vocab_size=Vd, aux_layer_ids=resolved["eagle_aux_hidden_state_layer_ids"],
        embed_requires_grad=False, fc_norm=flags["fc_norm"], norm_before_fc=flags["norm_before_fc"],
        norm_before_residual=resolved["norm_before_residual"], norm_output=flags["norm_output"],
        target_hidden_size=ec.get("target_hidden_size"),
    )
    want = _wanted(src, expected_tensors(parse_config(config, path=str(src.path / "config.json"))), reduce_vocab)
    require(src, want, shown=_source_name, kind="SafeAILab EAGLE-3")
    if Vd != vocab and not reduce_vocab:
        raise ExternalSourceError(f"draft_vocab_size {Vd} != verifier vocab_size {vocab} but the source has no t2d: "
                                  "the pruned vocabulary cannot be mapped back to target ids (speculators would write "
                                  "a draft without t2d/d2t)", path=src.weights, key="t2d")
    if flags["norm_before_fc"] or flags["fc_norm"]:
        notes.append("kept the source's input_norm/fc_norm tensors (speculators 0.9.0's legacy converter module has "
                     "no such parameters and drops them)")

    tensors = {}
    for n in want:
        a = src.array(_source_name(n))
        tensors[n] = cast(a, "int64" if n == "d2t" else bool if n == "t2d" else weights_dtype)
    dropped = sorted(set(src.names) - {_source_name(n) for n in want})
    if dropped:
        notes.append(f"dropped {len(dropped)} source tensor(s) the EAGLE-3 draft does not use (speculators ignores "
                     f"them too): {dropped[:8]}")

    return Plan(config, tensors, resolved, notes)

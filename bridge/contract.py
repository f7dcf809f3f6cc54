"""The tensor contract of each algorithm: which names a speculators 0.9.0 checkpoint holds
for a given config, with shapes and dtypes, and which of them may be absent.

Read off speculators 0.9.0 (`models/*/core.py`, `model.py` save/load rules, REFERENCE 2)
and checked against checkpoints that speculators itself writes (tests/bridge).
"""

from __future__ import annotations

from dataclasses import dataclass

from bridge.schema import DFlashConfig, DraftConfig, DSparkConfig, Eagle3Config, MTPConfig, PEagleConfig

FLOAT = "float"  # any floating dtype (F32/BF16/F16/...)
FLOAT_TAGS = frozenset({"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"})  # the safetensors tags FLOAT admits


@dataclass(frozen=True)
class Spec:
    shape: tuple[int, ...]
    dtype: str = FLOAT  # FLOAT, or an exact safetensors tag such as "BOOL" / "I64"
    required: bool = True
    why: str = ""


def _attn(prefix: str, lc, in_features: int, qk_norm: bool, out: dict[str, Spec]):
    nh, nkv, hd, H = lc.num_attention_heads, lc.kv_heads, lc.head_size, lc.hidden_size
    out[f"{prefix}.self_attn.q_proj.weight"] = Spec((nh * hd, in_features))
    out[f"{prefix}.self_attn.k_proj.weight"] = Spec((nkv * hd, in_features))
    out[f"{prefix}.self_attn.v_proj.weight"] = Spec((nkv * hd, in_features))
    out[f"{prefix}.self_attn.o_proj.weight"] = Spec((H, nh * hd))
    if lc.attention_bias:
        out[f"{prefix}.self_attn.q_proj.bias"] = Spec((nh * hd,))
        out[f"{prefix}.self_attn.k_proj.bias"] = Spec((nkv * hd,))
        out[f"{prefix}.self_attn.v_proj.bias"] = Spec((nkv * hd,))
        out[f"{prefix}.self_attn.o_proj.bias"] = Spec((H,))
    if qk_norm:
        out[f"{prefix}.self_attn.q_norm.weight"] = Spec((hd,))
        out[f"{prefix}.self_attn.k_norm.weight"] = Spec((hd,))


def _mlp(prefix: str, lc, out: dict[str, Spec]):
    H, I = lc.hidden_size, lc.intermediate_size
    out[f"{prefix}.mlp.gate_proj.weight"] = Spec((I, H))
    out[f"{prefix}.mlp.up_proj.weight"] = Spec((I, H))
    out[f"{prefix}.mlp.down_proj.weight"] = Spec((H, I))
    if lc.mlp_bias:
        out[f"{prefix}.mlp.gate_proj.bias"] = Spec((I,))
        out[f"{prefix}.mlp.up_proj.bias"] = Spec((I,))
        out[f"{prefix}.mlp.down_proj.bias"] = Spec((H,))


def _layer(prefix: str, lc, in_features: int, qk_norm: bool, out: dict[str, Spec]):
    H = lc.hidden_size
    out[f"{prefix}.input_layernorm.weight"] = Spec((H,))
    out[f"{prefix}.post_attention_layernorm.weight"] = Spec((H,))
    _attn(prefix, lc, in_features, qk_norm, out)
    _mlp(prefix, lc, out)


def _vocab(cfg: DraftConfig, out: dict[str, Spec], *, lm_head_required: bool):
    lc = cfg.layer
    H, V, Vd = lc.hidden_size, lc.vocab_size, cfg.draft_vocab_size
    out["embed_tokens.weight"] = Spec((V, H), required=False, why="filled from the verifier when absent")
    out["lm_head.weight"] = Spec((Vd, H), required=lm_head_required,
                                 why="" if lm_head_required else "filled from the verifier when absent")
    out["verifier_lm_head.weight"] = Spec((Vd, H), required=False, why="not saved by 0.9.0; older writers kept it")
    if cfg.vocab_pruned:
        out["t2d"] = Spec((V,), "BOOL", why="pruned draft vocabulary")
        out["d2t"] = Spec((Vd,), "I64", why="pruned draft vocabulary")


def expected_tensors(cfg: DraftConfig) -> dict[str, Spec]:
    """Every tensor name the checkpoint of ``cfg`` may hold, with its spec."""
    lc = cfg.layer
    H = lc.hidden_size
    out: dict[str, Spec] = {}
    if isinstance(cfg, Eagle3Config):  # includes P-EAGLE
        A = cfg.num_aux
        qk = lc.model_type == "qwen3"
        out["fc.weight"] = Spec((H, A * H))
        if cfg.norm_before_fc:
            out["input_norm.weight"] = Spec((A * H,))
        if cfg.fc_norm:
            for i in range(A):
                out[f"fc_norm.{i}.weight"] = Spec((H,))
        for layer in range(lc.num_hidden_layers):
            p = f"layers.{layer}"
            _layer(p, lc, 2 * H if layer == 0 else H, qk, out)
            if layer == 0:
                out[f"{p}.hidden_norm.weight"] = Spec((H,))
        out["norm.weight"] = Spec((H,))
        out["verifier_norm.weight"] = Spec((H,), required=False, why="not saved; filled from the verifier")
        _vocab(cfg, out, lm_head_required=True)
        if isinstance(cfg, PEagleConfig):
            out["mask_hidden"] = Spec((1, 1, A * H))
    elif isinstance(cfg, DFlashConfig):  # includes DSpark
        A = cfg.num_aux
        out["fc.weight"] = Spec((H, A * H))
        out["hidden_norm.weight"] = Spec((H,))
        for layer in range(lc.num_hidden_layers):
            _layer(f"layers.{layer}", lc, H, True, out)  # Qwen3-style layers whatever model_type says
        out["norm.weight"] = Spec((H,))
        out["verifier_norm.weight"] = Spec((H,), required=False, why="not saved; filled from the verifier")
        _vocab(cfg, out, lm_head_required=cfg.vocab_pruned)
        if isinstance(cfg, DSparkConfig):
            r = cfg.markov_rank
            V, Vd = lc.vocab_size, cfg.draft_vocab_size
            if r > 0:
                out["markov_head.markov_w1.weight"] = Spec((V, r))
                out["markov_head.markov_w2.weight"] = Spec((Vd, r))
                if cfg.markov_head_type == "gated":
                    out["markov_head.gate_proj.weight"] = Spec((r, H + r))
                    out["markov_head.gate_proj.bias"] = Spec((r,))
                elif cfg.markov_head_type == "rnn":
                    out["markov_head.joint_proj.weight"] = Spec((3 * r, 2 * r + H))
                    out["markov_head.joint_proj.bias"] = Spec((3 * r,))
            if cfg.enable_confidence_head:
                width = H + r if (cfg.confidence_head_with_markov and r > 0) else H
                out["confidence_head.proj.weight"] = Spec((1, width))
                out["confidence_head.proj.bias"] = Spec((1,))
    elif isinstance(cfg, MTPConfig):
        p = "mtp_layers.0"
        for n in ("hidden_layernorm", "token_layernorm", "final_layernorm"):
            out[f"{p}.{n}.weight"] = Spec((H,))
        out[f"{p}.input_proj.weight"] = Spec((H, 2 * H))
        if lc.model_type == "qwen3":
            _layer(p, lc, H, True, out)
        out["embed_tokens.weight"] = Spec((lc.vocab_size, H), required=False, why="filled from the verifier")
        out["lm_head.weight"] = Spec((lc.vocab_size, H), required=False, why="filled from the verifier")
    return out


def open_prefixes(cfg: DraftConfig) -> tuple[str, ...]:
    """Name prefixes whose exact content this contract does not enumerate (accepted as is)."""
    if isinstance(cfg, MTPConfig) and cfg.layer.model_type != "qwen3":
        return ("mtp_layers.0.",)  # hybrid / MoE verifier families: layer layout is the verifier's own
    return ()

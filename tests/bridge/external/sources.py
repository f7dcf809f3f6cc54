"""Third-party draft checkpoints in their own layouts, built from tiny random weights.

Names, shapes and config keys follow REFERENCE 6 and what speculators 0.9.0's converters
read (``convert/eagle/eagle3_converter.py``, ``convert/dflash/converter.py``,
``convert/mtp/converter.py``); the config values mirror the published drafts
(``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``, ``z-lab/Qwen3-8B-DFlash-b16``, Qwen3-Next's
``mtp.*`` head) at toy sizes. Each builder takes the verifier it belongs to.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.refs.speculators_ckpts import vocab_mapping

DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _vcfg(verifier: Path) -> dict:
    return json.loads((Path(verifier) / "config.json").read_text())


class _Rand:
    def __init__(self, seed: int, dtype: torch.dtype):
        self.g = torch.Generator().manual_seed(seed)
        self.dtype = dtype

    def w(self, *shape):
        return (0.05 * torch.randn(*shape, generator=self.g)).to(self.dtype)

    def norm(self, *shape):
        return (1.0 + 0.1 * torch.randn(*shape, generator=self.g)).to(self.dtype)


def _save(weights: dict, out: Path, fmt: str, shards: int = 1):
    weights = {k: v.contiguous() for k, v in weights.items()}
    if fmt == "bin":
        torch.save(weights, out / "pytorch_model.bin")
    elif shards == 1:
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    else:
        names = sorted(weights)
        groups = [names[i::shards] for i in range(shards)]
        wm = {}
        for i, g in enumerate(groups, 1):
            fn = f"model-{i:05d}-of-{shards:05d}.safetensors"
            save_file({k: weights[k] for k in g}, out / fn, metadata={"format": "pt"})
            wm.update({k: fn for k in g})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def safeailab_eagle3(out: Path, verifier: Path, *, dtype: str = "float16", draft_vocab: int | None = 40,
                     embed: bool = False, fmt: str = "safetensors", rope_scaling: dict | None = None,
                     config_over: dict | None = None, drop: tuple = (), extra: dict | None = None,
                     seed: int = 0, weights_dtype: str | None = None) -> Path:
    """SafeAILab EAGLE-3: ``midlayer.*`` + fc/norm/lm_head (+ d2t/t2d when the vocab is pruned)."""
    v = _vcfg(verifier)
    H, V, heads, kv = v["hidden_size"], v["vocab_size"], v["num_attention_heads"], v["num_key_value_heads"]
    hd, I = H // heads, v["intermediate_size"]
    Vd = draft_vocab or V
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000, "eos_token_id": 128001,
           "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": I,
           "max_position_embeddings": 128, "model_type": "llama", "num_attention_heads": heads,
           "num_key_value_heads": kv, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05,
           "tie_word_embeddings": False, "torch_dtype": dtype, "transformers_version": "4.28.1", "use_cache": True,
           "vocab_size": V, "draft_vocab_size": Vd, "rope_theta": 500000.0}
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    cfg.update(config_over or {})
    cfg = {k: v for k, v in cfg.items() if v is not None}
    r = _Rand(seed, DT[weights_dtype or dtype])
    w = {"fc.weight": r.w(H, 3 * H), "midlayer.input_layernorm.weight": r.norm(H),
         "midlayer.hidden_norm.weight": r.norm(H), "midlayer.post_attention_layernorm.weight": r.norm(H),
         "midlayer.self_attn.q_proj.weight": r.w(heads * hd, 2 * H),
         "midlayer.self_attn.k_proj.weight": r.w(kv * hd, 2 * H),
         "midlayer.self_attn.v_proj.weight": r.w(kv * hd, 2 * H),
         "midlayer.self_attn.o_proj.weight": r.w(H, heads * hd),
         "midlayer.mlp.gate_proj.weight": r.w(I, H), "midlayer.mlp.up_proj.weight": r.w(I, H),
         "midlayer.mlp.down_proj.weight": r.w(H, I), "norm.weight": r.norm(H), "lm_head.weight": r.w(Vd, H)}
    if Vd != V:
        t2d, d2t = vocab_mapping(Vd, seed)
        w["t2d"], w["d2t"] = t2d, d2t
    if embed:
        w["embed_tokens.weight"] = r.w(V, H)
    w.update(extra or {})
    for k in drop:
        w.pop(k)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _save(w, out, fmt)
    return out


def zlab_dflash(out: Path, verifier: Path, *, layers: int = 2, target_layer_ids=(0, 2, 4), block_size=4,
                block_in: str | None = "top", mask_token_id: int | None = None, dtype: str = "bfloat16",
                fused_qkv: bool = False, config_over: dict | None = None, drop: tuple = (), seed: int = 0,
                fc_aux: int | None = None) -> Path:
    """z-lab DFlash: Qwen3 body (``layers.*``, ``fc``, ``hidden_norm``, ``norm``), config with
    ``dflash_config {mask_token_id, target_layer_ids}`` and ``block_size`` at the top level
    (Qwen3/LLaMA drafts) or inside ``dflash_config`` (Qwen3.5+ drafts)."""
    v = _vcfg(verifier)
    H, V, heads, kv = v["hidden_size"], v["vocab_size"], v["num_attention_heads"], v["num_key_value_heads"]
    hd, I = v.get("head_dim") or H // heads, v["intermediate_size"]
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    dcfg = {"mask_token_id": V - 1 if mask_token_id is None else mask_token_id,
            "target_layer_ids": list(target_layer_ids)}
    cfg = {"architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
           "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "bos_token_id": 151643, "dflash_config": dcfg,
           "dtype": dtype, "eos_token_id": 151645, "head_dim": hd, "hidden_act": "silu", "hidden_size": H,
           "initializer_range": 0.02, "intermediate_size": I, "layer_types": ["full_attention"] * layers,
           "max_position_embeddings": 40960, "max_window_layers": layers, "model_type": "qwen3",
           "num_attention_heads": heads, "num_hidden_layers": layers, "num_key_value_heads": kv,
           "num_target_layers": v["num_hidden_layers"], "rms_norm_eps": 1e-06, "rope_scaling": None,
           "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
           "transformers_version": "4.57.1", "use_cache": True, "use_sliding_window": False, "vocab_size": V}
    if block_in == "top":
        cfg["block_size"] = block_size
    elif block_in == "nested":
        dcfg["block_size"] = block_size
    cfg.update(config_over or {})
    r = _Rand(seed, DT[dtype])
    A = fc_aux or len(target_layer_ids)
    w = {"fc.weight": r.w(H, A * H), "hidden_norm.weight": r.norm(H), "norm.weight": r.norm(H)}
    for i in range(layers):
        p = f"layers.{i}."
        q, k, vv = r.w(heads * hd, H), r.w(kv * hd, H), r.w(kv * hd, H)
        if fused_qkv:
            w[p + "self_attn.qkv_proj.weight"] = torch.cat([q, k, vv], 0)
            w[p + "self_attn.g_proj.weight"] = r.w(heads, H)
        else:
            w.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                      p + "self_attn.v_proj.weight": vv})
        w.update({p + "input_layernorm.weight": r.norm(H), p + "post_attention_layernorm.weight": r.norm(H),
                  p + "self_attn.o_proj.weight": r.w(H, heads * hd), p + "self_attn.q_norm.weight": r.norm(hd),
                  p + "self_attn.k_norm.weight": r.norm(hd), p + "mlp.gate_proj.weight": r.w(I, H),
                  p + "mlp.up_proj.weight": r.w(I, H), p + "mlp.down_proj.weight": r.w(H, I)})
    if fused_qkv:
        for i in range(A):
            w[f"aux_hidden_norms.{i}.weight"] = r.norm(H)
    for k in drop:
        w.pop(k)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _save(w, out, "safetensors")
    return out


# speculators MTP name -> native name (stitch_mtp's inverse of the converter's remap)
def _native_name(n: str) -> str:
    exact = {"mtp_layers.0.input_proj.weight": "mtp.fc.weight",
             "mtp_layers.0.final_layernorm.weight": "mtp.norm.weight"}
    if n in exact:
        return exact[n]
    for a, b in (("mtp_layers.0.hidden_layernorm.", "mtp.pre_fc_norm_hidden."),
                 ("mtp_layers.0.token_layernorm.", "mtp.pre_fc_norm_embedding."), ("mtp_layers.0.", "mtp.layers.0.")):
        if n.startswith(a):
            return b + n[len(a):]
    raise KeyError(n)


def _mtp_head_names(layer_config) -> dict[str, tuple]:
    """The ``mtp_layers.0.*`` tensors of speculators' MTPDraftModel for this verifier config."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    cfg = MTPSpeculatorConfig(transformer_layer_config=layer_config, speculators_config=SpeculatorsConfig(
        algorithm="mtp", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
        default_proposal_method="greedy", verifier=VerifierConfig(name_or_path="v", architectures=["X"])))
    with torch.device("meta"):
        model = MTPDraftModel(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith("mtp_layers.0.")}


def native_mtp(out: Path, verifier: Path, *, dtype: str = "float32", shards: int = 1, seed: int = 0,
               drop: tuple = (), body: bool = True) -> Path:
    """A verifier checkpoint with a native MTP head: the verifier's own config and tensors
    plus ``mtp.*`` (per-expert ``experts.{e}.{gate,up,down}_proj`` for MoE families)."""
    from transformers import AutoConfig

    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.copy(Path(verifier) / "config.json", out / "config.json")
    vcfg = AutoConfig.from_pretrained(verifier)
    r = _Rand(seed, DT[dtype])
    w = {}
    if body and (Path(verifier) / "model.safetensors").exists():
        from safetensors.torch import load_file

        w.update({k: t.to(DT[dtype]) for k, t in load_file(Path(verifier) / "model.safetensors").items()})
    else:
        w["model.embed_tokens.weight"] = r.w(vcfg.vocab_size, vcfg.hidden_size)
    for n, shape in _mtp_head_names(vcfg).items():
        if n.endswith("experts.gate_up_proj"):
            E, two_i, H = shape
            for e in range(E):
                w[_native_name(n.replace("gate_up_proj", f"{e}.gate_proj.weight"))] = r.w(two_i // 2, H)
                w[_native_name(n.replace("gate_up_proj", f"{e}.up_proj.weight"))] = r.w(two_i // 2, H)
        elif n.endswith("experts.down_proj"):
            E, H, i = shape
            for e in range(E):
                w[_native_name(n.replace("down_proj", f"{e}.down_proj.weight"))] = r.w(H, i)
        else:
            w[_native_name(n)] = r.norm(*shape) if "norm" in n else r.w(*shape)
    for k in drop:
        w.pop(k)
    _save(w, out, "safetensors", shards=shards)
    return out


def qwen3_next_verifier(out: Path) -> Path:
    """A config-only tiny Qwen3-Next (hybrid linear/full attention, MoE) verifier directory."""
    from transformers import Qwen3NextConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = Qwen3NextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, max_position_embeddings=256, dtype="bfloat16",
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    cfg.architectures = ["Qwen3NextForCausalLM"]
    cfg.save_pretrained(out)
    return out

"""Header-only safetensors files (sparse data) for real-sized shapes, and mutated copies."""

import json
import math
import shutil
import struct
from pathlib import Path

from bridge.safetensors_io import DTYPES, open_tensors


def write_header_only(path: Path, specs: dict[str, tuple[str, tuple[int, ...]]]) -> Path:
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name in sorted(specs):
        tag, shape = specs[name]
        nb = math.prod(shape) * DTYPES[tag].itemsize
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    raw = json.dumps(header).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + off)  # sparse: no data blocks are written
    return path


def mutated(src: Path, dst: Path, *, shapes: dict | None = None, drop=(), add: dict | None = None, config_fn=None) -> Path:
    """Copy of checkpoint ``src`` with altered header shapes (header-only) and/or config."""
    dst.mkdir(parents=True)
    s = open_tensors(src)
    specs = {n: (s.info(n).dtype, tuple(s.info(n).shape)) for n in s.names if n not in drop}
    for n, shp in (shapes or {}).items():
        specs[n] = (specs[n][0], tuple(shp))
    specs.update(add or {})
    write_header_only(dst / "model.safetensors", specs)
    cfg = json.loads((src / "config.json").read_text())
    if config_fn:
        config_fn(cfg)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def llama_layer(prefix, H, nh, nkv, hd, I, in_features, tag="BF16", qk_norm=False):
    d = {
        f"{prefix}.input_layernorm.weight": (tag, (H,)),
        f"{prefix}.post_attention_layernorm.weight": (tag, (H,)),
        f"{prefix}.self_attn.q_proj.weight": (tag, (nh * hd, in_features)),
        f"{prefix}.self_attn.k_proj.weight": (tag, (nkv * hd, in_features)),
        f"{prefix}.self_attn.v_proj.weight": (tag, (nkv * hd, in_features)),
        f"{prefix}.self_attn.o_proj.weight": (tag, (H, nh * hd)),
        f"{prefix}.mlp.gate_proj.weight": (tag, (I, H)),
        f"{prefix}.mlp.up_proj.weight": (tag, (I, H)),
        f"{prefix}.mlp.down_proj.weight": (tag, (H, I)),
    }
    if qk_norm:
        d[f"{prefix}.self_attn.q_norm.weight"] = (tag, (hd,))
        d[f"{prefix}.self_attn.k_norm.weight"] = (tag, (hd,))
    return d


def _proposal(k):
    return {"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1}


def qwen3_8b_eagle3(root: Path) -> Path:
    """RedHatAI/Qwen3-8B-speculator.eagle3 as described in seed 000 (config values + real shapes)."""
    d = root / "qwen3-8b-eagle3"
    d.mkdir(parents=True)
    H, V, Vd, nh, nkv, hd, I = 4096, 151936, 32000, 32, 8, 128, 12288
    cfg = {
        "architectures": ["Eagle3Speculator"], "draft_vocab_size": Vd, "norm_before_residual": True,
        "speculators_model_type": "eagle3", "speculators_version": "0.2.0.dev11", "target_hidden_size": None,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [_proposal(3)],
                               "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "Qwen/Qwen3-8B"}},
        "transformer_layer_config": {"model_type": "llama", "hidden_size": H, "num_attention_heads": nh,
                                     "num_key_value_heads": nkv, "head_dim": hd, "intermediate_size": I,
                                     "num_hidden_layers": 1, "vocab_size": V, "rms_norm_eps": 1e-6,
                                     "max_position_embeddings": 40960, "rope_theta": 1000000.0},
    }
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    specs = {"fc.weight": ("BF16", (H, 3 * H)), "lm_head.weight": ("BF16", (Vd, H)),
             "embed_tokens.weight": ("BF16", (V, H)), "t2d": ("BOOL", (V,)), "d2t": ("I64", (Vd,)),
             "norm.weight": ("BF16", (H,)), "layers.0.hidden_norm.weight": ("BF16", (H,))}
    specs.update(llama_layer("layers.0", H, nh, nkv, hd, I, 2 * H))
    write_header_only(d / "model.safetensors", specs)
    return d


def gemma4_31b_dflash(root: Path) -> Path:
    """RedHatAI/gemma-4-31B-it-speculator.dflash as described in seed 000."""
    d = root / "gemma-4-31b-dflash"
    d.mkdir(parents=True)
    H, V, Vd, nh, nkv, hd, I, L = 5376, 262144, 32000, 32, 16, 256, 21504, 5
    aux = [1, 17, 29, 47, 58]
    cfg = {
        "architectures": ["DFlashSpeculator"], "draft_vocab_size": Vd, "block_size": 8,
        "aux_hidden_state_layer_ids": aux, "mask_token_id": 4, "speculators_model_type": "dflash",
        "speculators_version": "0.5.0.dev53", "target_hidden_size": None,
        "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                               "proposal_methods": [_proposal(8)],
                               "verifier": {"architectures": [], "name_or_path": "google/gemma-4-31B-it"}},
        "transformer_layer_config": {"model_type": "llama", "hidden_size": H, "num_attention_heads": nh,
                                     "num_key_value_heads": nkv, "head_dim": hd, "intermediate_size": I,
                                     "num_hidden_layers": L, "vocab_size": V, "rms_norm_eps": 1e-6},
    }
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    specs = {"fc.weight": ("BF16", (H, len(aux) * H)), "lm_head.weight": ("BF16", (Vd, H)),
             "embed_tokens.weight": ("BF16", (V, H)), "t2d": ("BOOL", (V,)), "d2t": ("I64", (Vd,)),
             "norm.weight": ("BF16", (H,)), "hidden_norm.weight": ("BF16", (H,))}
    for i in range(L):
        specs.update(llama_layer(f"layers.{i}", H, nh, nkv, hd, I, H, qk_norm=True))
    write_header_only(d / "model.safetensors", specs)
    return d


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst

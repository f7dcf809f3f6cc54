"""Tiny tokenizer directories around published chat templates (tests/models/chat_templates/).

Each is a byte-level BPE (trained here on a few sentences with ``tokenizers``: a few hundred
tokens) with the model family's special tokens, pre-tokenizer and post-processor, and a
tokenizer_config.json with the family's published fields (tokenizer_class, special tokens) and
its chat template: what ``AutoTokenizer.from_pretrained`` and specjax's ``Tokenizer.from_dir``
both read."""

from __future__ import annotations

import json
from pathlib import Path

from specjax.models.tokenizer import PRE_TOKENIZER_SPLITS

TEMPLATES = Path(__file__).parent / "chat_templates"

_CORPUS = [
    "Hello, how are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog 1234567890.",
    "system user assistant tool ipython You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n",
    "Environment: ipython Given the following functions, please respond with a JSON for a function call",
    '{"name": "get_weather", "parameters": {"city": "Paris"}} <tool_call> </tool_call>',
    "héllo wörld — naïve café ünïcode",
]

_LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
_CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# family -> (template file, special tokens, split regex (None: plain ByteLevel), NFC, extra
# non-special added tokens, tokenizer_config fields as published, BOS added by a post-processor)
FAMILIES = {
    "llama-3.1": ("llama-3.1.jinja", _LLAMA_SPECIALS, "llama3", False, [],
                  {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                   "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True, "model_max_length": 131072}, True),
    "llama-3.2": ("llama-3.2.jinja", _LLAMA_SPECIALS, "llama3", False, [],
                  {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                   "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True, "model_max_length": 131072}, True),
    "qwen3": ("qwen3.jinja", _CHATML_SPECIALS, "qwen2", True,
              ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
              {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
               "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace", "add_prefix_space": False,
               "split_special_tokens": False, "model_max_length": 131072}, False),
    "smollm2": ("smollm2.jinja", _CHATML_SPECIALS, None, False, [],
                {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                 "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>", "add_prefix_space": False,
                 "model_max_length": 8192}, False),
    "smollm2-generation": ("smollm2-generation.jinja", _CHATML_SPECIALS, None, False, [],
                           {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|im_start|>",
                            "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>",
                            "add_prefix_space": False, "model_max_length": 8192}, False),
}


def write_tokenizer_dir(out: Path, family: str, *, vocab_size: int = 400) -> Path:
    """``out/tokenizer.json`` + ``out/tokenizer_config.json`` for ``family`` (a FAMILIES key)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    template_file, specials, split, nfc, added, config, bos_post = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[split]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    if added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if bos_post:  # Llama 3: the BOS comes from the post-processor (not from the template's tokenizing)
        bos = config["bos_token"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {**config, "chat_template": (TEMPLATES / template_file).read_text(encoding="utf-8")}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")
    return out

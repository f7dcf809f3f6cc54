"""A torch-free tokenizer: a ``tokenizers.Tokenizer`` plus special tokens and a chat template,
built from a GGUF's vocabulary/merges or from an HF ``tokenizer.json``.

Chat templates are rendered by transformers' own ``apply_chat_template`` (on a
``PreTrainedTokenizerFast`` wrapping this backend; transformers' tokenizer classes import and run
without torch), so ``strftime_now``, ``raise_exception``, ``{% generation %}`` assistant masks,
named templates (``tool_use``) and the special-token variables behave exactly as in transformers
and in vLLM, which renders through the same function. Only the template's source differs between
the GGUF path (``tokenizer.chat_template`` metadata) and an HF directory (``chat_template.jinja``,
``additional_chat_templates/``, or ``tokenizer_config.json``).

The GGUF byte-level BPE build mirrors transformers' own GGUF loader (``GPT2Tokenizer`` backend:
vocabulary spelled in the byte-to-unicode alphabet, merges as given, ``ByteLevel`` pre-tokenizer
and decoder, or a llama.cpp ``tokenizer.ggml.pre`` split regex where one is known; control tokens
added as special, user-defined tokens as plain added tokens), so ids equal what
``AutoTokenizer.from_pretrained(..., gguf_file=...)`` produces.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

from specjax.models.errors import ChatTemplateError, GGUFError, UnsupportedGGUFError

# llama.cpp tokenizer.ggml.pre -> split regex (as in transformers' GGUF tokenizer mapping).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}

CONTROL, USER_DEFINED = 3, 4

# transformers' named special tokens: the variables every chat template sees (special_tokens_map).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# How transformers recognises a template that marks assistant tokens (render_jinja_template).
_GENERATION_BLOCK = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


class Tokenizer:
    """encode / decode / apply_chat_template over a ``tokenizers.Tokenizer``.

    ``chat_template`` is one template string, or ``{name: template}`` (transformers' named
    templates: ``default``, ``tool_use``, ...)."""

    def __init__(self, backend, *, chat_template: str | dict[str, str] | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None, unk_token: str | None = None,
                 add_bos_token: bool = False, add_eos_token: bool = False, sep_token: str | None = None,
                 cls_token: str | None = None, mask_token: str | None = None, source: str | None = None):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.sep_token, self.cls_token, self.mask_token = sep_token, cls_token, mask_token
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self.source = source  # the file or directory it came from, for messages
        self._chat = None  # transformers' tokenizer over a copy of ``backend``, built on first render

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set (transformers' ``special_tokens_map``)."""
        return {k: getattr(self, k) for k in SPECIAL_TOKEN_NAMES if getattr(self, k) is not None}

    # ------------------------------------------------------------------ ids
    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self):
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self):
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self):
        return self.token_to_id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids = [self.bos_token_id] + ids
            if self.add_eos_token and self.eos_token_id is not None:
                ids = ids + [self.eos_token_id]
        return ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat
    @property
    def uses_generation_mask(self) -> bool:
        """Whether the (default) template marks assistant tokens with ``{% generation %}``."""
        t = self.chat_template
        if isinstance(t, dict):
            t = t.get("default")
        return bool(t) and _GENERATION_BLOCK.search(t) is not None

    def chat_tokenizer(self):
        """transformers' ``PreTrainedTokenizerFast`` over (a copy of) this backend, with this chat
        template and these special tokens; imported on first use (it does not import torch)."""
        if self._chat is None:
            _hide_no_torch_advice()
            from transformers import PreTrainedTokenizerFast

            self._chat = PreTrainedTokenizerFast(tokenizer_object=self.backend, chat_template=self.chat_template,
                                                 **self.special_tokens_map)
        return self._chat

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            tokenize: bool = False, return_assistant_tokens_mask: bool = False, **template_kwargs):
        """Render ``messages`` with transformers' ``apply_chat_template`` (its sandboxed jinja
        environment: ``strftime_now``, ``raise_exception``, ``tojson``, ``{% generation %}``).

        Returns the text; with ``tokenize`` the token ids (no special tokens added around the
        rendered text, as transformers and vLLM do); with ``return_assistant_tokens_mask``
        ``(ids, mask)``, mask 1 on the tokens inside the template's ``{% generation %}`` blocks.
        ``template_kwargs`` reach the template (``enable_thinking``, ``tools``, ``date_string``...)."""
        import jinja2

        if not self.chat_template:
            where = f" ({self.source})" if self.source else ""
            raise ChatTemplateError(f"this tokenizer{where} has no chat template; pass plain prompts (without --chat) "
                                    "or token ids")
        if return_assistant_tokens_mask and not self.uses_generation_mask:
            raise ChatTemplateError(f"an assistant-token mask needs a chat template with {{% generation %}} blocks; "
                                    f"the template of {self.source or 'this tokenizer'} has none")
        tok = self.chat_tokenizer()
        try:
            out = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize,
                                          return_dict=return_assistant_tokens_mask,
                                          return_assistant_tokens_mask=return_assistant_tokens_mask, **template_kwargs)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template of {self.source or 'this tokenizer'} failed on a conversation of "
                                    f"roles {[m.get('role') for m in messages]}: {type(e).__name__}: {e}") from e
        if return_assistant_tokens_mask:
            return list(out["input_ids"]), list(out["assistant_masks"])
        return list(out) if tokenize else out

    # ------------------------------------------------------------------ build / save
    @classmethod
    def from_gguf(cls, gf) -> "Tokenizer":
        """From a :class:`specjax.models.gguf.GGUFFile` (or a path to one)."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as Backend

        if not hasattr(gf, "reader"):
            from specjax.models.gguf import GGUFFile  # heavy: jax (this module imports without it)

            gf = GGUFFile(gf)
        kind = gf.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedGGUFError(f"tokenizer.ggml.model {kind!r} is not supported; expected 'gpt2' (byte-level BPE)",
                                       path=gf.path, key="tokenizer.ggml.model")
        tokens = gf.get("tokenizer.ggml.tokens")
        merges = gf.get("tokenizer.ggml.merges")
        if tokens is None or merges is None:
            raise GGUFError("metadata lacks tokenizer.ggml.tokens / tokenizer.ggml.merges", path=gf.path,
                            key="tokenizer.ggml.tokens")
        types = gf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {}
        for i, t in enumerate(tokens):
            spelled = t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
            vocab[spelled] = i
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                         continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
        tok = Backend(bpe)
        split = PRE_TOKENIZER_SPLITS.get(gf.get("tokenizer.ggml.pre"))
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        tok.decoder = decoders.ByteLevel()
        control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
                   if ty == CONTROL and set(t) <= alphabet]
        if control:
            tok.add_special_tokens(control)
        user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
                if ty == USER_DEFINED and t in vocab]
        if user:
            tok.add_tokens(user)

        def tok_of(key):
            v = gf.get(key)
            return None if v is None or not 0 <= int(v) < len(tokens) else tokens[int(v)]

        return cls(tok, chat_template=gf.get("tokenizer.chat_template"), source=str(gf.path),
                   bos_token=tok_of("tokenizer.ggml.bos_token_id"),
                   eos_token=tok_of("tokenizer.ggml.eos_token_id"), pad_token=tok_of("tokenizer.ggml.padding_token_id"),
                   unk_token=tok_of("tokenizer.ggml.unknown_token_id"),
                   add_bos_token=bool(gf.get("tokenizer.ggml.add_bos_token", False)),
                   add_eos_token=bool(gf.get("tokenizer.ggml.add_eos_token", False)))

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> "Tokenizer | None":
        """From an HF directory's ``tokenizer.json`` (+ ``tokenizer_config.json`` / ``chat_template.jinja``);
        None when the directory has no tokenizer.json."""
        from tokenizers import Tokenizer as Backend

        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            return None
        tok = Backend.from_file(str(d / "tokenizer.json"))
        cfg = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = _dir_chat_template(d, cfg)

        def name(k):
            v = cfg.get(k)
            return v.get("content") if isinstance(v, dict) else v

        # A post-processor in tokenizer.json adds its own specials; only without one do the
        # tokenizer_config flags apply (e.g. a directory written by :meth:`save`).
        own = tok.post_processor is None
        return cls(tok, chat_template=template, add_bos_token=own and bool(cfg.get("add_bos_token", False)),
                   add_eos_token=own and bool(cfg.get("add_eos_token", False)), source=str(d),
                   **{k: name(k) for k in SPECIAL_TOKEN_NAMES})

    def save(self, directory: str | os.PathLike) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(d / "tokenizer.json"))
        cfg = {**{k: getattr(self, k) for k in SPECIAL_TOKEN_NAMES}, "add_bos_token": self.add_bos_token,
               "add_eos_token": self.add_eos_token, "tokenizer_class": "PreTrainedTokenizerFast"}
        if isinstance(self.chat_template, dict):
            cfg["chat_template"] = [{"name": k, "template": v} for k, v in self.chat_template.items()]
        elif self.chat_template:
            cfg["chat_template"] = self.chat_template
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


class _NoTorchAdvice:
    """Drops transformers' import-time "PyTorch was not found" advice: specjax uses only its
    torch-free tokenizer and chat-template code, so the advice would only confuse a user."""

    @staticmethod
    def filter(record) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


def _hide_no_torch_advice() -> None:
    import logging

    lib = logging.getLogger("transformers")  # the logger transformers configures and advises through
    if not any(isinstance(f, _NoTorchAdvice) for f in lib.filters):
        lib.addFilter(_NoTorchAdvice())


def _dir_chat_template(d: Path, cfg: dict) -> str | dict[str, str] | None:
    """An HF directory's chat template(s), as transformers reads them: ``chat_template.jinja``
    over tokenizer_config's ``chat_template`` (a string or ``[{name, template}]``), plus
    ``additional_chat_templates/<name>.jinja``; several come back as ``{name: template}``."""
    template = cfg.get("chat_template")
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}
    if (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = d / "additional_chat_templates"
    extra = {f.stem: f.read_text(encoding="utf-8") for f in sorted(extra_dir.glob("*.jinja"))} if extra_dir.is_dir() else {}
    if extra:
        base = template if isinstance(template, dict) else ({"default": template} if template else {})
        template = {**base, **extra}
    return template

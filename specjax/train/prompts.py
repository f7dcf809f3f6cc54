"""Prompts in: the one reader behind every prompt input of ``data prepare``, ``train`` and ``bench``.

Sources (the ``prompts`` string):

==============================  ==============================================================
``builtin:<name>[:<n>]``         an offline set made from Python's stdlib (:mod:`.stdlib_prompts`)
``hf:<id>[:<config>][:<split>]`` a dataset in the local HF datasets cache (``datasets.load_dataset``
                                 offline); split default ``train``, or the only split there is
``<file>.jsonl``                 JSON Lines (``json``, line by line)
``<file>.json``                  one JSON list of records (or JSON Lines under a .json name)
``<file>.parquet``               ``pyarrow.parquet``, batch by batch
``<file>.arrow``                 ``datasets.Dataset.from_file`` (memory-mapped)
``<dir>`` from ``save_to_disk``  ``datasets.load_from_disk``; a ``DatasetDict`` gives its ``train``
                                 split (or its only one); ``<dir>/<split>`` picks another
``<dir>``                        every .json/.jsonl/.parquet/.arrow file under it, sorted by path
==============================  ==============================================================

A list of sources (a recipe's ``prompts: [builtin:stdlib:1000, builtin:stdlib-source:700]``,
``--prompts`` given twice) is read in its order and concatenated.

JSON text is read with the stdlib ``json`` module rather than ``datasets``' json builder: that
builder reports "Expected object or value" without a line, refuses bare-string lines, turns
``["a", "b"]`` into ``{"text": ...}`` rows, and copies the file into the datasets cache first.
Columnar inputs (parquet, arrow, ``save_to_disk``, the hub cache) go through pyarrow / datasets
(:mod:`.prompt_datasets`).

Record shapes, one record a row:

* ``{"conversations": [{"from": ..., "value": ...}, ...]}`` (ShareGPT), ``{"messages": [{"role":
  ..., "content": ...}, ...]}`` (OpenAI / UltraChat), or a bare list of such turns. Content is a
  string, null (a tool-call turn), or OpenAI text parts ``[{"type": "text", "text": ...}]``;
* ``{"prompt": ...}`` / ``{"text": ...}`` / ``{"question": ...}`` / ``{"instruction": ...,
  "input": ...}`` or a bare string: one user turn (plus an assistant turn from ``response`` /
  ``output`` / ``completion`` / ``answer`` when present);
* ``{"input_ids": [...], "loss_mask": [...]}``: an already tokenized training row;
* ``{"prompt_ids": [...]}`` / ``{"token_ids": [...]}``: a tokenized prompt (``bench``).

Roles (case-insensitive) map as speculators' ``_normalize_conversation`` does for the names it
knows (``ROLES``); a role outside the table is an error here, where speculators would silently
train it as an assistant turn.

Every record is parsed and checked before anything uses the set (:func:`read_prompts`), so a bad
input fails before a model loads. Errors are :class:`PromptFileError`: the file, ``record N``
(1-based; ``(line L)`` for JSON Lines), the field, what was found and what was expected.

Selection (over all the sources together): ``shuffle_seed`` orders the records by
``numpy.random.default_rng(seed).permutation`` (the order ``datasets.Dataset.shuffle(seed=...)``
gives), then ``max_samples`` keeps the first N.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence, Union

from bridge.atomic import atomic_file
from specjax.train.errors import PromptFileError
from specjax.train.prompt_datasets import hf_fetch_command, parse_hf_spec  # noqa: F401  (public here too)
from specjax.train.prompt_datasets import is_saved_dataset, read_arrow, read_hf, read_parquet, read_saved
from specjax.train.stdlib_prompts import builtin_prompts, is_eval_module  # noqa: F401  (public here too)

Conversation = list[dict[str, Any]]


@dataclass
class PretokenizedRow:
    """A training row given as token ids with its loss mask (``data prepare`` passes it through)."""

    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class PromptIds:
    """A prompt given as token ids (``bench``: no chat template applied)."""

    ids: list[int]


Record = Union[Conversation, PretokenizedRow, PromptIds]
KINDS = {"conversation": list, "pretokenized": PretokenizedRow, "prompt_ids": PromptIds}

# role as written -> the role the chat template sees (speculators' mapping, plus the usual aliases)
ROLES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant", "bot": "assistant",
    "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "ipython": "tool",  # tool / function results
}
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
_PROMPT_KEYS = ("prompt", "text", "question", "instruction")
_ANSWER_KEYS = ("response", "output", "completion", "answer")


# ----------------------------------------------------------------------------- record shapes


class _Loc:
    """Where a record is: the file, its 1-based number, and (JSON Lines) its line."""

    def __init__(self, path: str, record: int, line: int | None = None):
        self.path, self.record, self.line = path, record, line

    def fail(self, msg: str, key: str | None = None):
        at = f"record {self.record}" + (f" (line {self.line})" if self.line else "")
        raise PromptFileError(f"{at}: {msg}", path=self.path, key=key)


def _get(obj: dict, *keys: str):
    """The first of ``keys`` with a non-null value (arrow inputs fill absent keys with None)."""
    for k in keys:
        if obj.get(k) is not None:
            return k, obj[k]
    return None, None


def _text(content, loc: _Loc, key: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type", "text") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                loc.fail(f"a content part of type {kind!r}; only text parts are supported", key)
        return "".join(parts)
    loc.fail(f"content is {_kind(content)}; expected a string, null or a list of text parts", key)


def _kind(x) -> str:
    if isinstance(x, bytes):
        return f"bytes (not UTF-8 text: {x[:24]!r})"
    return f"a {type(x).__name__}"


def _turns(turns: list, loc: _Loc, field: str) -> Conversation:
    if not isinstance(turns, list) or not turns:
        loc.fail(f"'{field}' is {_kind(turns) if turns else 'empty'}; expected a non-empty list of turns", field)
    out = []
    for k, t in enumerate(turns):
        where = f"{field}[{k}]"
        if not isinstance(t, dict):
            loc.fail(f"turn {k} is {_kind(t)}; expected an object with role/content (or from/value)", where)
        rk, role = _get(t, "role", "from")
        if role is None:
            loc.fail(f"turn {k} has no 'role' (or 'from') key (found {sorted(x for x in t if t[x] is not None)})",
                     where)
        if not isinstance(role, str) or role.strip().lower() not in ROLES:
            loc.fail(f"turn {k} has {rk} {role!r}; expected one of {', '.join(ROLES)}", f"{where}.{rk}")
        ck, content = _get(t, "content", "value")
        turn = {"role": ROLES[role.strip().lower()], "content": _text(content, loc, f"{where}.{ck or 'content'}")}
        for extra in ("tool_calls", "tool_call_id", "name"):
            if t.get(extra):
                turn[extra] = t[extra]
        _, thinking = _get(t, "thinking", "reasoning_content")
        if thinking:
            turn["thinking"] = turn["reasoning_content"] = _text(thinking, loc, f"{where}.thinking")
        out.append(turn)
    if not any(t["role"] == "user" and t["content"].strip() for t in out):
        loc.fail(f"'{field}' has no user turn with text; a prompt needs one", field)
    return out


def _ints(xs, loc: _Loc, key: str, *, allowed: tuple | None = None) -> list[int]:
    if not isinstance(xs, list) or not xs:
        loc.fail(f"'{key}' is {_kind(xs) if xs else 'empty'}; expected a non-empty list of integers", key)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs):
        loc.fail(f"'{key}' holds a non-integer or negative value; expected token ids", key)
    if allowed is not None and not all(x in allowed for x in xs):
        loc.fail(f"'{key}' holds values other than {allowed}", key)
    return [int(x) for x in xs]


def parse_record(obj: Any, loc: _Loc) -> Record:
    """One raw record (a JSON value or an arrow row) -> a :data:`Record`; bad -> PromptFileError."""
    if isinstance(obj, str):
        if not obj.strip():
            loc.fail("an empty prompt string")
        return [{"role": "user", "content": obj}]
    if isinstance(obj, list):
        return _turns(obj, loc, "turns")
    if not isinstance(obj, dict):
        loc.fail(f"{_kind(obj)}; expected an object, a list of turns or a string")
    if _get(obj, "input_ids", "loss_mask")[0]:
        ids = _ints(obj.get("input_ids"), loc, "input_ids")
        mask = _ints(obj.get("loss_mask"), loc, "loss_mask", allowed=(0, 1))
        if len(ids) != len(mask):
            loc.fail(f"pretokenized row: {len(ids)} input_ids but {len(mask)} loss_mask values; expected equal "
                     "lengths", "loss_mask")
        return PretokenizedRow(ids, mask)
    k, ids = _get(obj, "prompt_ids", "token_ids")
    if k:
        return PromptIds(_ints(ids, loc, k))
    k, turns = _get(obj, "conversations", "messages")
    if k:
        return _turns(turns, loc, k)
    k, text = _get(obj, *_PROMPT_KEYS)
    if k:
        text = _text(text, loc, k)
        if not text.strip():
            loc.fail(f"'{k}' is empty", k)
        if k == "instruction":
            _, extra = _get(obj, "input")
            if isinstance(extra, str) and extra.strip():
                text = f"{text}\n\n{extra}"
        conv = [{"role": "user", "content": text}]
        ak, answer = _get(obj, *_ANSWER_KEYS)
        if ak:
            conv.append({"role": "assistant", "content": _text(answer, loc, ak)})
        return conv
    found = sorted(x for x in obj if obj[x] is not None)
    loc.fail(f"no 'conversations', 'messages', 'prompt', 'text', 'input_ids' or 'prompt_ids' key (found {found[:8]})")


def normalize_conversation(turns: list) -> Conversation:
    """speculators' role / content normalisation (``preprocessing._normalize_conversation``),
    refusing unknown roles (see ``ROLES``)."""
    return _turns(turns, _Loc("<conversation>", 1), "turns")


# ----------------------------------------------------------------------------- readers


@dataclass
class _Part:
    """The raw records of one file (or dataset), in order."""

    path: str
    rows: list
    lines: list[int] | None = None  # JSON Lines: the line of each record


def _not_utf8(raw: bytes, e: UnicodeDecodeError) -> str:
    return f"byte 0x{raw[e.start]:02x} is not UTF-8 ({e.reason}); expected UTF-8 text"


def _read_jsonl(path: Path, raw: bytes) -> _Part:
    rows, lines = [], []
    for ln, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        at = f"record {len(rows) + 1} (line {ln})"
        try:
            rows.append(json.loads(line.decode("utf-8")))
        except UnicodeDecodeError as e:
            raise PromptFileError(f"{at}: column {e.start + 1}: {_not_utf8(line, e)}", path=str(path)) from None
        except ValueError as e:
            raise PromptFileError(f"{at}: not valid JSON ({e.msg} at column {e.colno}); expected one JSON record per "
                                  "line", path=str(path)) from None
        lines.append(ln)
    return _Part(str(path), rows, lines)


def _read_json_file(path: Path) -> _Part:
    """.jsonl: JSON Lines. .json: one JSON document (a list of records, or one record), else JSON
    Lines under a .json name."""
    raw = path.read_bytes()
    if path.suffix == ".jsonl":
        return _read_jsonl(path, raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise PromptFileError(f"line {line}, column {col}: {_not_utf8(raw, e)}", path=str(path)) from None
    try:
        doc = json.loads(text)
    except ValueError as e:
        if not text.lstrip().startswith("["):
            return _read_jsonl(path, raw)
        raise PromptFileError(f"line {e.lineno}, column {e.colno}: not valid JSON ({e.msg}); expected one JSON list "
                              "of records (or JSON Lines)", path=str(path)) from None
    return _Part(str(path), doc if isinstance(doc, list) else [doc])


def _read_file(p: Path) -> _Part:
    try:
        if p.suffix in (".json", ".jsonl"):
            return _read_json_file(p)
        if p.suffix == ".parquet":
            return _Part(str(p), read_parquet(p))
        if p.suffix == ".arrow":
            return _Part(str(p), read_arrow(p))
    except OSError as e:
        raise PromptFileError(f"cannot read ({e.strerror or e})", path=str(p)) from None
    raise PromptFileError(f"unknown prompt file type {p.suffix or '(no suffix)'!r}; expected "
                          f"{', '.join(FILE_SUFFIXES)}, a save_to_disk directory or a directory of such files",
                          path=str(p))


def _read_dir(d: Path) -> list[_Part]:
    if is_saved_dataset(d):
        return [_Part(*read_saved(d))]
    files = sorted(f for f in d.rglob("*") if f.is_file() and f.suffix in FILE_SUFFIXES
                   and not any(part.startswith(".") for part in f.relative_to(d).parts))
    if not files:
        raise PromptFileError(f"a directory with no prompt files (expected {', '.join(FILE_SUFFIXES)} files or a "
                              "save_to_disk dataset)", path=str(d))
    return [_read_file(f) for f in files]


def _read_source(spec: str, *, seed: int, hf_cache_dir: str | None) -> list[_Part]:
    if spec.startswith("builtin:"):
        parts = spec.split(":")
        try:
            n = int(parts[2]) if len(parts) > 2 and parts[2] else None
        except ValueError:
            raise PromptFileError(f"{spec!r}: expected builtin:<name>[:<n>] with an integer n", key="prompts") from None
        return [_Part(spec, builtin_prompts(parts[1] or "stdlib", n, seed=seed))]
    if spec.startswith("hf:"):
        return [_Part(*read_hf(spec, hf_cache_dir))]
    p = Path(spec)
    if p.is_dir():
        return _read_dir(p)
    if p.is_file():
        return [_read_file(p)]
    raise PromptFileError("prompt file does not exist (expected a .jsonl/.json/.parquet/.arrow file, a directory, "
                          "hf:<id>[:<config>][:<split>] or builtin:<name>[:<n>])", path=str(p))


# ----------------------------------------------------------------------------- the reader


def select(n: int, *, max_samples: int | None = None, shuffle_seed: int | None = None) -> list[int]:
    """Indices of the records used, in use order: shuffled by ``shuffle_seed`` (datasets'
    ``Dataset.shuffle`` order), then the first ``max_samples``."""
    if shuffle_seed is None:
        order = list(range(n))
    else:
        import numpy as np

        order = [int(i) for i in np.random.default_rng(shuffle_seed).permutation(n)]
    return order if max_samples is None else order[: int(max_samples)]


def read_prompts(spec: str | os.PathLike | Sequence[str | os.PathLike], *, max_samples: int | None = None,
                 shuffle_seed: int | None = None, seed: int = 0, accept: Iterable[str] = tuple(KINDS),
                 hf_cache_dir: str | None = None) -> list[Record]:
    """Read and validate a prompt input (see the module docstring) -> records in use order. A list
    of inputs is read in its order and concatenated before the selection.

    Every record of the input is parsed and checked (``accept`` names the record kinds the caller
    can use: ``conversation``, ``pretokenized``, ``prompt_ids``), then the selection applies.
    ``seed`` drives the built-in sets' own sampling; ``hf_cache_dir`` overrides the datasets cache.
    Raises :class:`PromptFileError` naming the file, the record and the key."""
    if max_samples is not None and int(max_samples) < 1:
        raise PromptFileError(f"max_samples is {max_samples}; expected a positive count (or none for all)",
                              key="max_samples")
    accept = tuple(accept)
    unknown = [a for a in accept if a not in KINDS]
    if unknown:
        raise ValueError(f"accept: unknown record kinds {unknown}; expected some of {list(KINDS)}")
    out: list[Record] = []
    sources = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not sources:
        raise PromptFileError("no prompt sources given", key="prompts")
    parts = [part for s in sources for part in _read_source(os.fspath(s), seed=seed, hf_cache_dir=hf_cache_dir)]
    for part in parts:
        if not part.rows:
            raise PromptFileError("no records (the input is empty)", path=part.path)
        for i, obj in enumerate(part.rows):
            loc = _Loc(part.path, i + 1, part.lines[i] if part.lines else None)
            rec = parse_record(obj, loc)
            kind = next(k for k, t in KINDS.items() if isinstance(rec, t))
            if kind not in accept:
                loc.fail(f"a {kind} record; this command takes {' or '.join(accept)} records")
            out.append(rec)
    return [out[i] for i in select(len(out), max_samples=max_samples, shuffle_seed=shuffle_seed)]


def resolve_prompts(spec: str | Sequence[str], *, seed: int = 0, max_samples: int | None = None,
                    shuffle_seed: int | None = None) -> list[Conversation | PretokenizedRow]:
    """Training records (conversations and pretokenized rows) of a prompt input."""
    return read_prompts(spec, seed=seed, max_samples=max_samples, shuffle_seed=shuffle_seed,
                        accept=("conversation", "pretokenized"))


def load_prompt_file(path: str | os.PathLike) -> list[Conversation | PretokenizedRow]:
    """Training records of one prompt file or directory (no built-in or hf: sets)."""
    p = os.fspath(path)
    if p.startswith(("builtin:", "hf:")):
        raise PromptFileError("expected a file or directory path", path=p)
    return resolve_prompts(p)


def write_prompt_file(path: str | os.PathLike, convs: list[Conversation]) -> Path:
    with atomic_file(path, text=True) as f:
        for c in convs:
            f.write(json.dumps({"conversations": c}, ensure_ascii=False) + "\n")
    return Path(path)

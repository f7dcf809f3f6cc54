"""The built-in offline prompt sets (``builtin:<name>[:<n>]``), parsed with ``ast`` from the
stdlib sources that ship with the interpreter (nothing is imported or downloaded). Modules are split
once by a hash of their name: ``stdlib`` (training) never uses a module the ``eval-code`` /
``eval-prose`` sets use.

* ``stdlib``: a mix (``STDLIB_MIX``) of code prompts (40 % complete a function from its
  signature and docstring, 15 % write a function from a description, 15 % explain / review /
  test / annotate code) and 30 % prose prompts (what a function or class does, explain a module,
  summarise documentation), drawn in that proportion from shuffled pools.
* ``stdlib-code``: code prompts only, from the same training modules (``STDLIB_CODE_MIX``: 80 %
  complete a function, 20 % write one from a description), for a draft meant for code (the
  main job's short recipe spends its minutes there).
* ``stdlib-source``: the code prompts of ``stdlib-code`` (80 % complete a function, 20 % write
  one from its description), each answered with the function's own source (its first
  ``SOURCE_LINES`` lines in a code block): conversations with an assistant turn, used as given
  (``data.prepare.regenerate: unanswered`` regenerates only the sets without answers). A row
  costs one forward of the target instead of a decode per token.
* ``eval-code``: function-completion prompts from the held-out modules.
* ``eval-prose``: explanation prompts from the held-out modules.
"""

from __future__ import annotations

import ast
import random
import sysconfig
import textwrap
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from specjax.train.errors import PromptFileError

Conversation = list[dict[str, Any]]

# Pure-Python stdlib modules with real docstrings; packages are walked one level down.
_MODULES = (
    "abc argparse ast base64 bisect calendar cmd code codecs collections colorsys configparser contextlib copy csv "
    "dataclasses datetime decimal difflib dis email enum filecmp fileinput fnmatch fractions ftplib functools "
    "getopt gettext glob graphlib gzip hashlib heapq hmac html http imaplib inspect ipaddress json keyword "
    "linecache locale logging lzma mailbox mimetypes netrc numbers operator optparse os pathlib pickle pickletools "
    "pkgutil platform plistlib poplib pprint profile pstats py_compile pydoc queue quopri random re reprlib "
    "sched secrets selectors shelve shlex shutil signal smtplib socket socketserver sqlite3 statistics string "
    "stringprep struct subprocess symtable sysconfig tabnanny tarfile tempfile textwrap threading timeit token "
    "tokenize tomllib trace traceback tracemalloc types typing unittest urllib uuid warnings wave weakref "
    "webbrowser xml zipapp zipfile zipimport zoneinfo asyncio concurrent importlib multiprocessing wsgiref xmlrpc "
    "encodings ctypes curses dbm json sqlite3 venv ensurepip"
).split()

SOURCE_LINES = 30  # the stdlib-source answers: a function's first lines
EVAL_BUCKET = 5  # modules with crc32(name) % EVAL_BUCKET == 0 are held out for evaluation


def is_eval_module(name: str) -> bool:
    return zlib.crc32(name.split(".")[0].encode()) % EVAL_BUCKET == 0


@dataclass
class _Item:
    module: str
    qualname: str
    kind: str  # "function" | "class" | "module"
    header: str  # "def f(a, b=1) -> int:" (dedented), or "class C(Base):"
    doc: str
    source: str
    body_lines: int


def _stdlib_files() -> Iterator[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    seen = set()
    for name in dict.fromkeys(_MODULES):
        f = root / f"{name}.py"
        pkg = root / name
        files = []
        if f.is_file():
            files.append((name, f))
        elif pkg.is_dir():
            for sub in sorted(pkg.glob("*.py")):
                if sub.name.startswith("_") and sub.name != "__init__.py":
                    continue
                mod = name if sub.name == "__init__.py" else f"{name}.{sub.stem}"
                files.append((mod, sub))
        for mod, path in files:
            if path not in seen:
                seen.add(path)
                yield mod, path


def _items_of(mod: str, path: Path) -> Iterator[_Item]:
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return
    lines = src.splitlines()
    mdoc = ast.get_docstring(tree)
    if mdoc and len(mdoc) > 80:
        yield _Item(mod, mod, "module", "", mdoc, "", 0)

    def header_of(node) -> str:
        start = node.lineno - 1
        end = node.body[0].lineno - 1 if node.body else node.lineno
        head = "\n".join(lines[start:end])
        # strip everything from the docstring start if the first body stmt is on the header line
        return textwrap.dedent(head).rstrip()

    def visit(node, prefix: str):
        for ch in getattr(node, "body", []):
            if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if ch.name.startswith("_") and ch.name != "__init__":
                    continue
                doc = ast.get_docstring(ch)
                qual = f"{prefix}{ch.name}"
                if doc and len(doc) >= 40:
                    first = min([ch.lineno] + [d.lineno for d in ch.decorator_list]) - 1
                    seg = textwrap.dedent("\n".join(lines[first: ch.end_lineno or ch.lineno]))
                    head = header_of(ch)
                    if head.endswith(":") and "\n" not in head.strip() or head.count("\n") < 6:
                        kind = "class" if isinstance(ch, ast.ClassDef) else "function"
                        yield _Item(mod, qual, kind, head, doc, seg, seg.count("\n") + 1)
                if isinstance(ch, ast.ClassDef):
                    yield from visit(ch, f"{qual}.")

    yield from visit(tree, "")


def _first_para(doc: str) -> str:
    return doc.strip().split("\n\n")[0].strip()


def _code_block(s: str) -> str:
    return f"```python\n{s.rstrip()}\n```"


def _indent_doc(doc: str, indent: str = "    ") -> str:
    body = doc.strip().replace('"""', "'''")
    return textwrap.indent(f'"""{body}\n"""', indent) if "\n" in body else f'{indent}"""{body}"""'


_CODE_TEMPLATES = (
    "Complete the following Python function:\n\n{stub}",
    "Implement this Python function so that it does what its docstring says.\n\n{stub}",
    "Write the body of this function:\n\n{stub}",
    "Finish the implementation:\n\n{stub}",
    "{stub}\n\nComplete the function above.",
)
_WRITE_TEMPLATES = (
    "Write a Python function `{name}` that does the following: {summary}",
    "In Python, write a function named `{name}`. {summary}",
    "Write Python code for `{header}` given this description: {summary}",
)
_EXPLAIN_CODE = (
    "Explain what this Python code does:\n\n{code}",
    "Walk me through the following code step by step.\n\n{code}",
    "Review this Python code and suggest improvements.\n\n{code}",
    "Add type hints and a short docstring to this function.\n\n{code}",
    "Write a unit test for this function.\n\n{code}",
)
_PROSE = (
    "What does `{full}` do in Python?",
    "Explain the purpose of `{full}` from the Python standard library, with a short example.",
    "Summarize the following documentation in plain English:\n\n{doc}",
    "When would I use `{full}`? Explain briefly.",
    "Here is the documentation of `{full}`:\n\n{doc}\n\nExplain it to a beginner.",
)
_MODULE_PROSE = (
    "Explain what the Python `{mod}` module is for.",
    "Give an overview of the `{mod}` module in Python's standard library.",
    "Summarize this module documentation:\n\n{doc}",
)


def _stub(it: _Item) -> str:
    return _code_block(f"{it.header}\n{_indent_doc(_first_para(it.doc) if len(it.doc) > 600 else it.doc)}")


def _completion(it: _Item, rng: random.Random) -> str | None:
    if it.kind == "function" and it.header.lstrip().startswith(("def ", "async def ", "@")):
        return rng.choice(_CODE_TEMPLATES).format(stub=_stub(it))
    return None


def _write(it: _Item, rng: random.Random) -> str | None:
    if it.kind == "function" and it.header.lstrip().startswith(("def ", "async def ", "@")):
        name = it.qualname.split(".")[-1]
        return rng.choice(_WRITE_TEMPLATES).format(name=name, header=it.header.strip().rstrip(":"),
                                                   summary=_first_para(it.doc))
    return None


def _explain(it: _Item, rng: random.Random) -> str | None:
    if it.source and 4 <= it.body_lines <= 40:
        return rng.choice(_EXPLAIN_CODE).format(code=_code_block(it.source))
    return None


def _prose(it: _Item, rng: random.Random) -> str | None:
    if it.kind == "module":
        return rng.choice(_MODULE_PROSE).format(mod=it.module, doc=it.doc.strip()[:1200])
    full = f"{it.module}.{it.qualname}"
    return rng.choice(_PROSE).format(full=full, doc=it.doc.strip()[:1200])


# The training mix: what users send a small chat model (function completion first, then
# explanations), in these proportions.
STDLIB_MIX = (("complete", 0.40, _completion), ("write", 0.15, _write), ("explain", 0.15, _explain),
              ("prose", 0.30, _prose))
STDLIB_CODE_MIX = (("complete", 0.80, _completion), ("write", 0.20, _write))
MIXES = {"stdlib": STDLIB_MIX, "stdlib-code": STDLIB_CODE_MIX}


def _collect(split: str) -> list[_Item]:
    items = []
    for mod, path in _stdlib_files():
        if is_eval_module(mod) == (split == "train"):
            continue
        items.extend(_items_of(mod, path))
    return items


def _train_items() -> list[_Item]:
    """The training modules' items. The same code can live in a training and a held-out module
    (pydoc's HTMLDoc.markup is copied into xmlrpc.server): such items are dropped so no evaluation
    prompt is trained on."""
    held_out = {(it.header, it.doc) for it in _collect("eval")}
    return [it for it in _collect("train") if (it.header, it.doc) not in held_out]


def _source_answer(it: _Item) -> str:
    """The function's first ``SOURCE_LINES`` lines, moved left by its first line's indent (a
    method's docstring at column 0 keeps ``textwrap.dedent`` from doing it), so the answer starts
    as the prompt's stub does."""
    lines = it.source.splitlines()[:SOURCE_LINES]
    pad = lines[0][: len(lines[0]) - len(lines[0].lstrip())] if lines else ""
    return _code_block("\n".join(l[len(pad):] if l.startswith(pad) else l for l in lines))


def _source_set(rng: random.Random) -> list[Conversation]:
    """``stdlib-source``: (code prompt, the function's own source) conversations, in item order."""
    out, seen = [], set()
    for it in _train_items():
        make = _completion if rng.random() < STDLIB_CODE_MIX[0][1] else _write
        p = make(it, rng)
        if p and it.source and p not in seen:
            seen.add(p)
            out.append([{"role": "user", "content": p}, {"role": "assistant", "content": _source_answer(it)}])
    return out


def builtin_prompts(name: str = "stdlib", n: int | None = None, *, seed: int = 0) -> list[Conversation]:
    """A built-in prompt set (see the module docstring) as conversations (one user turn; a user
    and an assistant turn for ``stdlib-source``), shuffled with ``seed`` and cut to ``n``."""
    rng = random.Random(seed)
    if name == "stdlib-source":
        convs = _source_set(rng)
        rng.shuffle(convs)
        return convs if n is None else convs[: int(n)]
    if name in MIXES:
        mix = MIXES[name]
        items = _train_items()
        pools = []
        for _, w, make in mix:
            pool = sorted({p for p in (make(it, rng) for it in items) if p})
            rng.shuffle(pool)
            pools.append(pool)
        weights = [w for _, w, _ in mix]
        prompts, seen = [], set()
        total = sum(len(p) for p in pools)
        while len(prompts) < (n if n is not None else total):
            live = [k for k, p in enumerate(pools) if p]
            if not live:
                break
            k = rng.choices(live, weights=[weights[i] for i in live])[0]
            p = pools[k].pop()
            if p not in seen:
                seen.add(p)
                prompts.append(p)
        return [[{"role": "user", "content": p}] for p in prompts]
    elif name == "eval-code":
        items = [it for it in _collect("eval") if it.kind == "function"
                 and it.header.lstrip().startswith(("def ", "async def "))]
        prompts = [_CODE_TEMPLATES[0].format(stub=_stub(it)) for it in items]
    elif name == "eval-prose":
        prompts = [_PROSE[i % 2].format(full=f"{it.module}.{it.qualname}", doc="") if it.kind != "module"
                   else _MODULE_PROSE[0].format(mod=it.module, doc="") for i, it in enumerate(_collect("eval"))]
    else:
        raise PromptFileError(f"unknown built-in prompt set {name!r}; expected one of {sorted(MIXES)}, stdlib-source, "
                              "eval-code or eval-prose",
                              key="prompts")
    prompts = sorted(set(prompts))
    rng.shuffle(prompts)
    if n is not None:
        prompts = prompts[: int(n)]
    return [[{"role": "user", "content": p}] for p in prompts]

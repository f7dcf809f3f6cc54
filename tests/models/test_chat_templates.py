"""Chat templates render as transformers (and so vLLM) renders them: the same text and token ids
as ``AutoTokenizer.from_pretrained(dir).apply_chat_template`` on the published Llama-3.1,
Llama-3.2, Qwen3 and SmolLM2 templates; ``strftime_now``; ``{% generation %}`` masks; typed errors;
and no torch import on the way."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specjax.models.errors import ChatTemplateError
from specjax.models.tokenizer import Tokenizer
from specjax.train.render import conversation_rows
from tests.models.chat_fixtures import FAMILIES, write_tokenizer_dir

REPO = Path(__file__).resolve().parents[2]

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello, how are you today?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "def add(a, b):\n    return a + b\n"}],
    [{"role": "user", "content": "  héllo wörld — naïve café  \n\n"}, {"role": "assistant", "content": "fine, 1234567890."},
     {"role": "user", "content": "and the lazy dog?"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
     {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}],
]

# family -> extra (template kwargs, conversation) cases on top of CONVERSATIONS
EXTRA = {
    "llama-3.1": [({"tools": [TOOL]}, [{"role": "user", "content": "Weather in Paris?"}]),
                  ({"date_string": "01 Jan 2025"}, CONVERSATIONS[0]),
                  ({"builtin_tools": ["brave_search"]}, CONVERSATIONS[1])],
    "llama-3.2": [({"tools": [TOOL]}, [{"role": "user", "content": "Weather in Paris?"}])],
    "qwen3": [({"enable_thinking": False}, CONVERSATIONS[0]),
              ({}, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer"}]),
              ({"tools": [TOOL]}, [{"role": "system", "content": "S"}, {"role": "user", "content": "Weather?"}])],
    "smollm2": [],
}


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-tokenizers")
    return {f: write_tokenizer_dir(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def reference():
    """transformers' AutoTokenizer per directory (the test venv has torch; specjax does not use it)."""
    from transformers import AutoTokenizer

    cache = {}

    def get(d: Path):
        if d not in cache:
            cache[d] = AutoTokenizer.from_pretrained(str(d))
        return cache[d]

    return get


def _cases(family):
    for conv in CONVERSATIONS:
        for gen in (True, False):
            yield {}, conv, gen
    for kw, conv in EXTRA[family]:
        yield kw, conv, True


@pytest.mark.parametrize("family", ["llama-3.1", "llama-3.2", "qwen3", "smollm2"])
def test_ids_and_text_identical_to_transformers(family, tok_dirs, reference):
    ours = Tokenizer.from_dir(tok_dirs[family])
    ref = reference(tok_dirs[family])
    n = 0
    for kw, conv, gen in _cases(family):
        want_text = ref.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False, **kw)
        want_ids = ref.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True, return_dict=False, **kw)
        got_text = ours.apply_chat_template(conv, add_generation_prompt=gen, **kw)
        got_ids = ours.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True, **kw)
        assert got_text == want_text, (family, kw, conv, gen)
        assert got_ids == list(want_ids), (family, kw, conv, gen)
        assert len(got_ids) > 10
        n += 1
    assert n == 2 * len(CONVERSATIONS) + len(EXTRA[family])
    if family.startswith("llama"):  # BOS from the template only, not doubled by the post-processor
        bos = ours.bos_token_id
        ids = ours.apply_chat_template(CONVERSATIONS[0], tokenize=True)
        assert ids[0] == bos and ids.count(bos) == 1


def test_strftime_now_renders_todays_date(tok_dirs, reference):
    """Llama-3.2's template asks ``strftime_now`` for the date; the old jinja environment lacked it
    and rendered the template's fallback "26 Jul 2024"."""
    ours = Tokenizer.from_dir(tok_dirs["llama-3.2"])
    before = datetime.datetime.now().strftime("%d %b %Y")
    text = ours.apply_chat_template(CONVERSATIONS[0])
    after = datetime.datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {before}\n" in text or f"Today Date: {after}\n" in text, text[:200]
    assert "26 Jul 2024" not in text
    # Llama-3.1's published template has no strftime_now: its fixed date stays, as in transformers
    assert "Today Date: 26 Jul 2024\n" in Tokenizer.from_dir(tok_dirs["llama-3.1"]).apply_chat_template(CONVERSATIONS[0])


def test_generation_mask_is_transformers_assistant_mask(tok_dirs, reference):
    ours = Tokenizer.from_dir(tok_dirs["smollm2-generation"])
    ref = reference(tok_dirs["smollm2-generation"])
    assert ours.uses_generation_mask and not Tokenizer.from_dir(tok_dirs["smollm2"]).uses_generation_mask
    conv = CONVERSATIONS[3]
    ids, mask = ours.apply_chat_template(conv, add_generation_prompt=False, tokenize=True,
                                         return_assistant_tokens_mask=True)
    want = ref.apply_chat_template(conv, add_generation_prompt=False, tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True)
    assert ids == list(want["input_ids"]) and mask == list(want["assistant_masks"])
    assert ours.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == "a1<|im_end|>a2<|im_end|>"

    # training rows: per assistant turn, the template's own mask past the prompt boundary; the
    # newline the template writes after {% endgeneration %} stays unsupervised (the boundary rule
    # alone, on the same text without generation tags, supervises it)
    rows = conversation_rows(ours, conv, max_length=512)
    plain = conversation_rows(Tokenizer.from_dir(tok_dirs["smollm2"]), conv, max_length=512)
    assert [r[0] for r in rows] == [r[0] for r in plain]  # the same token rows
    for (ids, m), (_, pm), ans in zip(rows, plain, ("a1", "a2")):
        assert ours.decode([i for i, x in zip(ids, m) if x], skip_special_tokens=False) == f"{ans}<|im_end|>"
        assert ours.decode([i for i, x in zip(ids, pm) if x], skip_special_tokens=False) == f"{ans}<|im_end|>\n"
        full_ids, full_mask = ours.apply_chat_template(conv[: conv.index({"role": "assistant", "content": ans}) + 1],
                                                       add_generation_prompt=False, tokenize=True,
                                                       return_assistant_tokens_mask=True)
        boundary = m.index(1)
        assert ids == full_ids and m[boundary:] == full_mask[boundary:] and not any(m[:boundary])


def test_template_errors_are_typed(tok_dirs):
    llama = Tokenizer.from_dir(tok_dirs["llama-3.1"])
    tool_call = {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "a", "arguments": {}}},
        {"type": "function", "function": {"name": "b", "arguments": {}}}]}
    with pytest.raises(ChatTemplateError, match=r"llama-3.1.*roles \['user', 'assistant'\].*"
                                                r"This model only supports single tool-calls at once!"):
        llama.apply_chat_template([{"role": "user", "content": "x"}, tool_call])
    with pytest.raises(ChatTemplateError, match=r"needs a chat template with \{% generation %\} blocks; the template "
                                                r"of .*llama-3.1 has none"):
        llama.apply_chat_template(CONVERSATIONS[0], tokenize=True, return_assistant_tokens_mask=True)
    broken = Tokenizer(llama.backend, chat_template="{% for m in messages %}{{ m.content }", source="broken-dir")
    with pytest.raises(ChatTemplateError, match="broken-dir.*TemplateSyntaxError"):
        broken.apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ChatTemplateError, match=r"this tokenizer \(bare\) has no chat template"):
        Tokenizer(llama.backend, source="bare").apply_chat_template(CONVERSATIONS[0])


def test_named_templates_as_transformers_picks_them(tok_dirs, reference, tmp_path):
    """[{name, template}] in tokenizer_config: 'default', or 'tool_use' when tools are passed."""
    import shutil

    d = tmp_path / "named"
    shutil.copytree(tok_dirs["smollm2"], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg["chat_template"] = [{"name": "default", "template": cfg["chat_template"]},
                            {"name": "tool_use", "template": "TOOLS {{ tools | length }} {{ messages[0].content }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    ours, ref = Tokenizer.from_dir(d), reference(d)
    for kw in ({}, {"tools": [TOOL]}):
        want = ref.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, tokenize=False, **kw)
        assert ours.apply_chat_template(CONVERSATIONS[0], **kw) == want
    assert ours.apply_chat_template(CONVERSATIONS[0], tools=[TOOL]) == "TOOLS 1 Hello, how are you today?"


def test_render_does_not_import_torch(tok_dirs):
    """specjax's tokenizer and row rendering run without torch (the runtime venv has none); here
    torch is installed, so a subprocess shows it is never imported."""
    script = f"""
import json, sys
from specjax.models.tokenizer import Tokenizer
from specjax.train.render import conversation_rows
dirs = {json.dumps({k: str(v) for k, v in tok_dirs.items()})}
conv = {json.dumps(CONVERSATIONS[3])}
out = {{"text": Tokenizer.from_dir(dirs["llama-3.2"]).apply_chat_template(conv[:2]),
        "ids": Tokenizer.from_dir(dirs["qwen3"]).apply_chat_template(conv, tokenize=True),
        "rows": conversation_rows(Tokenizer.from_dir(dirs["smollm2-generation"]), conv, max_length=512),
        "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}}
print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["transformers"] and not out["torch"]
    assert out["ids"] == Tokenizer.from_dir(tok_dirs["qwen3"]).apply_chat_template(CONVERSATIONS[3], tokenize=True)
    gen = Tokenizer.from_dir(tok_dirs["smollm2-generation"])
    assert [tuple(map(list, r)) for r in out["rows"]] == [tuple(r) for r in conversation_rows(gen, CONVERSATIONS[3],
                                                                                             max_length=512)]

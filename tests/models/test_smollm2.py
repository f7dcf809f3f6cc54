"""The embedded default, SmolLM2-135M-Instruct (GGUF Q4_1), end to end against transformers'
own GGUF loading of the same file: logits, taps, greedy continuations, tokenizer ids, chat
template, and the CLI."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.models.conftest import rel_err

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]


def test_logits_and_taps_match_transformers_gguf(smol, smol_ref):
    tok = smol.tokenizer
    ids = np.asarray([tok.encode(PROMPTS[2])])
    n = smol.config.num_hidden_layers
    seen = {}
    hook = smol_ref.model.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("pre", i[0].detach()))
    try:
        with torch.no_grad():
            ref = smol_ref(torch.tensor(ids), output_hidden_states=True)
    finally:
        hook.remove()
    out = smol.model(jnp.asarray(ids), tap_ids=(2, n // 2, n - 3, n))
    assert rel_err(out.logits, ref.logits.numpy()) <= 1e-4
    for k, got in zip((2, n // 2, n - 3), out.aux_hidden_states):
        assert rel_err(got, ref.hidden_states[k].numpy()) <= 1e-4
    assert rel_err(out.aux_hidden_states[-1], seen["pre"].numpy()) <= 1e-4


def test_greedy_continuations_identical(smol, smol_ref):
    from specjax.decode.generate import generate_ids

    tok = smol.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    res = generate_ids(smol.model, prompts, max_new_tokens=32, eos_token_ids=[])
    for p, got in zip(prompts, res.tokens):
        with torch.no_grad():
            want = smol_ref.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                     pad_token_id=2)[0, len(p):].tolist()
        assert got == want, (tok.decode(got), tok.decode(want))


def _texts(n_random: int = 240) -> list[str]:
    fixed = [
        "", " ", "  ", "\n", "\n\n\n", "\t\tindented", "trailing   ", "   leading", "a  b   c    d",
        "Hello, world!", "It's a dog's life; we're done, they'll see.", "UPPER lower MiXeD",
        "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
        "import numpy as np\nnp.zeros((3, 4), dtype=np.float32)", "SELECT * FROM t WHERE id = 42;",
        '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}', "<html><body class=\"x\">hi</body></html>",
        "3.14159265358979 1e-10 0x1F 1,000,000 12345678901234567890", "2024-01-31T12:34:56Z",
        "naïve café résumé façade", "Straße Übermaß Ökonomie", "日本語のテキストです。", "中文文本测试",
        "한국어 텍스트", "Русский текст с пунктуацией.", "العربية نص", "עברית", "हिन्दी पाठ", "ελληνικά",
        "emoji 🤖🚀👍🏽 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵", "math ∑∫∂√∞ ≤ ≥ ≠ ±", "zero\u200bwidth\u200djoiner", "tab\tsep\tvalues",
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>text<|endoftext|>",
        "<repo_name>x<file_sep>y", "no<|im_end|>space", "\r\nwindows\r\nlines", "....!!!???,,,;;;",
        "https://example.com/path?query=1&b=2#frag", "user@example.com", "C:\\Users\\name\\file.txt",
        "a" * 200, " " * 37 + "x", "\n" * 5 + "y" + "\t" * 4, "ｆｕｌｌｗｉｄｔｈ", "Ⅻ ① ㈱",
    ]
    rng = np.random.default_rng(0)
    pool = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") + list(" \n\t.,;:'\"!?()[]{}<>-_=+*/\\|@#$%^&~`") \
        + list("éüñßøåçàèìòù") + list("日本語中文한국어Русский") + ["🤖", "🚀", "👍", "∑", "√", "\u200b", "  ", "    "]
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "don't", "I'm", "return", "self", "None",
             "lambda", "print(", ")", "<|im_end|>", "<|im_start|>", "\n", "  ", "1234", "3.5"]
    out = list(fixed)
    for i in range(n_random):
        if i % 2:
            out.append("".join(rng.choice(pool) for _ in range(int(rng.integers(1, 60)))))
        else:
            out.append(" ".join(rng.choice(words) for _ in range(int(rng.integers(1, 25)))))
    return out


def test_tokenizer_ids_identical_to_transformers(smol, smol_ref_tokenizer):
    tok = smol.tokenizer
    texts = _texts()
    assert len(texts) >= 280
    mismatches = [t for t in texts if tok.encode(t) != smol_ref_tokenizer.encode(t)]
    assert not mismatches, mismatches[:5]
    for t in texts[:60]:
        ids = tok.encode(t)
        assert tok.decode(ids, skip_special_tokens=False) == smol_ref_tokenizer.decode(ids, skip_special_tokens=False)
        assert tok.decode(ids) == smol_ref_tokenizer.decode(ids, skip_special_tokens=True)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)


def test_chat_template_renders_like_transformers(smol, smol_ref_tokenizer):
    convs = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."},
         {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}],
    ]
    for msgs in convs:
        for gen_prompt in (True, False):
            want = smol_ref_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen_prompt)
            assert smol.tokenizer.apply_chat_template(msgs, add_generation_prompt=gen_prompt) == want
            want_ids = smol_ref_tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen_prompt)
            if isinstance(want_ids, dict) or hasattr(want_ids, "keys"):
                want_ids = want_ids["input_ids"]
            assert smol.tokenizer.apply_chat_template(msgs, add_generation_prompt=gen_prompt, tokenize=True) == want_ids


def test_cli_generate_json_on_default_target(smol, monkeypatch):
    from typer.testing import CliRunner

    from specjax.cli import app
    from specjax.commands import generate as cmd

    monkeypatch.setattr("specjax.models.loading.load_target", lambda *a, **k: smol)
    r = CliRunner().invoke(app, ["generate", "--prompt", "What is the capital of France?", "--chat",
                                 "--max-new-tokens", "16", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    c = doc["completions"][0]
    assert "Paris" in c["text"] and c["stop_reason"] in ("eos", "length")
    assert len(c["token_ids"]) <= 16
    from specjax import generate

    api = generate("What is the capital of France?", target=smol, chat=True, max_new_tokens=16)[0]
    assert api.token_ids == c["token_ids"]
    assert cmd is not None

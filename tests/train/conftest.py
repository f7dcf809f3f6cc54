"""Training tests: speculators-built tiny drafts (cached per build arguments), relative errors."""

from __future__ import annotations

import json

import numpy as np
import pytest


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))


@pytest.fixture(scope="session")
def spec_draft(spec_root, verifiers):
    """``spec_draft(algo, family, **build_kwargs) -> Path`` built by speculators once per arguments."""
    from tests.refs.speculators_ckpts import build

    cache = {}

    def make(algo: str, family: str = "llama", **kw):
        key = (algo, family, json.dumps(kw, sort_keys=True, default=str))
        if key not in cache:
            out = spec_root / f"train-{algo}-{family}-{len(cache)}"
            cache[key] = build(algo, out, verifiers[family], **kw)
        return cache[key]

    return make


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def write_char_tokenizer(d, vocab_size: int = 96):
    """A character-level tokenizer (tokenizer.json + tokenizer_config.json with a chat template)
    over ids [0, vocab_size): 0 <pad>, 1 <s>, 2 </s>, 3 <unk>, then printable characters."""
    import json as _json
    import string

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [c for c in string.printable if c not in "\x0b\x0c"][: vocab_size - 4]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<pad>", "<s>", "</s>", "<unk>")])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(_json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


@pytest.fixture(scope="session")
def tiny_target_dir(spec_root, verifiers):
    """The llama test verifier (6 layers, hidden 32, vocab 96) plus a char tokenizer with a chat template."""
    import shutil

    d = spec_root / "train-target-llama"
    if not d.exists():
        shutil.copytree(verifiers["llama"], d)
        write_char_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    from specjax.models.loading import load_target

    return load_target(str(tiny_target_dir), progress=False)


TINY_AUX = [1, 3, 4]


def tiny_prompts(path, n: int = 24):
    import json as _json

    lines = [_json.dumps({"prompt": f"p{i}: say {'ab' * (i % 5)} then {i * 7}"}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_spec(prompts, **kw):
    from specjax.train.pipeline import DataSpec

    base = dict(prompts=str(prompts), max_new_tokens=20, seq_length=128, aux_layer_ids=TINY_AUX, batch_size=8,
                draft_vocab_size=40, temperature=0.0)
    base.update(kw)
    return DataSpec(**base)


@pytest.fixture(scope="session")
def tiny_data(spec_root, tiny_target):
    """A regenerated (self-distilled) data directory from the tiny target."""
    from specjax.train.pipeline import prepare_data

    d = spec_root / "train-data"
    if not (d / "specjax_data.json").is_file():
        prepare_data(d, tiny_spec(tiny_prompts(spec_root / "train-prompts.jsonl")), tiny_target, progress=False)
    return d

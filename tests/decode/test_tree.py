"""Token trees: parsing and validation, the static tree's arrays by hand, dynamic (EAGLE-2)
selection, the greedy tree rule by hand and against the chain rule, and losslessness of the
sampled tree rule by chi-square on the joint of the first two emitted tokens (a depth-2 tree with
three siblings at depth 1, draft distributions unlike the target's), for i.i.d. sampled and for
point-mass (top-k) proposals. Dropping the residual update fails the same test."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.decode import tree as tree_mod
from specjax.decode.accept import accept_greedy
from specjax.decode.sampling import SamplingParams, probs
from specjax.decode.tree import (TokenTree, TreeSpecError, accept_tree, accept_tree_greedy, ancestor_mask,
                                 dynamic_tree, parse_tree)
from tests.decode.test_accept import _onehot_logits

VLLM_TREE = "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]"


# ----------------------------------------------------------------------------- static trees


def test_parse_vllm_tree_arrays():
    t = parse_tree(VLLM_TREE)
    assert t.num_nodes == 5 and t.max_depth == 3
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    np.testing.assert_array_equal(t.parent, [-1, 0, 0, 1, 1, 3])
    np.testing.assert_array_equal(t.depth, [0, 1, 1, 2, 2, 3])
    np.testing.assert_array_equal(t.rank, [0, 0, 1, 0, 1, 0])
    np.testing.assert_array_equal(t.children, [[1, 2], [3, 4], [-1, -1], [5, -1], [-1, -1], [-1, -1]])
    assert [lv.tolist() for lv in t.levels] == [[0], [1, 2], [3, 4], [5]]
    np.testing.assert_array_equal(t.path_nodes[5], [0, 1, 3, 5])
    np.testing.assert_array_equal(t.path_nodes[2], [0, 2, -1, -1])
    m = np.zeros((6, 6), bool)
    for i, anc in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 1, 3, 5]]):
        m[i, anc] = True
    np.testing.assert_array_equal(t.mask, m)
    # order of the given paths does not matter; equal trees hash equal (a static jit argument)
    t2 = parse_tree([(0, 0, 0), (0, 1), (1,), (0,), (0, 0)])
    assert t2 == t and hash(t2) == hash(t)
    np.testing.assert_array_equal(np.asarray(ancestor_mask(jnp.asarray(t.parent)[None], t.max_depth))[0], t.mask)


def test_chain_tree():
    t = TokenTree.chain(3)
    np.testing.assert_array_equal(t.parent, [-1, 0, 1, 2])
    np.testing.assert_array_equal(t.mask, np.tril(np.ones((4, 4), bool)))


@pytest.mark.parametrize("spec, msg", [
    ("[(0,), (0, 0), (1, 0)]", r"\(1, 0\): its parent \(1,\) is not in the tree"),
    ("[(0,), (2,)]", r"\(2,\): rank 2 but sibling \(1,\) is missing"),
    ("[(1,)]", r"\(1,\): rank 1 but sibling \(0,\) is missing"),
    ("[(0,), (0, 1)]", r"\(0, 1\): rank 1 but sibling \(0, 0\) is missing"),
    ("[(0,), (0,)]", r"\(0,\) appears twice"),
    ("[(0,), ()]", r"path \(\)"),
    ("[(0,), (-1,)]", r"path \(-1,\)"),
    ("[(0,), (True,)]", r"path \(True,\)"),
    ("[(0,), (0.5,)]", r"path \(0.5,\)"),
    ("[]", "non-empty list"),
    ("[(0,), (1,", "not a Python literal"),
    ("__import__('os').system('true')", "not a Python literal"),
    ("(0, 1)", r"path 0"),
])
def test_bad_trees_are_refused(spec, msg):
    with pytest.raises(TreeSpecError, match=msg):
        parse_tree(spec)


# ----------------------------------------------------------------------------- dynamic trees


def _markov_draft(V, seed, scale=2.0):
    rng = np.random.default_rng(seed)
    table = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(V, V)) * scale, jnp.float32), -1)
    root = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(3, V)) * scale, jnp.float32), -1)
    return root, table


def _check_tree(tr, root, logp, b):
    """``logp(path tokens) -> [V]``: the draft's log-probs after a path."""
    par, dep, tok = (np.asarray(a)[b] for a in (tr.parent, tr.depth, tr.tokens))
    n1 = len(par)
    assert par[0] == -1 and (par[1:] >= 0).all() and (par[1:] < np.arange(1, n1)).all()  # ancestor-closed, ordered
    mask = np.asarray(tr.mask)[b]
    for i in range(1, n1):
        assert dep[i] == dep[par[i]] + 1
        anc, j = {i}, i
        while par[j] >= 0:
            j = par[j]
            anc.add(j)
        assert set(np.nonzero(mask[i])[0]) == anc
        # score = cumulative draft log-prob along the path, recomputed from the tokens
        s, j, toks = 0.0, i, []
        while j > 0:
            toks.append(tok[j - 1])
            j = par[j]
        toks = toks[::-1]
        s = float(root[b, toks[0]]) + sum(float(logp(toks[: j + 1])[toks[j + 1]]) for j in range(len(toks) - 1))
        assert abs(s - float(tr.score[b, i - 1])) < 1e-4
    kids = np.asarray(tr.children)[b]
    for i in range(n1):
        assert sorted(k for k in kids[i] if k >= 0) == [j for j in range(n1) if par[j] == i]


def test_dynamic_tree_is_a_valid_best_first_tree():
    V, topk, depth, n = 10, 3, 3, 8
    root, table = _markov_draft(V, 0)
    calls = []

    second = jax.nn.log_softmax(jnp.asarray(np.random.default_rng(9).normal(size=(V, V)), jnp.float32), -1)

    def expand(level, paths, frontier):  # noqa: ARG001  a draft that depends on the first and the last token
        calls.append((level, paths.shape))
        return jax.nn.log_softmax(table[paths[..., -1]] + second[paths[..., 0]], -1)

    tr = jax.jit(lambda r: dynamic_tree(r, expand, topk=topk, depth=depth, num_nodes=n))(root)
    assert calls == [(1, (3, topk, 1)), (2, (3, topk, 2))]
    assert tr.tokens.shape == (3, n) and tr.mask.shape == (3, n + 1, n + 1) and tr.children.shape == (3, n + 1, topk)
    for b in range(3):
        _check_tree(tr, root, lambda p: np.asarray(jax.nn.log_softmax(table[p[-1]] + second[p[0]])), b)
        # best first: the depth-1 nodes are the root's best children in order of probability
        d1 = np.asarray(tr.tokens)[b][np.asarray(tr.depth)[b, 1:] == 1]
        best = np.argsort(-np.asarray(root[b]), kind="stable")[: len(d1)]
        assert sorted(d1.tolist()) == sorted(best.tolist())
    assert (np.asarray(tr.depth).max(1) >= 2).any()


def test_dynamic_tree_ties_stay_ancestor_closed():
    """Deterministic draft transitions (log-prob 0): children score exactly as their parent, so
    only the index tie-break keeps the selection closed under ancestors."""
    V, topk, depth = 6, 2, 3
    table = jnp.where(jnp.eye(V, dtype=bool)[jnp.roll(jnp.arange(V), 1)], 0.0, -1e9).astype(jnp.float32)
    root = jnp.log(jnp.asarray([[0.5, 0.5, 0, 0, 0, 0]] * 3, jnp.float32) + 1e-30)
    M = topk + (depth - 1) * topk * topk
    for n in range(1, M + 1):
        tr = dynamic_tree(root, lambda lvl, paths, frontier: table[paths[..., -1]], topk=topk, depth=depth, num_nodes=n)
        par = np.asarray(tr.parent)
        assert (par[:, 1:] >= 0).all() and (par[:, 1:] < np.arange(1, n + 1)).all(), n


# ----------------------------------------------------------------------------- greedy accept


def test_greedy_tree_by_hand():
    t = parse_tree(VLLM_TREE)  # nodes: 1=(0,) 2=(1,) 3=(0,0) 4=(0,1) 5=(0,0,0)
    tokens = jnp.asarray([[7, 2, 3, 4, 5, 6]])  # root token 7
    # target argmax after each node: root->3 (matches node 2), node 2 -> 1 (node 2 has no children)
    r = accept_tree_greedy(_onehot_logits([3, 0, 1, 0, 0, 0]), tokens, t.children, t.max_depth)
    assert int(r.num_accepted[0]) == 1 and np.asarray(r.path)[0].tolist() == [0, 2, -1, -1]
    assert np.asarray(r.tokens)[0].tolist() == [3, 1, 1, 1]
    # root->2 (node 1), node 1->5 (its second child, node 4), node 4 -> bonus 0
    r = accept_tree_greedy(_onehot_logits([2, 5, 0, 0, 0, 0]), tokens, t.children, t.max_depth)
    assert np.asarray(r.path)[0].tolist() == [0, 1, 4, -1] and np.asarray(r.tokens)[0].tolist() == [2, 5, 0, 0]
    # the full depth-3 path, then the bonus from the leaf
    r = accept_tree_greedy(_onehot_logits([2, 4, 0, 6, 0, 1]), tokens, t.children, t.max_depth)
    assert int(r.num_accepted[0]) == 3 and np.asarray(r.tokens)[0].tolist() == [2, 4, 6, 1]
    # nothing matches: the root's argmax
    r = accept_tree(jax.random.key(0), _onehot_logits([0, 4, 0, 6, 0, 1]), tokens, t.children, t.max_depth, None,
                    SamplingParams())
    assert int(r.num_accepted[0]) == 0 and np.asarray(r.path)[0].tolist() == [0, -1, -1, -1]
    assert int(r.tokens[0, 0]) == 0


def test_greedy_chain_tree_equals_chain_rule():
    rng = np.random.default_rng(0)
    B, k, V = 64, 3, 5
    logits = jnp.asarray(rng.normal(size=(B, k + 1, V)).astype(np.float32))
    best = np.asarray(jnp.argmax(logits, -1))
    draft = np.where(rng.random((B, k)) < 0.7, best[:, :k], rng.integers(0, V, (B, k))).astype(np.int32)
    chain = accept_greedy(logits, jnp.asarray(draft))
    t = TokenTree.chain(k)
    node_tokens = jnp.asarray(np.concatenate([np.zeros((B, 1), np.int32), draft], 1))
    tr = accept_tree_greedy(logits, node_tokens, t.children, k)
    np.testing.assert_array_equal(np.asarray(tr.num_accepted), np.asarray(chain.num_accepted))
    np.testing.assert_array_equal(np.asarray(tr.tokens), np.asarray(chain.tokens))
    assert len(set(np.asarray(chain.num_accepted).tolist())) >= 3


# ----------------------------------------------------------------------------- losslessness

V, N_DRAWS = 8, 40_000
TREE = parse_tree("[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]")  # three siblings at depth 1


def _tables(seed):
    rng = np.random.default_rng(seed)
    t = [rng.normal(size=s).astype(np.float32) * 0.8 for s in ((V,), (V, V), (V, V, V))]  # target logits by path
    d = [rng.normal(size=s).astype(np.float32) * 0.8 for s in ((V,), (V, V))]  # draft logits by path
    return t, d


def _round(key, t, d, sampling: SamplingParams, sampled: bool):
    """One tree round for N_DRAWS sequences -> (t1, t2) int32 [N_DRAWS] each; t2 is the round's
    second token, or (when only one token was emitted) a draw from the target after t1 -- what
    the next round emits, by induction."""
    kd1, kd2, ka, kn = jax.random.split(key, 4)
    q1 = probs(d[0], sampling)  # [V] draft after the root
    q2 = probs(d[1], sampling)  # [V, V] draft after a depth-1 token
    n1 = len(TREE.levels[1])
    if sampled:  # i.i.d. children from the parent's q
        x1 = jax.random.categorical(kd1, jnp.log(q1), shape=(N_DRAWS, n1))
    else:  # point masses: the top-n1 draft tokens, distinct
        x1 = jnp.broadcast_to(jax.lax.top_k(q1, n1)[1], (N_DRAWS, n1))
    toks = [jnp.zeros((N_DRAWS,), jnp.int32)] + [x1[:, j] for j in range(n1)]
    for node in TREE.levels[2]:  # children of depth-1 node parent[node], rank r
        par = toks[TREE.parent[node]]
        if sampled:
            toks.append(jax.random.categorical(jax.random.fold_in(kd2, int(node)), jnp.log(q2[par])))
        else:
            toks.append(jax.lax.top_k(q2[par], 2)[1][:, TREE.rank[node]])
    node_tokens = jnp.stack(toks, 1).astype(jnp.int32)  # [N, 7]
    rows, qrows = [jnp.broadcast_to(t[0], (N_DRAWS, V))], [jnp.zeros((N_DRAWS, V))]
    for i in range(1, TREE.num_nodes + 1):
        p = TREE.path_nodes[i][1:][TREE.path_nodes[i][1:] > 0]
        tok = [node_tokens[:, j] for j in p]
        rows.append(t[1][tok[0]] if len(tok) == 1 else t[2][tok[0], tok[1]])
        qrows.append(jnp.broadcast_to(q1, (N_DRAWS, V)) if len(tok) == 1 else q2[tok[0]])
    logits = jnp.stack(rows, 1)
    node_q = jnp.stack(qrows, 1) if sampled else None
    r = accept_tree(ka, logits, node_tokens, TREE.children, TREE.max_depth, node_q, sampling)
    t1 = r.tokens[:, 0]
    nxt = jax.random.categorical(kn, jnp.log(probs(t[1][t1], sampling)), axis=-1)
    return t1, jnp.where(r.num_accepted >= 1, r.tokens[:, 1], nxt), r.num_accepted


def _joint_p(sampling, sampled, seed=3, key=11):
    t, d = _tables(seed)
    run = jax.jit(lambda k, t, d: _round(k, t, d, sampling, sampled))  # tables as arguments (no folding)
    t1, t2, n = map(np.asarray, run(jax.random.key(key), [jnp.asarray(a) for a in t], [jnp.asarray(a) for a in d]))
    p1 = np.asarray(probs(jnp.asarray(t[0]), sampling), np.float64)
    p2 = np.asarray(probs(jnp.asarray(t[1]), sampling), np.float64)
    joint = p1[:, None] * p2  # [V, V]
    joint /= joint.sum()
    obs = np.bincount(t1 * V + t2, minlength=V * V).astype(np.float64)
    exp = joint.reshape(-1) * len(t1)
    assert obs[exp == 0].sum() == 0, "tokens outside top-p were emitted"
    big = exp >= 5
    assert big.sum() >= 12
    o, e = np.append(obs[big], obs[~big].sum()), np.append(exp[big], exp[~big].sum())
    keep = e > 0
    return float(stats.chisquare(o[keep], e[keep] * o[keep].sum() / e[keep].sum()).pvalue), n


SAMPLINGS = [SamplingParams(temperature=0.6, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.9),
             SamplingParams(temperature=1.0)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t0.6_p0.9", "t1_p0.9", "t1"])
@pytest.mark.parametrize("sampled", [True, False], ids=["iid_q", "point_mass"])
def test_tree_rule_is_lossless_chi_square(sampling, sampled):
    pval, n = _joint_p(sampling, sampled)
    counts = np.bincount(n, minlength=3)
    assert (counts > 200).all(), counts  # every path length is exercised
    print(f"chi-square {sampling} {'iid' if sampled else 'point-mass'}: p = {pval:.4f}, accept counts {counts}")
    assert pval > 0.01, pval


@pytest.mark.parametrize("sampled", [True, False], ids=["iid_q", "point_mass"])
def test_tree_chi_square_catches_a_missing_residual(sampled, monkeypatch):
    """Trying the next sibling against the unchanged p (and drawing the correction from p) is
    not lossless; the same chi-square test rejects it."""
    monkeypatch.setattr(tree_mod, "residual", lambda p, q: p)
    pval, _ = _joint_p(SamplingParams(temperature=1.0, top_p=0.9), sampled)
    print(f"chi-square without the residual update ({'iid' if sampled else 'point-mass'}): p = {pval:.3g}")
    assert pval < 1e-6, pval

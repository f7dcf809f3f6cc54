"""The offline acceptance walk equals real greedy drafting: at every verify point the draft's own
cached chain proposal (``Eagle3Draft.propose``, feeding its own tokens) has the accepted length
the teacher-forced TTT forward gives."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.drafts.common import d2t_of
from specjax.train.config import load_recipe
from specjax.train.evaluate import _accept_lengths, evaluate_acceptance
from specjax.train.pipeline import load_data_dir
from specjax.train.trainer import Run
from tests.train.conftest import TINY_AUX


@nnx.jit(static_argnames=("k",))
def _propose(draft, cache, aux, ids, pos, n_valid, k):
    return draft.propose(cache, aux, ids, pos, k=k, n_valid=n_valid)


def test_walk_matches_propose(tmp_path, tiny_data, tiny_target):
    cfg = load_recipe(None, [f"data.path={tiny_data}", "data.total_seq_len=128", f"draft.target_layer_ids={TINY_AUX}",
                             "draft.draft_vocab_size=40", f"trainer.output_dir={tmp_path / 'r'}",
                             "trainer.compute_dtype=float32", "optimizer.lr=3e-3", "trainer.epochs=8"])
    run = Run(cfg, target=tiny_target, progress=False)
    run.train()
    draft = run.model_of(run.params)
    rows, _ = load_data_dir(tiny_data)
    prompts = [rows.input_ids[i][rows.loss_mask[i] == 0].tolist() for i in range(6)]
    rep = evaluate_acceptance(draft, tiny_target, prompts, aux_layer_ids=TINY_AUX, k=3, max_new_tokens=20)
    assert 1.0 <= rep.tau <= 4.0 and rep.steps > 0
    assert rep.tau > 1.2  # trained on these very continuations
    from specjax.train.selfdistill import generate_with_hidden_states

    g = generate_with_hidden_states(tiny_target.model, prompts[:3], max_new_tokens=20, taps=TINY_AUX + [6],
                                    eos_token_ids=tiny_target.eos_token_ids, batch_size=4, out_dtype=jnp.float32,
                                    progress=False)
    d2t = d2t_of(draft)
    checked = 0
    for r in g:
        ids = np.asarray(r.prompt_ids + r.token_ids)
        hs = r.hidden_states
        A = _accept_lengths(draft, hs, ids, 3, d2t)
        T = len(ids)
        W = 64
        aux = np.zeros((1, W, hs.shape[1] - 1, hs.shape[2]), np.float32)
        aux[0, :T] = hs[:, :-1]
        aux = jnp.asarray(aux.reshape(1, W, -1))
        nxt = np.zeros((1, W), np.int32)
        nxt[0, : T - 1] = ids[1:]
        nxt, pos = jnp.asarray(nxt), jnp.arange(1, W + 1)[None]
        for j in range(len(r.prompt_ids) - 1, T - 5):
            prop = _propose(draft, draft.init_cache(1, 80), aux, nxt, pos, jnp.asarray([j + 1]), 3)
            toks = np.asarray(prop.tokens[0])
            a = 0
            while a < 3 and toks[a] == ids[j + 2 + a]:
                a += 1
            assert a == A[j], (j, a, A[j])
            checked += 1
    assert checked > 20

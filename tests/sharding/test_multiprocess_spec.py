"""Two processes on 127.0.0.1 (gloo, 2 CPU devices each): the GGUF -> HF cache export is written
by process 0 alone (the other waits at a barrier, then reads the same directory), and the
speculative loop over a mesh spanning both processes gives the single-process tokens and
acceptance histogram. The test starts and stops the processes itself, with a timeout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.sharding import tiny
from tests.sharding.test_multiprocess import run_workers

WORKER = Path(__file__).with_name("mp_spec_worker.py")
TIMEOUT_S = 240
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21]]


def test_two_processes_share_one_gguf_cache_and_match_one_process(tmp_path):
    from tests.models.conftest import write_tiny_gguf

    gguf = write_tiny_gguf(tiny.write_target(tmp_path / "target"), tmp_path / "tiny.gguf")
    draft = tiny.write_eagle3(tmp_path / "eagle3")
    cache, out = tmp_path / "cache", tmp_path / "out"
    out.mkdir()
    (out / "prompts.json").write_text(json.dumps(PROMPTS))
    run_workers(WORKER, lambda i, port: [i, 2, port, gguf, draft, cache, out], TIMEOUT_S)

    seen = [json.loads((out / f"proc{i}.json").read_text()) for i in range(2)]
    (cdir,) = cache.iterdir()
    assert seen[0]["exports"] == [str(cdir)] and seen[1]["exports"] == []  # process 0 alone wrote it, once
    for s in seen:
        assert s["kind"] == s["again"] == "gguf_cache" and s["source"] == str(cdir)
        assert s["q_local_shards"] == 2 and s["fc_spec"] == ["fsdp", None]
    assert [s["main"] for s in seen] == [True, False]
    assert not [p for p in cache.iterdir() if p != cdir]  # no temporary directory left behind

    # one process, one device, the same files
    from specjax.decode import speculative as spec
    from specjax.models.loading import load_target

    lt = load_target(gguf, progress=False)
    want = spec.speculative_generate_ids(lt.model, spec.load_spec_draft(str(draft), lt), PROMPTS, k=3,
                                         max_new_tokens=6, eos_token_ids=[], prompt_bucket=16, verifier_accept_k=40,
                                         accept_tolerance=1.0)
    for s in seen:
        assert s["tokens"] == want.tokens and s["rounds"] == want.rounds
        np.testing.assert_array_equal(np.asarray(s["hist"]), want.stats.hist)

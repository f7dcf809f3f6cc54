"""The training loop's background row builder (specjax.train.feed.Prefetch): items in order,
errors surfaced, and a consumer that stops early stops the thread (no builder left waiting forever
with rows in hand: online, it would keep running the target)."""

from __future__ import annotations

import threading
import time

import pytest

from specjax.train.feed import Prefetch


def test_items_in_order_and_the_thread_ends():
    built = []
    with Prefetch(lambda i: built.append(i) or i * 10, [(k, k) for k in range(7)]) as feed:
        got = list(feed)
    assert got == [(k, k * 10) for k in range(7)] and built == list(range(7))
    assert not feed.t.is_alive()


def test_a_build_error_reaches_the_consumer():
    def build(i):
        if i == 2:
            raise ValueError("row 2 is bad")
        return i

    with pytest.raises(ValueError, match="row 2 is bad"):
        with Prefetch(build, [(k, k) for k in range(5)]) as feed:
            list(feed)
    assert not feed.t.is_alive()


def test_an_early_stop_closes_the_builder():
    """The consumer takes two of 100 items and leaves the block: the thread exits promptly and
    builds at most the queue's depth beyond what was taken (plus the one in hand)."""
    built = []
    lock = threading.Lock()

    def build(i):
        with lock:
            built.append(i)
        return i

    with Prefetch(build, [(k, k) for k in range(100)], depth=2) as feed:
        for n, _ in enumerate(feed):
            if n == 1:
                break
        time.sleep(0.3)  # the builder fills the queue and waits to hand over the next rows
    t0 = time.perf_counter()
    feed.t.join(5)
    assert not feed.t.is_alive(), "the builder still runs after close()"
    assert time.perf_counter() - t0 < 1.0
    assert len(built) <= 2 + 2 + 1, built


def test_online_target_rows_take_a_handful_of_lengths():
    """data.online's target row: the draft row's length T when the samples fit, else T plus steps
    of max(64, T / 8) tokens, so an 8192-token recipe with trimmed prompts compiles a few step
    shapes, not one per 64 tokens."""
    from specjax.train.online import target_length

    assert target_length(320, 1) == target_length(320, 320) == 320
    assert [target_length(320, n) for n in (321, 384, 385, 576)] == [384, 384, 448, 576]
    assert [target_length(8192, n) for n in (8193, 9216, 9217, 20000)] == [9216, 9216, 10240, 20480]
    assert len({target_length(8192, n) for n in range(1, 8192 * 2)}) == 9

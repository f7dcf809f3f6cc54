"""Orbax I/O details the round-trip tests do not reach: the filter that keeps a failed Orbax
restore from printing asyncio tracebacks, and error messages without tensorstore's spec JSON."""

import asyncio
import sys
from types import SimpleNamespace

from bridge import orbax_io


def _unraisable(e: BaseException, obj=None):
    return SimpleNamespace(exc_type=type(e), exc_value=e, exc_traceback=e.__traceback__, err_msg=None, object=obj)


def _closed_loop_error() -> RuntimeError:
    """What a tensorstore thread gets posting a read's result to the loop Orbax already closed."""
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as e:
        return e
    raise AssertionError("call_soon_threadsafe on a closed loop did not raise")


def test_closed_loop_callbacks_are_dropped_and_other_unraisables_kept(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    orbax_io._drop_closed_loop_callbacks()
    orbax_io._drop_closed_loop_callbacks()  # installed once: no second wrapper
    assert sys.unraisablehook is not seen.append
    other_runtime = RuntimeError("Event loop is closed")  # same text, not from asyncio's call_soon_threadsafe
    kept = [_unraisable(ValueError("x")), _unraisable(other_runtime)]
    sys.unraisablehook(_unraisable(_closed_loop_error()))
    for u in kept:
        sys.unraisablehook(u)
    assert seen == kept


def test_reason_drops_the_tensorstore_spec():
    e = ValueError('OUT_OF_RANGE: Error reading "x/.zarray" [tensorstore_spec=\'{"driver":"zarr"}\']')
    assert orbax_io._reason(e) == 'ValueError: OUT_OF_RANGE: Error reading "x/.zarray"'

"""Atomic writers: what lands in place has the umask's ordinary modes (tempfile's 0600 / 0700
would keep another user or a vLLM container from reading an exported checkpoint), and a staged
directory leaves nothing behind when its body fails."""

import os
import stat

import pytest

from bridge.atomic import atomic_dir, atomic_file, staged_dir
from bridge.errors import WriteError
from tests.conftest import unreadable_modes


def _write_tree(d):
    (d / "sub").mkdir()
    with atomic_file(d / "a.json", text=True) as f:
        f.write("{}")
    with atomic_file(d / "sub" / "b.bin") as f:
        f.write(b"\0")


def test_atomic_file_and_dir_get_ordinary_modes(tmp_path, umask022):
    with atomic_dir(tmp_path / "out") as d:
        _write_tree(d)
    assert unreadable_modes(tmp_path / "out") == []


def test_staged_dir_gets_ordinary_modes(tmp_path, umask022):
    with staged_dir(tmp_path / "out") as d:
        d.mkdir()
        _write_tree(d)
    assert unreadable_modes(tmp_path / "out") == []
    assert os.listdir(tmp_path) == ["out"]


def test_modes_follow_a_stricter_umask(tmp_path):
    old = os.umask(0o077)
    try:
        with atomic_dir(tmp_path / "out") as d:
            _write_tree(d)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "out" / "a.json").stat().st_mode) == 0o600


def test_staged_dir_failure_leaves_nothing_and_keeps_the_old_dest(tmp_path):
    old = tmp_path / "out"
    old.mkdir()
    (old / "keep").write_text("old")
    with pytest.raises(RuntimeError, match="check failed"):
        with staged_dir(old, overwrite=True) as d:
            d.mkdir()
            (d / "new").write_text("new")
            raise RuntimeError("check failed")
    assert os.listdir(tmp_path) == ["out"] and os.listdir(old) == ["keep"]
    with pytest.raises(WriteError, match="destination exists"):
        with staged_dir(old):
            pass

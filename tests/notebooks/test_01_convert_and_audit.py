"""Notebook 01 executed top to bottom in the SMALL setting; checks read its RESULT lines."""

from __future__ import annotations

import pytest

from tests.notebooks.runner import report, run_notebook

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nb01(tmp_path_factory):
    ex = run_notebook("01_convert_and_audit.ipynb", tmp_path_factory.mktemp("nb01"))
    report(ex)
    return ex


def test_01_runs_on_cpu_in_small_mode(nb01):
    assert nb01.results["backend"] == "cpu"
    assert nb01.seconds < 300, f"01 took {nb01.seconds:.0f}s in SMALL mode"


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

"""Notebook 03 executed top to bottom in the SMALL setting; checks read its RESULT lines."""

from __future__ import annotations

import pytest

from tests.notebooks.runner import report, run_notebook

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nb03(tmp_path_factory):
    ex = run_notebook("03_train_eagle3_draft.ipynb", tmp_path_factory.mktemp("nb03"))
    report(ex)
    return ex


def test_03_mesh_uses_every_device(nb03):
    assert nb03.num("mesh_devices") == nb03.num("devices") >= 1


def test_03_data_prepared(nb03):
    assert nb03.num("data_rows") >= 2
    assert nb03.num("supervised_tokens") > 0


def test_03_trains_on_the_mesh(nb03):
    """The trainer ran on the notebook's mesh: its params live on every mesh device, each step took
    data x fsdp packed rows, and the step compiled once."""
    assert nb03.num("train_mesh_devices") == nb03.num("mesh_devices")
    assert nb03.num("train_rows_per_step") == nb03.num("mesh_batch_split") >= 1
    assert nb03.num("train_compiles") == 1


def test_03_loss_decreases(nb03):
    assert nb03.num("train_steps") >= 10
    assert nb03.num("loss_last") < nb03.num("loss_first")


def test_03_export_passes_the_audit(nb03):
    assert nb03.num("export_audit_errors") == 0


def test_03_acceptance_length_at_least_one(nb03):
    assert nb03.num("accept_length") >= 1.0


def test_03_bench_ran(nb03):
    assert nb03.num("bench_speedup") > 0
    assert len(nb03.images()) >= 2  # the live training plot and the bench plot

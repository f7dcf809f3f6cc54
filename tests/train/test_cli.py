"""`specjax train` on the command line: its help names every algorithm a recipe can train."""

from typing import get_args

from typer.testing import CliRunner

from specjax.cli import app
from specjax.train.config import TrainConfig

runner = CliRunner()


def test_train_help_names_every_algorithm():
    r = runner.invoke(app, ["train", "--help"])
    assert r.exit_code == 0, r.output
    algos = get_args(TrainConfig.model_fields["speculator_type"].annotation)
    assert set(algos) == {"eagle3", "peagle", "dflash", "dspark", "mtp"}
    for a in algos:
        assert a in r.output, a

"""The `specjax` console script's own options (the subcommands are tested with their packages:
tests/bridge/test_cli.py, tests/train/test_cli.py, ...)."""

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from typer.testing import CliRunner

import specjax
from specjax.cli import app

runner = CliRunner()


def test_version_prints_name_and_version_and_exits_0():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0, r.output
    assert r.output == f"specjax {version('specjax')}\n"


def test_version_falls_back_to_the_package_attribute(monkeypatch):
    import importlib.metadata as md

    def not_installed(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "version", not_installed)
    monkeypatch.setattr(specjax, "__version__", "9.9.9+checkout")
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output == "specjax 9.9.9+checkout\n"


def test_version_of_the_installed_console_script():
    # eager: the default-model run of a bare `specjax` never starts
    exe = Path(sys.executable).with_name("specjax")
    r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"specjax {version('specjax')}\n"

"""The `specjax` console script's own options (the subcommands are tested with their packages:
tests/bridge/test_cli.py, tests/train/test_cli.py, ...)."""

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
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


def test_compilation_cache_defaults_under_the_specjax_cache(monkeypatch, tmp_path):
    """Every CLI run keeps JAX's persistent compilation cache in $SPECJAX_CACHE/jax unless the user
    chose a directory or turned it off."""
    from specjax.paths import use_compilation_cache

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("SPECJAX_COMPILATION_CACHE", raising=False)
    assert use_compilation_cache() == str(tmp_path / "jax")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere/else")
    assert use_compilation_cache() == "/somewhere/else"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("SPECJAX_COMPILATION_CACHE", "0")
    assert use_compilation_cache() is None and "JAX_COMPILATION_CACHE_DIR" not in __import__("os").environ


def test_a_missing_dependency_is_a_message_not_a_traceback(monkeypatch, capsys):
    """A package gone from the environment (here gguf, which reads the embedded model) stops a
    command with a message naming it and the environment, exit 1."""
    import sys

    from specjax import cli

    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ModuleNotFoundError
    monkeypatch.setattr(sys, "argv", ["specjax", "generate", "--prompt", "hi", "--max-new-tokens", "1"])
    with pytest.raises(SystemExit) as ex:
        cli.main()
    assert ex.value.code == 1
    err = capsys.readouterr().err
    assert "'gguf' is missing from this environment" in err and sys.prefix in err and "Traceback" not in err


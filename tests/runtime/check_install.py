"""The user's install, checked from inside it: run with a runtime-only venv's python (what
``scripts/setup.sh run`` / ``scripts/main.sh`` make: no torch, no test extras)::

    .venv-run/bin/python tests/runtime/check_install.py

Imports every module of ``specjax`` and ``bridge`` (a module that imports an undeclared
dependency fails here, as it would for a user), then runs ``--help`` of every CLI command and
subcommand and ``specjax --version``. Needs nothing but the runtime dependencies. Prints one line
per failure and a closing ``N passed, M failed`` line; exits 1 on any failure.
``tests/runtime/test_install.py`` runs the same checks in the test venv."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import traceback
from pathlib import Path

PACKAGES = ("bridge", "specjax")


def module_names() -> list[str]:
    names = []
    for pkg in PACKAGES:
        names.append(pkg)
        mod = importlib.import_module(pkg)
        for info in pkgutil.walk_packages(mod.__path__, prefix=pkg + "."):
            names.append(info.name)
    return sorted(set(names))


def check_imports() -> list[str]:
    failed = []
    for name in module_names():
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - every failure is reported, whatever its kind
            failed.append(f"import {name}: {type(e).__name__}: {e}")
    return failed


def command_paths() -> list[list[str]]:
    """Every command of the CLI as its argv prefix (``[]`` is the top level)."""
    import typer

    from specjax.cli import app

    out: list[list[str]] = []

    def walk(cmd, prefix):
        out.append(prefix)
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):  # a group (typer may vendor its click)
            walk(sub, prefix + [name])

    walk(typer.main.get_command(app), [])
    return out


def check_cli() -> tuple[int, list[str]]:
    from typer.testing import CliRunner

    from specjax.cli import app

    runner = CliRunner()
    failed, n = [], 0
    for path in command_paths():
        n += 1
        res = runner.invoke(app, path + ["--help"])
        if res.exit_code != 0 or "Usage" not in res.output:
            err = "".join(traceback.format_exception(*res.exc_info)) if res.exc_info else res.output
            failed.append(f"specjax {' '.join(path + ['--help'])}: exit {res.exit_code}\n{err[-2000:]}")
    # the installed console script itself, as a user runs it
    exe = Path(sys.executable).with_name("specjax")
    for argv in (["--version"], ["--help"]):
        n += 1
        r = subprocess.run([str(exe), *argv], capture_output=True, text=True, timeout=300)
        if r.returncode != 0 or not r.stdout.strip():
            failed.append(f"{exe} {' '.join(argv)}: exit {r.returncode}\n{r.stderr[-2000:]}")
    return n, failed


def main() -> int:
    names = module_names()
    failed = check_imports()
    n_cli, cli_failed = check_cli()
    failed += cli_failed
    for f in failed:
        print("FAILED", f)
    total = len(names) + n_cli
    print(f"{total - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

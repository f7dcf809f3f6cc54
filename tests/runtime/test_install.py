"""The runtime install's contract, checked in the test venv: pyproject.toml declares exactly
what the package imports, the accelerator extras pin the same jax as the base install, and every
module imports and every command's ``--help`` runs (the same checks CI runs in a runtime-only
venv with ``tests/runtime/check_install.py``)."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.runtime import check_install

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_modules() -> dict[str, str]:
    """Third-party top-level modules imported anywhere in bridge/ and specjax/ -> one file."""
    out: dict[str, str] = {}
    for pkg in check_install.PACKAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            for n in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
                if isinstance(n, ast.Import):
                    names = [a.name for a in n.names]
                elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                    names = [n.module]
                else:
                    continue
                for m in names:
                    top = m.split(".")[0]
                    if top not in check_install.PACKAGES and top not in sys.stdlib_module_names:
                        out.setdefault(top, str(f.relative_to(REPO)))
    return out


def declared() -> dict[str, Requirement]:
    return {_norm(r.name): r for r in map(Requirement, PYPROJECT["dependencies"])}


def test_every_imported_module_is_declared_and_every_declared_dependency_imported():
    deps = declared()
    dist_of = md.packages_distributions()
    used = set()
    missing = []
    for mod, where in imported_modules().items():
        dists = {_norm(d) for d in dist_of.get(mod, [mod])}
        hit = dists & set(deps)
        if not hit:
            missing.append(f"{mod} (imported in {where}; distributions {sorted(dists)})")
        used |= hit
    assert not missing, f"imported at run time but not declared in pyproject.toml: {missing}"
    unused = sorted(set(deps) - used)
    assert not unused, f"declared in pyproject.toml but never imported by bridge/ or specjax/: {unused}"


def test_accelerator_extras_pin_the_base_jax_and_flax_accepts_it():
    deps = declared()
    pin = deps["jax"].specifier
    (exact,) = [s.version for s in pin if s.operator == "=="]
    assert str(deps["jaxlib"].specifier) == f"=={exact}"
    extras = PYPROJECT["optional-dependencies"]
    for name in ("tpu", "cuda", "cuda13"):
        (req,) = map(Requirement, extras[name])
        assert _norm(req.name) == "jax" and str(req.specifier) == f"=={exact}", (name, str(req))
    flax_jax = [Requirement(r) for r in md.requires("flax") or [] if r.startswith("jax") and "extra" not in r]
    assert flax_jax, "flax declares no jax requirement?"
    for r in flax_jax:
        assert r.specifier.contains(Version(exact)), f"flax requires {r}, the pin is jax=={exact}"


def test_every_module_imports():
    assert check_install.check_imports() == []


def test_every_command_help_and_version_run():
    n, failed = check_install.check_cli()
    assert n >= 16 and failed == [], failed  # 13 commands and groups + the top level + two console-script runs

"""Mesh presets ship in the wheel: configs/mesh/ is the one copy (specjax/sharding/presets links to
it), and a non-editable install must find every preset without the source tree.

Builds the wheel offline (``pip wheel --no-build-isolation --no-deps``) from a copy of the
sources in a temporary directory (no build/ left in the checkout), unpacks it, and asks a fresh
interpreter that sees only the unpacked wheel for ``presets()``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_presets_link_to_configs_mesh():
    from specjax.sharding import mesh

    link = ROOT / "specjax" / "sharding" / "presets"
    assert link.is_symlink() and link.resolve() == (ROOT / "configs" / "mesh").resolve()
    found = mesh.presets()
    assert sorted(found) == sorted(p.stem for p in (ROOT / "configs" / "mesh").glob("*.yaml"))
    assert all(p.resolve().parent == (ROOT / "configs" / "mesh").resolve() for p in found.values())


def test_installed_wheel_resolves_every_preset(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in ("specjax", "bridge", "configs"):
        shutil.copytree(ROOT / d, src / d, symlinks=True, ignore=ignore)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp_path / "dist").glob("specjax-*.whl")
    want = {p.stem: p.read_bytes() for p in (ROOT / "configs" / "mesh").glob("*.yaml")}
    assert {"default", "cpu-8", "tpu-v5e-8", "tpu-v4-32", "gpu-8"} <= set(want)
    with zipfile.ZipFile(whl) as z:
        shipped = {Path(n).stem: z.read(n) for n in z.namelist() if n.startswith("specjax/sharding/presets/")}
        assert shipped == want  # the files themselves (not a link), byte for byte
        z.extractall(tmp_path / "site")
    code = ("import json; from specjax.sharding import mesh; "
            "print(json.dumps({n: [str(p), mesh.load_mesh_config(n).sizes] for n, p in mesh.presets().items()}))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECJAX_MESH_DIR")}
    env["PYTHONPATH"] = str(tmp_path / "site")
    # -S: no .pth files, so the checkout's editable install is not on the path; only the unpacked
    # wheel and this interpreter's site-packages (the dependencies) are
    deps = [p for p in sys.path if p.endswith("site-packages")]
    r = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path[:0] = {[str(tmp_path / 'site'), *deps]!r}; "
                        f"{code}"], capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(got) == sorted(want)
    for name, (path, sizes) in got.items():
        assert Path(path).parent == tmp_path / "site" / "specjax" / "sharding" / "presets", path
        assert set(sizes) == {"data", "fsdp", "tensor"}

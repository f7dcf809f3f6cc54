"""Mesh configs: presets, files, inline sizes, ``-1``, errors; multi-process settings; the
``--mesh`` option of ``specjax generate`` (1 device here; 8 devices in mesh8_suite.py)."""

from __future__ import annotations

import jax
import pytest
from typer.testing import CliRunner

import specjax.sharding as shd
from specjax.sharding.distributed import initialize


def test_presets_exist_and_resolve():
    names = set(shd.presets())
    assert {"default", "cpu-8", "tpu-v5e-8", "tpu-v4-32", "gpu-8"} <= names
    assert shd.load_mesh_config("cpu-8").shape(8) == (2, 2, 2)
    assert shd.load_mesh_config(None).shape(8) == (8, 1, 1)
    assert shd.load_mesh_config("default").shape(1) == (1, 1, 1)
    assert shd.load_mesh_config("tpu-v4-32").shape(16) == (1, 4, 4)
    assert shd.load_mesh_config("tpu-v5e-8").shape(8) == (1, 1, 8)
    assert shd.load_mesh_config("gpu-8").shape(16) == (2, 1, 8)  # two nodes: data takes the second


def test_inline_file_and_mapping(tmp_path):
    assert shd.load_mesh_config("2,1,4").shape(8) == (2, 1, 4)
    assert shd.load_mesh_config("data=2,tensor=-1").shape(8) == (2, 1, 4)
    assert shd.load_mesh_config({"fsdp": -1, "data": 1}).shape(6) == (1, 6, 1)
    assert shd.load_mesh_config((1, 4, 2)).shape(8) == (1, 4, 2)
    f = tmp_path / "mine.yaml"
    f.write_text("data: 1\nfsdp: 2\ntensor: -1\n")
    cfg = shd.load_mesh_config(str(f))
    assert cfg.name == "mine" and cfg.shape(8) == (1, 2, 4)


@pytest.mark.parametrize("spec,n,match", [
    ("cpu-8", 4, "written for 8 devices but 4 are visible.*jax.distributed"),
    ("data=3", 8, r"uses 3 devices but 8 are visible; set one axis to -1"),
    ("data=-1,tensor=3", 8, "fixed axes use 3 devices, which does not divide the 8"),
    ("data=-1,tensor=-1", 8, "more than one axis is -1"),
    ("data=0", 8, "axis 'data' = 0; expected a positive int or -1"),
    ("nope", 8, r"mesh 'nope' is not a preset.*cpu-8"),
])
def test_mesh_config_errors(spec, n, match):
    with pytest.raises(shd.MeshConfigError, match=match):
        shd.load_mesh_config(spec).shape(n)


def test_yaml_unknown_key(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("data: 1\nmodel: 2\n")
    with pytest.raises(shd.MeshConfigError, match=r"unknown key\(s\) \['model'\]") as ei:
        shd.load_mesh_config(str(f))
    assert ei.value.key == "model"


def test_make_mesh_on_this_process():
    mesh = shd.make_mesh()
    assert mesh.axis_names == shd.AXES and mesh.size == jax.device_count()
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert shd.describe(mesh).startswith("mesh {data: %d, fsdp: 1, tensor: 1}" % jax.device_count())


def test_distributed_settings(monkeypatch):
    for k in ("SPECJAX_COORDINATOR", "JAX_COORDINATOR_ADDRESS", "SPECJAX_NUM_PROCESSES", "SPECJAX_PROCESS_ID"):
        monkeypatch.delenv(k, raising=False)
    assert initialize() is False  # nothing asked: single process, nothing started
    assert shd.is_main_process() and shd.process_count() == 1
    with pytest.raises(shd.DistributedConfigError, match=r"missing: --num-processes \(SPECJAX_NUM_PROCESSES\), "
                                                         r"--process-id"):
        initialize("127.0.0.1:1234")
    monkeypatch.setenv("SPECJAX_NUM_PROCESSES", "two")
    with pytest.raises(shd.DistributedConfigError, match="SPECJAX_NUM_PROCESSES = 'two'; expected an integer"):
        initialize("127.0.0.1:1234", process_id=0)
    monkeypatch.setenv("SPECJAX_NUM_PROCESSES", "2")
    with pytest.raises(shd.DistributedConfigError, match=r"--process-id 2 is outside \[0, 2\)"):
        initialize("127.0.0.1:1234", process_id=2)
    jax.devices()  # the backend is up in this test process
    with pytest.raises(shd.DistributedConfigError, match="after JAX already started"):
        initialize("127.0.0.1:1234", process_id=0)


def test_generate_cli_mesh_option(tmp_path):
    from specjax.cli import app

    d = __import__("tests.sharding.tiny", fromlist=["x"]).write_target(tmp_path / "t")
    r = CliRunner().invoke(app, ["generate", "-p", "w5 w6 w7", "-t", str(d), "-n", "3", "--mesh", "nope"])
    assert r.exit_code == 2 and "mesh 'nope' is not a preset" in r.output
    r = CliRunner().invoke(app, ["generate", "-p", "w5 w6 w7", "-t", str(d), "-n", "3", "--mesh", "default", "--json"])
    assert r.exit_code == 0, r.output
    r2 = CliRunner().invoke(app, ["generate", "--help"])
    assert "--mesh" in r2.output and "--coordinator" in r2.output


def test_accelerator_mesh_on_a_cpu_only_jax_names_the_backend_and_the_extra():
    """A TPU preset on a machine whose JAX sees only the CPU (no libtpu / CUDA plugin installed):
    the error says what JAX found and which install brings the accelerator."""
    cpu = jax.devices("cpu")[:1]
    with pytest.raises(shd.MeshConfigError) as ei:
        shd.make_mesh("tpu-v5e-8", devices=cpu)
    msg = str(ei.value)
    assert "written for 8 devices but 1 are visible" in msg
    assert "JAX sees 1 cpu device(s) (backend cpu" in msg
    assert 'pip install "specjax[tpu]"' in msg and 'pip install "specjax[cuda]"' in msg

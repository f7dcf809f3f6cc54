"""Device meshes from a small config: three named axes, ``data``, ``fsdp`` and ``tensor``.

* ``data``   - batch parallel: parameters replicated, the batch split.
* ``fsdp``   - batch parallel with parameters (and optimizer state) split too; XLA gathers
  each weight where it is used.
* ``tensor`` - model parallel inside a layer: attention heads, MLP width and vocabulary split.

The batch dimension of activations, inputs and KV caches is split over ``("data", "fsdp")``.
Axes are laid out ``data`` outermost, ``tensor`` innermost, so a tensor-parallel group is made
of neighbouring devices (one host's GPUs, a TPU's nearest chips).

A config is written as YAML (``configs/mesh/*.yaml``)::

    data: -1      # -1 = "the rest of the devices" (at most one axis)
    fsdp: 1
    tensor: 4
    devices: 16   # optional: the device count this preset is written for (multi-host presets)

and named on the command line as ``--mesh PRESET_OR_FILE``: a preset name (``cpu-8``,
``tpu-v5e-8``, ``tpu-v4-32``, ``gpu-8``, ``default``), a YAML file, or inline sizes
(``data=2,tensor=4`` or ``2,1,4`` in axis order).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from specjax.sharding.errors import MeshConfigError

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the batch dimension is split over both
DEFAULT_PRESET = "default"
PRESET_ENV = "SPECJAX_MESH_DIR"  # extra directory of preset YAML files (searched first)
# The presets live in configs/mesh/ (the documented place, the only copy). specjax/sharding/presets
# is a link to it, and setuptools package-data puts the files themselves into a wheel, so an
# installed (non-editable) specjax finds them next to this module.
_PACKAGE_PRESETS = Path(__file__).resolve().parent / "presets"
_REPO_PRESETS = Path(__file__).resolve().parents[2] / "configs" / "mesh"


@dataclass(frozen=True)
class MeshConfig:
    """Axis sizes (``-1`` = the rest of the devices, at most once) and an optional expected
    device count. Validated on construction; :meth:`shape` resolves it for a device count."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    devices: int | None = None  # expected total device count (over all processes); None = any
    name: str = "custom"
    description: str = ""

    def __post_init__(self):
        for ax in AXES:
            v = getattr(self, ax)
            if isinstance(v, bool) or not isinstance(v, int) or (v < 1 and v != -1):
                raise MeshConfigError(f"mesh {self.name!r}: axis {ax!r} = {v!r}; expected a positive int or -1 "
                                      "(the rest of the devices)", key=ax)
        if sum(getattr(self, ax) == -1 for ax in AXES) > 1:
            raise MeshConfigError(f"mesh {self.name!r}: more than one axis is -1 ({self.sizes}); at most one axis may "
                                  "take the rest of the devices", key="data")
        if self.devices is not None and (isinstance(self.devices, bool) or not isinstance(self.devices, int)
                                         or self.devices < 1):
            raise MeshConfigError(f"mesh {self.name!r}: devices = {self.devices!r}; expected a positive int",
                                  key="devices")

    @property
    def sizes(self) -> dict[str, int]:
        return {ax: getattr(self, ax) for ax in AXES}

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        """The (data, fsdp, tensor) sizes on ``num_devices`` devices, or a :class:`MeshConfigError`
        that says what does not fit."""
        n = int(num_devices)
        if self.devices is not None and n != self.devices:
            raise MeshConfigError(
                f"mesh {self.name!r} is written for {self.devices} devices but {n} are visible. On a multi-host "
                f"slice run the same command on every host with jax.distributed initialised (--coordinator / "
                f"--num-processes / --process-id, or SPECJAX_COORDINATOR=auto on Cloud TPU, SLURM or Open MPI); "
                f"otherwise pick a preset for this machine", key="devices")
        fixed = math.prod(v for v in self.sizes.values() if v != -1)
        if -1 in self.sizes.values():
            if n % fixed:
                raise MeshConfigError(f"mesh {self.name!r} {_fmt(self.sizes)}: the fixed axes use {fixed} devices, "
                                      f"which does not divide the {n} devices visible", key="data")
            return tuple(n // fixed if v == -1 else v for v in self.sizes.values())  # type: ignore[return-value]
        if fixed != n:
            raise MeshConfigError(f"mesh {self.name!r} {_fmt(self.sizes)} uses {fixed} devices but {n} are visible; "
                                  "set one axis to -1 to take the rest", key="data")
        return tuple(self.sizes.values())  # type: ignore[return-value]

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, name: str = "custom", where: str = "") -> "MeshConfig":
        if not isinstance(doc, Mapping):
            raise MeshConfigError(f"mesh config {where or name!r} holds a {type(doc).__name__}; expected a mapping "
                                  f"with keys {list(AXES)}")
        known = {f.name for f in fields(cls)}
        bad = sorted(set(doc) - known)
        if bad:
            raise MeshConfigError(f"mesh config {where or name!r}: unknown key(s) {bad}; expected some of "
                                  f"{[*AXES, 'devices', 'description']}", key=bad[0])
        kw = dict(doc)
        kw.setdefault("name", name)
        return cls(**kw)


def _fmt(sizes: Mapping[str, int]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in sizes.items()) + "}"


def preset_dirs() -> list[Path]:
    """Where presets are looked up, first match wins: ``$SPECJAX_MESH_DIR``, the package's
    ``presets/`` (in a checkout: the link to ``configs/mesh``; in a wheel: the shipped files), and
    ``configs/mesh`` beside the package (a checkout whose link did not survive, e.g. on Windows)."""
    dirs = []
    if os.environ.get(PRESET_ENV):
        dirs.append(Path(os.environ[PRESET_ENV]))
    for d in (_PACKAGE_PRESETS, _REPO_PRESETS):
        if d.is_dir() and all(d.resolve() != x.resolve() for x in dirs):
            dirs.append(d)
    return dirs or [_PACKAGE_PRESETS]


def presets() -> dict[str, Path]:
    """``{name: yaml path}`` of every preset found (first directory wins)."""
    out: dict[str, Path] = {}
    for d in preset_dirs():
        if d.is_dir():
            for p in sorted(d.glob("*.yaml")):
                out.setdefault(p.stem, p)
    return out


def _read_yaml(path: Path, name: str) -> MeshConfig:
    import yaml

    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise MeshConfigError(f"cannot read mesh config {path}: {e}") from e
    return MeshConfig.from_dict(doc or {}, name=name, where=str(path))


_INLINE_POS = re.compile(r"^\s*-?\d+\s*(,\s*-?\d+\s*){2}$")
_INLINE_KV = re.compile(r"^\s*[a-z]+\s*=\s*-?\d+\s*(,\s*[a-z]+\s*=\s*-?\d+\s*)*$")


def load_mesh_config(spec: "str | os.PathLike | MeshConfig | Mapping | Sequence[int] | None" = None) -> MeshConfig:
    """A :class:`MeshConfig` from a preset name, a YAML path, inline sizes (``"data=2,tensor=4"``,
    ``"2,1,4"``), a mapping, a (data, fsdp, tensor) tuple, or ``None`` (the default preset)."""
    if isinstance(spec, MeshConfig):
        return spec
    if isinstance(spec, Mapping):
        return MeshConfig.from_dict(spec)
    if isinstance(spec, (tuple, list)):
        if len(spec) != len(AXES):
            raise MeshConfigError(f"mesh sizes {list(spec)}: expected {len(AXES)} sizes in axis order {list(AXES)}")
        return MeshConfig(*(int(s) for s in spec), name=",".join(str(s) for s in spec))
    if spec is None or str(spec).strip() in ("", DEFAULT_PRESET):
        found = presets().get(DEFAULT_PRESET)
        return _read_yaml(found, DEFAULT_PRESET) if found else MeshConfig(name=DEFAULT_PRESET)
    text = str(spec).strip()
    if _INLINE_POS.match(text):
        return MeshConfig(*(int(s) for s in text.split(",")), name=text)
    if _INLINE_KV.match(text):
        kv = {}
        for part in text.split(","):
            k, v = (s.strip() for s in part.split("="))
            kv[k] = int(v)
        return MeshConfig.from_dict(kv, name=text)
    p = Path(text).expanduser()
    if p.is_file():
        return _read_yaml(p, p.stem)
    found = presets()
    if text in found:
        return _read_yaml(found[text], text)
    raise MeshConfigError(
        f"mesh {text!r} is not a preset, a file or inline sizes; presets: {sorted(found) or '(none found)'} "
        f"(searched {[str(d) for d in preset_dirs()]}); files are YAML with keys {list(AXES)}; inline sizes look like "
        f"'data=2,tensor=4' or '2,1,4'")


def make_mesh(spec=None, *, devices=None):
    """A ``jax.sharding.Mesh`` with axes ``("data", "fsdp", "tensor")`` (all ``AxisType.Auto``: the
    compiler propagates shardings from the jit in/out shardings) over ``devices`` (default: every
    device of every process, ``jax.devices()``). ``spec`` as for :func:`load_mesh_config`."""
    import jax
    from jax.sharding import AxisType, Mesh

    if isinstance(spec, Mesh):
        return spec
    cfg = load_mesh_config(spec)
    devs = list(jax.devices() if devices is None else devices)
    try:
        shape = cfg.shape(len(devs))
    except MeshConfigError as e:
        raise MeshConfigError(f"{e}. {backend_hint(devs)}", key=e.key) from None
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devs)


def backend_hint(devices) -> str:
    """What JAX sees, and how to get the accelerator when it sees only the CPU: a mesh written for
    a TPU slice or a GPU host fails on a machine whose JAX lacks the plugin, and the message must
    say which install fixes it."""
    platforms = sorted({d.platform for d in devices})
    seen = f"JAX sees {len(devices)} {'/'.join(platforms)} device(s)"
    if platforms != ["cpu"]:
        return seen
    return (f"{seen} (backend cpu: no accelerator plugin is loaded). On a TPU VM install `pip install "
            f"\"specjax[tpu]\"` (libtpu for this jax), on an NVIDIA GPU `pip install \"specjax[cuda]\"`; to try a mesh on "
            f"the CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=8 and use --mesh cpu-8")


def mesh_sizes(mesh) -> dict[str, int]:
    """``{axis: size}`` of a Mesh or AbstractMesh."""
    return {str(k): int(v) for k, v in dict(mesh.shape).items()}


def describe(mesh) -> str:
    """``"mesh {data: 2, fsdp: 1, tensor: 4}"`` (+ device kind and processes for a concrete mesh)."""
    s = f"mesh {_fmt(mesh_sizes(mesh))}"
    try:
        devs = mesh.devices
    except (ValueError, AttributeError):  # AbstractMesh
        devs = None
    if devs is not None and hasattr(devs, "flat"):
        flat = list(devs.flat)
        procs = len({d.process_index for d in flat})
        s += f" over {len(flat)} {flat[0].platform} device(s)" + (f" in {procs} processes" if procs > 1 else "")
    return s


def batch_divisor(mesh) -> int:
    """How many ways the batch dimension is split (``data * fsdp``): batches must be a multiple."""
    sz = mesh_sizes(mesh)
    return math.prod(sz.get(a, 1) for a in BATCH_AXES)

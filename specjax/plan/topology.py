"""TPU slices for deviceless compiles: the chip table and a mesh over a simulated topology.

``jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4")`` gives
the devices of a slice without hardware (libtpu, ``pip install "specjax[tpu]"``); programs
compiled for a mesh over them are the real TPU programs (XLA:TPU), so memory, flops and bytes
come from the TPU compiler.

A simulated v4 slice exposes one device per TensorCore (two per chip) while a real v4 runs one
device per chip (megacore): the mesh takes one core of each chip, so a ``v4:2x2x4`` plan is a
16-chip plan with each chip's HBM and peak, as a ``tpu-v4-32`` preset expects.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specjax.sharding.errors import MeshConfigError
from specjax.sharding.mesh import AXES, load_mesh_config


class TopologyError(ValueError):
    """A topology name this planner does not know, or one libtpu cannot describe."""


@dataclass(frozen=True)
class Chip:
    """Per-chip figures for rooflines (public spec sheets)."""

    name: str
    hbm_gib: float
    peak_tflops: float  # bf16 dense
    hbm_gbps: float  # GB/s
    cores_per_device: int = 1  # TensorCores the simulated topology exposes per chip

    @property
    def hbm_bytes(self) -> int:
        return int(self.hbm_gib * 2**30)


CHIPS = {
    "v5e": Chip("v5e", 16, 197, 819),
    "v6e": Chip("v6e", 32, 918, 1640),
    "v5p": Chip("v5p", 95, 459, 2765),
    "v4": Chip("v4", 32, 275, 1228, cores_per_device=2),
}


def chip_of(topology: str) -> Chip:
    gen = str(topology).split(":", 1)[0].strip().lower()
    if gen not in CHIPS or ":" not in str(topology):
        raise TopologyError(f"topology {topology!r}: expected GENERATION:SHAPE with a generation in {sorted(CHIPS)} "
                            "(e.g. v5e:2x4, v6e:2x4, v5p:2x2x2, v4:2x2x4)")
    return CHIPS[gen]


def topology_devices(topology: str) -> list:
    """One device per chip of ``topology`` (see the module docstring for v4), in the slice's order."""
    chip = chip_of(topology)
    try:
        from jax.experimental import topologies
    except ImportError as e:  # pragma: no cover - part of jax
        raise TopologyError(f"jax.experimental.topologies is unavailable ({e})") from None
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=str(topology))
    except Exception as e:  # libtpu missing, or a shape it refuses
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TopologyError(f"cannot describe TPU topology {topology!r}: {msg}. Compiling for a TPU without one needs "
                            "libtpu for this jax: pip install \"specjax[tpu]\"") from None
    devs = list(desc.devices)
    if chip.cores_per_device > 1:
        devs = [d for d in devs if getattr(d, "core_on_chip", 0) == 0]
    return devs


def tpu_mesh(topology: str, mesh_spec="data=1,tensor=-1"):
    """A ``Mesh`` with axes (data, fsdp, tensor) over the chips of ``topology``, shaped by a mesh
    preset / file / inline sizes (``specjax.sharding.load_mesh_config``). Built from the device
    array directly (``jax.make_mesh`` refuses simulated v4 cores)."""
    from jax.sharding import AxisType, Mesh

    cfg = load_mesh_config(mesh_spec)
    devs = topology_devices(topology)
    try:
        shape = cfg.shape(len(devs))
    except MeshConfigError as e:
        raise MeshConfigError(f"{e} (topology {topology} has {len(devs)} chips)", key=e.key) from None
    return Mesh(np.array(devs, dtype=object).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))

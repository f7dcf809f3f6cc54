"""Typer options shared by every command that runs a model (``generate``, ``bench``, ``data``,
``train``), and the one call that turns them into a mesh.

    from specjax.sharding import cli as shcli

    def my_cmd(..., mesh: str = shcli.mesh_option(),
               coordinator: Optional[str] = shcli.coordinator_option(),
               num_processes: Optional[int] = shcli.num_processes_option(),
               process_id: Optional[int] = shcli.process_id_option()):
        mesh = shcli.setup(mesh, coordinator, num_processes, process_id)   # before any JAX work
"""

from __future__ import annotations

import typer

MESH_HELP = ("device mesh: a preset (default, cpu-8, tpu-v5e-8, tpu-v4-32, gpu-8), a YAML file with "
             "data/fsdp/tensor sizes (-1 = the rest), or inline 'data=2,tensor=4'; default: every device on the "
             "data axis")


def mesh_option(default: str = "default"):
    return typer.Option(default, "--mesh", envvar="SPECJAX_MESH", help=MESH_HELP)


def coordinator_option():
    return typer.Option(None, "--coordinator", envvar="SPECJAX_COORDINATOR",
                        help="multi-process: process 0's HOST:PORT, or 'auto' (Cloud TPU slice, SLURM, Open MPI)")


def num_processes_option():
    return typer.Option(None, "--num-processes", envvar="SPECJAX_NUM_PROCESSES", min=1,
                        help="multi-process: how many processes (one per host)")


def process_id_option():
    return typer.Option(None, "--process-id", envvar="SPECJAX_PROCESS_ID", min=0,
                        help="multi-process: this process's index, 0 .. num-processes - 1")


def setup(mesh: str | None = "default", coordinator: str | None = None, num_processes: int | None = None,
          process_id: int | None = None):
    """Initialise ``jax.distributed`` when asked, then build the mesh. Raises
    ``specjax.sharding.errors.ShardingError`` subclasses (BridgeError: CLI prints, exit code 2)."""
    from specjax.sharding.distributed import initialize
    from specjax.sharding.mesh import make_mesh

    initialize(coordinator, num_processes, process_id)
    return make_mesh(mesh)

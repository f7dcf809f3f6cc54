"""Multi-process runs: ``jax.distributed.initialize`` from flags or the environment, and the
"only process 0 writes and prints" helpers.

Settings (a flag wins over its environment variable)::

    --coordinator HOST:PORT   SPECJAX_COORDINATOR  (or JAX_COORDINATOR_ADDRESS)
    --num-processes N         SPECJAX_NUM_PROCESSES
    --process-id I            SPECJAX_PROCESS_ID

``--coordinator auto`` (or ``SPECJAX_COORDINATOR=auto``) lets JAX detect everything on a Cloud
TPU slice, under SLURM or Open MPI. With none of them set the run is single-process.
Initialisation must happen before anything touches a JAX device.
"""

from __future__ import annotations

import os
from typing import Sequence

from specjax.processes import is_main_process, process_count, process_index, sync  # noqa: F401 (re-exported)
from specjax.sharding.errors import DistributedConfigError

ENV_COORDINATOR = ("SPECJAX_COORDINATOR", "JAX_COORDINATOR_ADDRESS")
ENV_NUM_PROCESSES = ("SPECJAX_NUM_PROCESSES",)
ENV_PROCESS_ID = ("SPECJAX_PROCESS_ID",)


def _env(names: Sequence[str]) -> str | None:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return v
    return None


def _int(value, flag: str, env: Sequence[str]) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError) as e:
        raise DistributedConfigError(f"{flag} / {env[0]} = {value!r}; expected an integer", key=flag) from e


def initialize(coordinator: str | None = None, num_processes: int | str | None = None,
               process_id: int | str | None = None, *, local_device_ids: Sequence[int] | None = None,
               timeout_s: int = 300) -> bool:
    """Start ``jax.distributed`` if flags or environment ask for it; returns True when the run is
    (now) multi-process-initialised, False for a plain single-process run. Idempotent."""
    import jax

    if jax.distributed.is_initialized():
        return True
    coordinator = coordinator or _env(ENV_COORDINATOR)
    n = _int(num_processes if num_processes is not None else _env(ENV_NUM_PROCESSES), "--num-processes",
             ENV_NUM_PROCESSES)
    pid = _int(process_id if process_id is not None else _env(ENV_PROCESS_ID), "--process-id", ENV_PROCESS_ID)
    if coordinator is None and n is None and pid is None:
        return False
    if coordinator == "auto":
        _not_started()
        jax.distributed.initialize(num_processes=n, process_id=pid, local_device_ids=local_device_ids,
                                   initialization_timeout=timeout_s)
        return True
    missing = [f"{flag} ({env[0]})" for flag, env, v in (("--coordinator", ENV_COORDINATOR, coordinator),
                                                          ("--num-processes", ENV_NUM_PROCESSES, n),
                                                          ("--process-id", ENV_PROCESS_ID, pid)) if v is None]
    if missing:
        raise DistributedConfigError(f"a multi-process run needs all of --coordinator, --num-processes and "
                                     f"--process-id (or --coordinator auto on TPU/SLURM/Open MPI); missing: "
                                     f"{', '.join(missing)}", key=missing[0].split(" ")[0])
    if not 0 <= pid < n:
        raise DistributedConfigError(f"--process-id {pid} is outside [0, {n}) for --num-processes {n}",
                                     key="--process-id")
    _not_started()
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=n, process_id=pid,
                               local_device_ids=local_device_ids, initialization_timeout=timeout_s,
                               cluster_detection_method="deactivate")
    return True


def _not_started() -> None:
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise DistributedConfigError("multi-process settings were given after JAX already started its devices; "
                                     "call specjax.sharding.initialize() (or pass the flags) before any JAX "
                                     "computation", key="--coordinator")


def shutdown() -> None:
    import jax

    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


def main_print(*args, **kwargs) -> None:
    """``print`` on process 0 only."""
    if is_main_process():
        print(*args, **kwargs)

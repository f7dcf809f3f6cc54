"""``specjax plan``: compile a recipe's programs for a TPU slice on this host (no TPU, no weights)
and report whether each fits and how fast it could run.

    from specjax.plan import plan
    rows = plan(load_recipe("configs/eagle3-llama3.1-8b-tpu.yaml"), "v5e:2x4", mesh="data=1,tensor=-1")

Each row is a :class:`~specjax.plan.report.ProgramReport` (``to_dict()`` for JSON). Needs libtpu
for this jax (``pip install "specjax[tpu]"``); see docs/plan-before.md for the 8B tables.
"""

from __future__ import annotations

from typing import Sequence

from specjax.models.presets import target_config_for
from specjax.plan.programs import BUILDERS, DEFAULT_PROGRAMS, PROGRAMS, PlanError, PlanInputs, Program  # noqa: F401
from specjax.plan.report import ProgramReport, analyse, count_ops  # noqa: F401
from specjax.plan.topology import CHIPS, Chip, TopologyError, chip_of, topology_devices, tpu_mesh  # noqa: F401
from specjax.sharding import describe

DEFAULT_MESH = "data=1,tensor=-1"  # an 8B target needs tensor parallel on a 16 GiB chip


def parse_programs(text: str | Sequence[str] | None) -> list[str]:
    names = list(DEFAULT_PROGRAMS) if text is None else (
        [s.strip() for s in text.split(",") if s.strip()] if isinstance(text, str) else list(text))
    bad = [n for n in names if n not in PROGRAMS]
    if bad or not names:
        raise PlanError(f"programs {bad or names}: expected a comma-separated subset of {list(PROGRAMS)}")
    return names


def plan(cfg, topology: str, *, mesh=DEFAULT_MESH, programs=None, target=None, target_overrides: dict | None = None,
         batch: int | None = None, seq: int | None = None, prompt_len: int = 2048, new_tokens: int = 2048,
         k: int | None = None, tree: str | None = None, on_report=None) -> list[ProgramReport]:
    """Compile ``programs`` of recipe ``cfg`` (a ``TrainConfig``) for ``topology`` (``v5e:2x4``, ...)
    on ``mesh`` (a preset, file or inline sizes) and report each. ``target``: a config.json, a
    directory, a cached hub id or a preset id (default: the recipe's ``target``);
    ``target_overrides``: config keys to replace (a scaled-down target). A program that fails to
    build or compile is reported with its error, the others still run. JAX's persistent
    compilation cache is off while planning, so ``compile_s`` is the compiler's real time.
    ``tree``: the token tree of the ``tree`` program (vLLM's path list; default vLLM's example).
    ``on_report(report)`` is called as each row is done."""
    import jax

    names = parse_programs(programs)
    chip = chip_of(topology)
    m = tpu_mesh(topology, mesh)
    tc = target_config_for(target or cfg.target, overrides=target_overrides)
    inputs = PlanInputs(cfg, tc, m, batch=batch, seq=seq, prompt_len=prompt_len, new_tokens=new_tokens, k=k,
                        tree=tree)
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    out = []
    try:
        for name in names:
            try:
                prog = BUILDERS[name](inputs)
            except Exception as e:  # a program that cannot be built is a row, not the end of the plan
                rep = ProgramReport(name, topology, describe(m), {}, compiled=False, hbm_gib=chip.hbm_gib,
                                    error=f"{type(e).__name__}: {str(e).strip()[:2000]}")
            else:
                rep = analyse(prog, topology=topology, mesh_desc=describe(m), chip=chip)
            out.append(rep)
            if on_report is not None:
                on_report(rep)
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
    return out

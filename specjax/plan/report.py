"""Compile a :class:`specjax.plan.programs.Program` and read what the TPU compiler says about it:
per-chip memory (``memory_analysis``), flops and bytes (``cost_analysis``), collectives and
custom calls (``as_text``), and the roofline against the chip's figures.

Definitions (per chip):

* ``peak`` = arguments + outputs - aliased (donated) + temporaries + generated code; ``total`` =
  peak + ``resident`` (what the run holds outside the program); ``fits`` = total <= HBM,
  ``headroom_pct`` = (HBM - total) / HBM.
* ``flops`` is XLA's ``cost_analysis`` count plus ``kernel_flops``: the flash-attention (splash)
  kernels are Mosaic custom calls that the compiler counts as 0 flops, so each traced call
  reports the blocks it runs (:func:`specjax.kernels.tpu.splash.count_kernel_flops`; forward
  and backward for a train step). The decode kernel carries its own cost estimate.
* ``bytes`` is XLA's ``cost_analysis`` count (every operand and result of every instruction, in
  any memory); ``hbm_bytes`` only what crosses HBM (:mod:`specjax.plan.hbm`: a weight the
  compiler prefetches into VMEM counts once, not four or five times).
* ``roofline`` = max(flops / bf16 peak, hbm_bytes / HBM bandwidth), of one step for a loop (its
  loop body compiled on its own); ``bound`` names the larger term.
* A program whose target scans its layers (TPU programs without a KV cache: extraction, the
  online train step) takes ``flops``, ``bytes`` and the collectives from its twin with the layers
  unrolled (``cost_compile_s``): ``cost_analysis`` counts a while body once.
* ``tok_per_s`` = tokens per call (or step) / roofline: a ceiling, not a measurement.
* ``mfu_ceiling`` = (flops / roofline) / bf16 peak: the fraction of peak the program's own flops
  can reach at its roofline (1.0 when compute-bound; the rest is bandwidth).
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field

from specjax.kernels.tpu.splash import count_kernel_flops
from specjax.models.layer_scan import recording_layer_scans
from specjax.plan import hbm
from specjax.plan.topology import Chip

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_COLL_RE = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_CUSTOM_RE = re.compile(r'custom_call_target="([^"]+)"')
_OOM_RES = (re.compile(r"Used ([\d.]+)([KMGT]?) of [\d.]+[KMGT]? hbm", re.I),  # "Used 20.5G of 15.75G hbm"
            re.compile(r"memory required for [^(]*\(([\d.]+)([KMGT]?)\) exceeds available HBM", re.I))
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
GIB = 2**30


@dataclass
class ProgramReport:
    program: str
    topology: str
    mesh: str
    shape: dict
    compiled: bool
    error: str | None = None
    argument_gib: float | None = None
    output_gib: float | None = None
    alias_gib: float | None = None
    temp_gib: float | None = None
    code_gib: float | None = None
    resident_gib: float = 0.0
    peak_gib: float | None = None
    hbm_gib: float = 0.0
    fits: bool | None = None
    headroom_pct: float | None = None
    flops: float | None = None  # the compiler's count + kernel_flops
    kernel_flops: float = 0.0  # the splash kernels' flops (custom calls the compiler counts as 0)
    bytes: float | None = None
    hbm_bytes: float | None = None
    compute_ms: float | None = None
    memory_ms: float | None = None
    roofline_ms: float | None = None
    bound: str | None = None
    tokens: int = 0
    tok_per_s: float | None = None
    mfu_ceiling: float | None = None
    per: str = "call"  # "call" (one program run) or "step" (one loop iteration)
    collectives: dict = field(default_factory=dict)  # in the program the roofline is of
    loop_collectives: dict | None = None  # the whole loop program's (loops)
    custom_calls: dict = field(default_factory=dict)
    compile_s: float = 0.0
    step_compile_s: float | None = None
    cost_compile_s: float | None = None  # the unrolled twin of a layer-scanning program (flops, bytes)
    unrolled_peak_gib: float | None = None  # that twin's peak and HBM bytes: what unrolling would take
    unrolled_hbm_bytes: float | None = None
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def count_ops(hlo: str) -> tuple[dict, dict]:
    """``({collective: count}, {custom-call target: count})`` in optimised HLO text."""
    coll = {c: 0 for c in COLLECTIVES}
    for m in _COLL_RE.finditer(hlo):
        coll[m.group(1)] += 1
    custom: dict = {}
    for m in _CUSTOM_RE.finditer(hlo):
        custom[m.group(1)] = custom.get(m.group(1), 0) + 1
    return coll, custom


def _cost(compiled) -> tuple[float, float]:
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    ca = ca or {}
    return float(ca.get("flops", 0.0)), float(ca.get("bytes accessed", 0.0))


def _peak_bytes(m) -> int:
    """Peak bytes per chip of a ``memory_analysis``: arguments + outputs - aliased + temporaries + code."""
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
            + m.generated_code_size_in_bytes)


def _compile(lower) -> tuple[object | None, float, str | None, list]:
    """(compiled or None, seconds, error, the flash-attention calls traced: their flop records)."""
    t0 = time.perf_counter()
    with count_kernel_flops() as kernels:
        try:
            compiled = lower().compile()
        except Exception as e:  # the compiler's own message is the report (OOM, an unpartitionable op)
            return None, time.perf_counter() - t0, f"{type(e).__name__}: {str(e).strip()[:2000]}", kernels
    return compiled, time.perf_counter() - t0, None, kernels


def _oom_used(err: str) -> float | None:
    """GiB the compiler says the program needs, from its out-of-memory message (None: not an OOM;
    0.0: an OOM without a figure)."""
    for rx in _OOM_RES:
        m = rx.search(err or "")
        if m:
            return float(m.group(1)) * _UNIT[m.group(2).upper()] / GIB
    return 0.0 if "RESOURCE_EXHAUSTED" in (err or "") or "out of memory" in (err or "").lower() else None


def analyse(prog, *, topology: str, mesh_desc: str, chip: Chip, with_step: bool = True) -> ProgramReport:
    """Compile ``prog`` (and its loop step) and fill a :class:`ProgramReport`."""
    rep = ProgramReport(prog.name, topology, mesh_desc, dict(prog.shape), compiled=False, hbm_gib=chip.hbm_gib,
                        resident_gib=round(prog.resident_bytes / GIB, 3), tokens=int(prog.tokens),
                        notes=list(prog.notes))
    with recording_layer_scans() as scans:
        compiled, secs, err, kernels = _compile(prog.lower)
    rep.compile_s = round(secs, 2)
    if compiled is None:
        rep.error = err
        used = _oom_used(err)
        if used is not None:  # the compiler refused for memory: that is a plan answer, not a crash
            rep.fits = False
            if used > 0:  # at least this much (the compiler's figure: temporaries, or all it counted)
                rep.peak_gib = round(used, 3)
                rep.headroom_pct = round((chip.hbm_gib - used - rep.resident_gib) / chip.hbm_gib * 100, 1)
            rep.notes.append("the TPU compiler refused the program for memory; peak_gib is its figure")
        return rep
    rep.compiled = True
    m = compiled.memory_analysis()
    arg, out, alias = m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes
    temp, code = m.temp_size_in_bytes, m.generated_code_size_in_bytes
    peak = _peak_bytes(m)
    rep.argument_gib, rep.output_gib, rep.alias_gib = (round(x / GIB, 3) for x in (arg, out, alias))
    rep.temp_gib, rep.code_gib, rep.peak_gib = (round(x / GIB, 3) for x in (temp, code, peak))
    total = peak + prog.resident_bytes
    rep.fits = total <= chip.hbm_bytes
    rep.headroom_pct = round((chip.hbm_bytes - total) / chip.hbm_bytes * 100, 1)
    text = compiled.as_text()
    coll, custom = count_ops(text)
    rep.custom_calls = custom
    cost_of = compiled
    if prog.step_lower is not None and with_step:
        rep.loop_collectives = coll
        step, ssecs, serr, kernels = _compile(prog.step_lower)
        rep.step_compile_s = round(ssecs, 2)
        if step is None:
            rep.error = f"loop step: {serr}"
            rep.collectives = coll
            return rep
        rep.per = "step"
        cost_of = step
        if scans:  # the decode layer scan (specjax.models.layer_scan.decode_layer_scan)
            rep.notes.append("layers scanned (decode layer scan): the step's flops count each scanned layer body "
                             "once; hbm_bytes counts each loop body times its trip count")
        text = step.as_text()
        coll, scustom = count_ops(text)
        for k, v in scustom.items():
            rep.custom_calls[k] = rep.custom_calls.get(k, 0) + v
    elif prog.cost_lower is not None and scans:
        # cost_analysis (and the kernels' flop records, one per trace) count a scanned layer body
        # once: flops, XLA's bytes and the collectives come from the same program with its layers
        # unrolled; memory, compile time and HBM bytes (loop bodies times their trip count) from
        # the program that runs
        twin, tsecs, terr, tkernels = _compile(prog.cost_lower)
        rep.cost_compile_s = round(tsecs, 2)
        if twin is None:
            rep.notes.append(f"the unrolled twin did not compile ({terr}): flops and bytes count each scanned "
                             f"layer body once")
        else:
            cost_of, kernels = twin, tkernels
            ttext = twin.as_text()
            coll, _ = count_ops(ttext)
            rep.unrolled_peak_gib = round(_peak_bytes(twin.memory_analysis()) / GIB, 3)
            rep.unrolled_hbm_bytes = hbm.hbm_bytes(ttext)
            rep.notes.append("layers scanned: flops, bytes and collectives of the same program unrolled; hbm_bytes "
                             "counts each loop body times its trip count")
    rep.collectives = coll
    flops, nbytes = _cost(cost_of)
    rep.kernel_flops = sum(r["flops"] * (r.get("passes") or prog.kernel_passes) for r in kernels)
    if any(not r["exact"] for r in kernels):
        rep.notes.append("flash attention under a runtime mask: kernel_flops counts all its blocks (an upper bound)")
    flops += rep.kernel_flops
    rep.flops, rep.bytes = flops, nbytes
    rep.hbm_bytes = hbm.hbm_bytes(text)
    tc = flops / (chip.peak_tflops * 1e12)
    tm = rep.hbm_bytes / (chip.hbm_gbps * 1e9)
    t = max(tc, tm)
    rep.compute_ms, rep.memory_ms, rep.roofline_ms = round(tc * 1e3, 4), round(tm * 1e3, 4), round(t * 1e3, 4)
    rep.bound = "compute" if tc >= tm else "memory"
    if t > 0:
        rep.tok_per_s = round(prog.tokens / t, 1)
        rep.mfu_ceiling = round(tc / t, 3)
    return rep

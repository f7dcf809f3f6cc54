"""HBM traffic of a compiled TPU program, read from its optimised HLO.

XLA's ``cost_analysis()["bytes accessed"]`` adds up every operand read and every result written
by every instruction, whatever memory it lives in. On a TPU the compiler prefetches a decode
step's weight matrices into VMEM with asynchronous slices (``async-start`` of a ``slice``, then a
``ConcatBitcast`` of the pieces) so that the matmul fusion reads them on chip: that weight is
counted about four to five times (the slice's read and write, the concatenation's read and
write, the fusion's read) although HBM delivers it once. A decode step of Llama-3.1-8B on v5e-8
"moves" 7.3 GB per chip by that count against 2 GB of weights.

:func:`hbm_bytes` counts only what crosses HBM: operands and results whose layout carries no
memory space (``S(n)``, n > 0, is on-chip: VMEM, SMEM, semaphores). Per instruction:

* a fusion reads, of each HBM operand, what its fused computation takes from it: the whole
  operand, or only the outputs of the ``dynamic-slice`` / ``slice`` / ``gather`` that are its
  only users, directly or through nested fusions (an embedding lookup reads one row, not the
  table; a scanned layer's matmul reads its layer of the stacked weights); a fused
  ``dynamic-update-slice`` or ``scatter`` into a parameter writes only its update (in place: a
  KV-cache write touches the new rows, not the cache);
* a ``dynamic-update-slice`` or ``scatter`` writes its update, in place (its indices and update
  are read); an asynchronous slice (``async-start``
  calling a ``slice``, or ``slice-start``: its shape is ``((operands), destination, context)``)
  reads the slice; ``copy-start`` and ``copy`` read the source and write the destination;
* ``bitcast``, tuples, ``get-tuple-element``, parameters, constants and the ``*-done`` halves of
  async pairs move nothing; a ``while`` counts its body times its trip count when the condition
  is a counted loop's (``lax.scan``/``fori_loop``: ROOT ``compare(counter, constant N),
  direction=LT``, the counter starting at 0: a scan over layers), else once (as ``cost_analysis``
  counts every body: a decode loop's trip count is not static); a ``call`` its callee, a
  ``conditional`` every branch (an upper bound);
* a Mosaic kernel (``tpu_custom_call``) is charged its whole HBM operands and results, or the
  bytes its cost estimate declares (``bytes_accessed``, which the decode attention kernel gives:
  every slot of the one layer it attends) where that is less: a kernel reading a layer of a stacked
  ``[L, ...]`` cache by a prefetched index takes the whole stack as its operand, yet its block
  index maps read only that layer (the compiler copies nothing: no ``copy`` of the stack appears
  in the HLO).

Layout tiling padding is ignored (shapes are counted at their logical size).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8,
               "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8,
               "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%([^\s(]+)\s*\(")
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
               "replica-id", "iota", "opt-barrier", "add-dependency"}
_PARTIAL_READS = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # op -> operand index of the update written
_DECLARED = re.compile(r'bytes_accessed\\?"\s*:\s*\\?"?(\d+)')


@dataclass
class Inst:
    name: str
    shape: str
    op: str
    operands: list[str]
    attrs: str
    args: str = ""  # the text between the opcode's parentheses


@dataclass
class Computation:
    name: str
    entry: bool
    insts: list[Inst] = field(default_factory=list)
    params: dict[int, str] = field(default_factory=dict)  # parameter number -> instruction name

    def by_name(self) -> dict[str, Inst]:
        return {i.name: i for i in self.insts}


def arrays(shape: str) -> list[tuple[float, int]]:
    """``[(bytes, memory space)]`` of every array in an HLO shape (a tuple: each element)."""
    out = []
    for dt, dims, layout in _ARRAY.findall(shape):
        if dt not in DTYPE_BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        m = _SPACE.search(layout or "")
        out.append((n * DTYPE_BYTES[dt], int(m.group(1)) if m else 0))
    return out


def in_hbm(shape: str) -> float:
    """Bytes of the arrays of ``shape`` that live in HBM (memory space 0)."""
    return sum(b for b, s in arrays(shape) if s == 0)


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    return len(text)


def _parse_inst(line: str) -> Inst | None:
    s = line.strip()
    if s.startswith("ROOT "):
        s = s[5:]
    if not s.startswith("%") or " = " not in s:
        return None
    name, rest = s[1:].split(" = ", 1)
    if rest.startswith("("):
        end = _balanced(rest, 0)
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    m = re.match(r"([a-z][a-z0-9-]*)\(", rest)
    if not m:
        return None
    end = _balanced(rest, m.end() - 1)
    operands = re.findall(r"%([^\s,()]+)", rest[m.end():end - 1])
    return Inst(name, shape, m.group(1), operands, rest[end:], rest[m.end():end - 1])


def _depth(text: str, depth: int = 0) -> int:
    """Bracket depth after ``text`` (starting at ``depth``), brackets inside quoted strings skipped."""
    quoted = escaped = False
    for c in text:
        if quoted:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
    return depth


def parse(hlo: str) -> dict[str, Computation]:
    """The computations of an HLO module's text, by name. An instruction may span lines (a Mosaic
    kernel's ``frontend_attributes`` carry multi-line JSON): lines are joined until its brackets
    close, so only a bare ``}`` ends a computation."""
    comps: dict[str, Computation] = {}
    cur = None
    pending, depth = "", 0
    for line in hlo.splitlines():
        if pending:
            pending, depth = pending + "\n" + line, _depth(line, depth)
            if depth > 0:
                continue
            line, pending = pending, ""
        elif cur is not None and line.strip() != "}" and _depth(line) > 0:
            pending, depth = line, _depth(line)
            continue
        head = _COMP_HEAD.match(line)
        if head and line.rstrip().endswith("{"):
            cur = Computation(head.group(2), bool(head.group(1)))
            comps[cur.name] = cur
            continue
        if cur is None:
            continue
        if line.strip() == "}":
            cur = None
            continue
        inst = _parse_inst(line)
        if inst is None:
            continue
        cur.insts.append(inst)
        if inst.op == "parameter" and inst.args.strip().isdigit():
            cur.params[int(inst.args)] = inst.name
    return comps


def _called(inst: Inst, key: str) -> str | None:
    m = re.search(key + r"=%([^\s,}]+)", inst.attrs)
    return m.group(1) if m else None


def _partial_read(comp: Computation, pname: str, comps: dict[str, Computation], depth: int = 0) -> float | None:
    """Bytes a fused computation reads of its parameter ``pname`` when it takes only slices of it:
    every user a ``dynamic-slice`` / ``slice`` / ``gather`` of it, or a nested fusion that in turn
    only slices it (a scanned layer's weights: the matmul fusion's operand is the whole
    ``[layers, ...]`` stack, its inner fusion slices the iteration's layer). None: read whole."""
    users = [i for i in comp.insts if pname in i.operands]
    if not users or depth > 8:
        return None
    total = 0.0
    for u in users:
        if u.op in _PARTIAL_READS and u.operands[0] == pname and pname not in u.operands[1:]:
            total += sum(b for b, _ in arrays(u.shape))
            continue
        inner = comps.get(_called(u, "calls") or "") if u.op == "fusion" else None
        if inner is None:
            return None
        for j, o in enumerate(u.operands):
            if o != pname:
                continue
            r = _partial_read(inner, inner.params.get(j, ""), comps, depth + 1)
            if r is None:
                return None
            total += r
    return total


def _fusion_reads(inst: Inst, fused: Computation | None, shapes: dict[str, str],
                  comps: dict[str, Computation] | None = None) -> float:
    """HBM bytes a fusion reads from its operands."""
    total = 0.0
    if fused is None:
        return sum(in_hbm(shapes.get(o, "")) for o in inst.operands)
    users: dict[str, list[Inst]] = {}
    for i in fused.insts:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    for j, o in enumerate(inst.operands):
        full = in_hbm(shapes.get(o, ""))
        if not full:
            continue
        pname = fused.params.get(j)
        us = users.get(pname, []) if pname else []
        if us and all(u.op in _IN_PLACE and u.operands[0] == pname for u in us):
            continue  # updated in place: the write is counted, the rest is not read
        part = _partial_read(fused, pname, comps or {}) if pname else None
        total += full if part is None else min(part, full)
    return total


def _fusion_writes(inst: Inst, fused: Computation | None) -> float:
    out = in_hbm(inst.shape)
    if fused is None or not out:
        return out
    root = fused.insts[-1] if fused.insts else None  # the ROOT is the last instruction printed
    if root is not None and root.op in _IN_PLACE and root.operands[0] in fused.params.values():
        upd = fused.by_name().get(root.operands[_IN_PLACE[root.op]])
        return sum(b for b, _ in arrays(upd.shape)) if upd is not None else out
    return out


def trip_count(cond: Computation | None) -> int | None:
    """The static trip count of a ``while`` whose condition is a counted loop's (``lax.scan``,
    ``fori_loop`` with static bounds: ROOT ``compare(get-tuple-element(param, i), constant N),
    direction=LT``; JAX starts the counter at 0), else None."""
    if cond is None or not cond.insts:
        return None
    root = cond.insts[-1]
    if root.op != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2:
        return None
    by = cond.by_name()
    counter, bound = (by.get(o) for o in root.operands)
    if counter is None or bound is None or counter.op != "get-tuple-element" or bound.op != "constant":
        return None
    m = re.fullmatch(r"\s*(\d+)\s*", bound.args)
    return int(m.group(1)) if m else None


def _count(comp: Computation, comps: dict[str, Computation], shapes: dict[str, str], seen: set) -> float:
    total = 0.0
    for inst in comp.insts:
        op = inst.op
        if op in _NO_TRAFFIC or op.endswith("-done"):
            continue
        if op == "while":
            body = comps.get(_called(inst, "body") or "")
            cond = comps.get(_called(inst, "condition") or "")
            trips = trip_count(cond) or 1
            for c in (body, cond):
                if c is not None and c.name not in seen:
                    total += trips * _count(c, comps, shapes, seen | {c.name})
            continue
        if op in ("call", "conditional"):
            for c in re.findall(r"%([^\s,}]+)", inst.attrs):
                if c in comps and c not in seen and not comps[c].entry:
                    total += _count(comps[c], comps, shapes, seen | {c})
            continue
        if op == "fusion":
            fused = comps.get(_called(inst, "calls") or "")
            total += _fusion_reads(inst, fused, shapes, comps) + _fusion_writes(inst, fused)
            continue
        if op in _IN_PLACE:
            j = _IN_PLACE[op]
            upd = arrays(shapes.get(inst.operands[j], ""))
            total += sum(b for b, _ in upd) if in_hbm(inst.shape) else 0.0
            total += sum(in_hbm(shapes.get(o, "")) for o in inst.operands[1:] if o != inst.operands[0])
            continue
        if op == "async-start" or (op.endswith("-start") and inst.shape.startswith("((")):
            parts = arrays(inst.shape)  # ((operands...), destination, context)
            n_in = len(arrays(inst.shape[1:_balanced(inst.shape, 1)])) if inst.shape.startswith("((") else 0
            dest = parts[n_in] if len(parts) > n_in else (0, 1)
            src_hbm = any(in_hbm(shapes.get(o, "")) for o in inst.operands)
            total += (dest[0] if src_hbm else 0.0) + (dest[0] if dest[1] == 0 else 0.0)
            continue
        if op == "copy-start":
            parts = arrays(inst.shape)  # (destination, source, context)
            total += sum(in_hbm(shapes.get(o, "")) for o in inst.operands)
            total += parts[0][0] if parts and parts[0][1] == 0 else 0.0
            continue
        if op.endswith("-start"):  # collectives: the operands are read, the result written
            total += sum(in_hbm(shapes.get(o, "")) for o in inst.operands)
            parts = arrays(inst.shape)
            total += parts[-1][0] if parts and parts[-1][1] == 0 else 0.0
            continue
        whole = sum(in_hbm(shapes.get(o, "")) for o in inst.operands) + in_hbm(inst.shape)
        if op == "custom-call" and "tpu_custom_call" in inst.attrs:
            declared = _DECLARED.search(inst.attrs)
            if declared:
                whole = min(whole, float(declared.group(1)))
        total += whole
    return total


def hbm_bytes(hlo: str) -> float:
    """Bytes a compiled program moves to and from HBM per run (its entry computation; a counted
    loop's body per iteration, any other loop's once), from its optimised HLO text
    (``compiled.as_text()``)."""
    comps = parse(hlo)
    entry = next((c for c in comps.values() if c.entry), None)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    shapes = {i.name: i.shape for c in comps.values() for i in c.insts}
    return _count(entry, comps, shapes, {entry.name})

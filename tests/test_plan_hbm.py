"""specjax.plan.hbm on hand-written optimised HLO (the shapes and layouts the TPU compiler prints):
each rule of what crosses HBM, against the count worked out by hand."""

from __future__ import annotations

import pytest

from specjax.plan import hbm

MB = 1 << 20

# A decode-step shape: a [1024, 512] bf16 weight (1 MiB) prefetched into VMEM by two async slices and
# concatenated on chip, a second weight read in place by a fusion, an embedding row gathered by a
# fusion, a cache row written in place, and a copy of the cache back to HBM.
STEP = """HloModule jit_step, entry_computation_layout={()}

%fused_embed (param_0.1: bf16[4096,512], param_1.1: s32[]) -> bf16[1,512] {
  %param_0.1 = bf16[4096,512]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1.1 = s32[]{:T(128)} parameter(1)
  %constant.1 = s32[]{:T(128)} constant(0)
  ROOT %dynamic-slice.1 = bf16[1,512]{1,0:T(2,128)(2,1)S(1)} dynamic-slice(%param_0.1, %param_1.1, %constant.1), dynamic_slice_sizes={1,512}
}

%fused_matvec (param_0.2: bf16[1024,512], param_1.2: bf16[512]) -> f32[1024] {
  %param_0.2 = bf16[1024,512]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1.2 = bf16[512]{0:T(512)(128)(2,1)S(1)} parameter(1)
  %broadcast.2 = bf16[1024,512]{1,0} broadcast(%param_1.2), dimensions={1}
  %multiply.2 = bf16[1024,512]{1,0} multiply(%param_0.2, %broadcast.2)
  %convert.2 = f32[1024,512]{1,0} convert(%multiply.2)
  %constant.2 = f32[] constant(0)
  ROOT %reduce.2 = f32[1024]{0:T(1024)S(1)} reduce(%convert.2, %constant.2), dimensions={1}, to_apply=%add
}

%fused_write (param_0.3: bf16[1,4096,128], param_1.3: bf16[1,1,128], param_2.3: s32[]) -> bf16[1,4096,128] {
  %param_0.3 = bf16[1,4096,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %param_1.3 = bf16[1,1,128]{2,1,0:T(2,128)(2,1)S(1)} parameter(1)
  %param_2.3 = s32[]{:T(128)} parameter(2)
  %constant.3 = s32[]{:T(128)} constant(0)
  ROOT %dynamic-update-slice.3 = bf16[1,4096,128]{2,1,0:T(8,128)(2,1)} dynamic-update-slice(%param_0.3, %param_1.3, %constant.3, %param_2.3, %constant.3)
}

%async_computation (param_0.4: bf16[1024,512]) -> bf16[512,512] {
  %param_0.4 = bf16[1024,512]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %slice.4 = bf16[512,512]{1,0:T(8,128)(2,1)S(1)} slice(%param_0.4), slice={[0:512], [0:512]}
}

%async_computation.1 (param_0.5: bf16[1024,512]) -> bf16[512,512] {
  %param_0.5 = bf16[1024,512]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %slice.5 = bf16[512,512]{1,0:T(8,128)(2,1)S(1)} slice(%param_0.5), slice={[512:1024], [0:512]}
}

ENTRY %main (w.1: bf16[1024,512], w.2: bf16[1024,512], emb: bf16[4096,512], cache: bf16[1,4096,128], pos: s32[]) -> bf16[1,4096,128] {
  %w.1 = bf16[1024,512]{1,0:T(8,128)(2,1)} parameter(0)
  %w.2 = bf16[1024,512]{1,0:T(8,128)(2,1)} parameter(1)
  %emb = bf16[4096,512]{1,0:T(8,128)(2,1)} parameter(2)
  %cache = bf16[1,4096,128]{2,1,0:T(8,128)(2,1)} parameter(3)
  %pos = s32[]{:T(128)} parameter(4)
  %row = bf16[1,512]{1,0:T(2,128)(2,1)S(1)} fusion(%emb, %pos), kind=kLoop, calls=%fused_embed
  %x = bf16[512]{0:T(512)(128)(2,1)S(1)} bitcast(%row)
  %slice-start = ((bf16[1024,512]{1,0:T(8,128)(2,1)}), bf16[512,512]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) async-start(%w.1), calls=%async_computation
  %slice-start.1 = ((bf16[1024,512]{1,0:T(8,128)(2,1)}), bf16[512,512]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) async-start(%w.1), calls=%async_computation.1
  %slice-done = bf16[512,512]{1,0:T(8,128)(2,1)S(1)} async-done(%slice-start)
  %slice-done.1 = bf16[512,512]{1,0:T(8,128)(2,1)S(1)} async-done(%slice-start.1)
  %w.1v = bf16[1024,512]{1,0:T(8,128)(2,1)S(1)} custom-call(%slice-done, %slice-done.1), custom_call_target="ConcatBitcast"
  %h.1 = f32[1024]{0:T(1024)S(1)} fusion(%w.1v, %x), kind=kLoop, calls=%fused_matvec
  %h.2 = f32[1024]{0:T(1024)S(1)} fusion(%w.2, %x), kind=kLoop, calls=%fused_matvec
  %k = bf16[1,1,128]{2,1,0:T(2,128)(2,1)S(1)} bitcast(%h.1)
  %new = bf16[1,4096,128]{2,1,0:T(8,128)(2,1)} fusion(%cache, %k, %pos), kind=kLoop, calls=%fused_write
  %copy-start = (bf16[1,4096,128]{2,1,0:T(8,128)(2,1)}, bf16[1,4096,128]{2,1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}) copy-start(%h.2)
  %copy-done = bf16[1,4096,128]{2,1,0:T(8,128)(2,1)} copy-done(%copy-start)
  ROOT %t = (bf16[1,4096,128]{2,1,0:T(8,128)(2,1)}) tuple(%new)
}
"""


def test_arrays_and_memory_spaces():
    assert hbm.arrays("bf16[1024,512]{1,0:T(8,128)(2,1)}") == [(1 * MB, 0)]
    assert hbm.arrays("f32[64]{0:T(128)S(1)}") == [(256, 1)]
    tup = "((bf16[8,8]{1,0}), bf16[4,8]{1,0:S(1)}, s32[]{:S(2)})"
    assert hbm.arrays(tup) == [(128, 0), (64, 1), (4, 2)] and hbm.in_hbm(tup) == 128


def test_parse_reads_computations_parameters_and_operands():
    comps = hbm.parse(STEP)
    entry = [c for c in comps.values() if c.entry]
    assert len(entry) == 1 and entry[0].name == "main" and len(entry[0].params) == 5
    fused = comps["fused_write"]
    assert fused.params == {0: "param_0.3", 1: "param_1.3", 2: "param_2.3"}
    root = fused.insts[-1]
    assert root.op == "dynamic-update-slice" and root.operands[:2] == ["param_0.3", "param_1.3"]
    start = entry[0].by_name()["slice-start"]
    assert start.op == "async-start" and start.operands == ["w.1"]


def test_each_weight_once_one_embedding_row_and_in_place_writes():
    want = (
        1 * MB        # w.1 through two async slices into VMEM (each reads its half once)
        + 0           # ConcatBitcast and the fusion read VMEM
        + 1 * MB      # w.2 read in place by its fusion
        + 512 * 2     # the embedding: one row, not the 4 MiB table
        + 128 * 2     # the cache row written in place (the 1 MiB cache is not read or rewritten)
        + 1 * MB      # the copy of a VMEM value to HBM: the destination written
        + 2 * 4       # the position scalar (in HBM), read by the two fusions that take it
    )
    assert hbm.hbm_bytes(STEP) == pytest.approx(want)


def test_a_while_body_counts_once_and_a_missing_entry_is_an_error():
    loop = """HloModule m

%body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[256]{0} get-tuple-element(%p), index=1
  %n = f32[256]{0} negate(%v)
  ROOT %t = (s32[], f32[256]{0}) tuple(%i, %n)
}

%cond (p.1: (s32[], f32[256])) -> pred[] {
  %p.1 = (s32[], f32[256]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: (s32[], f32[256])) -> (s32[], f32[256]) {
  %a = (s32[], f32[256]{0}) parameter(0)
  ROOT %w = (s32[], f32[256]{0}) while(%a), condition=%cond, body=%body
}
"""
    assert hbm.hbm_bytes(loop) == 2 * 256 * 4  # the negate's read and write, once
    with pytest.raises(ValueError, match="no ENTRY"):
        hbm.hbm_bytes(loop.replace("ENTRY ", ""))


def test_a_scanned_layer_counts_its_body_per_iteration_and_reads_one_layer_of_the_stack():
    """A ``lax.scan`` over 4 stacked [512, 256] bf16 weights (256 KiB each): the body's matmul
    fusion takes the whole stack, its nested fusion slices the iteration's layer. Per iteration:
    one layer's weight, the [8, 512] f32 input read and the [8, 256] f32 output written; 4 times."""
    scan = """HloModule m

%slice_layer (param_0.1: bf16[4,512,256], param_1.1: s32[]) -> bf16[512,256] {
  %param_0.1 = bf16[4,512,256]{2,1,0:T(8,128)(2,1)} parameter(0)
  %param_1.1 = s32[]{:T(128)} parameter(1)
  %constant.1 = s32[]{:T(128)} constant(0)
  %ds.1 = bf16[1,512,256]{2,1,0:T(8,128)(2,1)} dynamic-slice(%param_0.1, %param_1.1, %constant.1, %constant.1), dynamic_slice_sizes={1,512,256}
  ROOT %b.1 = bf16[512,256]{1,0:T(8,128)(2,1)} bitcast(%ds.1)
}

%matmul (param_0.2: f32[8,512], param_1.2: bf16[4,512,256], param_2.2: s32[]) -> f32[8,256] {
  %param_0.2 = f32[8,512]{1,0:T(8,128)} parameter(0)
  %param_1.2 = bf16[4,512,256]{2,1,0:T(8,128)(2,1)} parameter(1)
  %param_2.2 = s32[]{:T(128)} parameter(2)
  %w.2 = bf16[512,256]{1,0:T(8,128)(2,1)} fusion(%param_1.2, %param_2.2), kind=kLoop, calls=%slice_layer
  %c.2 = f32[512,256]{1,0:T(8,128)} convert(%w.2)
  ROOT %d.2 = f32[8,256]{1,0:T(8,128)} dot(%param_0.2, %c.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], f32[8,512], bf16[4,512,256])) -> (s32[], f32[8,512], bf16[4,512,256]) {
  %p = (s32[], f32[8,512]{1,0:T(8,128)}, bf16[4,512,256]{2,1,0:T(8,128)(2,1)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %x = f32[8,512]{1,0:T(8,128)} get-tuple-element(%p), index=1
  %ws = bf16[4,512,256]{2,1,0:T(8,128)(2,1)} get-tuple-element(%p), index=2
  %y = f32[8,256]{1,0:T(8,128)} fusion(%x, %ws, %i), kind=kOutput, calls=%matmul
  %one = s32[]{:T(128)} constant(1)
  %i1 = s32[]{:T(128)} add(%i, %one)
  ROOT %t = (s32[], f32[8,512]{1,0:T(8,128)}, bf16[4,512,256]{2,1,0:T(8,128)(2,1)}) tuple(%i1, %x, %ws)
}

%cond (p.1: (s32[], f32[8,512], bf16[4,512,256])) -> pred[] {
  %p.1 = (s32[], f32[8,512]{1,0:T(8,128)}, bf16[4,512,256]{2,1,0:T(8,128)(2,1)}) parameter(0)
  %n.1 = s32[]{:T(128)} constant(4)
  %i.1 = s32[]{:T(128)} get-tuple-element(%p.1), index=0
  ROOT %lt.1 = pred[]{:T(512)} compare(%i.1, %n.1), direction=LT
}

ENTRY %main (a: (s32[], f32[8,512], bf16[4,512,256])) -> (s32[], f32[8,512], bf16[4,512,256]) {
  %a = (s32[], f32[8,512]{1,0:T(8,128)}, bf16[4,512,256]{2,1,0:T(8,128)(2,1)}) parameter(0)
  ROOT %w = (s32[], f32[8,512]{1,0:T(8,128)}, bf16[4,512,256]{2,1,0:T(8,128)(2,1)}) while(%a), condition=%cond, body=%body
}
"""
    comps = hbm.parse(scan)
    assert hbm.trip_count(comps["cond"]) == 4
    # per iteration, besides the layer's weight, the input and the output: the fusion reads the counter
    # (4 bytes), the counter's add reads 8 and writes 4, the condition's compare reads 8 and writes 1
    per = 512 * 256 * 2 + 8 * 512 * 4 + 8 * 256 * 4 + 4 + 12 + 9
    assert hbm.hbm_bytes(scan) == 4 * per
    # a condition that is not a counted loop's (a decode loop's `not done`) counts the body once
    assert hbm.hbm_bytes(scan.replace("direction=LT", "direction=NE")) == per


def test_slice_start_reads_its_slice_as_async_start_does():
    """The same prefetch printed as ``slice-start`` (another libtpu's spelling) counts the same."""
    alt = STEP.replace("async-start(%w.1), calls=%async_computation.1", "slice-start(%w.1), slice={[512:1024], [0:512]}")
    alt = alt.replace("async-start(%w.1), calls=%async_computation", "slice-start(%w.1), slice={[0:512], [0:512]}")
    assert alt.count("slice-start(") == 2
    assert hbm.hbm_bytes(alt) == hbm.hbm_bytes(STEP)


def test_a_fused_cache_scatter_writes_its_rows_in_place():
    """A batched KV-cache write (a scatter into the cache parameter, as the B=8 decode step does):
    the new rows are written; the 8 MiB cache is neither read nor rewritten."""
    hlo = """HloModule m

%fused_scatter (param_0: bf16[8,4096,128], param_1: s32[8,1], param_2: bf16[8,1,128]) -> bf16[8,4096,128] {
  %param_0 = bf16[8,4096,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = s32[8,1]{1,0:T(8,128)S(1)} parameter(1)
  %param_2 = bf16[8,1,128]{2,1,0:T(8,128)(2,1)S(1)} parameter(2)
  ROOT %scatter.1 = bf16[8,4096,128]{2,1,0:T(8,128)(2,1)} scatter(%param_0, %param_1, %param_2), update_window_dims={1,2}, inserted_window_dims={}, scatter_dims_to_operand_dims={1}, index_vector_dim=1, to_apply=%assign
}

ENTRY %main (cache: bf16[8,4096,128], idx: s32[8,1], rows: bf16[8,1,128]) -> bf16[8,4096,128] {
  %cache = bf16[8,4096,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %idx = s32[8,1]{1,0:T(8,128)S(1)} parameter(1)
  %rows = bf16[8,1,128]{2,1,0:T(8,128)(2,1)S(1)} parameter(2)
  ROOT %new = bf16[8,4096,128]{2,1,0:T(8,128)(2,1)} fusion(%cache, %idx, %rows), kind=kLoop, calls=%fused_scatter
}
"""
    assert hbm.hbm_bytes(hlo) == 8 * 128 * 2


def test_an_instruction_spanning_lines_ends_no_computation():
    """A Mosaic kernel's ``frontend_attributes`` carry multi-line JSON whose lines start with ``}``
    (splash attention's ``kernel_metadata``): the instructions after it still count."""
    kernel = """HloModule m

ENTRY %main (a: f32[256], b: f32[256]) -> f32[256] {
  %a = f32[256]{0} parameter(0)
  %b = f32[256]{0} parameter(1)
  %k = f32[256]{0} custom-call(%a), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 512, \\"note\\": \\"a } and a { in a string\\"}"
}}, metadata={op_name="pallas_call"}
  %n = f32[256]{0} negate(%b)
  ROOT %s = f32[256]{0} add(%k, %n)
}
"""
    comps = hbm.parse(kernel)
    assert [i.name for i in comps["main"].insts] == ["a", "b", "k", "n", "s"]
    assert comps["main"].by_name()["k"].op == "custom-call"
    assert hbm.hbm_bytes(kernel) == 1024 * (2 + 2 + 3)  # kernel, negate: read + write; add: two reads + write


def test_a_kernel_declaring_its_bytes_is_charged_them_where_they_are_less():
    """A Mosaic kernel reading a layer of a stacked [L, ...] cache by a prefetched index takes the
    whole stack as its operand: it is charged the ``bytes_accessed`` of its cost estimate (the
    decode kernel's: every slot of one layer), never more than its whole operands and result."""
    def hlo(declared):
        return f"""HloModule m

ENTRY %main (i: s32[1], kv: bf16[32,8,1,4096,128], q: bf16[8,1,4,128]) -> bf16[8,1,4,128] {{
  %i = s32[1]{{0}} parameter(0)
  %kv = bf16[32,8,1,4096,128]{{4,3,2,1,0}} parameter(1)
  %q = bf16[8,1,4,128]{{3,2,1,0}} parameter(2)
  ROOT %k = bf16[8,1,4,128]{{3,2,1,0}} custom-call(%i, %q, %kv), custom_call_target="tpu_custom_call", backend_config={{"custom_call_config": {{"cost_estimate":{{"flops":"1","transcendentals":"0","bytes_accessed":"{declared}"}}}}}}
}}
"""
    whole = 4 + 32 * 8 * 4096 * 128 * 2 + 2 * (8 * 4 * 128 * 2)
    one_layer = 8 * 4096 * 128 * 2
    assert hbm.hbm_bytes(hlo(one_layer)) == one_layer
    assert hbm.hbm_bytes(hlo(10 * whole)) == whole
    assert hbm.hbm_bytes(hlo(1).replace("bytes_accessed", "other")) == whole

"""Pallas TPU attention kernels and their selection (#23 scope 3).

* :mod:`~specjax.kernels.tpu.masks` -- :class:`MaskSpec`: causal / sliding / segment ids,
  EAGLE-3 TTT, runtime dense masks (DFlash, DSpark, P-EAGLE), and their dense XLA form.
* :mod:`~specjax.kernels.tpu.splash` -- flash attention on jax's splash kernel (forward and
  backward), GQA, shard_map wrapper.
* :mod:`~specjax.kernels.tpu.decode` -- attention over a KV cache reading only each sequence's
  visible blocks (scalar-prefetched block ranges).
* :mod:`~specjax.kernels.tpu.dispatch` -- :func:`attention_impl` (from the placement the program
  is built for) and the entry points :func:`tpu_attention`, :func:`cache_attention`,
  :func:`tree_cache_attention`.

Unlike the parent package's native CPU kernels nothing here is built: the kernels are Mosaic
programs compiled with the TPU program (or run in Pallas interpret mode on the CPU in tests).
"""

from specjax.kernels.tpu.decode import decode_attention, merge_attention, position_ranges
from specjax.kernels.tpu.dispatch import (IMPLS, AttentionImplError, attention_impl, cache_attention, cache_slots,
                                          pallas_interpret, range_mask, tpu_attention, tree_cache_attention,
                                          tree_rows_attention)
from specjax.kernels.tpu.masks import MaskSpec, MaskSpecError, causal, dense, dense_mask, segments_from_documents, ttt
from specjax.kernels.tpu.splash import (KernelShapeError, count_kernel_flops, flash_attention, forward_only,
                                        sharded_flash_attention)

__all__ = ["IMPLS", "AttentionImplError", "KernelShapeError", "MaskSpec", "MaskSpecError", "attention_impl",
           "cache_attention", "cache_slots", "causal", "count_kernel_flops", "decode_attention", "dense", "dense_mask", "flash_attention", "forward_only",
           "merge_attention", "pallas_interpret", "position_ranges", "range_mask", "segments_from_documents",
           "sharded_flash_attention", "tpu_attention", "tree_cache_attention", "tree_rows_attention", "ttt"]

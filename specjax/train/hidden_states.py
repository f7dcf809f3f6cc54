"""Target hidden states in speculators' on-disk cache format, and their extraction by the JAX target.

One file per dataset row ``i``: ``<data>/hidden_states/hs_{i}.safetensors`` with

    hidden_states  [T, L, H]  the serving dtype (bf16 by default): the aux layers in the draft's
                              order, then the final pre-norm state (layer id n) last
    token_ids      [T]        int64, the row's input_ids

(hs_connectors' ``ExampleHiddenStatesConnector`` / ``FileTransfer`` layout, REFERENCE 5.2). Layer
id k < n is the residual stream entering decoder layer k (HF ``hidden_states[k]``), id n the
final state *before* the final norm. speculators' dataset splits it as ``hs[:, :-1]`` (aux,
flattened) and ``hs[:, -1]`` (``verifier_last_hidden_states``).

Files are written to a temp name and renamed, so a killed extraction never leaves a partial file
under a final name; a header that does not parse is treated as missing and rewritten. specjax
adds ``__metadata__`` (``layer_ids``, ``target``) that speculators ignores.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import specjax.sharding as shd
from bridge.errors import BridgeError
from bridge.safetensors_io import SafetensorsFile, write_safetensors
from specjax import placement
from specjax.decode.batch import bucket as round_up, overlapped
from specjax.train.dataset import TokenRows
from specjax.train.errors import HiddenStateCacheError

HS_DIR = "hidden_states"
DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32),
          "float16": np.dtype(np.float16)}


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """speculators' default ``[2, n // 2, n - 3]``."""
    n = int(num_layers)
    return [2, n // 2, n - 3]


def cache_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """The stored layer set: the aux ids then the final pre-norm layer ``n`` (``--include-last-layer``)."""
    ids = [int(i) for i in aux_layer_ids]
    n = int(num_layers)
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > n:
        raise HiddenStateCacheError(f"aux layer ids {ids} must be distinct and within [0, {n}] for a target with "
                                    f"{n} layers", key="aux_layer_ids")
    if n in ids:
        raise HiddenStateCacheError(f"aux layer ids {ids} include the final layer {n}, which the cache always "
                                    "appends; pass the aux ids without it (as speculators' --target-layer-ids)",
                                    key="aux_layer_ids")
    return ids + [n]


def hs_path(directory: str | os.PathLike, i: int) -> Path:
    return Path(directory) / HS_DIR / f"hs_{int(i)}.safetensors"


def write_hs(path: str | os.PathLike, hidden_states: np.ndarray, token_ids: np.ndarray, *,
             metadata: dict[str, str] | None = None) -> None:
    hs = np.asarray(hidden_states)
    ids = np.asarray(token_ids, np.int64).reshape(-1)
    if hs.ndim != 3 or hs.shape[0] != ids.shape[0]:
        raise HiddenStateCacheError(f"hidden_states {list(hs.shape)} must be [T, L, H] with T = {ids.shape[0]} "
                                    "token ids", path=str(path))
    write_safetensors(path, {"hidden_states": hs, "token_ids": ids}, metadata)


@dataclass
class HSRecord:
    hidden_states: np.ndarray  # [T, L, H] (read-only view)
    token_ids: np.ndarray  # [T] int64
    metadata: dict


def read_hs(path: str | os.PathLike) -> HSRecord:
    try:
        f = SafetensorsFile(path)
    except BridgeError as e:
        raise HiddenStateCacheError(f"unreadable hidden-state file: {e}", path=str(path)) from None
    missing = [k for k in ("hidden_states", "token_ids") if k not in f.tensors]
    if missing:
        raise HiddenStateCacheError(f"keys {missing} are missing; found {sorted(f.tensors)}", path=str(path),
                                    key=missing[0])
    hs, ids = f.array("hidden_states"), f.array("token_ids")
    if hs.ndim != 3 or ids.ndim != 1 or hs.shape[0] != ids.shape[0]:
        raise HiddenStateCacheError(f"hidden_states {list(hs.shape)} and token_ids {list(ids.shape)}: expected "
                                    "[T, L, H] and [T]", path=str(path), key="hidden_states")
    if hs.dtype.kind not in "fV" and "float" not in hs.dtype.name:
        raise HiddenStateCacheError(f"hidden_states has dtype {hs.dtype}; expected a float dtype", path=str(path),
                                    key="hidden_states")
    if "float8" in hs.dtype.name:  # hs_connectors' FP8 connector: per-token scales beside the values
        if "hidden_states_scales" not in f.tensors:
            raise HiddenStateCacheError("float8 hidden_states without 'hidden_states_scales'; expected both (the "
                                        "FP8 hidden-states connector layout)", path=str(path), key="hidden_states")
        bf16 = DTYPES["bfloat16"]
        sc = np.asarray(f.array("hidden_states_scales")).astype(bf16)
        hs = np.asarray(hs).astype(bf16) * sc  # as hs_connectors does: both cast to bf16, product in bf16
    return HSRecord(hs, ids.astype(np.int64), dict(f.metadata))


def is_complete(path: Path) -> bool:
    """A file exists under its final name and its header parses (speculators'
    ``find_corrupt_hidden_state_indices`` test)."""
    if not path.is_file():
        return False
    try:
        SafetensorsFile(path)
    except BridgeError:
        return False
    return True


def check_record(rec: HSRecord, *, input_ids: np.ndarray, num_layers: int, hidden_size: int,
                 layer_ids: Sequence[int] | None = None, where: str = "", check_finite: bool = True) -> None:
    """Refuse a cached row that does not match the dataset row or the target."""
    ids = np.asarray(input_ids, np.int64)
    if rec.token_ids.shape != ids.shape or not np.array_equal(rec.token_ids, ids):
        n_diff = int((rec.token_ids[: len(ids)] != ids[: len(rec.token_ids)]).sum()) if len(ids) else 0
        raise HiddenStateCacheError(
            f"token_ids ({len(rec.token_ids)} tokens) do not match the dataset row ({len(ids)} tokens, {n_diff} ids "
            "differ); the cache was made from other data", path=where, key="token_ids")
    T, L, H = rec.hidden_states.shape
    if L != num_layers:
        raise HiddenStateCacheError(f"hidden_states holds {L} layers; expected {num_layers} (the aux layers plus the "
                                    "final pre-norm layer)", path=where, key="hidden_states")
    if H != hidden_size:
        raise HiddenStateCacheError(f"hidden size {H}; the target's is {hidden_size}", path=where, key="hidden_states")
    if layer_ids is not None and rec.metadata.get("layer_ids"):
        got = [int(x) for x in rec.metadata["layer_ids"].split(",")]
        if got != list(layer_ids):
            raise HiddenStateCacheError(f"cached layer ids {got}; expected {list(layer_ids)}", path=where,
                                        key="layer_ids")
    if check_finite and T:
        a = np.asarray(rec.hidden_states, np.float32)
        if not (np.isfinite(a.min()) and np.isfinite(a.max())):
            raise HiddenStateCacheError("hidden_states contain non-finite values", path=where, key="hidden_states")


# ----------------------------------------------------------------------------- extraction


def plan_batches(lengths: Sequence[int], *, max_tokens: int, bucket: int = 64, max_batch: int = 64) -> list[list[int]]:
    """Group row indices (sorted by length) into batches of one padded shape each, at most
    ``max_tokens`` padded tokens (and ``max_batch`` rows) per batch."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches, cur, cur_len = [], [], 0
    for i in order:
        L = round_up(lengths[i], bucket)
        if cur and (max(cur_len, L) * (len(cur) + 1) > max_tokens or len(cur) >= max_batch or L != cur_len):
            batches.append(cur)
            cur, cur_len = [], 0
        cur.append(i)
        cur_len = max(cur_len, L)
    if cur:
        batches.append(cur)
    return batches


class TapFn:
    """The jitted tap program of :func:`make_tap_fn`: ``fn(ids)`` runs it on host ids [B, T];
    ``fn.lower(ids)`` lowers it for ``ids`` given as a ``jax.ShapeDtypeStruct`` (or an array) with
    the params as they are (arrays or abstract leaves with shardings: a deviceless compile)."""

    def __init__(self, jitted, state, ids_sharding):
        self.jitted, self.state, self.ids_sharding = jitted, state, ids_sharding

    def _ids(self, ids):
        if isinstance(ids, jax.ShapeDtypeStruct):
            return ids if ids.sharding is not None or self.ids_sharding is None else jax.ShapeDtypeStruct(
                ids.shape, ids.dtype, sharding=self.ids_sharding)
        if self.ids_sharding is None:
            return jnp.asarray(ids)
        return shd.put(np.asarray(ids), self.ids_sharding)

    def __call__(self, ids):
        return self.jitted(self.state, self._ids(ids))

    def lower(self, ids):
        return self.jitted.lower(self.state, self._ids(ids))


def make_tap_fn(model, layer_ids: Sequence[int], out_dtype, mesh=None, *, compute: str = "float32") -> TapFn:
    """jitted ``ids [B, T] -> hidden [B, T, L, H]`` (right padding needs no mask: causal).

    With ``mesh`` the jit has explicit shardings: params as placed, ids split over
    ``("data", "fsdp")`` (B must be a multiple of ``data x fsdp``), output replicated (process 0
    writes it). ``ids`` is then a host array every process passes in full. ``model`` may be
    abstract (params ``ShapeDtypeStruct`` with shardings): then only :meth:`TapFn.lower` applies.

    ``compute="bfloat16"``: the matmuls in bf16 with float32 sums where the CPU kernels apply
    (:func:`specjax.models.panels.decode_state`, a single-device CPU model; float32 elsewhere)."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    if mesh is None and compute != "float32":
        from specjax.models import panels

        state = panels.decode_state(model, state, compute=compute)
    taps = tuple(int(i) for i in layer_ids)
    where = mesh if mesh is not None else placement.platform_of(state)

    def run(state, ids):
        with placement.building_for(where):
            return tapped_states(nnx.merge(graphdef, state), ids, taps, out_dtype)

    if mesh is None:
        return TapFn(jax.jit(run), state, None)
    ids_sh = shd.batch_sharding(mesh, 2)
    fn = jax.jit(run, in_shardings=(shd.shardings_of(state), ids_sh), out_shardings=shd.replicated(mesh))
    return TapFn(fn, state, ids_sh)


def tapped_states(model, ids, layer_ids: Sequence[int], out_dtype, **forward_kw):
    """The target's states at ``layer_ids`` for ids [B, T] (``forward_kw``: positions, segments):
    [B, T, L, H] in ``out_dtype``, the cache's layout; traced inside extraction and the online step."""
    out = model(ids, tap_ids=tuple(int(i) for i in layer_ids), return_logits=False, **forward_kw)
    return jnp.stack(out.aux_hidden_states, axis=2).astype(out_dtype)


def on_mesh(model, mesh):
    """The mesh the forward runs on (default: the params' own) and the model placed there by ``TARGET_RULES``."""
    if mesh is None:
        mesh = shd.mesh_of(model)
    elif shd.mesh_of(model) != mesh:
        from flax import nnx

        graphdef, state = nnx.split(model)  # a placed copy; the caller's model is left alone
        model = nnx.merge(graphdef, jax.device_put(state, shd.named_shardings(state, shd.TARGET_RULES, mesh)))
    return model, mesh


def _row_lengths(rows: TokenRows, todo: list[int], ctx: int) -> list[int]:
    """The token counts of the rows to extract; a row longer than the target's context is refused."""
    lengths = [len(rows.input_ids[i]) for i in todo]
    for i, L in zip(todo, lengths):
        if L > ctx:
            raise HiddenStateCacheError(f"row {i} has {L} tokens; the target's context is {ctx}", key="input_ids")
    return lengths


def _batch_ids(rows: TokenRows, idx: list[int], ctx: int, mesh) -> np.ndarray:
    """One batch's right-padded ids [B, T]: T rounded up to 64 (at most ``ctx``), B to the mesh's data x fsdp."""
    T = min(round_up(max(len(rows.input_ids[i]) for i in idx), 64), ctx)
    B = len(idx) if mesh is None else shd.pad_batch(len(idx), mesh)  # padding rows: token 0, dropped
    ids = np.zeros((B, T), np.int32)
    for r, i in enumerate(idx):
        ids[r, : len(rows.input_ids[i])] = rows.input_ids[i]
    return ids


def _write_batches(fn: TapFn, rows: TokenRows, data_dir, todo: list[int], batches: list[list[int]], *, ctx: int,
                   mesh, meta: dict, main: bool, bar, t0: float) -> int:
    """The tap program batch by batch, each row's file written by process 0; returns the tokens done.

    Software-pipelined (:func:`specjax.decode.batch.overlapped`): batch ``n + 1`` is dispatched
    before batch ``n`` is copied to the host and written."""
    done_tokens = 0

    def write(idx, out):
        nonlocal done_tokens
        hs = shd.to_host(out)
        for r, i in enumerate(idx):
            t = len(rows.input_ids[i])
            if main:
                write_hs(hs_path(data_dir, i), hs[r, :t], rows.input_ids[i], metadata=meta)
            done_tokens += t
            bar.update(t)
        el = time.perf_counter() - t0
        bar.set_postfix_str(f"{done_tokens / max(el, 1e-9):.0f} tok/s")

    overlapped([[todo[k] for k in b] for b in batches], lambda idx: fn(_batch_ids(rows, idx, ctx, mesh)), write)
    return done_tokens


def extract_hidden_states(model, rows: TokenRows, data_dir: str | os.PathLike, *, aux_layer_ids: Sequence[int],
                          dtype: str = "bfloat16", max_batch_tokens: int = 4096, indices: Sequence[int] | None = None,
                          progress: bool = True, target_name: str = "", log: Callable[[str], None] | None = None,
                          mesh=None, compute: str = "float32") -> dict:
    """Write ``hs_{i}.safetensors`` for every row that lacks a complete file (resumable).

    ``model``: a specjax target (``CausalLM``). Returns ``{"written", "skipped", "tokens", "seconds"}``.

    ``mesh``: run the target's forward on it (default: the mesh the model's params already live
    on, ``specjax.sharding.mesh_of``; ``None`` for a single-device model). A model not on the
    mesh is placed there by ``TARGET_RULES`` first. Each batch is padded to a multiple of
    ``data x fsdp`` rows (padding rows are dropped) and split over ``("data", "fsdp")``; every
    process computes, only process 0 writes files.
    """
    from tqdm.auto import tqdm

    model, mesh = on_mesh(model, mesh)
    main = shd.is_main_process()
    progress = progress and main

    n = model.config.num_hidden_layers
    layer_ids = cache_layer_ids(aux_layer_ids, n)
    if dtype not in DTYPES:
        raise HiddenStateCacheError(f"hidden-state dtype {dtype!r}; expected one of {sorted(DTYPES)}", key="dtype")
    out_np = DTYPES[dtype]
    todo_all = list(range(len(rows))) if indices is None else [int(i) for i in indices]
    todo = [i for i in todo_all if not is_complete(hs_path(data_dir, i))]
    shd.sync("specjax-extract-plan")  # every process has its plan before process 0 writes a file
    skipped = len(todo_all) - len(todo)
    hs_dir = Path(data_dir) / HS_DIR
    if main:
        hs_dir.mkdir(parents=True, exist_ok=True)
    meta = {"layer_ids": ",".join(map(str, layer_ids)), "target": str(target_name), "format": "pt"}
    ctx = int(model.config.max_position_embeddings)
    lengths = _row_lengths(rows, todo, ctx)
    batches = plan_batches(lengths, max_tokens=max_batch_tokens)
    fn = make_tap_fn(model, layer_ids, jnp.dtype(out_np), mesh, compute=compute)
    total = int(sum(lengths))
    t0 = time.perf_counter()
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc="hidden states", disable=not progress,
               dynamic_ncols=True)
    if skipped and log and main:
        log(f"{skipped} of {len(todo_all)} rows already cached; extracting {len(todo)}")
    done_tokens = _write_batches(fn, rows, data_dir, todo, batches, ctx=ctx, mesh=mesh, meta=meta, main=main, bar=bar,
                                 t0=t0)
    bar.close()
    shd.sync("specjax-extract-done")
    return {"written": len(todo), "skipped": skipped, "tokens": done_tokens,
            "seconds": round(time.perf_counter() - t0, 3), "layer_ids": layer_ids}


def verify_cache(rows: TokenRows, data_dir: str | os.PathLike, *, aux_layer_ids: Sequence[int], num_layers: int,
                 hidden_size: int, indices: Sequence[int] | None = None, sample: int | None = None,
                 check_finite: bool = False) -> None:
    """Check cached rows against the dataset and the target before any long work starts
    (every row's header; ``sample`` rows' token ids in full)."""
    layer_ids = cache_layer_ids(aux_layer_ids, num_layers)
    idx = list(range(len(rows))) if indices is None else list(indices)
    missing = [i for i in idx if not is_complete(hs_path(data_dir, i))]
    if missing:
        raise HiddenStateCacheError(f"{len(missing)} of {len(idx)} rows have no complete hidden-state file (e.g. "
                                    f"hs_{missing[0]}.safetensors); run `specjax data extract` first",
                                    path=str(Path(data_dir) / HS_DIR))
    step = 1 if not sample else max(1, math.ceil(len(idx) / sample))
    for i in idx[::step]:
        p = hs_path(data_dir, i)
        check_record(read_hs(p), input_ids=rows.input_ids[i], num_layers=len(layer_ids), hidden_size=hidden_size,
                     layer_ids=layer_ids, where=str(p), check_finite=check_finite)

"""Shared decoder building blocks (targets and drafts), with HF parameter names.

Param paths match the HF / speculators tensor names through ``bridge.layout`` (``q_proj.weight``
[out, in] <-> ``q_proj.kernel`` [in, out]; ``*norm.weight`` <-> ``*norm.scale``), so a tree from
``layout.unflatten`` loads 1:1 with :func:`specjax.models.params.load_tree`.

Shapes: ``x`` [batch, seq, hidden]; per-head tensors [batch, seq, heads, head_dim]; attention
masks are boolean ``[batch, 1 or heads, q_len, kv_len]`` with True = may attend.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import placement
from specjax.kernels import ops as native_ops
from specjax.models import panels
from specjax.models.rope import apply_rope

INIT_STD = 0.02  # HF initializer_range default; speculators inits Linear/Embedding N(0, 0.02)


LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _dot(a, b, ca: int, cb: int, nb: int, out=jnp.float32):
    """``dot_general`` contracting ``a``'s dim ``ca`` with ``b``'s dim ``cb``, the first ``nb``
    dims batch dims, accumulated in float32 and returned as ``out``."""
    batch = tuple(range(nb))
    return jax.lax.dot_general(a, b, (((ca,), (cb,)), (batch, batch)), preferred_element_type=out)


def dot_tn(a, b):
    """``a^T b`` over the rows: ``a`` [..., M, K], ``b`` [..., M, N] -> float32 [..., K, N] (a
    weight gradient), leading dims batch dims.

    XLA's CPU backend hands a dot to YNNPACK only when the left operand is row-major with its
    contraction minor, so ``a^T b`` of bf16 operands runs as a float32 Eigen dot (measured 180-250
    GFLOP/s on one core against 350-470 for YNNPACK's bf16). On the CPU ``a`` is therefore
    transposed into memory first; XLA would fold a bare transpose back into the dot, so the
    transposed copy and ``b`` get a few zero rows of padding along ``M`` (exact: zeros add nothing).
    When ``a`` is the larger operand (attention's ``p^T dO``: ``a`` is [T, T], ``b`` [T, D]) the
    product is computed as ``(b^T a)^T`` instead, which transposes ``b`` and the small result
    rather than ``a`` (the optimisation barrier keeps XLA from folding the output transpose into
    the dot, which the CPU backend then cannot run in bf16); the cheaper of the two is taken by
    the elements moved: ``M K`` against ``M N + K N``. Other backends take the contraction as it is.
    The backend is the one the program is built for (:func:`specjax.placement.platform`), so a
    program compiled for a TPU from a CPU host takes the plain contraction."""
    nb = a.ndim - 2
    if jnp.dtype(a.dtype) not in LOW_PRECISION or not placement.is_cpu():
        return _dot(a, b, nb, nb, nb)
    (M, K), N = a.shape[-2:], b.shape[-1]
    pad = 16 - M % 16
    if M * K <= (M + K) * N:
        at = jnp.pad(jnp.swapaxes(a, -1, -2), [(0, 0)] * (nb + 1) + [(0, pad)])
        bp = jnp.pad(b, [(0, 0)] * nb + [(0, pad), (0, 0)])
        return _dot(at, bp, nb + 1, nb, nb)
    bt = jnp.pad(jnp.swapaxes(b, -1, -2), [(0, 0)] * (nb + 1) + [(0, pad)])
    ap = jnp.pad(a, [(0, 0)] * nb + [(0, pad), (0, 0)])
    return jnp.swapaxes(jax.lax.optimization_barrier(_dot(bt, ap, nb + 1, nb, nb)), -1, -2)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def bmm_f32acc(x, w, transpose_rhs: bool = False, keep_f32: bool = False):
    """Batched ``x @ w`` (``x @ w^T`` with ``transpose_rhs``) for same-dtype operands whose
    leading dims are batch dims: ``x`` [..., M, K], ``w`` [..., K, N] (or [..., N, K]). Products
    accumulate in float32; the result is float32 with ``keep_f32`` (attention scores), else
    rounded once to ``x.dtype`` (torch autocast's matmul).

    Written out because XLA's CPU backend runs a ``bf16 x bf16 -> bf16`` dot as a float32 dot
    (it upcasts both operands), while ``bf16 x bf16 -> f32`` runs natively on YNNPACK (measured
    2x faster on one AVX-512-BF16 core). The backward keeps the same contract: the cotangent is
    rounded to ``x.dtype``, both gradient products accumulate in float32, and the transposed one
    goes through :func:`dot_tn`."""
    return _bmm(x, w, transpose_rhs, keep_f32)


def _bmm(x, w, transpose_rhs, keep_f32):
    # On the CPU the float32 result, rounded once, is what runs natively (docstring). TPU / GPU
    # matrix units accumulate a bf16 dot in float32 and round once too, so there the dot returns
    # x.dtype directly; that also makes a tensor-parallel layer (o_proj, down_proj: contraction
    # split over chips) send bf16 partial sums to its all-reduce, as vLLM and Megatron do, where
    # the float32 dot wrote and sent float32 [T, H] partials (an 8B extraction row on v5e-8:
    # 42.1 -> 33.5 GB of HBM traffic).
    out = jnp.float32 if keep_f32 or placement.is_cpu() else x.dtype
    y = _dot(x, w, x.ndim - 1, w.ndim - 1 if transpose_rhs else w.ndim - 2, x.ndim - 2, out)
    return y if keep_f32 else y.astype(x.dtype)


def _bmm_fwd(x, w, transpose_rhs, keep_f32):
    return _bmm(x, w, transpose_rhs, keep_f32), (x, w)


def _bmm_bwd(transpose_rhs, keep_f32, res, g):
    x, w = res
    g = g.astype(x.dtype)
    nb = x.ndim - 2
    if transpose_rhs:  # out = x w^T: dx = g w, dw = g^T x
        dx, dw = _dot(g, w, nb + 1, nb, nb), dot_tn(g, x)
    else:  # out = x w: dx = g w^T, dw = x^T g
        dx, dw = _dot(g, w, nb + 1, nb + 1, nb), dot_tn(x, g)
    return dx.astype(x.dtype), dw.astype(w.dtype)


bmm_f32acc.defvjp(_bmm_fwd, _bmm_bwd)


def dot_general_f32acc(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    """``nnx.Linear``'s ``dot_general``: :func:`bmm_f32acc` (rows flattened) for a low-precision linear layer
    (same-dtype bf16/f16 operands, the layer's contraction, no explicit output type); plain
    ``lax.dot_general`` for everything else (float32 layers compute exactly as before)."""
    (lc, rc), (lb, _) = dimension_numbers
    if (jnp.dtype(lhs.dtype) in LOW_PRECISION and rhs.dtype == lhs.dtype and rhs.ndim == 2 and not lb
            and tuple(lc) == (lhs.ndim - 1,) and tuple(rc) == (0,) and out_sharding is None
            and (preferred_element_type is None or jnp.dtype(preferred_element_type) == jnp.dtype(lhs.dtype))):
        return bmm_f32acc(lhs.reshape(-1, lhs.shape[-1]), rhs).reshape(*lhs.shape[:-1], rhs.shape[-1])
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, out_sharding=out_sharding)


class Dense(nnx.Linear):
    """``nnx.Linear`` that runs on the panel kernel when its kernel is a decode-time
    :class:`specjax.models.panels.Paneled` and the input fits it (a few float32 rows on the CPU)."""

    panel_param = "kernel"  # panels.packable packs this param (panels does not import layers)

    def __call__(self, inputs, out_sharding=None):
        value = self.kernel.get_value()
        wp = panels.panels_for(value, inputs, dtype=self.dtype, out_sharding=out_sharding)
        if wp is not None:
            y = panels.matmul(inputs, wp)
        elif panels.bf16_compute(value, self.dtype, out_sharding):  # a prefill in a bf16-compute decode state
            y = panels.bf16_dot(inputs, value.plain)
        else:
            return super().__call__(inputs, out_sharding=out_sharding)
        return y if self.bias is None else y + self.bias[...]


def dense(in_features: int, out_features: int, *, bias: bool, rngs: nnx.Rngs, param_dtype=jnp.float32,
          dtype=None) -> Dense:
    return Dense(in_features, out_features, use_bias=bias, rngs=rngs, param_dtype=param_dtype, dtype=dtype,
                 kernel_init=nnx.initializers.normal(INIT_STD), dot_general=dot_general_f32acc)


class Embed(nnx.Embed):
    """``nnx.Embed`` whose output follows the table as it is at call time: a tree cast to bf16
    (the trainer's compute dtype) embeds in bf16. ``nnx.Embed`` fixes its output dtype to the
    parameter dtype at construction, so a float32-built table cast to bf16 still returned float32
    rows, and everything downstream of the embedding ran in float32. An explicit ``dtype`` wins."""

    def __init__(self, num_embeddings: int, features: int, *, dtype=None, **kw):
        super().__init__(num_embeddings, features, dtype=dtype, **kw)
        self.dtype = dtype

    def __call__(self, inputs, out_sharding=None):
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"embedding ids must be integers, got {inputs.dtype}")
        table = self.embedding[...]
        if self.dtype is not None:
            table = table.astype(self.dtype)
        if out_sharding is not None:
            return super().__call__(inputs, out_sharding=out_sharding)
        return jnp.take(table, inputs, axis=0)

    def attend(self, query, out_sharding=None):
        """``query @ embedding^T`` (a tied LM head); on the panel kernel for a decode-time
        :class:`specjax.models.panels.Paneled` table and a query that fits it."""
        value = self.embedding.get_value()
        wp = panels.panels_for(value, query, dtype=self.dtype, out_sharding=out_sharding)
        if wp is not None:
            return panels.matmul(query, wp)
        if panels.bf16_compute(value, self.dtype, out_sharding):
            return panels.bf16_dot(query, jnp.transpose(value.plain))
        return super().attend(query, out_sharding=out_sharding)


class RMSNorm(nnx.Module):
    """HF RMSNorm. ``unit_offset=False`` (Llama/Qwen3): ``scale * cast_to_input(x32 * rsqrt(mean(x32^2) + eps))``
    (cast back BEFORE the weight multiply). ``unit_offset=True`` (Gemma/Qwen3.5): ``cast_to_input(
    normed32 * (1 + scale32))``. Param ``scale`` [dim] (ones, or zeros with unit_offset)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, rngs: nnx.Rngs | None = None, param_dtype=jnp.float32,
                 unit_offset: bool = False):
        self.eps = float(eps)
        self.unit_offset = bool(unit_offset)
        init = jnp.zeros if unit_offset else jnp.ones
        self.scale = nnx.Param(init((dim,), param_dtype))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scaled(x, normed)

    def scaled(self, x, normed):
        """The norm's output from ``normed`` = ``x32 * rsqrt(mean(x32^2) + eps)`` (float32), however
        that was computed (the CPU decode path's kernel, :func:`specjax.models.panels.rms_normed`)."""
        if self.unit_offset:
            return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        return self.scale[...] * normed.astype(x.dtype)


def first_argmax(x, axis: int = -1):
    """``jnp.argmax`` (int32, the first maximum on ties) as two plain reductions: the max, then
    the smallest index that reaches it. XLA's CPU backend runs argmax's paired (value, index)
    reduction 4-7x slower (measured 0.86 vs 0.12 ms over SmolLM2's 49152 logits at batch 4), and
    decoding takes one per target and draft step, training one per scored position. Rows holding
    NaN give ``x.shape[axis]`` (no index) instead of the NaN's index. Float32 logits in a
    single-device CPU program take the native one-pass kernel instead
    (:func:`specjax.kernels.ops.row_argmax`, the same indices: a verify's [6, 49152] logits in
    ~0.3 ms less on 2 cores)."""
    if native_ops.row_argmax_fits(x, axis):
        return native_ops.row_argmax(x)
    axis = axis % x.ndim
    m = jnp.max(x, axis=axis, keepdims=True)
    idx = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.min(jnp.where(x == m, idx, x.shape[axis]), axis=axis)


def attend(q, k, v, mask=None, *, scale: float | None = None, bias=None):
    """Scaled dot-product attention through ``jax.nn.dot_product_attention`` with GQA.

    q [B, T, Hq, D]; k, v [B, S, Hkv, D] with Hq % Hkv == 0; ``mask`` bool [B, 1|Hq, T, S] or
    [B, T, S] (True = attend) or None (full attention); ``bias`` additive, same shapes.
    Returns [B, T, Hq, D]. Query rows with no allowed key produce finite garbage (uniform
    weights), never NaN; callers ignore them.
    """
    if mask is not None and mask.ndim == 3:
        mask = mask[:, None]
    if bias is not None and bias.ndim == 3:
        bias = bias[:, None]
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale)


def write_cache(buf, positions, rows, layer=None):
    """Heads-major KV cache write. buf [B, Hkv, S, D]; positions int [B, T]; rows [B, T, Hkv, D]
    -> buf with row t of sequence b at slot ``positions[b, t]`` (slots past S are dropped).
    ``layer`` (int32 scalar): buf is a stacked cache [L, B, Hkv, S, D] and layer ``layer``'s rows
    are written in place (the decode layer scan's carry).

    Off the CPU the heads stay a window of the scatter (indices (b, slot) only): a cache whose
    heads are sharded over a mesh axis is then written shard by shard. Indexing the heads too (the
    CPU form, same values) makes XLA's partitioner all-gather every head's rows and indices first."""
    lead = () if layer is None else (layer,)
    B, H = buf.shape[len(lead):len(lead) + 2]
    if not placement.is_cpu():
        return buf.at[lead + (jnp.arange(B)[:, None], slice(None), positions)].set(rows.astype(buf.dtype), mode="drop")
    b = jnp.arange(B)[:, None, None]
    h = jnp.arange(H)[None, :, None]
    return buf.at[lead + (b, h, positions[:, None, :])].set(jnp.swapaxes(rows, 1, 2).astype(buf.dtype), mode="drop")


def write_packed(buf, segments, positions, rows, layer=None):
    """Heads-major KV cache write from one packed row. buf [B, Hkv, S, D]; segments int [T]
    (the sequence of each row, >= B for padding); positions int [T]; rows [T, Hkv, D] -> buf
    with row t at ``buf[segments[t], :, positions[t]]`` (padding and slots past S are dropped).
    ``layer``: buf is a stacked cache [L, B, Hkv, S, D], layer ``layer`` written."""
    lead = () if layer is None else (layer,)
    h = jnp.arange(buf.shape[len(lead) + 1])[None, :]
    return buf.at[lead + (segments[:, None], h, positions[:, None])].set(rows.astype(buf.dtype), mode="drop")


def attend_cache(q, k, v, mask=None, *, scale: float | None = None):
    """GQA attention over a heads-major cache: the same result as :func:`attend` with the cache
    in ``[B, S, Hkv, D]``, but both products are plain batched matmuls over ``(B, Hkv)`` on the
    cache as it lies (``jax.nn.dot_product_attention`` wants keys seq-major and so copies the
    whole cache into its layout at every call: 3-4x the cost of the attention itself on CPU).

    q [B, T, Hq, D]; k, v [B, Hkv, S, D]; ``mask`` bool [B, 1, T, S] (True = attend) or None.
    Logits and softmax in float32 (as ``dot_product_attention``); a query row with no allowed
    key gets uniform weights (finite garbage, never NaN). Returns [B, T, Hq, D] in q's dtype.
    """
    B, T, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    qh = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)  # rows (g, t)
    logits = jnp.einsum("bkqd,bksd->bkqs", qh, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    if mask is not None:
        if mask.ndim == 3:
            mask = mask[:, None]
        if mask.shape[1] != 1:
            raise ValueError(f"attend_cache takes a mask shared by all heads ([B, 1, T, S]), got {mask.shape}")
        m = jnp.broadcast_to(mask[:, :, None], (B, 1, G, T, S)).reshape(B, 1, G * T, S)
        logits = jnp.where(m, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkqs,bksd->bkqd", probs, v, preferred_element_type=jnp.float32).astype(q.dtype)
    return o.reshape(B, Hkv, G, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D)


class Attention(nnx.Module):
    """GQA attention projections ``q_proj/k_proj/v_proj/o_proj`` (+ optional per-head ``q_norm/k_norm``).

    ``in_features`` is the q/k/v input width (default ``hidden_size``; EAGLE-3's first draft layer
    uses 2*hidden). Building blocks are separate so drafts can build their own keys/masks:
    :meth:`project` (projections + q/k norm, no rope), :func:`apply_rope`, :func:`attend`,
    :meth:`output`. ``__call__`` is plain self-attention without a cache.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, rngs: nnx.Rngs,
                 in_features: int | None = None, bias: bool = False, o_bias: bool | None = None,
                 qk_norm: bool = False, norm_eps: float = 1e-6, param_dtype=jnp.float32, dtype=None):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling = head_dim ** -0.5
        d_in = in_features or hidden_size
        kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.q_proj = dense(d_in, num_heads * head_dim, bias=bias, **kw)
        self.k_proj = dense(d_in, num_kv_heads * head_dim, bias=bias, **kw)
        self.v_proj = dense(d_in, num_kv_heads * head_dim, bias=bias, **kw)
        self.o_proj = dense(num_heads * head_dim, hidden_size, bias=bias if o_bias is None else o_bias, **kw)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, norm_eps, param_dtype=param_dtype)
            self.k_norm = RMSNorm(head_dim, norm_eps, param_dtype=param_dtype)
        else:
            self.q_norm = None
            self.k_norm = None

    def project_q(self, x):
        q = self.q_proj(x).reshape(*x.shape[:-1], self.num_heads, self.head_dim)
        return q if self.q_norm is None else self.q_norm(q)

    def project_kv(self, x):
        k = self.k_proj(x).reshape(*x.shape[:-1], self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(*x.shape[:-1], self.num_kv_heads, self.head_dim)
        return (k if self.k_norm is None else self.k_norm(k)), v

    def project(self, x, kv_x=None):
        """q [B,T,Hq,D], k, v [B,S,Hkv,D] (q/k normed if configured, NOT rotated). ``kv_x`` (default x)
        is the key/value input."""
        k, v = self.project_kv(x if kv_x is None else kv_x)
        return self.project_q(x), k, v

    def output(self, o):
        """o [B, T, Hq, D] -> [B, T, hidden]."""
        return self.o_proj(o.reshape(*o.shape[:-2], self.num_heads * self.head_dim))

    def __call__(self, x, cos, sin, mask=None):
        q, k, v = self.project(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.output(attend(q, k, v, mask, scale=self.scaling))


class MLP(nnx.Module):
    """Gated SiLU MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs, bias: bool = False,
                 param_dtype=jnp.float32, dtype=None):
        kw = dict(bias=bias, rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.gate_proj = dense(hidden_size, intermediate_size, **kw)
        self.up_proj = dense(hidden_size, intermediate_size, **kw)
        self.down_proj = dense(intermediate_size, hidden_size, **kw)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm decoder layer: ``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``.

    ``sliding_window`` (None = full attention) is metadata for whoever builds the mask (HF rule:
    key j visible from query i iff ``i - W < j <= i``); see :func:`causal_mask`.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 *, rngs: nnx.Rngs, norm_eps: float = 1e-6, attn_in_features: int | None = None,
                 attention_bias: bool = False, mlp_bias: bool = False, qk_norm: bool = False,
                 sliding_window: int | None = None, norm_unit_offset: bool = False,
                 param_dtype=jnp.float32, dtype=None):
        self.sliding_window = sliding_window
        kw = dict(param_dtype=param_dtype, dtype=dtype)
        self.input_layernorm = RMSNorm(hidden_size, norm_eps, unit_offset=norm_unit_offset, param_dtype=param_dtype)
        self.self_attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim, rngs=rngs,
                                   in_features=attn_in_features, bias=attention_bias, qk_norm=qk_norm,
                                   norm_eps=norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(hidden_size, norm_eps, unit_offset=norm_unit_offset,
                                                param_dtype=param_dtype)
        self.mlp = MLP(hidden_size, intermediate_size, rngs=rngs, bias=mlp_bias, **kw)

    def __call__(self, x, cos, sin, mask=None):
        """Self-attention without a cache. x [B,T,H]; cos/sin [B,T,rotary_dim]; mask [B,1,T,T]."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def causal_mask(q_pos, kv_pos, *, sliding_window: int | None = None, kv_valid=None):
    """Boolean [B, 1, T, S]: key j visible from query t iff ``kv_pos[j] <= q_pos[t]`` (and
    ``kv_pos[j] > q_pos[t] - W`` with a sliding window) and ``kv_valid[b, j]``.

    q_pos [B, T]; kv_pos [B, S] or [S]; kv_valid [B, S] bool or None.
    """
    if kv_pos.ndim == 1:
        kv_pos = kv_pos[None]
    qp, kp = q_pos[:, :, None], kv_pos[:, None, :]
    m = kp <= qp
    if sliding_window is not None:
        m &= kp > qp - sliding_window
    if kv_valid is not None:
        m &= kv_valid[:, None, :].astype(bool)
    return m[:, None]


def tree_cache_mask(q_pos, lengths, tree_mask, num_slots: int, *, sliding_window: int | None = None):
    """Boolean [B, 1, T, S] for a token-tree verify over a KV cache (S = ``num_slots``).

    The T tree tokens lie at slots ``lengths[b] + t`` with rope positions ``q_pos`` int [B, T]
    (the committed length plus the node's depth); ``tree_mask`` bool [T, T] or [B, T, T]
    (``[t, j]``: node j is t or an ancestor of t). Query t sees the committed slots
    ``< lengths[b]`` and tree slot ``lengths[b] + j`` iff ``tree_mask[b, t, j]``; with a sliding
    window, only keys whose position is ``> q_pos - W``."""
    B, T = q_pos.shape
    tm = jnp.broadcast_to(jnp.asarray(tree_mask, bool), (B, T, T))
    slot = jnp.arange(num_slots, dtype=jnp.int32)
    rel = slot[None] - lengths[:, None].astype(jnp.int32)  # [B, S]: tree node at each slot
    in_tree = (rel >= 0) & (rel < T)
    relc = jnp.clip(rel, 0, T - 1)
    tvis = jnp.take_along_axis(tm, jnp.broadcast_to(relc[:, None, :], (B, T, num_slots)), axis=2)  # [B, T, S]
    m = jnp.where(in_tree[:, None, :], tvis, rel[:, None, :] < 0)
    if sliding_window is not None:
        kv_pos = jnp.where(in_tree, jnp.take_along_axis(q_pos, relc, axis=1), slot[None])  # [B, S]
        m &= kv_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    return m[:, None]

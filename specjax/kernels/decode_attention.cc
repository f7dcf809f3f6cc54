// specjax CPU kernel: attention of a few query tokens over a KV cache, reading only the slots
// each query can see.
//
//   q      [B, T, Hq, D]                        float32 (rotated, normed)
//   k, v   [B, Hkv, S, D] (heads-major) or      float32 (the cache, this step's rows already
//          [B, S, Hkv, D] (seq_major = 1)       written)
//   lo, hi [B, T]                               int32: query t of sequence b sees the slots
//                                               lo[b, t] .. hi[b, t] (inclusive, clipped to 0..S-1)
//   attrs: scale (float32), seq_major (int64: 0 heads-major, as the target's cache; 1 seq-major,
//          as a draft's)
//   out    [B, T, Hq, D]                        float32
//
// The target's causal mask (layers.causal_mask over arange(S)) is the range [pos - W + 1, pos]
// (or [0, pos] without a window); a chain draft step's mask (drafts.common.cache_mask) is one
// contiguous range too. The XLA paths score every slot of the cache and mask, so a decode step
// pays for max_len slots whatever the sequence's length, while this kernel reads only [lo, hi]
// of each row. Softmax in float32 with the max subtracted. A query that sees no slot gets zeros
// (the XLA path gives finite garbage; no caller reads either).
//
// specjax_tree_attention: the same with a token-tree verify's mask. Extra inputs
//   tbase  [B]                                  int32: the tree's first slot (the committed length)
//   tmask  [B, T, M]                            uint8: query t sees tree slot tbase[b] + m iff
//                                               tmask[b, t, m] (itself and its ancestors)
// A slot in [tbase, tbase + M) is visible iff it is in [lo, hi] and its tmask entry is set; other
// slots by [lo, hi] alone (the committed cache, with the window's lo).
//
// Work units are (b, t, kv head), shared out as in panel_matmul.cc (common.h);
// a unit loads each visible key and value row once for the kv head's G query heads. A query's
// output is the same bits whatever the other queries and whatever slots past its own are masked
// (a tree verify, a chain verify and a decode step agree on the rows they share).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

struct AttJob {
  const float *q, *k, *v;
  const int32_t *lo, *hi;
  float* out;
  int64_t T, Hq, Hkv, S, D;
  bool seq_major;
  float scale;
  const uint8_t* tmask = nullptr;  // tree verify only: [B, T, M]
  const int32_t* tbase = nullptr;  // [B]
  int64_t M = 0;
};

// The tree mask of one query row: hides tree slots that are not its ancestors (or itself).
struct SlotMask {
  const uint8_t* row = nullptr;
  int64_t base = 0, M = 0;
  bool hidden(int64_t s) const { return row != nullptr && s >= base && s - base < M && row[s - base] == 0; }
};

using specjax::i16v;
using specjax::load16;
using specjax::splat;
using specjax::store16;
using specjax::v16;

// exp for x <= 0 (softmax after the max is subtracted), relative error ~1e-7: 2^n * 2^f with
// n = round(x log2 e), |f| <= 1/2, 2^f from its degree-7 Taylor polynomial. Below -87 -> 0.
// V: 16 lanes where the build has AVX-512; else 8 lanes twice, the same operations lane by lane
// (GCC scalarises the selects of a 16-lane vector on AVX2: attention 2.5x slower than XLA's at a
// 1000-token prefill there).
template <typename V, typename I>
static inline V vexp_lanes(V x) {
  const V lo = -87.0f - V{};
  x = x < lo ? lo : x;
  V t = x * 1.4426950408889634f;
  V n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2^22)
  V f = (t - n) * 0.6931471805599453f;     // in [-ln2/2, ln2/2]
  V p = 1.0f / 5040 - V{};
  p = p * f + 1.0f / 720;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  I e = (__builtin_convertvector(n, I) + 127) << 23;
  V r = p * reinterpret_cast<V&>(e);
  return x <= -87.0f ? V{} : r;
}

static inline v16 vexp(v16 x) {
#if defined(__AVX512F__)
  return vexp_lanes<v16, i16v>(x);
#else
  typedef int32_t i8v __attribute__((vector_size(32)));
  specjax::v8 h[2];
  __builtin_memcpy(h, &x, sizeof x);
  h[0] = vexp_lanes<specjax::v8, i8v>(h[0]);
  h[1] = vexp_lanes<specjax::v8, i8v>(h[1]);
  __builtin_memcpy(&x, h, sizeof x);
  return x;
#endif
}

// tree reduction: 4 shuffles and adds instead of 15 serial adds
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SPECJAX_SHUFFLE(x, ...) __builtin_shufflevector(x, x, __VA_ARGS__)
#else  // GCC before 12: __builtin_shuffle with an index vector
#define SPECJAX_SHUFFLE(x, ...) __builtin_shuffle(x, i16v{__VA_ARGS__})
#endif
static inline float hsum(v16 x) {
  x += SPECJAX_SHUFFLE(x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += SPECJAX_SHUFFLE(x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += SPECJAX_SHUFFLE(x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += SPECJAX_SHUFFLE(x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return x[0];
}

// G query rows of one kv head against slots [lo, hi]: each key and value row is loaded once for
// all G rows. C = D / 16 vectors per row; slot s's row starts at kb + s * ld. lg: G rows of
// S + 16 floats.
template <int C>
static void att_group(const float* const* qr, int64_t G, const float* kb, const float* vb, int64_t ld, int64_t lo,
                      int64_t hi, float scale, float* lg, int64_t ld_lg, float* const* o, const SlotMask& sm) {
  v16 qv[8][C];
  float mx[8];
  for (int64_t g = 0; g < G; g++) {
    for (int c = 0; c < C; c++) qv[g][c] = load16(qr[g] + 16 * c) * scale;
    mx[g] = -INFINITY;
  }
  for (int64_t s = lo; s <= hi; s++) {
    v16 kv[C];
    for (int c = 0; c < C; c++) kv[c] = load16(kb + s * ld + 16 * c);
    for (int64_t g = 0; g < G; g++) {
      v16 acc = qv[g][0] * kv[0];
      for (int c = 1; c < C; c++) acc += qv[g][c] * kv[c];
      float a = sm.hidden(s) ? -INFINITY : hsum(acc);
      lg[g * ld_lg + s] = a;
      mx[g] = std::max(mx[g], a);
    }
  }
  float inv[8];
  // The softmax sum goes block by block (16 slots) from lo over the slots the query sees, in slot
  // order, every exp vexp's (the last block padded with -inf, exp 0): a query's sum does not
  // depend on slots past its own (a tree verify's rows all reach the tree's last slot) nor, in a
  // tree, on where its ancestors sit among the tree's slots: from the block holding the tree's
  // first slot on, the visible slots are summed compacted, so the blocks hold what a decode step
  // at the same position sums once the accepted path is in the cache.
  int64_t s0 = hi + 1;  // compacted from here (a tree reaching past its first slot)
  if (sm.row != nullptr && sm.base <= hi) s0 = lo + std::max<int64_t>(0, (sm.base - lo) / 16) * 16;
  thread_local std::vector<float> cbuf;
  if (s0 <= hi) cbuf.resize(hi - s0 + 17);
  for (int64_t g = 0; g < G; g++) {
    float* l = lg + g * ld_lg;
    for (int64_t t = hi + 1; t < hi + 16; t++) l[t] = -INFINITY;
    float sum = 0.0f;
    for (int64_t s = lo; s < s0; s += 16) {
      v16 e = vexp(load16(l + s) - splat(mx[g]));
      store16(l + s, e);
      sum += hsum(e);
    }
    if (s0 <= hi) {
      float* c = cbuf.data();
      int64_t n = 0;
      for (int64_t s = s0; s <= hi; s++)
        if (!sm.hidden(s)) c[n++] = l[s];
      for (int64_t t = n; t < n + 16; t++) c[t] = -INFINITY;
      for (int64_t j = 0; j < n; j += 16) {
        v16 e = vexp(load16(c + j) - splat(mx[g]));
        store16(c + j, e);
        sum += hsum(e);
      }
      for (int64_t s = s0, j = 0; s <= hi; s++) l[s] = sm.hidden(s) ? 0.0f : c[j++];
    }
    inv[g] = 1.0f / sum;
  }
  v16 ov[8][C];
  for (int64_t g = 0; g < G; g++)
    for (int c = 0; c < C; c++) ov[g][c] = v16{};
  for (int64_t s = lo; s <= hi; s++) {
    v16 vv[C];
    for (int c = 0; c < C; c++) vv[c] = load16(vb + s * ld + 16 * c);
    for (int64_t g = 0; g < G; g++) {
      const float w = lg[g * ld_lg + s];  // splat: a broadcast on AVX2 too
      for (int c = 0; c < C; c++) ov[g][c] += splat(w) * vv[c];
    }
  }
  for (int64_t g = 0; g < G; g++)
    for (int c = 0; c < C; c++) store16(o[g] + 16 * c, ov[g][c] * splat(inv[g]));
}

// The same for any D and G, one row at a time (no vectors).
static void att_row_scalar(const float* qr, const float* kb, const float* vb, int64_t ld, int64_t lo, int64_t hi,
                           int64_t D, float scale, float* lg, float* o, const SlotMask& sm) {
  float mx = -INFINITY;
  for (int64_t s = lo; s <= hi; s++) {
    float a = 0.0f;
    for (int64_t d = 0; d < D; d++) a += qr[d] * kb[s * ld + d];
    lg[s] = sm.hidden(s) ? -INFINITY : a * scale;
    mx = std::max(mx, lg[s]);
  }
  float sum = 0.0f;
  for (int64_t s = lo; s <= hi; s++) {
    lg[s] = std::exp(lg[s] - mx);
    sum += lg[s];
  }
  const float inv = 1.0f / sum;
  std::fill(o, o + D, 0.0f);
  for (int64_t s = lo; s <= hi; s++)
    for (int64_t d = 0; d < D; d++) o[d] += lg[s] * inv * vb[s * ld + d];
}

// One unit: the G query heads of kv head kh for token (b, t).
static void att_unit(const AttJob& j, int64_t u, std::vector<float>& logits) {
  const int64_t kh = u % j.Hkv, bt = u / j.Hkv, b = bt / j.T, G = j.Hq / j.Hkv, D = j.D, S = j.S;
  // row of slot s of kv head kh: heads-major at (b, kh) * S * D + s * D, seq-major at
  // (b * S + s) * Hkv * D + kh * D
  const int64_t off = j.seq_major ? b * S * j.Hkv * D + kh * D : (b * j.Hkv + kh) * S * D;
  const int64_t ld = j.seq_major ? j.Hkv * D : D;
  const float* kb = j.k + off;
  const float* vb = j.v + off;
  const int64_t hi = std::min<int64_t>(j.hi[bt], S - 1);
  const int64_t lo = std::max<int64_t>(j.lo[bt], 0);
  const int64_t ld_lg = S + 16;
  SlotMask sm;
  if (j.tmask != nullptr) sm = SlotMask{j.tmask + bt * j.M, j.tbase[b], j.M};
  logits.resize(std::min<int64_t>(G, 8) * ld_lg);
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const int64_t n = std::min<int64_t>(8, G - g0);
    const float* qr[8];
    float* o[8];
    for (int64_t g = 0; g < n; g++) {
      const int64_t row = bt * j.Hq + kh * G + g0 + g;
      qr[g] = j.q + row * D;
      o[g] = j.out + row * D;
    }
    if (lo > hi) {
      for (int64_t g = 0; g < n; g++) std::fill(o[g], o[g] + D, 0.0f);
    } else if (D == 64) {
      att_group<4>(qr, n, kb, vb, ld, lo, hi, j.scale, logits.data(), ld_lg, o, sm);
    } else if (D == 128) {
      att_group<8>(qr, n, kb, vb, ld, lo, hi, j.scale, logits.data(), ld_lg, o, sm);
    } else {
      for (int64_t g = 0; g < n; g++) att_row_scalar(qr[g], kb, vb, ld, lo, hi, D, j.scale, logits.data(), o[g], sm);
    }
  }
}

static ffi::Error Check(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v,
                        ffi::Buffer<ffi::S32>& lo, ffi::Buffer<ffi::S32>& hi, int64_t seq_major, AttJob& j,
                        float* out, float scale) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), ld = lo.dimensions(), hd = hi.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || ld.size() != 2 || hd.size() != 2)
    return ffi::Error::InvalidArgument("decode_attention: expected q [B,T,Hq,D], k/v 4-D, lo/hi [B,T]");
  const int64_t B = qd[0], T = qd[1], Hq = qd[2], D = qd[3];
  const int64_t Hkv = seq_major ? kd[2] : kd[1], S = seq_major ? kd[1] : kd[2];
  for (int i = 0; i < 4; i++)
    if (kd[i] != vd[i]) return ffi::Error::InvalidArgument("decode_attention: k and v shapes differ");
  if (kd[0] != B || kd[3] != D || Hkv <= 0 || Hq % Hkv != 0 || ld[0] != B || ld[1] != T || hd[0] != B || hd[1] != T)
    return ffi::Error::InvalidArgument("decode_attention: q, k/v and lo/hi disagree on B, T, D or heads");
  j = AttJob{q.typed_data(), k.typed_data(), v.typed_data(), lo.typed_data(), hi.typed_data(),
             out, T, Hq, Hkv, S, D, seq_major != 0, scale};
  return ffi::Error::Success();
}

static void Run(ffi::ThreadPool& pool, const AttJob& j, int64_t B) {
  specjax::parallel_for(pool, B * j.T * j.Hkv, [j](int64_t u) {
    thread_local std::vector<float> logits;
    att_unit(j, u, logits);
  });
}

static ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                  ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lo, ffi::Buffer<ffi::S32> hi,
                                  float scale, int64_t seq_major, ffi::ResultBuffer<ffi::F32> out) {
  AttJob j{};
  ffi::Error e = Check(q, k, v, lo, hi, seq_major, j, out->typed_data(), scale);
  if (e.failure()) return e;
  Run(pool, j, q.dimensions()[0]);
  return ffi::Error::Success();
}

static ffi::Error TreeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lo, ffi::Buffer<ffi::S32> hi,
                                ffi::Buffer<ffi::S32> tbase, ffi::Buffer<ffi::U8> tmask, float scale,
                                ffi::ResultBuffer<ffi::F32> out) {
  AttJob j{};
  ffi::Error e = Check(q, k, v, lo, hi, 0, j, out->typed_data(), scale);
  if (e.failure()) return e;
  auto bd = tbase.dimensions(), md = tmask.dimensions();
  const int64_t B = q.dimensions()[0];
  if (bd.size() != 1 || bd[0] != B || md.size() != 3 || md[0] != B || md[1] != j.T)
    return ffi::Error::InvalidArgument("tree_attention: expected tbase [B] and tmask [B, T, M]");
  j.tbase = tbase.typed_data();
  j.tmask = tmask.typed_data();
  j.M = md[2];
  Run(pool, j, B);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_decode_attention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("seq_major")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_tree_attention, TreeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());

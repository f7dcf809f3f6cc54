// specjax CPU kernel: y[M, N] = x[M, K] @ W, with W prepacked into column panels
// w[P, K, Wd] (panel p holds columns p*Wd .. p*Wd+Wd-1 of the [K, N] kernel, N = P*Wd,
// Wd in {16, 32, 64}). The panels are float32 (specjax_panel_matmul) or bfloat16
// (specjax_panel_matmul_bf16: half the bytes to stream; each weight is widened to float32 exactly
// -- a bf16 is the top half of a float32 -- so the products and sums are those of the float32
// kernel on the same values, and the rows of x stay float32).
//
// Why: a decode step multiplies a few rows (the batch, or the k+1 verified tokens) by every
// weight of the model once, so it is bound by how fast the weights stream from memory. XLA's CPU
// dot reads a row-major [K, N] kernel with a stride of N floats per row of K; each panel here is
// one contiguous stream instead, which the hardware prefetchers follow at close to the memory
// bandwidth. The rows of x stay in registers: a group of up to 6 rows (8 on narrower panels)
// keeps R x (Wd/16) accumulators of 16 floats and reads each weight once per group.
//
// Panels are the work units, shared out over the calling thread and XLA's intra-op pool
// (common.h, with the vector types).
#include <algorithm>
#include <cstdint>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 16
#endif

using specjax::load16;
using specjax::splat;
using specjax::store16;
using specjax::v16;

typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));  // 16 bf16, unaligned access
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// 16 consecutive weights as 16 floats: float32 as they are, bfloat16 (raw uint16) shifted into
// the top half of a float32 (exact).
static inline v16 load_w(const float* p) { return load16(p); }
static inline v16 load_w(const uint16_t* p) {
  u32x16 u = __builtin_convertvector(*reinterpret_cast<const u16x16*>(p), u32x16) << 16;
  v16 v;
  __builtin_memcpy(&v, &u, sizeof v);
  return v;
}

// An empty asm that "changes" v: the compiler must keep it in a register instead of re-loading it
// (only where one 16-float vector is one register: AVX-512; elsewhere a no-op).
static inline void keep_in_register(v16& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// rows of x (row stride ldx) times rows k0 .. k1-1 of panel w [K, 16*V] into y (row stride N);
// accumulates onto y when `add` (a later chunk of K), else overwrites it.
template <int R, int V, typename T>
static void panel_rows(const float* x, int64_t ldx, int64_t k0, int64_t k1, const T* w, float* y, int64_t N,
                       bool add) {
  v16 acc[R][V];
  for (int i = 0; i < R; i++)
    for (int j = 0; j < V; j++) acc[i][j] = add ? load16(y + i * N + 16 * j) : v16{};
  for (int64_t k = k0; k < k1; k++) {
    const T* wk = w + k * 16 * V;
    for (int j = 0; j < V; j++) __builtin_prefetch(wk + 16 * V * PREFETCH_ROWS + 16 * j);
    v16 wv[V];
    for (int j = 0; j < V; j++) wv[j] = load_w(wk + 16 * j);
    // keep the panel row in registers: one load per vector, not one per row (GCC otherwise
    // folds the load into every FMA, and loads, not FMAs, become the limit at 4 rows)
    for (int j = 0; j < V; j++) keep_in_register(wv[j]);
    for (int i = 0; i < R; i++) {
      v16 b = splat(x[i * ldx + k]);
      for (int j = 0; j < V; j++) acc[i][j] += b * wv[j];
    }
  }
  for (int i = 0; i < R; i++)
    for (int j = 0; j < V; j++) store16(y + i * N + 16 * j, acc[i][j]);
}

#if !defined(__AVX512F__)
// 8 consecutive weights as 8 floats (load_w's strip form).
static inline specjax::v8 load_w8(const float* p) { return specjax::load8(p); }
static inline specjax::v8 load_w8(const uint16_t* p) {
  typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2)));
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  u32x8 u = __builtin_convertvector(*reinterpret_cast<const u16x8*>(p), u32x8) << 16;
  specjax::v8 v;
  __builtin_memcpy(&v, &u, sizeof v);
  return v;
}

// panel_rows for a strip of W 8-column vectors of a panel (row stride ldw elements): R rows of x
// times the strip's rows k0 .. k1-1 into y. The same products and sums, in the same order.
// `whole`: prefetch the panel's whole rows ahead (the first strip; the others find them cached).
template <int R, int W, typename T>
static void strip_rows(const float* x, int64_t ldx, int64_t k0, int64_t k1, const T* w, int64_t ldw, float* y,
                       int64_t N, bool add, bool whole) {
  const int64_t lines = whole ? (ldw * static_cast<int64_t>(sizeof(T)) + 63) / 64 : 1;
  specjax::v8 acc[R][W];
  for (int i = 0; i < R; i++)
    for (int j = 0; j < W; j++) acc[i][j] = add ? specjax::load8(y + i * N + 8 * j) : specjax::v8{};
  for (int64_t k = k0; k < k1; k++) {
    const T* wk = w + k * ldw;
    for (int64_t l = 0; l < lines; l++)
      __builtin_prefetch(reinterpret_cast<const char*>(wk + ldw * PREFETCH_ROWS) + 64 * l);
    specjax::v8 wv[W];
    for (int j = 0; j < W; j++) wv[j] = load_w8(wk + 8 * j);
    for (int i = 0; i < R; i++) {
      const specjax::v8 b = specjax::splat8(x[i * ldx + k]);
      for (int j = 0; j < W; j++) acc[i][j] += b * wv[j];
    }
  }
  for (int i = 0; i < R; i++)
    for (int j = 0; j < W; j++) specjax::store8(y + i * N + 8 * j, acc[i][j]);
}
#endif

// All M rows times one panel: up to group_rows (common.h) rows in one pass; more in groups of 4
// over chunks of K small enough to stay in the core's cache, so the panel streams from memory once
// whatever M is. A row's sums run over K in the same order whatever the grouping (a chunk's partial
// sums are stored and reloaded exactly): its outputs do not depend on the other rows.
template <int V, typename T>
static void panel(const float* x, int64_t M, int64_t K, const T* w, float* y, int64_t N) {
#if !defined(__AVX512F__)
  // strips (common.h) over chunks of K whose panel rows stay in the core's cache while every strip
  // and row group reads them (the first streams them from memory)
  const int64_t chunk = std::max<int64_t>(1, 16384 / (16 * V * static_cast<int64_t>(sizeof(T))));
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t k1 = std::min(K, k0 + chunk);
    for (int64_t r0 = 0; r0 < M; r0 += specjax::kStripRows)
      specjax::with_rows<specjax::kStripRows>(std::min<int64_t>(specjax::kStripRows, M - r0), [&](auto R) {
        constexpr int W = specjax::strip_width(decltype(R)::value, 2 * V);
        for (int s = 0; s < 2 * V; s += W)
          strip_rows<decltype(R)::value, W, T>(x + r0 * K, K, k0, k1, w + 8 * s, 16 * V, y + r0 * N + 8 * s, N,
                                               k0 > 0, s == 0);
      });
  }
#else
  const bool one_pass = M <= specjax::group_rows<V>();
  const int64_t G = one_pass ? M : 4;
  const int64_t chunk = one_pass ? K : std::max<int64_t>(1, 32768 / (64 * V));
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    int64_t k1 = std::min(K, k0 + chunk);
    for (int64_t r0 = 0; r0 < M; r0 += G)
      specjax::with_rows<specjax::group_rows<V>()>(std::min<int64_t>(G, M - r0), [&](auto R) {
        panel_rows<decltype(R)::value, V, T>(x + r0 * K, K, k0, k1, w, y + r0 * N, N, k0 > 0);
      });
  }
#endif
}

template <ffi::DataType WT>
static ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                              ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3)
    return ffi::Error::InvalidArgument("panel_matmul: expected x [M, K] and w [P, K, Wd]");
  int64_t M = xd[0], K = xd[1], P = wd[0], Wd = wd[2];
  if (wd[1] != K) return ffi::Error::InvalidArgument("panel_matmul: x and w disagree on K");
  if (Wd != 16 && Wd != 32 && Wd != 64)
    return ffi::Error::InvalidArgument("panel_matmul: panel width must be 16, 32 or 64");
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != M || yd[1] != P * Wd)
    return ffi::Error::InvalidArgument("panel_matmul: y must be [M, P * Wd]");
  if (M == 0 || P == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(y->typed_data(), y->typed_data() + M * P * Wd, 0.0f);
    return ffi::Error::Success();
  }
  const float* xp = x.typed_data();
  const auto* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t N = P * Wd;
  specjax::parallel_for(pool, P, [=](int64_t p) {
    const auto* wpp = wp + p * K * Wd;
    float* ypp = yp + p * Wd;
    switch (Wd) {
      case 16: panel<1>(xp, M, K, wpp, ypp, N); break;
      case 32: panel<2>(xp, M, K, wpp, ypp, N); break;
      default: panel<4>(xp, M, K, wpp, ypp, N); break;
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_panel_matmul, PanelMatmul<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_panel_matmul_bf16, PanelMatmul<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

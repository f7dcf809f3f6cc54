// specjax CPU kernel: y[M, N] = x[M, K] @ W in bfloat16 arithmetic with float32 accumulation,
// x bfloat16 and W prepacked into column panels of k-pairs: w[P, K/2, Wd, 2] (bfloat16),
// w[p, h, j, t] = W[2h + t, p*Wd + j], Wd in {16, 32, 64}, K even. y is float32.
//
// Why: panel_matmul.cc multiplies float32 rows (bf16 weights widened exactly), so a decode step
// of 16 rows is bound by float32 FMAs. Where bf16 products are acceptable (regenerating training
// data: the draft trains in bf16 anyway), AVX512-BF16's vdpbf16ps takes 32 bf16 pairs per
// instruction, twice the float32 FMA's 16 lanes. One 512-bit load of a panel's k-pair row holds
// the pairs of 16 columns; each x row's pair is broadcast as one 32-bit word.
//
// Arithmetic, per output: acc += x[2h+1] w[2h+1], then acc += x[2h] w[2h], each product exact in
// float32 (8-bit significands) and each sum rounded to nearest even: vdpbf16ps as Intel documents
// it (inputs and outputs denormal-flushed). Without AVX512-BF16 the same two float32 FMAs per pair
// run on 16-float vectors (AVX-512) or on 8-column strips (common.h), identical but for denormals.
//
// On a CPU with AMX tiles (amx_bf16, built with -march=native there) a call takes the tiles instead
// (any number of rows, K a multiple of 32): one TDPBF16PS multiplies 16 rows by a 32 x 16
// block of the panel (the k-pair layout is the tile's B layout as it stands, 16 columns of pairs
// per 64-byte row, at a stride of the panel's width), so a verify of 16-64 rows costs about what
// streaming the panel costs, where vdpbf16ps pays a broadcast and an instruction per row. Same
// products (exact) and float32 sums, in the tile's order: outputs agree with the vector path to
// float32 rounding, not bit for bit; a row's sums do not depend on the other rows of the call.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define SPECJAX_DPBF16 1
#else
#define SPECJAX_DPBF16 0
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SPECJAX_AMX 1
#endif

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using specjax::load16;
using specjax::store16;
using specjax::v16;

typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16u __attribute__((vector_size(64), aligned(4)));

namespace {

#if SPECJAX_DPBF16
typedef __m512i wvec;
static inline wvec load_pairs(const uint16_t* p) { return _mm512_loadu_si512(p); }
static inline wvec splat_pair(const uint16_t* p) {
  uint32_t u;
  std::memcpy(&u, p, 4);
  return _mm512_set1_epi32(static_cast<int>(u));
}
static inline v16 dot(v16 acc, wvec x, wvec w) {
  return (v16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)x, (__m512bh)w);
}
#else
typedef u32x16 wvec;
static inline wvec load_pairs(const uint16_t* p) { return *reinterpret_cast<const u32x16u*>(p); }
static inline wvec splat_pair(const uint16_t* p) {
  uint32_t u;
  std::memcpy(&u, p, 4);
  return u - u32x16{};
}
static inline v16 as_f32(u32x16 u) {
  v16 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
static inline v16 dot(v16 acc, wvec x, wvec w) {
  const u32x16 hi = u32x16{} + 0xFFFF0000u;
  acc += as_f32(x & hi) * as_f32(w & hi);  // the odd element of each pair first, as vdpbf16ps
  acc += as_f32(x << 16) * as_f32(w << 16);
  return acc;
}
#endif

// R rows of x (row stride ldx bf16) times k-pairs h0 .. h1-1 of panel w [K/2, 16*V, 2] into y
// (row stride N); accumulates onto y when `add`, else overwrites it.
template <int R, int V>
void rows_dot(const uint16_t* x, int64_t ldx, int64_t h0, int64_t h1, const uint16_t* w, float* y, int64_t N,
              bool add) {
  v16 acc[R][V];
  for (int i = 0; i < R; i++)
    for (int j = 0; j < V; j++) acc[i][j] = add ? load16(y + i * N + 16 * j) : v16{};
  for (int64_t h = h0; h < h1; h++) {
    const uint16_t* wh = w + h * 32 * V;
    __builtin_prefetch(wh + 32 * V * 8);
    wvec wv[V];
    for (int j = 0; j < V; j++) wv[j] = load_pairs(wh + 32 * j);
    for (int i = 0; i < R; i++) {
      wvec b = splat_pair(x + i * ldx + 2 * h);
      for (int j = 0; j < V; j++) acc[i][j] = dot(acc[i][j], b, wv[j]);
    }
  }
  for (int i = 0; i < R; i++)
    for (int j = 0; j < V; j++) store16(y + i * N + 16 * j, acc[i][j]);
}

#if SPECJAX_DPBF16
// rows_dot for 7 rows of a 64-column panel: 28 accumulators and the 4-vector panel row fill the 32
// registers, so each row's pair is broadcast from memory inside the instruction ({1to16}) rather
// than into a register (the compiler spills an accumulator otherwise). Same products and sums, in
// the same order, as rows_dot.
#define SPECJAX_DOTM(a, p, w) asm("vdpbf16ps %[x]%{1to16%}, %[wv], %[acc]" : [acc] "+v"(a) : [wv] "v"(w), [x] "m"(*(p)))
#define SPECJAX_ROW7(i)                                                                    \
  {                                                                                        \
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(x + (i) * ldx + 2 * h);          \
    SPECJAX_DOTM(a##i##0, xp, w0);                                                          \
    SPECJAX_DOTM(a##i##1, xp, w1);                                                          \
    SPECJAX_DOTM(a##i##2, xp, w2);                                                          \
    SPECJAX_DOTM(a##i##3, xp, w3);                                                          \
  }
#define SPECJAX_INIT7(i)                                                         \
  __m512 a##i##0 = add ? _mm512_loadu_ps(y + (i) * N) : _mm512_setzero_ps();      \
  __m512 a##i##1 = add ? _mm512_loadu_ps(y + (i) * N + 16) : _mm512_setzero_ps(); \
  __m512 a##i##2 = add ? _mm512_loadu_ps(y + (i) * N + 32) : _mm512_setzero_ps(); \
  __m512 a##i##3 = add ? _mm512_loadu_ps(y + (i) * N + 48) : _mm512_setzero_ps();
#define SPECJAX_STORE7(i)                     \
  _mm512_storeu_ps(y + (i) * N, a##i##0);      \
  _mm512_storeu_ps(y + (i) * N + 16, a##i##1); \
  _mm512_storeu_ps(y + (i) * N + 32, a##i##2); \
  _mm512_storeu_ps(y + (i) * N + 48, a##i##3);
void rows_dot7(const uint16_t* x, int64_t ldx, int64_t h0, int64_t h1, const uint16_t* w, float* y, int64_t N,
               bool add) {
  SPECJAX_INIT7(0) SPECJAX_INIT7(1) SPECJAX_INIT7(2) SPECJAX_INIT7(3) SPECJAX_INIT7(4) SPECJAX_INIT7(5)
  SPECJAX_INIT7(6)
  for (int64_t h = h0; h < h1; h++) {
    const uint16_t* wh = w + h * 128;
    __builtin_prefetch(wh + 128 * 8);
    const __m512i w0 = _mm512_loadu_si512(wh), w1 = _mm512_loadu_si512(wh + 32);
    const __m512i w2 = _mm512_loadu_si512(wh + 64), w3 = _mm512_loadu_si512(wh + 96);
    SPECJAX_ROW7(0) SPECJAX_ROW7(1) SPECJAX_ROW7(2) SPECJAX_ROW7(3) SPECJAX_ROW7(4) SPECJAX_ROW7(5)
    SPECJAX_ROW7(6)
  }
  SPECJAX_STORE7(0) SPECJAX_STORE7(1) SPECJAX_STORE7(2) SPECJAX_STORE7(3) SPECJAX_STORE7(4) SPECJAX_STORE7(5)
  SPECJAX_STORE7(6)
}
#undef SPECJAX_DOTM
#undef SPECJAX_ROW7
#undef SPECJAX_INIT7
#undef SPECJAX_STORE7
#endif

// All M rows times one panel. With vdpbf16ps: up to one_pass_rows (7 on a 64-column panel) in one
// pass over the panel, more in groups of that many, each group over the whole panel (a panel is
// 73-196 KB: the first group streams it from memory, the others find it in the core's L2); on
// SmolLM2's 210 matmuls and head, 8 / 12 / 24 rows ran 11 / 10-16 / 8-10 % faster that way than in
// groups of 4 over 16-KB chunks of K, which leave memory idle while the later groups work. Without
// vdpbf16ps: up to group_rows (common.h) in one pass, more in groups of 4 over chunks of K (16 KB
// of panel) that stay in the core's L1 while every group reads them. A row's sums run over K in
// the same order whatever the grouping (a chunk's partial sums are stored and reloaded exactly),
// so its outputs do not depend on the other rows.
template <int V>
constexpr int one_pass_rows() {
  return SPECJAX_DPBF16 && V >= 4 ? 7 : specjax::group_rows<V>();
}

template <int V>
void panel_dot(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, float* y, int64_t N) {
  // groups of one_pass_rows over the whole panel (one group when M fits), else of 4 over chunks
  const bool whole = M <= one_pass_rows<V>() || SPECJAX_DPBF16;
  const int64_t H = K / 2, G = whole ? one_pass_rows<V>() : 4;
  const int64_t chunk = whole ? H : std::max<int64_t>(1, 16384 / (64 * V));
  for (int64_t h0 = 0; h0 < H; h0 += chunk) {
    int64_t h1 = std::min(H, h0 + chunk);
    for (int64_t r0 = 0; r0 < M; r0 += G)
      specjax::with_rows<one_pass_rows<V>()>(std::min<int64_t>(G, M - r0), [&](auto R) {
#if SPECJAX_DPBF16
        if constexpr (decltype(R)::value == 7 && V == 4)
          rows_dot7(x + r0 * K, K, h0, h1, w, y + r0 * N, N, h0 > 0);
        else
#endif
          rows_dot<decltype(R)::value, V>(x + r0 * K, K, h0, h1, w, y + r0 * N, N, h0 > 0);
      });
  }
}

#if SPECJAX_AMX
// Linux hands out the tiles' 8 KB of state only to a process that asks (once, for all its threads).
bool amx_permitted() {
  static const bool ok = [] {
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0..3: the accumulators of up to 4 column blocks (mr rows of 16 floats); 4: mr rows of x
// (32 bf16 each); 5, 6: 16 k-pair rows of the panel (16 columns of pairs), alternating.
void configure(int mr) {
  TileConfig c;
  for (int t = 0; t < 5; t++) c.rows[t] = static_cast<uint8_t>(mr), c.colsb[t] = 64;
  for (int t = 5; t < 7; t++) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// (GCC's tile intrinsics paste the tile numbers into the instruction text: literals only.)
#define SPECJAX_BLOCK(C, B)                       \
  do {                                            \
    _tile_loadd(B, wh + 32 * C, wstride);         \
    _tile_dpbf16ps(C, 4, B);                      \
  } while (0)

// All M rows times one panel w [K/2, 16*V, 2], K a multiple of 32: rows in groups of 16, each
// group's accumulators held in tiles over the whole of K (the panel stays in the core's L2 for
// the next group).
template <int V>
void panel_amx(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, float* y, int64_t N) {
  const int64_t wstride = 64 * V;  // bytes from one k-pair row of the panel to the next
  int configured = 0;
  for (int64_t r0 = 0; r0 < M; r0 += 16) {
    const int mr = static_cast<int>(std::min<int64_t>(16, M - r0));
    if (mr != configured) {
      configure(mr);
      configured = mr;
    }
    _tile_zero(0);
    if (V > 1) { _tile_zero(1); }
    if (V > 2) { _tile_zero(2); _tile_zero(3); }
    const uint16_t* xr = x + r0 * K;
    for (int64_t k = 0; k < K; k += 32) {
      const uint16_t* wh = w + (k / 2) * 32 * V;  // k-pair row k/2 of the panel
      __builtin_prefetch(wh + 32 * V * 64);
      _tile_loadd(4, xr + k, K * 2);
      SPECJAX_BLOCK(0, 5);
      if (V > 1) { SPECJAX_BLOCK(1, 6); }
      if (V > 2) { SPECJAX_BLOCK(2, 5); SPECJAX_BLOCK(3, 6); }
    }
    float* yr = y + r0 * N;
    _tile_stored(0, yr, N * 4);
    if (V > 1) { _tile_stored(1, yr + 16, N * 4); }
    if (V > 2) { _tile_stored(2, yr + 32, N * 4); _tile_stored(3, yr + 48, N * 4); }
  }
  _tile_release();
}
#undef SPECJAX_BLOCK
#endif

#if !defined(__AVX512F__)
// Without AVX-512: rows_dot over a strip of W 8-column vectors of a panel (k-pair row stride ldw
// uint16), R rows of xf (x widened to float32 once per call: a bf16 is the top half of a float32)
// times k-pairs h0 .. h1-1 into y. The same products and sums, in the same order, as rows_dot.
// `whole`: prefetch the panel's whole k-pair rows ahead (the first strip; the others find them cached).
template <int R, int W>
void strip_dot(const float* xf, int64_t ldx, int64_t h0, int64_t h1, const uint16_t* w, int64_t ldw, float* y,
               int64_t N, bool add, bool whole) {
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  typedef uint32_t u32x8u __attribute__((vector_size(32), aligned(2)));
  using specjax::v8;
  const int64_t lines = whole ? (ldw * 2 + 63) / 64 : 1;
  v8 acc[R][W];
  for (int i = 0; i < R; i++)
    for (int j = 0; j < W; j++) acc[i][j] = add ? specjax::load8(y + i * N + 8 * j) : v8{};
  for (int64_t h = h0; h < h1; h++) {
    const uint16_t* wh = w + h * ldw;
    for (int64_t l = 0; l < lines; l++) __builtin_prefetch(reinterpret_cast<const char*>(wh + ldw * 8) + 64 * l);
    v8 odd[W], even[W];
    for (int j = 0; j < W; j++) {
      const u32x8 u = *reinterpret_cast<const u32x8u*>(wh + 16 * j);
      const u32x8 hi = u & (u32x8{} + 0xFFFF0000u), lo = u << 16;
      __builtin_memcpy(&odd[j], &hi, sizeof hi);
      __builtin_memcpy(&even[j], &lo, sizeof lo);
    }
    for (int i = 0; i < R; i++) {
      const v8 b1 = specjax::splat8(xf[i * ldx + 2 * h + 1]), b0 = specjax::splat8(xf[i * ldx + 2 * h]);
      for (int j = 0; j < W; j++) {
        acc[i][j] += b1 * odd[j];  // the odd element of each pair first, as vdpbf16ps
        acc[i][j] += b0 * even[j];
      }
    }
  }
  for (int i = 0; i < R; i++)
    for (int j = 0; j < W; j++) specjax::store8(y + i * N + 8 * j, acc[i][j]);
}

// All M rows (xf, float32) times one panel in strips (common.h) over chunks of k-pairs whose panel
// rows stay in the core's cache while every strip and row group reads them.
template <int V>
void panel_strips(const float* xf, int64_t M, int64_t K, const uint16_t* w, float* y, int64_t N) {
  const int64_t H = K / 2, chunk = std::max<int64_t>(1, 16384 / (64 * V));
  for (int64_t h0 = 0; h0 < H; h0 += chunk) {
    const int64_t h1 = std::min(H, h0 + chunk);
    for (int64_t r0 = 0; r0 < M; r0 += specjax::kStripRows)
      specjax::with_rows<specjax::kStripRows>(std::min<int64_t>(specjax::kStripRows, M - r0), [&](auto R) {
        constexpr int W = specjax::strip_width(decltype(R)::value, 2 * V, 2, 2);
        for (int s = 0; s < 2 * V; s += W)
          strip_dot<decltype(R)::value, W>(xf + r0 * K, K, h0, h1, w + 16 * s, 32 * V, y + r0 * N + 8 * s, N,
                                           h0 > 0, s == 0);
      });
  }
}
#endif

// One panel on the tiles (``tiles``: a build with them, K a multiple of 32), the strips (no AVX-512:
// ``xf``, the rows widened to float32) or the vector path.
template <int V>
void panel_any(bool tiles, const uint16_t* x, const float* xf, int64_t M, int64_t K, const uint16_t* w, float* y,
               int64_t N) {
#if SPECJAX_AMX
  if (tiles) return panel_amx<V>(x, M, K, w, y, N);
#endif
  (void)tiles;
#if !defined(__AVX512F__)
  (void)x;
  panel_strips<V>(xf, M, K, w, y, N);
#else
  (void)xf;
  panel_dot<V>(x, M, K, w, y, N);
#endif
}

ffi::Error PanelDotBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                        ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[3] != 2)
    return ffi::Error::InvalidArgument("panel_dot_bf16: expected x [M, K] and w [P, K/2, Wd, 2]");
  int64_t M = xd[0], K = xd[1], P = wd[0], Wd = wd[2];
  if (K % 2 || wd[1] * 2 != K) return ffi::Error::InvalidArgument("panel_dot_bf16: x and w disagree on K (K even)");
  if (Wd != 16 && Wd != 32 && Wd != 64)
    return ffi::Error::InvalidArgument("panel_dot_bf16: panel width must be 16, 32 or 64");
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != M || yd[1] != P * Wd)
    return ffi::Error::InvalidArgument("panel_dot_bf16: y must be [M, P * Wd]");
  if (M == 0 || P == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(y->typed_data(), y->typed_data() + M * P * Wd, 0.0f);
    return ffi::Error::Success();
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.typed_data());
  float* yp = y->typed_data();
  const int64_t N = P * Wd;
#if SPECJAX_AMX
  const bool tiles = K % 32 == 0 && amx_permitted();
#else
  const bool tiles = false;
#endif
  const float* xfp = nullptr;
#if !defined(__AVX512F__)
  thread_local std::vector<float> xf;  // the rows widened once for every panel's strips
  xf.resize(M * K);
  for (int64_t i = 0; i < M * K; i++) {
    const uint32_t u = static_cast<uint32_t>(xp[i]) << 16;
    std::memcpy(&xf[i], &u, 4);
  }
  xfp = xf.data();
#endif
  specjax::parallel_for(pool, P, [=](int64_t p) {
    const uint16_t* wpp = wp + p * K * Wd;
    float* ypp = yp + p * Wd;
    switch (Wd) {
      case 16: panel_any<1>(tiles, xp, xfp, M, K, wpp, ypp, N); break;
      case 32: panel_any<2>(tiles, xp, xfp, M, K, wpp, ypp, N); break;
      default: panel_any<4>(tiles, xp, xfp, M, K, wpp, ypp, N); break;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

// 1 when this build multiplies on AMX tiles (compiled for a CPU with them, and Linux let the process
// use them), else 0: read through ctypes (specjax.kernels.amx_tiles).
extern "C" int specjax_amx_tiles() {
#if SPECJAX_AMX
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// 1 when this build's vector path multiplies with AVX512-BF16's vdpbf16ps (compiled for a CPU with it),
// else 0 (two float32 FMAs a pair): read through ctypes (specjax.kernels.dpbf16).
extern "C" int specjax_dpbf16() {
#if SPECJAX_DPBF16
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_panel_dot_bf16, PanelDotBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

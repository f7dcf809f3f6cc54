// specjax CPU kernel: y[M, N] = x[M, K] @ W, with W prepacked into column panels
// w[P, K, Wd] (panel p holds columns p*Wd .. p*Wd+Wd-1 of the [K, N] kernel, N = P*Wd,
// Wd in {16, 32, 64}).
//
// Why: a decode step multiplies a few rows (the batch, or the k+1 verified tokens) by every
// weight of the model once, so it is bound by how fast the weights stream from memory. XLA's CPU
// dot reads a row-major [K, N] kernel with a stride of N floats per row of K; each panel here is
// one contiguous stream instead, which the hardware prefetchers follow at close to the memory
// bandwidth. The rows of x stay in registers: a 4-row group keeps 4 x (Wd/16) accumulators of
// 16 floats and reads each weight once per group.
//
// Panels (and, for more than 4 rows, row groups within a panel) are work units shared out over
// XLA's intra-op thread pool; the calling thread works too and then waits only for units that
// have started, so a pool that never runs the scheduled task cannot deadlock it.
//
// Written with GCC/Clang vector extensions (no intrinsics): the compiler maps a 16-float vector
// to one AVX-512 register, two AVX2 registers, or whatever the build machine has.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
static inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// rows r0 .. r0+R-1 of x times panel w [K, 16*V] into y (row stride N).
template <int R, int V>
static void panel_rows(const float* x, int64_t K, const float* w, float* y, int64_t N) {
  v16 acc[R][V];
  for (int i = 0; i < R; i++)
    for (int j = 0; j < V; j++) acc[i][j] = v16{};
  for (int64_t k = 0; k < K; k++) {
    const float* wk = w + k * 16 * V;
    __builtin_prefetch(wk + 16 * V * 8);
    v16 wv[V];
    for (int j = 0; j < V; j++) wv[j] = load16(wk + 16 * j);
    for (int i = 0; i < R; i++) {
      v16 b = v16{} + x[i * K + k];
      for (int j = 0; j < V; j++) acc[i][j] += b * wv[j];
    }
  }
  for (int i = 0; i < R; i++)
    for (int j = 0; j < V; j++) store16(y + i * N + 16 * j, acc[i][j]);
}

template <int V>
static void panel_group(const float* x, int64_t rows, int64_t K, const float* w, float* y, int64_t N) {
  switch (rows) {
    case 1: panel_rows<1, V>(x, K, w, y, N); break;
    case 2: panel_rows<2, V>(x, K, w, y, N); break;
    case 3: panel_rows<3, V>(x, K, w, y, N); break;
    default: panel_rows<4, V>(x, K, w, y, N); break;
  }
}

static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

struct Job {
  const float* x;
  const float* w;
  float* y;
  int64_t M, K, N, Wd, groups, units;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

static void run_units(Job& j) {
  for (;;) {
    int64_t u = j.next.fetch_add(1, std::memory_order_relaxed);
    if (u >= j.units) return;
    int64_t p = u / j.groups, g = u % j.groups;
    int64_t r0 = g * 4, rows = std::min<int64_t>(4, j.M - r0);
    const float* wp = j.w + p * j.K * j.Wd;
    const float* xr = j.x + r0 * j.K;
    float* yr = j.y + r0 * j.N + p * j.Wd;
    switch (j.Wd) {
      case 16: panel_group<1>(xr, rows, j.K, wp, yr, j.N); break;
      case 32: panel_group<2>(xr, rows, j.K, wp, yr, j.N); break;
      default: panel_group<4>(xr, rows, j.K, wp, yr, j.N); break;
    }
    j.done.fetch_add(1, std::memory_order_release);
  }
}

static ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
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
    std::memset(y->typed_data(), 0, sizeof(float) * M * P * Wd);
    return ffi::Error::Success();
  }
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->w = w.typed_data();
  job->y = y->typed_data();
  job->M = M;
  job->K = K;
  job->N = P * Wd;
  job->Wd = Wd;
  job->groups = (M + 3) / 4;
  job->units = P * job->groups;
  int64_t helpers = std::min<int64_t>(pool.num_threads(), job->units) - 1;
  for (int64_t i = 0; i < helpers; i++) pool.Schedule([job] { run_units(*job); });
  run_units(*job);
  while (job->done.load(std::memory_order_acquire) < job->units) cpu_relax();
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_panel_matmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

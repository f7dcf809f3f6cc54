// Shared by the specjax CPU kernels: 16-float vectors (GCC/Clang vector extensions, no
// intrinsics: one AVX-512 register, two AVX2 registers, or whatever the build machine has) and
// work sharing: parallel_for(pool, units, fn) runs fn(u) for every u < units on the calling
// thread and on XLA's intra-op pool.
//
// The caller works too and then waits only for units that have started, so a scheduled task
// that never runs cannot deadlock it; a task that starts late finds no unit left and touches
// only the job object, which the shared_ptr keeps alive. (Measured against helper threads of our
// own that spin between calls: a faster chain of bare matmuls, a slower and less steady decode
// step, where they compete for the cores with XLA's own threads.)
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace specjax {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // unaligned access
typedef int32_t i16v __attribute__((vector_size(64)));

inline v16 load16(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store16(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }

// 8-float vectors: one AVX2 register. Without AVX-512 the matmul kernels pass over a panel in
// strips of strip_width 8-column vectors for R rows at a time (at most kStripRows), so that the
// accumulators, the strip's weights and a broadcast fit the 16 registers: GCC keeps arrays of
// 16-float vectors on the stack there (a 7-row verify over SmolLM2's layers took 3.3x the AVX-512
// build's time and 2.1x XLA's dot). A row's sums are the same whatever the strips.
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned access
inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void store8(float* p, v8 v) { *reinterpret_cast<v8u*>(p) = v; }
inline v8 splat8(float s) { return s - v8{}; }  // s - 0 == s exactly: a broadcast
// s in every lane (s - 0 == s exactly: folds to a broadcast); without AVX-512 built from an 8-lane
// half, which GCC broadcasts in a register where a 16-lane scalar operand goes through 16 stores.
inline v16 splat(float s) {
#if defined(__AVX512F__)
  return s - v16{};
#else
  const v8 h = splat8(s);
  v16 r;
  __builtin_memcpy(&r, &h, sizeof h);
  __builtin_memcpy(reinterpret_cast<char*>(&r) + sizeof h, &h, sizeof h);
  return r;
#endif
}

constexpr int kStripRows = 12;
// the widest strip (8-column vectors, dividing the panel's `vectors`) with R x W accumulators +
// per_weight x W weight vectors + the broadcasts <= 16 registers
constexpr int strip_width(int R, int vectors, int per_weight = 1, int broadcasts = 1) {
  int w = vectors;
  while (w > 1 && R * w + per_weight * w + broadcasts > 16) w /= 2;
  return w;
}

// The matmul kernels' rows per pass over a panel of 16 V columns: as many as the 32 vector registers
// hold beside the panel row and a broadcast (R x V accumulators), so a verify of up to 6 rows (8 on
// 16- and 32-column panels) reads each panel once, as a decode step does (the bf16 kernel's
// vdpbf16ps path takes 7 on 64-column panels, its broadcasts from memory: panel_dot_bf16.cc).
template <int V>
constexpr int group_rows() {
  return V >= 4 ? 6 : 8;
}

// f(std::integral_constant<int, r>{}) for a runtime 1 <= r <= Max: a row count as a template argument.
template <int Max, typename F>
inline void with_rows(int64_t r, F&& f) {
  if constexpr (Max > 1) {
    if (r < Max) return with_rows<Max - 1>(r, f);
  }
  f(std::integral_constant<int, Max>{});
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

struct Job {
  std::function<void(int64_t)> fn;
  int64_t units = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void run() {
    for (;;) {
      int64_t u = next.fetch_add(1, std::memory_order_relaxed);
      if (u >= units) return;
      fn(u);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t units, std::function<void(int64_t)> fn) {
  if (units <= 0) return;
  auto job = std::make_shared<Job>();
  job->fn = std::move(fn);
  job->units = units;
  int64_t helpers = std::min<int64_t>(pool.num_threads(), units) - 1;
  for (int64_t i = 0; i < helpers; i++) pool.Schedule([job] { job->run(); });
  job->run();
  while (job->done.load(std::memory_order_acquire) < job->units) cpu_relax();
}

}  // namespace specjax

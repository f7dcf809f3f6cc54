// specjax CPU kernel: the neox rotary embedding of a layer's queries and keys in one call, with
// every product and sum rounded on its own (no fused multiply-add).
//
//   q    [N, Hq, D], k [N, Hkv, D]    float32 (N = batch x tokens)
//   cos, sin [N, R]                   float32, R even, R <= D (the rotary channels)
//   out  q', k' of the same shapes:   for c < R/2:  x[c] cos[c] - x[c + R/2] sin[c]
//                                      for R/2 <= c < R:  x[c] cos[c] + x[c - R/2] sin[c]
//                                      for c >= R:  x[c]
//
// Why: ``x * cos + rotate_half(x) * sin`` in XLA's CPU fusions may or may not become an FMA
// (XLA lets LLVM contract a product into the following add), and which it does depends on the
// fusion's shapes: the 1-row decode loop of a batch-1 program rounded keys differently (one ulp)
// from the same program at batch 2 and from a k+1-row verify, which bf16 matmul inputs then turn
// into different greedy tokens. Here a product and the sum are always rounded separately,
// whatever the shapes, which is also what PyTorch's eager ops do (x*cos, rotate_half(x)*sin, +):
// (-a) * s + p and p - a * s round alike.
#pragma GCC optimize("fp-contract=off")
#include <cstdint>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__clang__)
#define SPECJAX_NO_CONTRACT _Pragma("clang fp contract(off)")
#else
#define SPECJAX_NO_CONTRACT
#endif

// Rows [r0, r1) of one tensor x [N, H, D].
void rope_rows(const float* x, const float* cs, const float* sn, float* y, int64_t r0, int64_t r1, int64_t H,
               int64_t D, int64_t R) {
  SPECJAX_NO_CONTRACT
  const int64_t h = R / 2;
  for (int64_t r = r0; r < r1; r++) {
    const float* c = cs + r * R;
    const float* s = sn + r * R;
    for (int64_t j = 0; j < H; j++) {
      const float* xi = x + (r * H + j) * D;
      float* yi = y + (r * H + j) * D;
      for (int64_t t = 0; t < h; t++) {
        const float p = xi[t] * c[t];
        const float m = xi[t + h] * s[t];
        yi[t] = p - m;
      }
      for (int64_t t = h; t < R; t++) {
        const float p = xi[t] * c[t];
        const float m = xi[t - h] * s[t];
        yi[t] = p + m;
      }
      for (int64_t t = R; t < D; t++) yi[t] = xi[t];
    }
  }
}

ffi::Error Rope(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> cos,
                ffi::Buffer<ffi::F32> sin, ffi::ResultBuffer<ffi::F32> qo, ffi::ResultBuffer<ffi::F32> ko) {
  auto qd = q.dimensions(), kd = k.dimensions(), cd = cos.dimensions(), sd = sin.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || cd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("rope: expected q [N, Hq, D], k [N, Hkv, D], cos/sin [N, R]");
  const int64_t N = qd[0], Hq = qd[1], D = qd[2], Hk = kd[1], R = cd[1];
  if (kd[0] != N || kd[2] != D || cd[0] != N || sd[0] != N || sd[1] != R || R % 2 || R > D)
    return ffi::Error::InvalidArgument("rope: q, k and cos/sin disagree on N or D (R even, at most D)");
  const float *qp = q.typed_data(), *kp = k.typed_data(), *cp = cos.typed_data(), *sp = sin.typed_data();
  float *qy = qo->typed_data(), *ky = ko->typed_data();
  // units of rows: a decode step's one row is a single unit (a call costs a few microseconds)
  const int64_t per = std::max<int64_t>(1, 4096 / ((Hq + Hk) * D));
  const int64_t units = (N + per - 1) / per;
  specjax::parallel_for(pool, units, [=](int64_t u) {
    const int64_t r0 = u * per, r1 = std::min<int64_t>(N, r0 + per);
    rope_rows(qp, cp, sp, qy, r0, r1, Hq, D, R);
    rope_rows(kp, cp, sp, ky, r0, r1, Hk, D, R);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_rope, Rope,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

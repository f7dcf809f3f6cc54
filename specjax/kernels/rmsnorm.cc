// specjax CPU kernel: the normalised rows of an RMSNorm, y = x / sqrt(mean(x^2) + eps), each row
// summed in one fixed order (16 lanes over the row, then the lanes pairwise), whatever the
// number of rows.
//
//   x [N, D] float32 -> y [N, D] float32; attr eps (float32)
//
// Why: XLA's CPU reductions pick their order from the shape: a cached forward of 8 or more rows
// summed each row's squares in another order than a forward of 1-7 rows (every row's keys off by
// 1e-5 in float32 at 8 rows), so a token tree's verify of 8+ rows and a decode step disagreed on
// the rows they share. The module applies its scale to y as before.
#include <cmath>
#include <cstdint>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using specjax::load16;
using specjax::v16;

inline float lanes_sum(v16 a) {  // ((0+8) + (4+12)) + ... : a fixed pairwise order
  float t[16];
  for (int i = 0; i < 16; i++) t[i] = a[i];
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; i++) t[i] = t[i] + t[i + w];
  return t[0];
}

void norm_row(const float* x, float* y, int64_t D, float eps) {
  v16 acc = v16{};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    v16 a = load16(x + d);
    acc = acc + a * a;
  }
  float s = lanes_sum(acc);
  for (; d < D; d++) s = s + x[d] * x[d];
  const float r = 1.0f / std::sqrt(s / static_cast<float>(D) + eps);
  for (int64_t i = 0; i < D; i++) y[i] = x[i] * r;
}

ffi::Error RmsNorm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, float eps, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("rmsnorm: expected x [N, D]");
  const int64_t N = xd[0], D = xd[1];
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const int64_t per = std::max<int64_t>(1, 8192 / std::max<int64_t>(D, 1));
  specjax::parallel_for(pool, (N + per - 1) / per, [=](int64_t u) {
    for (int64_t r = u * per; r < std::min<int64_t>(N, (u + 1) * per); r++) norm_row(xp + r * D, yp + r * D, D, eps);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_rmsnorm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>());

// specjax CPU kernel: a token-tree verify's accepted path moved to consecutive cache rows, in
// every layer's K and V buffer at once (specjax.decode.tree.compact_cache).
//
//   base   [B]        int32: the committed length before the verify (node i sits at slot base + i)
//   path   [B, D1]    int32: the accepted path's node indices (root 0), -1 past the accepted nodes
//   bufs   n x [B, H, S, Dh] (heads-major, any element type), each aliased to its output
//
// For every buffer, sequence b and j < D1: slot base[b] + j takes the row (all H heads) that slot
// min(base[b] + max(path[b, j], 0), S - 1) held before the call (every source read before any
// write, as XLA's gather then scatter), slots past S dropped. One call instead of a gather and a
// scatter per buffer (2 x 2 x layers small XLA ops a round, ~4 us of dispatch each on 2 cores).
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error CompactRows(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> base, ffi::Buffer<ffi::S32> path,
                              ffi::RemainingArgs bufs, ffi::RemainingRets outs) {
  auto bd = base.dimensions(), pd = path.dimensions();
  if (bd.size() != 1 || pd.size() != 2 || pd[0] != bd[0])
    return ffi::Error::InvalidArgument("compact_rows: expected base [B] and path [B, D1]");
  if (bufs.size() != outs.size()) return ffi::Error::InvalidArgument("compact_rows: one output per buffer");
  const int64_t B = bd[0], D1 = pd[1];
  const int32_t* bp = base.typed_data();
  const int32_t* pp = path.typed_data();
  struct Job {
    const char* in;
    char* out;
    int64_t H, S, row;  // row: bytes of one slot of one head
  };
  std::vector<Job> jobs;
  for (size_t i = 0; i < bufs.size(); i++) {
    auto a = bufs.get<ffi::AnyBuffer>(i);
    auto r = outs.get<ffi::AnyBuffer>(i);
    if (!a.has_value() || !r.has_value()) return ffi::Error::InvalidArgument("compact_rows: buffers expected");
    auto d = a->dimensions();
    if (d.size() != 4 || d[0] != B || (*r)->dimensions().size() != 4 || (*r)->size_bytes() != a->size_bytes())
      return ffi::Error::InvalidArgument("compact_rows: each buffer [B, H, S, Dh], its output the same");
    const int64_t row = d[3] * static_cast<int64_t>(ffi::ByteWidth(a->element_type()));
    jobs.push_back({static_cast<const char*>(a->untyped_data()), static_cast<char*>((*r)->untyped_data()), d[1], d[2],
                    row});
  }
  specjax::parallel_for(pool, static_cast<int64_t>(jobs.size()) * B, [&](int64_t u) {
    const Job& j = jobs[u / B];
    const int64_t b = u % B, S = j.S;
    const size_t slab = static_cast<size_t>(j.S * j.row);  // one head's slots
    if (j.in != j.out) std::memcpy(j.out + b * j.H * slab, j.in + b * j.H * slab, j.H * slab);
    char* o = j.out + b * j.H * slab;
    thread_local std::vector<char> tmp;
    tmp.resize(static_cast<size_t>(D1 * j.H * j.row));
    for (int64_t t = 0; t < D1; t++) {
      const int64_t src = std::min<int64_t>(bp[b] + std::max<int32_t>(pp[b * D1 + t], 0), S - 1);
      for (int64_t h = 0; h < j.H; h++)
        std::memcpy(tmp.data() + (t * j.H + h) * j.row, o + h * slab + src * j.row, j.row);
    }
    for (int64_t t = 0; t < D1; t++) {
      const int64_t dst = bp[b] + t;
      if (dst < 0 || dst >= S) continue;
      for (int64_t h = 0; h < j.H; h++)
        std::memcpy(o + h * slab + dst * j.row, tmp.data() + (t * j.H + h) * j.row, j.row);
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_compact_rows, CompactRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

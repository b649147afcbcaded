// The grouped matmul of a mixture of experts for the CPU, called from JAX through the XLA FFI:
// each expert's rows times its own weight, all experts in one call.
//
// x: [M, K] float32, the step's (token, expert) rows sorted by expert. offsets: [E + 1] int32,
// expert e's rows are offsets[e] .. offsets[e + 1] (ascending, offsets[0] = 0, offsets[E] <= M;
// rows past offsets[E], pairs of no expert, come out as zeros). w: [E, P, K, W] float32, each
// expert's [K, N = P * W] weight in column panels as the float32 matmul takes them
// (paged_jax.native.pack_weight). y: [M, N].
//
// Every expert's rows run over its panels with the float32 matmul's register tiles
// (panel_tiles.h), so each chosen expert's weight is streamed from memory once, with the same
// prefetching, and an expert no row chose is not read at all. The work units are (expert, chunk
// of up to 1024 rows, panel), the panels innermost, shared out over XLA's threads in contiguous
// ranges (an expert's panels, then the next expert's, lie one after another in w).

#include <cstdint>
#include <cstring>
#include <vector>

#include "panel_tiles.h"

namespace ffi = xla::ffi;

namespace {

struct Unit {
  int64_t expert, panel, m0, m1;
};

ffi::Error GroupedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> offsets,
                       ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), od = offsets.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || od.size() != 1 || wd.size() != 4 || yd.size() != 2)
    return ffi::Error::InvalidArgument("grouped linear: expected x [M, K], offsets [E + 1], w [E, P, K, W], y [M, P * W]");
  const int64_t M = xd[0], K = xd[1], E = wd[0], P = wd[1], W = wd[3];
  if (od[0] != E + 1 || wd[2] != K || (W != 16 && W != 32 && W != 48) || yd[0] != M || yd[1] != P * W)
    return ffi::Error::InvalidArgument("grouped linear: sizes do not match, or a panel width other than 16, 32, 48");
  const int32_t* off = offsets.typed_data();
  if (off[0] != 0 || off[E] > M)
    return ffi::Error::InvalidArgument("grouped linear: offsets must start at 0 and end at most at x's rows");
  for (int64_t e = 0; e < E; ++e)
    if (off[e + 1] < off[e]) return ffi::Error::InvalidArgument("grouped linear: offsets must not decrease");
  const float* xs = x.typed_data();
  const float* ws = w.typed_data();
  float* ys = y->typed_data();
  const int64_t N = P * W;
  if (off[E] < M) std::memset(ys + off[E] * N, 0, (M - off[E]) * N * sizeof(float));

  constexpr int64_t kRowChunk = 1024;  // rows per pass over a panel, as the float32 matmul's
  std::vector<Unit> units;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t m0 = off[e]; m0 < off[e + 1]; m0 += kRowChunk)
      for (int64_t p = 0; p < P; ++p) units.push_back({e, p, m0, std::min<int64_t>(off[e + 1], m0 + kRowChunk)});
  paged_jax_native::ParallelRanges(pool, static_cast<int64_t>(units.size()), 2, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const Unit& t = units[u];
      const float* panel = ws + (t.expert * P + t.panel) * K * W;
      float* out = ys + t.panel * W;
      switch (W) {
        case 48: Tiles<48>(xs, K, t.m0, t.m1, panel, out, N, K, true); break;
        case 32: Tiles<32>(xs, K, t.m0, t.m1, panel, out, N, K, true); break;
        default: Tiles<16>(xs, K, t.m0, t.m1, panel, out, N, K, true); break;
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedLinearF32, GroupedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

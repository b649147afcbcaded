// y = x @ w for the CPU, with w stored in column panels, called from JAX through the XLA FFI.
//
// x: [M, K] float32, row-major. w: [P, K, W] float32, the [K, N = P * W] weight cut into P
// panels of W (48, 32 or 16) columns, each panel contiguous (paged_jax.native.pack_weight).
// y: [M, N].
//
// One panel at a time: its K x W block stays in the core's L2 while every group of 8 rows of x
// runs over it in registers (8 x W accumulators), so each weight is read from memory once per
// 1024 rows. The first group's pass prefetches the weights kPrefetch floats ahead, running on
// into the next panel (the panels lie one after another): the hardware prefetchers alone keep
// too few lines in flight while both cores stream weights (at 32 rows this is what makes the
// difference against XLA's CPU matmuls, see experiments/roofline.py). Panels are shared out
// over XLA's intra-op thread pool in contiguous ranges (parallel.h). Sums run over k in order, in float32
// with fused multiply-adds.
//
// Three builds of the tiles, by the instruction set the library is compiled for (-march=native):
// AVX-512 (32 registers of 16 floats: up to 8 rows x 48 columns at once), AVX2 with FMA3 (16
// registers of 8 floats: one row over the whole panel, or up to 6 rows x 16 columns, the panel
// walked in 16-column strips that stay in L1/L2 after the first strip's pass) and portable loops.
// All three sum each output over k in order with one rounding per multiply-add where FMA exists.

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#include "panel_tiles.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("linear: expected x [M, K], w [P, K, W], y [M, P * W]");
  const int64_t M = xd[0], K = xd[1], P = wd[0], W = wd[2];
  if (wd[1] != K || (W != 16 && W != 32 && W != 48) || yd[0] != M || yd[1] != P * W)
    return ffi::Error::InvalidArgument("linear: sizes do not match, or a panel width other than 16, 32, 48");
  if (M == 0) return ffi::Error::Success();
  const float* xs = x.typed_data();
  const float* ws = w.typed_data();
  float* ys = y->typed_data();
  const int64_t N = P * W;
  ForEachPanelChunk(pool, M, P, [=](int64_t p, int64_t m0, int64_t m1) {
    const float* panel = ws + p * K * W;
    float* out = ys + p * W;
    switch (W) {
      case 48: Tiles<48>(xs, K, m0, m1, panel, out, N, K, true); break;
      case 32: Tiles<32>(xs, K, m0, m1, panel, out, N, K, true); break;
      default: Tiles<16>(xs, K, m0, m1, panel, out, N, K, true); break;
    }
  });
  return ffi::Error::Success();
}

// The sum of a float32 array, read with the same prefetching and thread sharing as the
// matmul's weights: experiments/roofline.py measures the machine's read bandwidth with it
// (beside a jitted jnp.sum), so the floor is not set by a slower reader than the kernels.
ffi::Error SumImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  const float* xs = x.typed_data();
  const int64_t n = static_cast<int64_t>(x.element_count());
  std::mutex mu;
  double total = 0;
  paged_jax_native::ParallelRanges(pool, (n + 4095) / 4096, 4, [&](int64_t a, int64_t b) {  // 4096-float pieces
    float acc[16] = {};
    const int64_t end = std::min(n, b * 4096);
    int64_t i = a * 4096;
    for (; i + 16 <= end; i += 16) {
      __builtin_prefetch(xs + i + kPrefetch, 0, 3);
#pragma omp simd
      for (int j = 0; j < 16; ++j) acc[j] += xs[i + j];
    }
    double part = 0;
    for (; i < end; ++i) part += xs[i];
    for (float v : acc) part += v;
    std::lock_guard<std::mutex> lock(mu);
    total += part;
  });
  *out->typed_data() = static_cast<float>(total);
  return ffi::Error::Success();
}

}  // namespace

// Which tiles the float32 and quantized matmuls were built with: 2 AVX-512, 1 AVX2 with FMA3,
// 0 the portable loops (slower than XLA's matmul: the runner then keeps plain float32 weights).
extern "C" int PagedJaxLinearIsa() {
#if defined(PAGED_JAX_AVX512)
  return 2;
#elif defined(PAGED_JAX_AVX2)
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SumF32, SumImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinearF32, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

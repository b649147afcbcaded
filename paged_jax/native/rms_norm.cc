// RMS normalization for the CPU, called from JAX through the XLA FFI: y = w * (x * rsqrt(mean(x^2) + eps))
// per row, as paged_jax.models.layers.rms_norm computes it in float32.
//
// Why: XLA's CPU backend compiles that expression into four operations (the squares, a
// reduce-window of partial sums, their sum with the rsqrt, the scaling), each a thunk of its own,
// and a model step has one norm before every attention and MLP block: at batch 1 the 68 thunks of
// the 17 norms of an 8-layer LLaMA were a third of the step's operations, each costing about a
// microsecond on its own for a few hundred floats of work. One call does a norm's rows in one pass.
//
// x: [T, D] float32, w: [D] float32, eps an attribute; y: [T, D]. Each row's squares are summed in
// 16 lanes (i mod 16), added in lane order, then divided by D: the sums' order differs from XLA's
// (a few units in the last place; the tests compare with numpy at that tolerance).

#include <cmath>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kRowsAlone = 64;  // rows up to which one thread does them all (a few microseconds)

void NormRows(const float* x, const float* w, float* y, int64_t r0, int64_t r1, int64_t D, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * D;
    float lanes[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= D; i += kLanes) {
#pragma omp simd
      for (int64_t j = 0; j < kLanes; ++j) lanes[j] += xr[i + j] * xr[i + j];
    }
    for (; i < D; ++i) lanes[i % kLanes] += xr[i] * xr[i];
    float sum = 0.f;
    for (float v : lanes) sum += v;
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(D) + eps);
    float* yr = y + r * D;
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) yr[j] = w[j] * (xr[j] * inv);
  }
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, float eps,
                ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 1 || yd.size() != 2 || wd[0] != xd[1] || yd[0] != xd[0] || yd[1] != xd[1])
    return ffi::Error::InvalidArgument("rms_norm: expected x [T, D], w [D], y [T, D]");
  const int64_t T = xd[0], D = xd[1];
  const float *xs = x.typed_data(), *ws = w.typed_data();
  float* ys = y->typed_data();
  if (T <= kRowsAlone) {
    NormRows(xs, ws, ys, 0, T, D, eps);
  } else {
    paged_jax_native::ParallelRanges(pool, T, 1, [=](int64_t r0, int64_t r1) { NormRows(xs, ws, ys, r0, r1, D, eps); });
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormF32, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>());

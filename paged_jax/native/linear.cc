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
// over XLA's intra-op thread pool in contiguous chunks. Sums run over k in order, in float32
// with fused multiply-adds.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRows = 8;          // rows of x per register tile
constexpr int64_t kRowChunk = 1024;   // rows of x per pass over the weights
constexpr int64_t kPrefetch = 3072;   // floats ahead in the panel stream

inline void PrefetchRow(const float* p, int64_t w) {
  for (int64_t off = 0; off < w; off += 16) __builtin_prefetch(p + off, 0, 3);
}

// y[0:R, 0:W] = x[0:R, 0:K] @ panel[0:K, 0:W]; x rows ldx apart, y rows ldy apart.
template <int R, int W>
inline void Tile(const float* x, int64_t ldx, const float* panel, float* y, int64_t ldy, int64_t K,
                 bool prefetch) {
  constexpr int V = W / 16;
#if defined(__AVX512F__)
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* b = panel + k * W;
    if (prefetch) PrefetchRow(b + kPrefetch, W);
    __m512 bv[V];
    for (int v = 0; v < V; ++v) bv[v] = _mm512_loadu_ps(b + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(a, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y + r * ldy + 16 * v, acc[r][v]);
#else
  float acc[R][W] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float* b = panel + k * W;
    if (prefetch) PrefetchRow(b + kPrefetch, W);
    for (int r = 0; r < R; ++r) {
      const float a = x[r * ldx + k];
#pragma omp simd
      for (int c = 0; c < W; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) y[r * ldy + c] = acc[r][c];
#endif
}

template <int W>
void Panel(const float* x, int64_t m0, int64_t m1, int64_t K, const float* panel, float* y, int64_t N) {
  for (int64_t m = m0; m < m1; m += kRows) {
    const float* xs = x + m * K;
    float* ys = y + m * N;
    const bool pf = m == m0;  // the first pass reads the panel from memory; prefetch ahead of it
    switch (std::min<int64_t>(kRows, m1 - m)) {
      case 8: Tile<8, W>(xs, K, panel, ys, N, K, pf); break;
      case 7: Tile<7, W>(xs, K, panel, ys, N, K, pf); break;
      case 6: Tile<6, W>(xs, K, panel, ys, N, K, pf); break;
      case 5: Tile<5, W>(xs, K, panel, ys, N, K, pf); break;
      case 4: Tile<4, W>(xs, K, panel, ys, N, K, pf); break;
      case 3: Tile<3, W>(xs, K, panel, ys, N, K, pf); break;
      case 2: Tile<2, W>(xs, K, panel, ys, N, K, pf); break;
      default: Tile<1, W>(xs, K, panel, ys, N, K, pf); break;
    }
  }
}

struct Shared {
  const float* x;
  const float* w;
  float* y;
  int64_t M, K, P, W;
  int64_t num_chunks, per_chunk;
  std::atomic<int64_t> next{0}, done{0};
};

void Work(Shared& s) {
  const int64_t N = s.P * s.W;
  for (int64_t c; (c = s.next.fetch_add(1)) < s.num_chunks;) {
    const int64_t p0 = c * s.per_chunk, p1 = std::min(s.P, p0 + s.per_chunk);
    for (int64_t m0 = 0; m0 < s.M; m0 += kRowChunk) {
      const int64_t m1 = std::min(s.M, m0 + kRowChunk);
      for (int64_t p = p0; p < p1; ++p) {
        const float* panel = s.w + p * s.K * s.W;
        float* y = s.y + p * s.W;
        switch (s.W) {
          case 48: Panel<48>(s.x, m0, m1, s.K, panel, y, N); break;
          case 32: Panel<32>(s.x, m0, m1, s.K, panel, y, N); break;
          default: Panel<16>(s.x, m0, m1, s.K, panel, y, N); break;
        }
      }
    }
    s.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("linear: expected x [M, K], w [P, K, W], y [M, P * W]");
  const int64_t M = xd[0], K = xd[1], P = wd[0], W = wd[2];
  if (wd[1] != K || (W != 16 && W != 32 && W != 48) || yd[0] != M || yd[1] != P * W)
    return ffi::Error::InvalidArgument("linear: sizes do not match, or a panel width other than 16, 32, 48");
  if (M == 0 || P == 0) return ffi::Error::Success();
  auto sh = std::make_shared<Shared>();
  sh->x = x.typed_data();
  sh->w = w.typed_data();
  sh->y = y->typed_data();
  sh->M = M, sh->K = K, sh->P = P, sh->W = W;
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  sh->num_chunks = std::min<int64_t>(P, 2 * (workers + 1));
  sh->per_chunk = (P + sh->num_chunks - 1) / sh->num_chunks;
  sh->num_chunks = (P + sh->per_chunk - 1) / sh->per_chunk;
  for (int64_t i = 0; i < std::min(workers, sh->num_chunks - 1); ++i) pool.Schedule([sh] { Work(*sh); });
  Work(*sh);  // the calling thread takes chunks too, so nothing waits on a task that never started
  while (sh->done.load(std::memory_order_acquire) < sh->num_chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

// The sum of a float32 array, read with the same prefetching and thread sharing as the
// matmul's weights: experiments/roofline.py measures the machine's read bandwidth with it
// (beside a jitted jnp.sum), so the floor is not set by a slower reader than the kernels.
struct SumShared {
  const float* x;
  int64_t n, num_chunks, per_chunk;
  std::unique_ptr<double[]> partial;
  std::atomic<int64_t> next{0}, done{0};
};

void SumWork(SumShared& s) {
  for (int64_t c; (c = s.next.fetch_add(1)) < s.num_chunks;) {
    const int64_t a = c * s.per_chunk, b = std::min(s.n, a + s.per_chunk);
    float acc[16] = {};
    int64_t i = a;
    for (; i + 16 <= b; i += 16) {
      __builtin_prefetch(s.x + i + kPrefetch, 0, 3);
#pragma omp simd
      for (int j = 0; j < 16; ++j) acc[j] += s.x[i + j];
    }
    double total = 0;
    for (; i < b; ++i) total += s.x[i];
    for (float v : acc) total += v;
    s.partial[c] = total;
    s.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error SumImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  auto sh = std::make_shared<SumShared>();
  sh->x = x.typed_data();
  sh->n = static_cast<int64_t>(x.element_count());
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  sh->num_chunks = std::max<int64_t>(1, std::min<int64_t>(sh->n / 4096, 4 * (workers + 1)));
  sh->per_chunk = (sh->n + sh->num_chunks - 1) / sh->num_chunks;
  sh->partial.reset(new double[sh->num_chunks]());
  for (int64_t i = 0; i < std::min(workers, sh->num_chunks - 1); ++i) pool.Schedule([sh] { SumWork(*sh); });
  SumWork(*sh);
  while (sh->done.load(std::memory_order_acquire) < sh->num_chunks) std::this_thread::yield();
  double total = 0;
  for (int64_t c = 0; c < sh->num_chunks; ++c) total += sh->partial[c];
  *out->typed_data() = static_cast<float>(total);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SumF32, SumImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinearF32, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

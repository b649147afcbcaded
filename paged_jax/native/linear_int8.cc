// y = (xq @ w) * x_scale * w_scale for the CPU, int8 activations times int8 weights (W8A8: the
// activations quantized per token at run time, paged_jax.weights.quantize_per_token),
// called from JAX through the XLA FFI.
//
// xq: [M, K] int8, row-major, K a multiple of 4. x_scale: [M] float32. w: [P, K / 4, W * 4] int8,
// the [K, N = P * W] weight cut into P panels of W (48, 32 or 16) columns, each panel's rows taken
// four at a time and interleaved per column (byte 4c + j of quad row i is w[4i + j, c]), which is
// the operand layout of AVX-512 VNNI's vpdpbusd: one instruction multiplies 16 columns by four
// rows and adds the four products into 16 int32 sums, 64 multiply-adds where a float32 fused
// multiply-add does 16. w_sums: [P, W] int32, each column's sum; w_scale: [P, W] float32.
//
// vpdpbusd multiplies unsigned by signed bytes: the activations enter as x + 128 (a flip of the
// sign bit), and 128 times the column's sum is taken off the integer sum after. The sums are
// exact (|x w| <= 2^14, so K up to 2^17 cannot overflow int32) and the result is
// float(sum) * x_scale * w_scale, the same operations in the same order as XLA's int8 dot in
// QuantizedLinear, so the two agree to the bit.
//
// With AVX2 and no VNNI: vpmaddwd on 16-bit values. Each 16-byte piece of a quad row (4 columns x
// 4 rows) widens to 16 int16, and vpmaddwd against the activation quad (widened once per call,
// broadcast as 64 bits) gives 8 int32, two partial sums per column, exact; the two halves are
// added once at the end. (vpmaddubsw would take the bytes as they are, but its 16-bit sums
// saturate: with x + 128 at once, and with llama.cpp's sign trick where both operands are -128;
// this path is exact for every int8.) Elsewhere the portable loops compute the same.

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAGED_JAX_VNNI 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define PAGED_JAX_AVX2 1
#endif
#include <vector>

namespace ffi = xla::ffi;

namespace {

#if defined(PAGED_JAX_AVX2)
constexpr int64_t kRows = 6;       // rows of x per register tile: 6 x 8 columns x 2 halves in 16 registers
constexpr int64_t kXBytes = 2;     // the activations as Tile reads them: widened to int16 (Impl)
#else
constexpr int64_t kXBytes = 1;
constexpr int64_t kRows = 8;       // rows of x per register tile
#endif
constexpr int64_t kAhead = 12288;  // bytes prefetched ahead in the panel stream

// y[0:R, 0:W] for rows of xq (ldx apart) against one panel ([K / 4, W * 4] bytes).
template <int R, int W>
inline void Tile(const int8_t* x, int64_t ldx, const float* xs, const int8_t* panel, const int32_t* sums,
                 const float* ws, float* y, int64_t ldy, int64_t K, bool prefetch) {
#if defined(PAGED_JAX_VNNI)
  constexpr int V = W / 16;
  __m512i acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_si512();
  for (int64_t k4 = 0; k4 < K / 4; ++k4) {
    const int8_t* b = panel + k4 * W * 4;
    if (prefetch)
      for (int off = 0; off < W * 4; off += 64) __builtin_prefetch(b + kAhead + off, 0, 3);
    __m512i bv[V];
    for (int v = 0; v < V; ++v) bv[v] = _mm512_loadu_si512(b + 64 * v);
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      __builtin_memcpy(&quad, x + r * ldx + 4 * k4, 4);
      const __m512i a = _mm512_set1_epi32(quad ^ static_cast<int32_t>(0x80808080u));  // x + 128, unsigned
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], a, bv[v]);
    }
  }
  for (int v = 0; v < V; ++v) {
    const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(sums + 16 * v), 7);  // 128 * column sum
    const __m512 scale = _mm512_loadu_ps(ws + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][v], offset));
      _mm512_storeu_ps(y + r * ldy + 16 * v, _mm512_mul_ps(_mm512_mul_ps(f, _mm512_set1_ps(xs[r])), scale));
    }
  }
#elif defined(PAGED_JAX_AVX2)
  // x here is the activations widened to int16 (Impl), rows ldx apart; 8 columns at a time
  const int16_t* x16 = reinterpret_cast<const int16_t*>(x);
  for (int c0 = 0; c0 < W; c0 += 8) {
    __m256i acc[R][2];  // [r][h]: columns c0 + 4h .. c0 + 4h + 3, two partial sums each
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t k4 = 0; k4 < K / 4; ++k4) {
      const int8_t* b = panel + k4 * W * 4 + 4 * c0;
      if (prefetch && c0 == 0)
        for (int off = 0; off < W * 4; off += 64) __builtin_prefetch(b + kAhead + off, 0, 3);
      __m256i bv[2];
      for (int h = 0; h < 2; ++h)
        bv[h] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * h)));
      for (int r = 0; r < R; ++r) {
        int64_t quad;
        __builtin_memcpy(&quad, x16 + r * ldx + 4 * k4, 8);
        const __m256i a = _mm256_set1_epi64x(quad);
        for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(a, bv[h]));
      }
    }
    const __m256 scale = _mm256_loadu_ps(ws + c0);
    for (int r = 0; r < R; ++r) {
      // hadd: [c0 c1 c4 c5 | c2 c3 c6 c7]; the 64-bit permute puts the columns in order
      const __m256i sum = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r][0], acc[r][1]), 0xD8);
      const __m256 f = _mm256_cvtepi32_ps(sum);
      _mm256_storeu_ps(y + r * ldy + c0, _mm256_mul_ps(_mm256_mul_ps(f, _mm256_set1_ps(xs[r])), scale));
    }
  }
  (void)sums;
#else
  int32_t acc[R][W] = {};
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* b = panel + (k / 4) * W * 4 + (k % 4);
    for (int r = 0; r < R; ++r) {
      const int32_t a = x[r * ldx + k];
      for (int c = 0; c < W; ++c) acc[r][c] += a * b[4 * c];
    }
  }
  (void)sums;
  (void)prefetch;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) y[r * ldy + c] = static_cast<float>(acc[r][c]) * xs[r] * ws[c];
#endif
}

template <int W>
void Panel(const int8_t* x, const float* xs, int64_t m0, int64_t m1, int64_t K, const int8_t* panel,
           const int32_t* sums, const float* ws, float* y, int64_t N) {
  for (int64_t m = m0; m < m1; m += kRows) {
    const int8_t* xr = x + m * K * kXBytes;
    float* yr = y + m * N;
    const bool pf = m == m0;  // the first pass reads the panel from memory
    switch (std::min<int64_t>(kRows, m1 - m)) {
      case 8: Tile<8, W>(xr, K, xs + m, panel, sums, ws, yr, N, K, pf); break;
      case 7: Tile<7, W>(xr, K, xs + m, panel, sums, ws, yr, N, K, pf); break;
      case 6: Tile<6, W>(xr, K, xs + m, panel, sums, ws, yr, N, K, pf); break;
      case 5: Tile<5, W>(xr, K, xs + m, panel, sums, ws, yr, N, K, pf); break;
      case 4: Tile<4, W>(xr, K, xs + m, panel, sums, ws, yr, N, K, pf); break;
      case 3: Tile<3, W>(xr, K, xs + m, panel, sums, ws, yr, N, K, pf); break;
      case 2: Tile<2, W>(xr, K, xs + m, panel, sums, ws, yr, N, K, pf); break;
      default: Tile<1, W>(xr, K, xs + m, panel, sums, ws, yr, N, K, pf); break;
    }
  }
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::F32> x_scale,
                ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::S32> w_sums, ffi::Buffer<ffi::F32> w_scale,
                ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), xsd = x_scale.dimensions(), wd = w.dimensions(), sd = w_sums.dimensions(),
       scd = w_scale.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || xsd.size() != 1 || wd.size() != 3 || sd.size() != 2 || scd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument(
        "int8 linear: expected x [M, K], x_scale [M], w [P, K / 4, W * 4], w_sums [P, W], w_scale [P, W], y [M, N]");
  const int64_t M = xd[0], K = xd[1], P = wd[0], W = wd[2] / 4;
  if (K % 4 || wd[1] != K / 4 || wd[2] % 4 || (W != 16 && W != 32 && W != 48) || xsd[0] != M || sd[0] != P ||
      sd[1] != W || scd[0] != P || scd[1] != W || yd[0] != M || yd[1] != P * W)
    return ffi::Error::InvalidArgument("int8 linear: sizes do not match (K a multiple of 4, panels of 16, 32 or 48)");
  if (M == 0) return ffi::Error::Success();
  const int8_t* xq = x.typed_data();
  const float* xs = x_scale.typed_data();
  const int8_t* wq = w.typed_data();
  const int32_t* sums = w_sums.typed_data();
  const float* ws = w_scale.typed_data();
  float* ys = y->typed_data();
  const int64_t N = P * W;
#if defined(PAGED_JAX_AVX2)
  // the activations widened to int16 once, for vpmaddwd (Tile reads them through an int8 pointer)
  std::vector<int16_t> wide(static_cast<size_t>(M * K));
  for (int64_t i = 0; i < M * K; ++i) wide[i] = xq[i];
  xq = reinterpret_cast<const int8_t*>(wide.data());
#endif
  paged_jax_native::ForEachPanelChunk(pool, M, P, [=](int64_t p, int64_t m0, int64_t m1) {
    const int8_t* panel = wq + p * K * W;
    switch (W) {
      case 48: Panel<48>(xq, xs, m0, m1, K, panel, sums + p * W, ws + p * W, ys + p * W, N); break;
      case 32: Panel<32>(xq, xs, m0, m1, K, panel, sums + p * W, ws + p * W, ys + p * W, N); break;
      default: Panel<16>(xq, xs, m0, m1, K, panel, sums + p * W, ws + p * W, ys + p * W, N); break;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

// Which tiles the int8 x int8 matmul was built with: 2 AVX-512 VNNI, 1 AVX2 (vpmaddwd), 0 portable.
extern "C" int PagedJaxLinearInt8Isa() {
#if defined(PAGED_JAX_VNNI)
  return 2;
#elif defined(PAGED_JAX_AVX2)
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinearI8I8, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

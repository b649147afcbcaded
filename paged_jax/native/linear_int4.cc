// y = x @ w for the CPU, 4-bit weights against activations quantized to int8 on the way in, as
// llama.cpp multiplies q4_0 weights by q8_0 activations; called from JAX through the XLA FFI.
//
// x: [M, K] float32, K a multiple of 32. w: [P, K / 8, W * 4] uint8, the [K, N = P * W] weight
// (symmetric 4-bit values q in [-8, 7], stored as u = q + 8) cut into P panels of W (48, 32 or 16)
// columns; in each panel, rows go eight at a time and per column: byte j (0 .. 3) of column c in
// block k8 holds u[8 k8 + j, c] in its low nibble and u[8 k8 + 4 + j, c] in its high one
// (paged_jax.native.pack_int4_blocks). scales: [P, G, W] float32, one per column and group of
// K / G rows, the groups a multiple of 32 rows. y: [M, P * W].
//
// The activations: each row's blocks of 32 (llama.cpp's q8_0) as d = max |x| / 127 and
// xq = round(x * (1 / d)) in [-127, 127] (ties to even), with xsum = sum(xq). Per block of 32
// rows, the integer sum s = sum(xq * u) - 8 * xsum = sum(xq * q) is exact, and the output adds
// float(s) * (d * scale) with one fused multiply-add per block, in order of the blocks; every path
// computes the same operations (the tests compare them with a numpy oracle of this scheme, and its
// error with float32's).
//
// Why: a float32 kernel turns every 4-bit weight into a float (5-6 instructions per 16 weights
// and rows) before its multiply-add; integer dot products take the nibbles as they are. A 64-byte
// load is 16 columns x 8 rows: an and, a shift and two vpdpbusd (AVX-512 VNNI: unsigned bytes
// times signed bytes, four products summed into each int32) do its 128 multiply-adds for one row.
// With AVX2 (no VNNI): vpmaddubsw (pairs of unsigned x signed bytes into int16: at most
// 2 x 15 x 127, so the eight of a block of 32 rows sum in int16 without saturating) then one
// vpmaddwd by ones per block. Elsewhere the portable loops compute the same.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGED_JAX_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGED_JAX_AVX2 1
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;  // activation rows per int8 scale (q8_0's block)
#if defined(PAGED_JAX_AVX2)
constexpr int64_t kRows = 4;  // rows of x per register tile: 16 registers
#else
constexpr int64_t kRows = 8;
#endif
constexpr int64_t kAhead = 6144;  // bytes prefetched ahead in the panel stream

// One row's activations, quantized: values [K], and per block the scale and the sum of values.
struct QuantizedRows {
  const int8_t* q;    // [M, K]
  const float* d;     // [M, K / 32]
  const int32_t* s;   // [M, K / 32]
  int64_t K;
};

// Every path quantizes the same: the largest magnitude, one float32 product per value, rounded to
// nearest even (AVX-512 two vectors a block, AVX2 four: this runs on one thread before the matmul's
// threads start; the AVX2 loop: 0.15 us a call against the serial loop's 0.35, bench_int4_call.py --one-core).
void QuantizeRows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* s) {
  const int64_t B = K / kBlock;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x + r * K + b * kBlock;
#if defined(PAGED_JAX_VNNI)
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      // max(|x|, m) keeps m where x is NaN, as the serial loop's std::max does
      const __m512 m = _mm512_max_ps(_mm512_abs_ps(x1), _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps()));
      const float scale = _mm512_reduce_max_ps(m) / 127.0f;
      const __m512 inv = _mm512_set1_ps(scale != 0 ? 1.0f / scale : 0.0f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * K + b * kBlock), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * K + b * kBlock + 16), _mm512_cvtepi32_epi8(q1));
      d[r * B + b] = scale;
      s[r * B + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif defined(PAGED_JAX_AVX2)
      const __m256 sign = _mm256_set1_ps(-0.0f);
      __m256 xv[4], m = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        xv[i] = _mm256_loadu_ps(xb + 8 * i);
        m = _mm256_max_ps(_mm256_andnot_ps(sign, xv[i]), m);  // m where x is NaN, as std::max below
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      const float scale = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1))) / 127.0f;
      const __m256 inv = _mm256_set1_ps(scale != 0 ? 1.0f / scale : 0.0f);
      const __m256i byte = _mm256_set1_epi32(0xFF);
      __m256i qi[4], sum = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(xv[i], inv));
        sum = _mm256_add_epi32(sum, qi[i]);
        qi[i] = _mm256_and_si256(qi[i], byte);  // each value's low byte, as the int8 cast keeps it
      }
      // packing works within 128-bit lanes: the permutation puts the 32 bytes back in order
      const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(qi[0], qi[1]), _mm256_packus_epi32(qi[2], qi[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + r * K + b * kBlock),
                          _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      d[r * B + b] = scale;
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
      s[r * B + b] = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
#else
      float amax = 0;
      for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float scale = amax / 127.0f;
      const float inv = scale != 0 ? 1.0f / scale : 0.0f;
      int32_t sum = 0;
      for (int i = 0; i < kBlock; ++i) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
        q[r * K + b * kBlock + i] = static_cast<int8_t>(v);
        sum += v;
      }
      d[r * B + b] = scale;
      s[r * B + b] = sum;
#endif
    }
  }
}

inline int32_t Quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// y[0:R, c0 .. c0 + C] for rows of x (quantized, a's rows from `row`) against one panel, C = V
// vectors of columns; scales: the panel's [G, W], group rows per scale.
template <int R, int V, int W>
inline void Tile(const QuantizedRows& a, int64_t row, const uint8_t* panel, const float* scales, int64_t group,
                 float* y, int64_t ldy, int64_t c0, bool prefetch) {
  const int64_t K = a.K, B = K / kBlock;
#if defined(PAGED_JAX_VNNI)
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    // low and high nibbles' sums apart: two dependency chains of vpdpbusd, not one twice as long
    // (at one or two rows the chain's latency, not the loads, set the pace); integer sums, exact
    __m512i isum[R][V], hsum[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) isum[r][v] = hsum[r][v] = _mm512_setzero_si512();
    for (int64_t k8 = 4 * b; k8 < 4 * b + 4; ++k8) {
      const uint8_t* p = panel + k8 * W * 4 + 4 * c0;
      if (prefetch)
        for (int off = 0; off < V * 64; off += 64) __builtin_prefetch(p + kAhead + off, 0, 3);
      __m512i lo[V], hi[V];
      for (int v = 0; v < V; ++v) {
        const __m512i wv = _mm512_loadu_si512(p + 64 * v);
        lo[v] = _mm512_and_si512(wv, low);
        hi[v] = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = a.q + (row + r) * K + 8 * k8;
        const __m512i xl = _mm512_set1_epi32(Quad(xr)), xh = _mm512_set1_epi32(Quad(xr + 4));
        for (int v = 0; v < V; ++v) {
          isum[r][v] = _mm512_dpbusd_epi32(isum[r][v], lo[v], xl);
          hsum[r][v] = _mm512_dpbusd_epi32(hsum[r][v], hi[v], xh);
        }
      }
    }
    const float* sc = scales + (b * kBlock / group) * W + c0;
    for (int r = 0; r < R; ++r) {
      const __m512i off = _mm512_set1_epi32(8 * a.s[(row + r) * B + b]);
      const __m512 d = _mm512_set1_ps(a.d[(row + r) * B + b]);
      for (int v = 0; v < V; ++v)
        acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(isum[r][v], hsum[r][v]), off)),
                                    _mm512_mul_ps(d, _mm512_loadu_ps(sc + 16 * v)), acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y + r * ldy + c0 + 16 * v, acc[r][v]);
#elif defined(PAGED_JAX_AVX2)
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    __m256i isum[R][V];  // int16 pair sums, then int32 per column
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) isum[r][v] = _mm256_setzero_si256();
    for (int64_t k8 = 4 * b; k8 < 4 * b + 4; ++k8) {
      const uint8_t* p = panel + k8 * W * 4 + 4 * c0;
      if (prefetch)
        for (int off = 0; off < V * 32; off += 64) __builtin_prefetch(p + kAhead + off, 0, 3);
      __m256i lo[V], hi[V];
      for (int v = 0; v < V; ++v) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * v));
        lo[v] = _mm256_and_si256(wv, low);
        hi[v] = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = a.q + (row + r) * K + 8 * k8;
        const __m256i xl = _mm256_set1_epi32(Quad(xr)), xh = _mm256_set1_epi32(Quad(xr + 4));
        for (int v = 0; v < V; ++v)
          isum[r][v] = _mm256_add_epi16(isum[r][v], _mm256_add_epi16(_mm256_maddubs_epi16(lo[v], xl),
                                                                     _mm256_maddubs_epi16(hi[v], xh)));
      }
    }
    const float* sc = scales + (b * kBlock / group) * W + c0;
    for (int r = 0; r < R; ++r) {
      const __m256i off = _mm256_set1_epi32(8 * a.s[(row + r) * B + b]);
      const __m256 d = _mm256_set1_ps(a.d[(row + r) * B + b]);
      for (int v = 0; v < V; ++v) {
        const __m256i s = _mm256_sub_epi32(_mm256_madd_epi16(isum[r][v], ones), off);
        acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_loadu_ps(sc + 8 * v)), acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(y + r * ldy + c0 + 8 * v, acc[r][v]);
#else
  constexpr int C = V * 8;
  float acc[R][C] = {};
  (void)prefetch;
  for (int64_t b = 0; b < B; ++b) {
    int32_t isum[R][C] = {};
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
      const uint8_t* p = panel + (k / 8) * W * 4 + 4 * c0 + (k % 4);
      const int shift = (k % 8) / 4 * 4;
      for (int r = 0; r < R; ++r) {
        const int32_t xv = a.q[(row + r) * K + k];
        for (int c = 0; c < C; ++c) isum[r][c] += xv * ((p[4 * c] >> shift) & 0xF);
      }
    }
    const float* sc = scales + (b * kBlock / group) * W + c0;
    for (int r = 0; r < R; ++r) {
      const int32_t off = 8 * a.s[(row + r) * B + b];
      const float d = a.d[(row + r) * B + b];
      for (int c = 0; c < C; ++c) acc[r][c] = std::fma(static_cast<float>(isum[r][c] - off), d * sc[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c0 + c] = acc[r][c];
#endif
}

#if defined(PAGED_JAX_VNNI)
constexpr int kLane = 16;  // columns per vector
#else
constexpr int kLane = 8;
#endif
// Rows taken over the whole panel width at once (more: strips one vector wide, within the registers)
#if defined(PAGED_JAX_AVX2)
constexpr int kWholeRows = 1;
#else
constexpr int kWholeRows = 2;
#endif

// Rows m0 .. m1 of y against one panel: one or two rows over the whole panel width at once (the
// weights read once, in order), more in strips one vector wide (kRows rows at a time).
template <int R, int W>
void Strips(const QuantizedRows& a, int64_t row, const uint8_t* panel, const float* scales, int64_t group, float* y,
            int64_t ldy, bool prefetch) {
  if (R <= kWholeRows) {
    Tile<R, W / kLane, W>(a, row, panel, scales, group, y, ldy, 0, prefetch);
  } else {
    for (int64_t c0 = 0; c0 < W; c0 += kLane) Tile<R, 1, W>(a, row, panel, scales, group, y, ldy, c0, prefetch && !c0);
  }
}

template <int W>
void Panel(const QuantizedRows& a, int64_t m0, int64_t m1, const uint8_t* panel, const float* scales, int64_t group,
           float* y, int64_t N) {
  for (int64_t m = m0; m < m1; m += kRows) {
    float* ys = y + m * N;
    const bool pf = m == m0;  // the first pass reads the panel from memory
    switch (std::min<int64_t>(kRows, m1 - m)) {
      case 8: Strips<8, W>(a, m, panel, scales, group, ys, N, pf); break;
      case 7: Strips<7, W>(a, m, panel, scales, group, ys, N, pf); break;
      case 6: Strips<6, W>(a, m, panel, scales, group, ys, N, pf); break;
      case 5: Strips<5, W>(a, m, panel, scales, group, ys, N, pf); break;
      case 4: Strips<4, W>(a, m, panel, scales, group, ys, N, pf); break;
      case 3: Strips<3, W>(a, m, panel, scales, group, ys, N, pf); break;
      case 2: Strips<2, W>(a, m, panel, scales, group, ys, N, pf); break;
      default: Strips<1, W>(a, m, panel, scales, group, ys, N, pf); break;
    }
  }
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> scales,
                ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scales.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument(
        "int4 x int8 linear: expected x [M, K], w [P, K / 8, W * 4], scales [P, G, W], y [M, P * W]");
  const int64_t M = xd[0], K = xd[1], P = wd[0], W = wd[2] / 4, G = sd[1];
  if (K % kBlock || wd[1] != K / 8 || wd[2] % 4 || (W != 16 && W != 32 && W != 48) || sd[0] != P || sd[2] != W ||
      G < 1 || K % G || (K / G) % kBlock || yd[0] != M || yd[1] != P * W)
    return ffi::Error::InvalidArgument("int4 x int8 linear: sizes do not match (K a multiple of 32, groups of a "
                                       "multiple of 32 rows, panels of 16, 32 or 48)");
  if (M == 0) return ffi::Error::Success();
  std::vector<int8_t> q(static_cast<size_t>(M * K));
  std::vector<float> d(static_cast<size_t>(M * K / kBlock));
  std::vector<int32_t> s(d.size());
  QuantizeRows(x.typed_data(), M, K, q.data(), d.data(), s.data());
  const QuantizedRows a{q.data(), d.data(), s.data(), K};
  const uint8_t* ws = w.typed_data();
  const float* ss = scales.typed_data();
  float* ys = y->typed_data();
  const int64_t N = P * W, group = K / G;
  paged_jax_native::ForEachPanelChunk(pool, M, P, [=](int64_t p, int64_t m0, int64_t m1) {
    const uint8_t* panel = ws + p * K * W / 2;
    switch (W) {
      case 48: Panel<48>(a, m0, m1, panel, ss + p * G * W, group, ys + p * W, N); break;
      case 32: Panel<32>(a, m0, m1, panel, ss + p * G * W, group, ys + p * W, N); break;
      default: Panel<16>(a, m0, m1, panel, ss + p * G * W, group, ys + p * W, N); break;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

// Which tiles the int4 x int8 matmul was built with: 2 AVX-512 VNNI, 1 AVX2 (vpmaddubsw), 0 portable.
extern "C" int PagedJaxLinearInt4Isa() {
#if defined(PAGED_JAX_VNNI)
  return 2;
#elif defined(PAGED_JAX_AVX2)
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinearQ4I8, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

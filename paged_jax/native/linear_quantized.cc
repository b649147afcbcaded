// y = x @ dequantized w for the CPU: the quantized weights' matmul (int8, packed int4 or fp8 values
// with scales and optional zero points), called from JAX through the XLA FFI. The float32 register
// tiles it runs over the values turned into float32 are panel_tiles.h's, as linear.cc's.

#include <algorithm>
#include <cstdint>

#include "fp8.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#include "panel_tiles.h"

namespace ffi = xla::ffi;

namespace {

// Quantized weights: y = x @ ((q - zero) * scale), the weight read as int8, packed int4 or fp8
// values and turned into float32 on the way (decode at small batch is bound by the bytes of
// weight read, 4 or 8 times fewer than float32). w: [P, K, W] int8 or float8 e4m3fn, or
// [P, K / 2, W] uint8 with rows 2i and 2i + 1 in the low and high nibbles of byte row i, each
// stored plus 8. scales: [P, G, W] float32, one per column and group of K / G consecutive rows
// (G = 1: per column); zeros: the same shape, in q's units (asymmetric weights), or [P, 0, W] for
// none. A weight in activation order (GPTQ's g_idx) has its rows sorted by group when packed and
// x's columns gathered to match (paged_jax.native.pack_quantized), so the kernel only ever sees
// contiguous groups.
//
// Two ways, by the rows of x in a unit of work:
// - up to RegisterRows() (decode at small batch): each weight becomes float32 in registers as it
//   streams in and serves every row at once (QTile);
// - more (prefill): slabs of kSlab weight rows become float32 once, into a buffer that stays in
//   L1, and the float tiles run over it, 8 rows at a time: the conversion is paid once per slab
//   rather than once per 8 rows (measured on this project's CPU: about even at 16-32 rows,
//   1.1-1.4x faster at 128; register tiles 1.4-2x faster at 6-8 rows).
// Both round (q - zero) * scale to float32 once and add it into the sums over k in order, so the
// two agree to the bit. A weight with one scale per column and no zero points (int8 on load,
// per-channel W8A16 or fp8: PerColumn) sums x * q unscaled instead and scales the sums once at the
// end, both ways alike: one multiply per weight fewer in the register tiles, whose conversions bound
// them at one row (an int8 [512, 2816] call at one row 1.15x as fast with AVX-512, 1.3x with AVX2), and
// one pass over the outputs for the slabs. (Grouped weights keep scaling each weight: their sums
// scaled per group cost the slabs a pass per group: measured 1.1x slower at 48 rows, groups of 32.)
// PAGED_JAX_NATIVE_FLAGS=-DPAGED_JAX_REGISTER_ROWS=... moves the switch.

constexpr int64_t kSlab = 128;  // weight rows per float32 slab: 128 x 48 floats = 24 KiB

struct QPanelView {
  const uint8_t* values;  // this panel's [K or K / 2, W] bytes
  const float* scales;    // [G, W]
  const float* zeros;     // [G, W], or nullptr
  int64_t group;          // rows per group (K / G)
};

// The stored value formats: int8, int4 (two rows to a byte, stored plus 8), float8 e4m3fn.
enum class QFormat { kInt8, kInt4, kFp8 };

// The register tiles' limit by format: on AVX2 the int4 and fp8 conversions (several instructions
// per 8 weights, paid again by every 6-row tile) make slabs faster from 6 rows on (measured: int4 at
// 8 rows 1.3x faster as slabs), while int8's single widening keeps register tiles ahead up to 8.
template <QFormat F>
constexpr int64_t RegisterRows() {
#if defined(PAGED_JAX_REGISTER_ROWS)
  return PAGED_JAX_REGISTER_ROWS;
#elif defined(PAGED_JAX_AVX2)
  return F == QFormat::kInt8 ? 8 : 5;
#else
  return 8;
#endif
}

template <QFormat F>
inline int64_t QRowAt(int64_t k, int64_t W) {  // where weight row k starts in a panel's bytes
  return F == QFormat::kInt4 ? (k / 2) * W : k * W;
}

template <QFormat F>
inline const uint8_t* QRow(const uint8_t* panel, int64_t k, int64_t W) {
  return panel + QRowAt<F>(k, W);
}

template <QFormat F>
inline float QValue(const uint8_t* row, int64_t k, int64_t c) {
  if (F == QFormat::kInt8) return static_cast<float>(static_cast<int8_t>(row[c]));
  if (F == QFormat::kFp8) return paged_jax_native::Fp8E4M3ToFloat(row[c]);
  return static_cast<float>(((row[c] >> ((k & 1) * 4)) & 0xF) - 8);
}

#if defined(PAGED_JAX_AVX512)
// 16 weights of a row (columns 16 v .. 16 v + 15) as float32, (q - zero) * scale (Scale) or q - zero.
template <QFormat F, bool Zero, bool Scale = true>
inline __m512 QLoad(const uint8_t* row, int64_t k, int v, __m512 scale, __m512 zero) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * v));
  __m512 f;
  if (F == QFormat::kFp8) {  // Fp8E4M3ToFloat (fp8.h), 16 at a time
    const __m512i u = _mm512_cvtepu8_epi32(bytes);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24);
    const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7f));
    const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
    const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f));
    const __mmask16 is_normal = _mm512_cmpge_epi32_mask(mag, _mm512_set1_epi32(8));
    f = _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_mask_blend_epi32(is_normal, _mm512_castps_si512(subnormal), normal), sign));
    if (Zero) f = _mm512_sub_ps(f, zero);
    return Scale ? _mm512_mul_ps(f, scale) : f;
  }
  __m512i q;
  if (F == QFormat::kInt8) {
    q = _mm512_cvtepi8_epi32(bytes);
  } else {
    q = _mm512_cvtepu8_epi32(bytes);
    if (k & 1) q = _mm512_srli_epi32(q, 4);
    q = _mm512_sub_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0xF)), _mm512_set1_epi32(8));
  }
  f = _mm512_cvtepi32_ps(q);
  if (Zero) f = _mm512_sub_ps(f, zero);
  return Scale ? _mm512_mul_ps(f, scale) : f;
}
#elif defined(PAGED_JAX_AVX2)
// 8 weights of a row (columns c .. c + 7) as float32: (q - zero) * scale (Scale) or q - zero, as QValue does.
template <QFormat F, bool Zero, bool Scale = true>
inline __m256 QLoad8(const uint8_t* row, int64_t k, int64_t c, __m256 scale, __m256 zero) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c));
  __m256 f;
  if (F == QFormat::kFp8) {  // Fp8E4M3ToFloat (fp8.h), 8 at a time
    const __m256i u = _mm256_cvtepu8_epi32(bytes);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24);
    const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7f));
    const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
    const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f));
    const __m256 is_normal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, _mm256_set1_epi32(7)));
    f = _mm256_or_ps(_mm256_blendv_ps(subnormal, _mm256_castsi256_ps(normal), is_normal), _mm256_castsi256_ps(sign));
  } else {
    __m256i q;
    if (F == QFormat::kInt8) {
      q = _mm256_cvtepi8_epi32(bytes);
    } else {
      q = _mm256_cvtepu8_epi32(bytes);
      if (k & 1) q = _mm256_srli_epi32(q, 4);
      q = _mm256_sub_epi32(_mm256_and_si256(q, _mm256_set1_epi32(0xF)), _mm256_set1_epi32(8));
    }
    f = _mm256_cvtepi32_ps(q);
  }
  if (Zero) f = _mm256_sub_ps(f, zero);
  return Scale ? _mm256_mul_ps(f, scale) : f;
}
#endif

// Register tile: y[0:R, 0:NP * W] = x[0:R, 0:K] @ NP panels side by side (q[0 .. NP - 1], their
// outputs adjacent), dequantized as they are read. Why several panels: at one or two rows a panel's
// 2-3 sums per row are too few to keep the multiply-add units busy (each waits on its own previous
// add: the tile ran at the latency of that chain, one k per 4 cycles), and the panels' sums are
// independent. Each output still sums over k in order, so the result is the same to the bit.
// PerColumn (one group): the weights stay unscaled and the sums are scaled as they are stored.
template <int R, int W, QFormat F, bool Zero, bool PerColumn, int NP = 1>
inline void QTile(const float* x, int64_t ldx, const QPanelView* q, float* y, int64_t ldy, int64_t K) {
  const int64_t group = q[0].group, G = K / group;
  // each panel's stream prefetches kPrefetch floats' bytes ahead of itself; past its own panel's end
  // (where the next of these NP panels is being read already), the same place in the next NP panels
  const int64_t panel_bytes = (F == QFormat::kInt4 ? K / 2 : K) * W, ahead = 4 * kPrefetch;
#if defined(PAGED_JAX_AVX512)
  constexpr int V = W / 16;
  __m512 acc[R][NP * V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NP * V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 sv[NP * V], zv[NP * V];
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < V; ++v) {
        sv[p * V + v] = _mm512_loadu_ps(q[p].scales + g * W + 16 * v);
        zv[p * V + v] = Zero ? _mm512_loadu_ps(q[p].zeros + g * W + 16 * v) : _mm512_setzero_ps();
      }
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      const int64_t at = QRowAt<F>(k, W);
      const int64_t skip = at + ahead >= panel_bytes ? (NP - 1) * panel_bytes : 0;
      __m512 bv[NP * V];
      for (int p = 0; p < NP; ++p) {
        const uint8_t* row = q[p].values + at;
        __builtin_prefetch(row + ahead + skip, 0, 3);
        for (int v = 0; v < V; ++v) bv[p * V + v] = QLoad<F, Zero, !PerColumn>(row, k, v, sv[p * V + v], zv[p * V + v]);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
        for (int v = 0; v < NP * V; ++v) acc[r][v] = _mm512_fmadd_ps(a, bv[v], acc[r][v]);
      }
    }
  }
  for (int p = 0; p < NP; ++p)
    for (int v = 0; v < V; ++v) {
      const __m512 sv = PerColumn ? _mm512_loadu_ps(q[p].scales + 16 * v) : _mm512_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const __m512 a = acc[r][p * V + v];
        _mm512_storeu_ps(y + r * ldy + p * W + 16 * v, PerColumn ? _mm512_mul_ps(a, sv) : a);
      }
    }
#elif defined(PAGED_JAX_AVX2)
  // one row: the whole panel width at once; up to 6 rows: 16-column strips (R x 2 accumulators, as
  // Tile); 7 or 8 rows: 8-column strips, so that the accumulators stay within the 16 registers
  // (8 x 2 spilled, measured 1.2x slower than these at 8 rows)
  constexpr int C = R == 1 ? W : R > 6 ? 8 : kStrip, V = C / 8;
  for (int c0 = 0; c0 < W; c0 += C) {
    __m256 acc[R][NP * V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NP * V; ++v) acc[r][v] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256 sv[NP * V], zv[NP * V];
      for (int p = 0; p < NP; ++p)
        for (int v = 0; v < V; ++v) {
          sv[p * V + v] = _mm256_loadu_ps(q[p].scales + g * W + c0 + 8 * v);
          zv[p * V + v] = Zero ? _mm256_loadu_ps(q[p].zeros + g * W + c0 + 8 * v) : _mm256_setzero_ps();
        }
      for (int64_t k = g * group; k < (g + 1) * group; ++k) {
        const int64_t at = QRowAt<F>(k, W);
        const int64_t skip = at + ahead >= panel_bytes ? (NP - 1) * panel_bytes : 0;
        __m256 bv[NP * V];
        for (int p = 0; p < NP; ++p) {
          const uint8_t* row = q[p].values + at;
          if (c0 == 0) __builtin_prefetch(row + ahead + skip, 0, 3);
          for (int v = 0; v < V; ++v)
            bv[p * V + v] = QLoad8<F, Zero, !PerColumn>(row, k, c0 + 8 * v, sv[p * V + v], zv[p * V + v]);
        }
        for (int r = 0; r < R; ++r) {
          const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
          for (int v = 0; v < NP * V; ++v) acc[r][v] = _mm256_fmadd_ps(a, bv[v], acc[r][v]);
        }
      }
    }
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < V; ++v) {
        const __m256 sv = PerColumn ? _mm256_loadu_ps(q[p].scales + c0 + 8 * v) : _mm256_setzero_ps();
        for (int r = 0; r < R; ++r) {
          const __m256 a = acc[r][p * V + v];
          _mm256_storeu_ps(y + r * ldy + p * W + c0 + 8 * v, PerColumn ? _mm256_mul_ps(a, sv) : a);
        }
      }
  }
#else
  for (int p = 0; p < NP; ++p) {  // the compiler's own vectors: one panel at a time
    float acc[R][W] = {};
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t* row = QRow<F>(q[p].values, k, W);
      const float* sc = q[p].scales + (k / group) * W;
      const float* zc = Zero ? q[p].zeros + (k / group) * W : nullptr;
      float b[W];
      for (int c = 0; c < W; ++c) {
        const float v = Zero ? QValue<F>(row, k, c) - zc[c] : QValue<F>(row, k, c);
        b[c] = PerColumn ? v : v * sc[c];
      }
      for (int r = 0; r < R; ++r) {
        const float a = x[r * ldx + k];
#pragma omp simd
        for (int c = 0; c < W; ++c) acc[r][c] += a * b[c];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < W; ++c) y[r * ldy + p * W + c] = PerColumn ? acc[r][c] * q[p].scales[c] : acc[r][c];
  }
#endif
}

// Weight rows k0 .. k1 of a panel as float32 ((q - zero) * scale, or q - zero for PerColumn), into
// out[(k1 - k0) x W]; reads the values once, prefetching ahead in the panel stream.
template <int W, QFormat F, bool Zero, bool PerColumn>
void Dequantize(const QPanelView& q, int64_t k0, int64_t k1, float* out) {
  for (int64_t g = k0 / q.group, k = k0; k < k1; ++g) {
    const float* sc = q.scales + g * W;
    const float* zc = Zero ? q.zeros + g * W : nullptr;
    for (const int64_t end = std::min(k1, (g + 1) * q.group); k < end; ++k) {
      const uint8_t* row = QRow<F>(q.values, k, W);
      __builtin_prefetch(row + 4 * kPrefetch, 0, 3);
      float* o = out + (k - k0) * W;
#if defined(PAGED_JAX_AVX2)  // the register tiles' conversion: the compiler's own of QValue is slower here
      for (int c = 0; c < W; c += 8)
        _mm256_storeu_ps(o + c, QLoad8<F, Zero, !PerColumn>(row, k, c, _mm256_loadu_ps(sc + c),
                                                Zero ? _mm256_loadu_ps(zc + c) : _mm256_setzero_ps()));
#else
#pragma omp simd
      for (int c = 0; c < W; ++c) {
        const float v = Zero ? QValue<F>(row, k, c) - zc[c] : QValue<F>(row, k, c);
        o[c] = PerColumn ? v : v * sc[c];
      }
#endif
    }
  }
}

// Register tiles of R rows over np panels at once (QTile's NP): 2 with AVX-512 where both panels'
// accumulators, weights, scales (not PerColumn's) and zero points fit its 32 registers. AVX2 keeps
// one: 16 registers (measured at one row, 32 columns: two panels spilled and ran 0.6x as fast).
template <int W, QFormat F, bool Zero, bool PerColumn>
constexpr int TilePanels(int R) {
#if defined(PAGED_JAX_AVX512)
  return 2 * (W / 16) * (R + 2 - PerColumn + Zero) + 1 <= 32 ? 2 : 1;
#else
  return 1;
#endif
}

template <int R, int W, QFormat F, bool Zero, bool PerColumn>
inline void QTiles(const float* x, int64_t ldx, const QPanelView* q, int np, float* y, int64_t ldy, int64_t K) {
  constexpr int NP = TilePanels<W, F, Zero, PerColumn>(R);
  int p = 0;
  for (; p + NP <= np; p += NP) QTile<R, W, F, Zero, PerColumn, NP>(x, ldx, q + p, y + p * W, ldy, K);
  for (; p < np; ++p) QTile<R, W, F, Zero, PerColumn>(x, ldx, q + p, y + p * W, ldy, K);
}

// Rows m0 .. m1 of y = x @ np adjacent panels (q[0 .. np - 1], outputs adjacent from y).
template <int W, QFormat F, bool Zero, bool PerColumn>
void QPanels(const float* x, int64_t m0, int64_t m1, int64_t K, const QPanelView* q, int np, float* y, int64_t N) {
  const float* xs = x + m0 * K;  // register tiles
  float* ys = y + m0 * N;
  if (m1 - m0 <= RegisterRows<F>()) {  // all the rows in one tile: each weight converted once
    static_assert(RegisterRows<F>() <= 8, "register tiles of up to 8 rows");
    switch (m1 - m0) {
      case 8: QTiles<8, W, F, Zero, PerColumn>(xs, K, q, np, ys, N, K); break;
      case 7: QTiles<7, W, F, Zero, PerColumn>(xs, K, q, np, ys, N, K); break;
      case 6: QTiles<6, W, F, Zero, PerColumn>(xs, K, q, np, ys, N, K); break;
      case 5: QTiles<5, W, F, Zero, PerColumn>(xs, K, q, np, ys, N, K); break;
      case 4: QTiles<4, W, F, Zero, PerColumn>(xs, K, q, np, ys, N, K); break;
      case 3: QTiles<3, W, F, Zero, PerColumn>(xs, K, q, np, ys, N, K); break;
      case 2: QTiles<2, W, F, Zero, PerColumn>(xs, K, q, np, ys, N, K); break;
      default: QTiles<1, W, F, Zero, PerColumn>(xs, K, q, np, ys, N, K); break;
    }
    return;
  }
  alignas(64) float slab[kSlab * W];
  for (int p = 0; p < np; ++p)
    for (int64_t k0 = 0; k0 < K; k0 += kSlab) {
      const int64_t k1 = std::min(K, k0 + kSlab);
      Dequantize<W, F, Zero, PerColumn>(q[p], k0, k1, slab);
      if (k0 == 0)
        Tiles<W, false>(x + k0, K, m0, m1, slab, y + p * W, N, k1 - k0, false);
      else
        Tiles<W, true>(x + k0, K, m0, m1, slab, y + p * W, N, k1 - k0, false);
    }
  if (PerColumn)  // the sums scaled, as the register tiles store theirs
    for (int64_t m = m0; m < m1; ++m)
      for (int p = 0; p < np; ++p) {
        float* o = y + m * N + p * W;
        const float* sc = q[p].scales;
#pragma omp simd
        for (int c = 0; c < W; ++c) o[c] *= sc[c];
      }
}

template <QFormat F>
ffi::Error QImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scales,
                 ffi::Buffer<ffi::F32> zeros, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scales.dimensions(), zd = zeros.dimensions(),
       yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3 || zd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument(
        "quantized linear: expected x [M, K], w [P, K', W], scales [P, G, W], zeros [P, G or 0, W], y [M, N]");
  const int64_t M = xd[0], K = xd[1], P = wd[0], W = wd[2], G = sd[1];
  const int64_t rows_stored = F == QFormat::kInt4 ? K / 2 : K;
  if (wd[1] != rows_stored || (W != 16 && W != 32 && W != 48) || sd[0] != P || sd[2] != W || G < 1 || K % G ||
      (F == QFormat::kInt4 && (K / G) % 2) || zd[0] != P || (zd[1] != G && zd[1] != 0) || zd[2] != W || yd[0] != M ||
      yd[1] != P * W)
    return ffi::Error::InvalidArgument("quantized linear: sizes do not match (K a multiple of the groups, "
                                       "even groups for 4 bits, panels of 16, 32 or 48, zeros as scales or none)");
  if (M == 0) return ffi::Error::Success();
  const float* xs = x.typed_data();
  const uint8_t* ws = static_cast<const uint8_t*>(w.untyped_data());
  const float* ss = scales.typed_data();
  const float* zs = zd[1] ? zeros.typed_data() : nullptr;
  float* ys = y->typed_data();
  const int64_t N = P * W;
  // work units of two adjacent panels where the rows fit one register tile (QTile's NP)
  const int64_t per = M <= RegisterRows<F>() ? 2 : 1;
  ForEachPanelChunk(pool, M, (P + per - 1) / per, [=](int64_t u, int64_t m0, int64_t m1) {
    const int64_t p0 = u * per;
    const int np = static_cast<int>(std::min(per, P - p0));
    QPanelView q[2];
    for (int i = 0; i < np; ++i)
      q[i] = {ws + (p0 + i) * rows_stored * W, ss + (p0 + i) * G * W, zs ? zs + (p0 + i) * G * W : nullptr, K / G};
    float* out = ys + p0 * W;
#define PAGED_JAX_QPANELS(w)                                                                   \
  (zs ? QPanels<w, F, true, false>(xs, m0, m1, K, q, np, out, N)                               \
   : G == 1 ? QPanels<w, F, false, true>(xs, m0, m1, K, q, np, out, N)                         \
   : QPanels<w, F, false, false>(xs, m0, m1, K, q, np, out, N))
    switch (W) {
      case 48: PAGED_JAX_QPANELS(48); break;
      case 32: PAGED_JAX_QPANELS(32); break;
      default: PAGED_JAX_QPANELS(16); break;
    }
#undef PAGED_JAX_QPANELS
  });
  return ffi::Error::Success();
}

}  // namespace

#define PAGED_JAX_QLINEAR(name, format)                                                               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, QImpl<format>,                                                    \
                                ffi::Ffi::Bind()                                                      \
                                    .Ctx<ffi::ThreadPool>()                                           \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                            \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                     \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                     \
                                    .Ret<ffi::Buffer<ffi::F32>>());
PAGED_JAX_QLINEAR(LinearQ8F32, QFormat::kInt8)
PAGED_JAX_QLINEAR(LinearQ4F32, QFormat::kInt4)
PAGED_JAX_QLINEAR(LinearFp8F32, QFormat::kFp8)

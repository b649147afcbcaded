// The ragged paged-attention kernel's inner loops (paged_attention.cc): the problem's layout, element
// conversions, dot products, the vectorised exp, the transposed-key score tiles and the weighted values
// in registers. Included by the attention kernel alone (paged_attention.cc, attention_item.h); its own
// anonymous namespace, as panel_tiles.h.
#pragma once

#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGED_JAX_ATTENTION_AVX2 1  // the same register code in 8-float vectors
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fp8.h"

namespace {

// The bits of a float8 e4m3fn value (the fp8 cache stores them in uint8).
struct Fp8E4M3 {
  uint8_t bits;
};

// T: float, or uint16_t holding bfloat16 bits. C: the cache's element, T, or int8_t or Fp8E4M3
// (quantized).
template <typename T, typename C = T>
struct Problem {
  const T* q;             // [NT, H, D] token-flat
  const C* k;             // [NB, BS, KVH, E], E = D (float caches) or D + 2 (8-bit values, float16 scale)
  const C* v;             // [NB, BS, KVH, E]
  const int32_t* bt;      // [S, MB]
  const int32_t* lens;    // [S] keys of each row, its new tokens included
  const int32_t* starts;  // [S] each row's first new token in q
  const int32_t* qlens;   // [S] each row's new tokens (0: a padding row)
  T* out;                 // [NT, H, D]
  int64_t NT, S, H, D, NB, BS, KVH, MB;
  float scale;
  int64_t E;         // elements per token and head in the cache
  int64_t window;    // > 0: a query at position p sees keys p - window + 1 .. p only
  float soft_cap;    // > 0: scores become soft_cap * tanh(scores / soft_cap) before the softmax
  const float* sinks;  // [H] a sink logit per query head in each softmax's denominator (nullptr: none)
};

inline float ToFloat(float x) { return x; }
inline float ToFloat(int8_t x) { return static_cast<float>(x); }

inline float ToFloat(Fp8E4M3 x) { return paged_jax_native::Fp8E4M3ToFloat(x.bits); }
inline float ToFloat(uint16_t bf16) { return __builtin_bit_cast(float, static_cast<uint32_t>(bf16) << 16); }

inline float HalfToFloat(uint16_t h) {  // IEEE binary16 -> float32
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {
    const float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  if (exp == 31) return __builtin_bit_cast(float, sign | 0x7f800000u | (man << 13));
  return __builtin_bit_cast(float, sign | ((exp + 112) << 23) | (man << 13));
}

// The scale of a quantized head entry (its last two bytes), 1 for a float cache.
template <typename C>
inline float EntryScale(const C* entry, int64_t D) {
  if constexpr (std::is_same_v<C, int8_t> || std::is_same_v<C, Fp8E4M3>) {
    uint16_t bits;
    std::memcpy(&bits, entry + D, sizeof(bits));
    return HalfToFloat(bits);
  } else {
    return 1.f;
  }
}

// Sixteen (AVX-512) or eight (AVX2) bfloat16 values widened to float32 in a register: each the upper
// half of its float.
#if defined(__AVX512F__)
inline __m512 LoadBf16x16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#elif defined(PAGED_JAX_ATTENTION_AVX2)
inline __m256 LoadBf16x8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

// dst[0 .. D) = a cache entry's D values as float32 times its scale (EntryScale): a bfloat16 entry
// (scale 1) widened in registers, as GCC leaves the plain loop of it scalar (it made a bfloat16 cache
// slower to read than a float32 one twice its size); other elements in the plain loop.
template <typename C>
inline void Widen(const C* entry, float scale, float* dst, int64_t D) {
  int64_t d = 0;
  if constexpr (std::is_same_v<C, uint16_t>) {
#if defined(__AVX512F__)
    for (; d + 16 <= D; d += 16) _mm512_storeu_ps(dst + d, LoadBf16x16(entry + d));
#elif defined(PAGED_JAX_ATTENTION_AVX2)
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, LoadBf16x8(entry + d));
#endif
  }
  for (; d < D; ++d) dst[d] = ToFloat(entry[d]) * scale;
}

inline void FromFloat(float x, float* out) { *out = x; }
inline void FromFloat(float x, uint16_t* out) {  // round to nearest even, as XLA's convert
  uint32_t u = __builtin_bit_cast(uint32_t, x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *out = static_cast<uint16_t>((u >> 16) | 0x40);
    return;
  }
  *out = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(PAGED_JAX_ATTENTION_AVX2)
// The sum of a vector's 8 lanes, added as a tree.
inline float Sum8(__m256 acc) {
  const __m128 x = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
}
#endif

// kD > 0: the head dimension known when compiling (fully unrolled); 0: any, read from n.
// A float cache's head of a multiple of 16 (8 with AVX2) sums in one vector and adds its lanes as a
// tree: the plain loop's lanes were added one after another (GCC keeps the order: 16 dependent adds
// a key and head, most of a short decode's attention).
template <int kD, typename T>
inline float Dot(const float* a, const T* b, int64_t n) {
  const int64_t len = kD > 0 ? kD : n;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> && kD > 0 && kD % 16 == 0) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (int i = 16; i < kD; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
  if constexpr (std::is_same_v<T, uint16_t> && kD > 0 && kD % 16 == 0) {  // bfloat16, widened in registers
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), LoadBf16x16(b));
    for (int i = 16; i < kD; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), LoadBf16x16(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#elif defined(PAGED_JAX_ATTENTION_AVX2)
  if constexpr (std::is_same_v<T, float> && kD > 0 && kD % 8 == 0) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    for (int i = 8; i < kD; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return Sum8(acc);
  }
  if constexpr (std::is_same_v<T, uint16_t> && kD > 0 && kD % 8 == 0) {  // bfloat16, widened in registers
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), LoadBf16x8(b));
    for (int i = 8; i < kD; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), LoadBf16x8(b + i), acc);
    return Sum8(acc);
  }
#endif
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < len; ++i) s += a[i] * ToFloat(b[i]);
  return s;
}

#if defined(__AVX512F__)
// Lane l of the result: the sum of a[l]'s 16 lanes, for 16 vectors at once, added as one tree of
// shuffles (pairs within 128-bit lanes, then the 128-bit lanes): 31 operations for 16 sums, where a
// reduction per vector (_mm512_reduce_add_ps) takes about 8 for one.
inline __m512 SumLanes16(const __m512* a) {
  __m512 s[8], u[4];
  for (int i = 0; i < 8; ++i)  // each 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of a = a[2i], b = a[2i+1]
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // each 128-bit lane: a[4i .. 4i + 4)'s sums over that lane's 4 floats
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44), _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
  // 128-bit lanes: v0 = [u0 lanes 0+1, u0 2+3, u1 0+1, u1 2+3], v1 the same of u2, u3; then their pairs.
  const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xDD));
}

inline __m512 LoadF32x16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 LoadF32x16(const uint16_t* p) { return LoadBf16x16(p); }

// q . keys[l] for 16 keys (float32 or bfloat16, kD values each, a multiple of 16), lane l: a decode's
// scores of one head and a chunk's keys, without a horizontal sum per key.
template <int kD, typename T>
inline __m512 Dot16(const float* q, const T* const* keys) {
  static_assert(kD > 0 && kD % 16 == 0);
  __m512 acc[16];
  for (int l = 0; l < 16; ++l) {
    acc[l] = _mm512_mul_ps(_mm512_loadu_ps(q), LoadF32x16(keys[l]));
    for (int i = 16; i < kD; i += 16) acc[l] = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), LoadF32x16(keys[l] + i), acc[l]);
  }
  return SumLanes16(acc);
}
#endif

template <int kD, typename T>
inline void Axpy(float w, const T* x, float* y, int64_t n) {
  const int64_t len = kD > 0 ? kD : n;
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) y[i] += w * ToFloat(x[i]);
}

// locality 3: into L1 (the next chunk of a decode); 2: into L2 (see AttendTiles)
template <int kLocality = 3>
inline void Prefetch(const char* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, kLocality);
}

// e^x for x <= 0 (a score less its running max), within a few ulp, written so that a loop of it
// vectorizes (no call, no branch; std::exp is a call per element, and was most of a long prompt's
// attention): x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts), e^r by Cephes' expf
// polynomial, 2^n put in the exponent bits. Below -87, e^x is under float's normal range: it comes
// out about 1e-38, not 0, a weight no sum notices.
inline float ExpNonPositive(float x) {
  x = x > -87.f ? x : -87.f;  // (a ternary: std::max's reference keeps GCC from vectorizing)
  // n = round(x / ln2) by adding and taking off 1.5 * 2^23 (std::floor does not vectorize here)
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = p * r * r + r + 1.f;
  return er * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

#if defined(PAGED_JAX_ATTENTION_AVX2)
// ExpNonPositive on 8 lanes (GCC leaves the loop of it scalar when building for AVX2).
inline __m256 ExpNonPositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));  // a NaN becomes -87, as the ternary
  const __m256 big = _mm256_set1_ps(12582912.f);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), big), big);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 er = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(er, _mm256_castsi256_ps(e));
}
#endif

// tanh(y) = sign(y) (1 - e^-2|y|) / (1 + e^-2|y|), through ExpNonPositive so that a loop of it
// vectorizes; within a few ulp of 1 at large |y|, and within about 1e-7 of y near 0.
inline float Tanh(float y) {
  const float a = y < 0.f ? -y : y;
  const float e = ExpNonPositive(-2.f * a);
  const float t = (1.f - e) / (1.f + e);
  return y < 0.f ? -t : t;
}

constexpr int64_t kLanes = 16;   // keys per vector of scores (one AVX-512 register of float32)

#ifdef __AVX512F__
// dst[d * ld + l] = src[l][d] for l, d < 16: sixteen rows of 16 floats transposed in registers
// (pairs of floats, then of pairs, then 128-bit lanes twice).
inline void Transpose16(const float* const* src, float* dst, int64_t ld) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src[i]);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xDD);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ld, r[i]);
}
#elif defined(PAGED_JAX_ATTENTION_AVX2)
// dst[d * ld + l] = src[l][d] for l, d < 8: eight rows of 8 floats transposed in registers.
inline void Transpose8(const float* const* src, float* dst, int64_t ld) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src[i]);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
    t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
  }
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + i * ld, t[i]);
}
#endif
#ifndef PAGED_JAX_SCORE_ROWS
#define PAGED_JAX_SCORE_ROWS 8
#endif
constexpr int64_t kRowTile = PAGED_JAX_SCORE_ROWS;  // query rows whose scores are computed together, sharing each key load
constexpr int64_t kMinTransposeRows = 4;  // query rows of a KV head from which its keys are transposed (below: dot products)

// scores[r, c .. c + kLanes) = q[r] . keys[c .. c + kLanes) for `rows` rows (at most kRowTile) of
// q ([rows, D], row stride D) against kt ([D, ldk]: the block's keys, transposed, one per lane).
#if defined(PAGED_JAX_ATTENTION_AVX2)
// ScoreTile's rows R at a time in AVX2 registers (R x 2 vectors of 8 lanes: the plain loop's
// kRowTile x 16 accumulators would not fit AVX2's 16 registers).
template <int R>
inline void ScoreRows(const float* q, int64_t D, int64_t len, const float* kt, int64_t ldk, int64_t c,
                      float* scores, int64_t lds) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < len; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * ldk + c), k1 = _mm256_loadu_ps(kt + d * ldk + c + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(q + r * D + d);
      acc[r][0] = _mm256_fmadd_ps(a, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(scores + r * lds + c, acc[r][0]);
    _mm256_storeu_ps(scores + r * lds + c + 8, acc[r][1]);
  }
}
#endif

template <int kD>
inline void ScoreTile(const float* q, int64_t rows, int64_t D, const float* kt, int64_t ldk, int64_t c,
                      float* scores, int64_t lds) {
  const int64_t len = kD > 0 ? kD : D;
#if defined(PAGED_JAX_ATTENTION_AVX2)
  if constexpr (kLanes == 16) {
    for (int64_t r0 = 0; r0 < rows; r0 += 6) {
      const float* qr = q + r0 * D;
      float* sr = scores + r0 * lds;
      switch (std::min<int64_t>(6, rows - r0)) {
        case 6: ScoreRows<6>(qr, D, len, kt, ldk, c, sr, lds); break;
        case 5: ScoreRows<5>(qr, D, len, kt, ldk, c, sr, lds); break;
        case 4: ScoreRows<4>(qr, D, len, kt, ldk, c, sr, lds); break;
        case 3: ScoreRows<3>(qr, D, len, kt, ldk, c, sr, lds); break;
        case 2: ScoreRows<2>(qr, D, len, kt, ldk, c, sr, lds); break;
        default: ScoreRows<1>(qr, D, len, kt, ldk, c, sr, lds); break;
      }
    }
    return;
  }
#endif
  float acc[kRowTile][kLanes] = {};
  for (int64_t d = 0; d < len; ++d) {
    const float* k = kt + d * ldk + c;
    for (int64_t r = 0; r < kRowTile; ++r) {
      const float qd = r < rows ? q[r * D + d] : 0.f;
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) acc[r][l] += qd * k[l];
    }
  }
  for (int64_t r = 0; r < rows; ++r) std::copy(acc[r], acc[r] + kLanes, scores + r * lds + c);
}

// out[0 .. D) += sum over t in [t0, t1) of w[t] * v[t][0 .. D), in plain loops: what
// WeightedValueRows does without AVX-512 or AVX2, or for a head size that is not a multiple of 16.
template <int kD>
inline void WeightedValues(const float* w, int64_t t0, int64_t t1, const float* const* v, int64_t D, float* out) {
  if constexpr (kD > 0) {
    float acc[kD];
    std::copy(out, out + kD, acc);
    for (int64_t t = t0; t < t1; ++t) {
      const float wt = w[t];
      const float* x = v[t];
#pragma omp simd
      for (int64_t d = 0; d < kD; ++d) acc[d] += wt * x[d];
    }
    std::copy(acc, acc + kD, out);
  } else {
    for (int64_t t = t0; t < t1; ++t) Axpy<0>(w[t], v[t], out, D);
  }
}

// The same for kValueRows rows at once (out rows and weight rows a stride apart), each over
// [t0, t1): every key's value loaded once for all of them. A row's weights are 0 outside its own
// visible keys, and every key in [t0, t1) is one some query of the item sees (so it holds a real,
// finite value). Written out in AVX-512 and AVX2: GCC vectorizes the plain loop across t, by gathers
// (80 % of a long chunk's time).
constexpr int64_t kValueRows = 4;
#if defined(PAGED_JAX_ATTENTION_AVX2)
// WeightedValueRows' AVX2 code for R rows and outputs j0 .. j0 + 16: 2R accumulators held in
// registers (a row count known when compiling, else GCC keeps them on the stack).
template <int R>
inline void ValueRows(const float* w, int64_t ldw, int64_t t0, int64_t t1, const float* const* v, int64_t j0,
                      int64_t D, float* out) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j) acc[r][j] = _mm256_loadu_ps(out + r * D + j0 + 8 * j);
  for (int64_t t = t0; t < t1; ++t) {
    const __m256 x0 = _mm256_loadu_ps(v[t] + j0), x1 = _mm256_loadu_ps(v[t] + j0 + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 wt = _mm256_broadcast_ss(w + r * ldw + t);
      acc[r][0] = _mm256_fmadd_ps(wt, x0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(wt, x1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j) _mm256_storeu_ps(out + r * D + j0 + 8 * j, acc[r][j]);
}
#endif
// V: float, or (AVX-512 only) uint16_t holding bfloat16 bits, widened as they are loaded.
template <int kD, typename V = float>
inline void WeightedValueRows(const float* w, int64_t ldw, int64_t rows, int64_t t0, int64_t t1,
                              const V* const* v, int64_t D, float* out) {
#ifdef __AVX512F__
  const int64_t len = kD > 0 ? kD : D;
  if (len % 16 == 0) {
    for (int64_t j0 = 0; j0 < len; j0 += 64) {  // up to 4 vectors of outputs for each of the rows
      const int64_t nj = std::min<int64_t>(4, (len - j0) / 16);
      __m512 acc[kValueRows][4];
      for (int64_t r = 0; r < kValueRows; ++r)
        for (int64_t j = 0; j < 4; ++j)
          acc[r][j] = r < rows && j < nj ? _mm512_loadu_ps(out + r * D + j0 + 16 * j) : _mm512_setzero_ps();
      for (int64_t t = t0; t < t1; ++t) {
        __m512 x[4];
        for (int64_t j = 0; j < 4; ++j) x[j] = j < nj ? LoadF32x16(v[t] + j0 + 16 * j) : _mm512_setzero_ps();
        for (int64_t r = 0; r < kValueRows; ++r) {
          if (r >= rows) break;
          const __m512 wt = _mm512_set1_ps(w[r * ldw + t]);
          for (int64_t j = 0; j < 4; ++j)
            if (j < nj) acc[r][j] = _mm512_fmadd_ps(wt, x[j], acc[r][j]);
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < nj; ++j) _mm512_storeu_ps(out + r * D + j0 + 16 * j, acc[r][j]);
    }
    return;
  }
#endif
  if constexpr (std::is_same_v<V, float>) {  // (bfloat16 values: the AVX-512 code above, a head of 16s only)
#if defined(PAGED_JAX_ATTENTION_AVX2)
  const int64_t len = kD > 0 ? kD : D;
  if (len % 16 == 0) {
    for (int64_t j0 = 0; j0 < len; j0 += 16) {  // 2 vectors of outputs for each of the rows, in registers
      switch (rows) {
        case 4: ValueRows<4>(w, ldw, t0, t1, v, j0, D, out); break;
        case 3: ValueRows<3>(w, ldw, t0, t1, v, j0, D, out); break;
        case 2: ValueRows<2>(w, ldw, t0, t1, v, j0, D, out); break;
        default: ValueRows<1>(w, ldw, t0, t1, v, j0, D, out); break;
      }
    }
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r) WeightedValues<kD>(w + r * ldw, t0, t1, v, D, out + r * D);
  }
}

// The first key a query at position `pos` sees: its sliding window's start (0 without a window).
template <typename T, typename C>
inline int64_t WindowStart(const Problem<T, C>& p, int64_t pos) {
  return p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
}

// Which keys of its row a work item reads, and where its result goes: keys [k0, k1) (a part of a
// long row; [0, INT64_MAX) a whole one). `partial` null: the output itself; else the part's
// unnormalized output, running max and sum for each query and head, [n, H, D + 2] from the item's first
// query (H: all the query heads), which MergeParts combines; a row's sink counts in its first part only.
struct KeyPart {
  int64_t k0 = 0, k1 = INT64_MAX;
  bool first = true;
  float* partial = nullptr;
};

// Keys per step of the online softmax: whole blocks, at least one vector of kLanes (so a block
// size under 16 still fills the vectors). Measured on 8 heads of 64 with a 4k context: chunks of
// 16 keys 1.2-1.4x faster than 64 (more of the chunk's scores, keys and values stay in L1).
#ifndef PAGED_JAX_CHUNK_KEYS
#define PAGED_JAX_CHUNK_KEYS 16
#endif
inline int64_t KeysPerChunk(int64_t BS) { return BS * std::max<int64_t>(1, PAGED_JAX_CHUNK_KEYS / BS); }

}  // namespace

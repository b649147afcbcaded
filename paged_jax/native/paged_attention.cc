// Ragged paged attention for the CPU, called from JAX through the XLA FFI: one call for a whole
// engine step, decode rows and prefill chunks together.
//
// The same function as paged_jax.attention.reference.paged_attention_reference, on token-flat
// queries: row s has query_lens[s] new tokens, consecutive in q from query_starts[s], the i-th at
// position context_lens[s] - query_lens[s] + i, and each attends over its row's keys up to its own
// position (causal; with a sliding window, only its last `window` keys; scores soft-capped when
// asked), read through block_tables[s] straight from the paged cache (nothing is gathered into a
// temporary), softmax in float32. A decode step is rows of one query each. Slots
// past a row's context are never read; query tokens no row covers come out zero. Work is split
// into (row, block of queries, KV heads) items, shared with XLA's intra-op thread pool (an item
// covers every head unless it costs more than a thread's share of the step); the queries of one
// item share each K/V block they read, so a long chunk reads its context once per block of
// queries, not once per query. Caches and queries are float32 or bfloat16 (read as float32; the
// output rounded to bfloat16 to nearest even, as astype), or float32 queries over an 8-bit cache
// (paged_jax.attention.kv_quant: each head's entry is D int8 or fp8 e4m3 values and a float16
// scale, D + 2 bytes; the scales multiply the dot products and the weights).

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
#include <vector>

#include "fp8.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

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

inline void FromFloat(float x, float* out) { *out = x; }
inline void FromFloat(float x, uint16_t* out) {  // round to nearest even, as XLA's convert
  uint32_t u = __builtin_bit_cast(uint32_t, x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *out = static_cast<uint16_t>((u >> 16) | 0x40);
    return;
  }
  *out = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// kD > 0: the head dimension known when compiling (fully unrolled); 0: any, read from n.
template <int kD, typename T>
inline float Dot(const float* a, const T* b, int64_t n) {
  const int64_t len = kD > 0 ? kD : n;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < len; ++i) s += a[i] * ToFloat(b[i]);
  return s;
}

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
template <int kD>
inline void WeightedValueRows(const float* w, int64_t ldw, int64_t rows, int64_t t0, int64_t t1,
                              const float* const* v, int64_t D, float* out) {
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
        for (int64_t j = 0; j < 4; ++j) x[j] = j < nj ? _mm512_loadu_ps(v[t] + j0 + 16 * j) : _mm512_setzero_ps();
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
#elif defined(PAGED_JAX_ATTENTION_AVX2)
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

// Keys per step of the online softmax: whole blocks, at least one vector of kLanes (so a block
// size under 16 still fills the vectors). Measured on 8 heads of 64 with a 4k context: chunks of
// 16 keys 1.2-1.4x faster than 64 (more of the chunk's scores, keys and values stay in L1).
#ifndef PAGED_JAX_CHUNK_KEYS
#define PAGED_JAX_CHUNK_KEYS 16
#endif
inline int64_t KeysPerChunk(int64_t BS) { return BS * std::max<int64_t>(1, PAGED_JAX_CHUNK_KEYS / BS); }

// ---------------------------------------------------------------------------------------------
// Query tiles in registers (AVX-512 or AVX2): a KV head's query rows W at a time, one per lane of a
// vector, so that each key element is loaded once (a broadcast) for W rows, and every quantity of
// the online softmax (running max, sum, correction) is one vector for W rows: no transposition of
// the keys, no horizontal reduction, no scalar exp. Scores of KT keys are KT vectors held in
// registers; the output is kept transposed ([D, W]: output d of the W rows), so the weighted values
// are broadcasts of each value element times the weights' vector. On 8 heads of 64 and 2 cores, a
// 16-token chunk at a 16k context ran ~2x faster than through transposed keys
// (experiments/bench_attention_step.py).
#if defined(__AVX512F__) || defined(PAGED_JAX_ATTENTION_AVX2)
#define PAGED_JAX_ATTENTION_TILES 1
#if defined(__AVX512F__)
struct Vec {
  using F = __m512;
  static constexpr int W = 16;   // query rows per vector
  static constexpr int KT = 16;  // keys whose scores are held in registers at once
  static constexpr int DB = 16;  // output elements accumulated in registers at once
  static F Zero() { return _mm512_setzero_ps(); }
  static F Set(float x) { return _mm512_set1_ps(x); }
  static F Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F Max(F a, F b) { return _mm512_max_ps(a, b); }
  static F Div(F a, F b) { return _mm512_div_ps(a, b); }
  // s where lo <= key <= pos (the lane's query sees the key at position key), else -inf
  static F Visible(F s, F key, F pos, F lo) {
    const __mmask16 m = _mm512_cmp_ps_mask(key, pos, _CMP_LE_OQ) & _mm512_cmp_ps_mask(key, lo, _CMP_GE_OQ);
    return _mm512_mask_blend_ps(m, Set(-INFINITY), s);
  }
  static F ZeroWhereNegInf(F m) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, Set(-INFINITY), _CMP_EQ_OQ), m, Zero()); }
  // e^x for x <= 0, as ExpNonPositive; 0 below -87 (and for -inf: a key the lane does not see)
  static F Exp(F x) {
    const __mmask16 normal = _mm512_cmp_ps_mask(x, Set(-87.f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, Set(-87.f));
    const F big = Set(12582912.f);
    const F n = _mm512_sub_ps(_mm512_fmadd_ps(x, Set(1.44269504088896341f), big), big);
    const F r = _mm512_fmadd_ps(n, Set(2.12194440e-4f), _mm512_fnmadd_ps(n, Set(0.693359375f), x));
    F p = Set(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, Set(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, Set(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, Set(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, Set(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, Set(5.0000001201e-1f));
    const F er = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), Set(1.f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(normal, er, _mm512_castsi512_ps(e));
  }
  static F Abs(F x) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff))); }
  static F SignOf(F x, F t) {  // t with the sign of x (t >= 0)
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
  }
};
#else
struct Vec {
  using F = __m256;
  static constexpr int W = 8;
  static constexpr int KT = 8;  // AVX2 has 16 registers: 8 scores, the queries' vector, the exp's temporaries
  static constexpr int DB = 8;
  static F Zero() { return _mm256_setzero_ps(); }
  static F Set(float x) { return _mm256_set1_ps(x); }
  static F Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F Max(F a, F b) { return _mm256_max_ps(a, b); }
  static F Div(F a, F b) { return _mm256_div_ps(a, b); }
  static F Visible(F s, F key, F pos, F lo) {
    const F m = _mm256_and_ps(_mm256_cmp_ps(key, pos, _CMP_LE_OQ), _mm256_cmp_ps(key, lo, _CMP_GE_OQ));
    return _mm256_blendv_ps(Set(-INFINITY), s, m);
  }
  static F ZeroWhereNegInf(F m) { return _mm256_andnot_ps(_mm256_cmp_ps(m, Set(-INFINITY), _CMP_EQ_OQ), m); }
  static F Exp(F x) { return _mm256_and_ps(ExpNonPositive8(x), _mm256_cmp_ps(x, Set(-87.f), _CMP_GE_OQ)); }
  static F Abs(F x) { return _mm256_andnot_ps(Set(-0.f), x); }
  static F SignOf(F x, F t) { return _mm256_or_ps(t, _mm256_and_ps(x, Set(-0.f))); }
};
#endif

// cap * tanh(s / cap) on a vector, as Tanh
inline Vec::F SoftCap(Vec::F s, float cap) {
  const Vec::F y = Vec::Mul(s, Vec::Set(1.f / cap));
  const Vec::F e = Vec::Exp(Vec::Mul(Vec::Abs(y), Vec::Set(-2.f)));
  const Vec::F t = Vec::Div(Vec::Sub(Vec::Set(1.f), e), Vec::Add(Vec::Set(1.f), e));
  return Vec::Mul(Vec::SignOf(y, t), Vec::Set(cap));
}

// The online softmax state of W query rows of one KV head (a group), each array [.., W].
struct TileGroup {
  float* qt;   // [D, W] the queries, scaled, transposed (0 in lanes past the head's rows)
  float* ot;   // [D, W] accumulated output, transposed
  float* m;    // [W] running max
  float* den;  // [W] running sum of exp
  float* pos;  // [W] each lane's query position (-1 past the head's rows: it sees no key)
  float* lo;   // [W] each lane's first visible key position (the window's start, or -1)
  int64_t key_lo, key_hi;  // the positions some lane sees: [key_lo, key_hi)
  int64_t t_lo, t_hi;      // the same in the chunk at hand, from its first key
};

// One KV head's group of W rows over keys [0, nk) of a chunk at position pos0: K and V rows as
// float32 pointers (keys and values of this head), in tiles of KT keys.
template <int kD>
inline void AttendTileGroup(const TileGroup& g, const float* kf, const float* const* vp, int64_t nk, int64_t pos0,
                            int64_t D_, float soft_cap, float* pt) {
  using F = Vec::F;
  constexpr int W = Vec::W, KT = Vec::KT, DB = Vec::DB;
  const int64_t D = kD > 0 ? kD : D_;
  const F pos = Vec::Load(g.pos), lo = Vec::Load(g.lo);
  for (int64_t c = 0; c < nk; c += KT) {
    const int64_t nc = std::min<int64_t>(KT, nk - c);
    const float* k = kf + c * D;  // [KT, D] (zeros past the chunk's keys)
    F s[KT];
    for (int t = 0; t < KT; ++t) s[t] = Vec::Zero();
    for (int64_t d = 0; d < D; ++d) {  // scores: each key element broadcast to the W rows
      const F q = Vec::Load(g.qt + d * W);
      for (int t = 0; t < KT; ++t) s[t] = Vec::Fma(Vec::Set(k[t * D + d]), q, s[t]);
    }
    F mx = Vec::Load(g.m);
    const F m_old = mx;
    for (int t = 0; t < KT; ++t) {
      if (soft_cap > 0.f) s[t] = SoftCap(s[t], soft_cap);
      s[t] = t < nc ? Vec::Visible(s[t], Vec::Set(static_cast<float>(pos0 + c + t)), pos, lo) : Vec::Set(-INFINITY);
      mx = Vec::Max(mx, s[t]);
    }
    const F base = Vec::ZeroWhereNegInf(mx);  // a lane that has seen no key yet: nothing to subtract
    const F corr = Vec::Exp(Vec::Sub(m_old, base));  // 0 on a lane's first keys (m = -inf)
    F sum = Vec::Zero();
    for (int t = 0; t < KT; ++t) {
      const F w = Vec::Exp(Vec::Sub(s[t], base));  // 0 for a key the lane does not see
      sum = Vec::Add(sum, w);
      Vec::Store(pt + t * W, w);
    }
    Vec::Store(g.m, mx);
    Vec::Store(g.den, Vec::Fma(Vec::Load(g.den), corr, sum));
    // Weighted values over the keys some lane sees (a key none sees may hold anything, NaN
    // included: a windowed sequence's given-back block), DB outputs of the W rows at a time.
    const int64_t t0 = std::clamp<int64_t>(g.t_lo - c, 0, nc), t1 = std::clamp<int64_t>(g.t_hi - c, 0, nc);
    int64_t d0 = 0;
    for (; d0 + DB <= D; d0 += DB) {
      F acc[DB];
      for (int j = 0; j < DB; ++j) acc[j] = Vec::Mul(Vec::Load(g.ot + (d0 + j) * W), corr);
      for (int64_t t = t0; t < t1; ++t) {
        const F w = Vec::Load(pt + t * W);
        const float* x = vp[c + t] + d0;
        for (int j = 0; j < DB; ++j) acc[j] = Vec::Fma(Vec::Set(x[j]), w, acc[j]);
      }
      for (int j = 0; j < DB; ++j) Vec::Store(g.ot + (d0 + j) * W, acc[j]);
    }
    for (; d0 < D; ++d0) {
      F acc = Vec::Mul(Vec::Load(g.ot + d0 * W), corr);
      for (int64_t t = t0; t < t1; ++t) acc = Vec::Fma(Vec::Set(vp[c + t][d0]), Vec::Load(pt + t * W), acc);
      Vec::Store(g.ot + d0 * W, acc);
    }
  }
}

// AttendRows for a head with many query rows (a prefill chunk, a speculative tile): its rows W to a
// group (lane l of group j: row j * W + l of the head's G * n, query head h = row / n, query
// i = row % n), each group attending over the chunk's keys in AttendTileGroup.
template <int kD, typename T, typename C>
void AttendTiles(const Problem<T, C>& p, int64_t s, int64_t i0, int64_t n, int64_t kh0, int64_t nkh,
                 std::vector<float>& scratch) {
  constexpr int W = Vec::W;
  const int64_t G = p.H / p.KVH, D = p.D, E = p.E, BS = p.BS, row = p.KVH * E;
  const int64_t CK = KeysPerChunk(BS), groups = (G * n + W - 1) / W, ng = nkh * groups;
  constexpr bool kFloatCache = std::is_same_v<C, float>;
  scratch.resize(ng * (2 * D * W + 4 * W) + Vec::KT * W + (kFloatCache ? 1 : 2) * CK * D + Vec::KT * D);
  float* state = scratch.data();
  float* pt = state + ng * (2 * D * W + 4 * W);  // [KT, W] one tile's weights
  float* kf = pt + Vec::KT * W;                  // [CK + KT, D] one head's keys of the chunk as float32 (zeros past them)
  float* vf = kf + (CK + Vec::KT) * D;           // [CK, D] its values (not a float cache)
  const int64_t first = int64_t{p.lens[s]} - p.qlens[s] + i0;  // position of query i0
  std::vector<TileGroup> gs(ng);
  for (int64_t kh = 0; kh < nkh; ++kh)
    for (int64_t j = 0; j < groups; ++j) {
      TileGroup& g = gs[kh * groups + j];
      float* base = state + (kh * groups + j) * (2 * D * W + 4 * W);
      g = {base, base + D * W, base + 2 * D * W, base + 2 * D * W + W, base + 2 * D * W + 2 * W,
           base + 2 * D * W + 3 * W, INT64_MAX, 0, 0, 0};
      std::fill(g.ot, g.ot + D * W, 0.f);
      for (int l = 0; l < W; ++l) {
        const int64_t r = j * W + l, h = kh * G + r / n, i = r % n;  // h: the item's query head
        const bool real = r < G * n;
        g.pos[l] = real ? static_cast<float>(first + i) : -1.f;
        g.lo[l] = real && p.window > 0 ? static_cast<float>(first + i - p.window + 1) : -1.f;
        g.m[l] = real && p.sinks ? p.sinks[kh0 * G + h] : -INFINITY;  // the sink: a key with no value
        g.den[l] = real && p.sinks ? 1.f : 0.f;
        const T* query = p.q + ((p.starts[s] + i0 + i) * p.H + kh0 * G + h) * D;
        for (int64_t d = 0; d < D; ++d) g.qt[d * W + l] = real ? ToFloat(query[d]) * p.scale : 0.f;
        if (real) {
          g.key_lo = std::min<int64_t>(g.key_lo, p.window > 0 ? first + i - p.window + 1 : 0);
          g.key_hi = std::max<int64_t>(g.key_hi, first + i + 1);
        }
      }
    }
  const int64_t L = std::min<int64_t>({first + n, p.lens[s], p.MB * BS});  // keys the last query sees
  const int32_t* table = p.bt + s * p.MB;
  auto block_at = [&](int64_t j) {  // as jnp's gather: a negative entry counts from the end, then clamped
    int64_t b = table[j];
    return std::clamp<int64_t>(b < 0 ? b + p.NB : b, 0, p.NB - 1);
  };
  const int64_t from = p.window > 0 ? std::max<int64_t>(0, first - p.window + 1) / CK * CK : 0;
  thread_local std::vector<const C*> keys;  // each key's row in the cache (from this item's first head)
  thread_local std::vector<const float*> vals;  // one head's value of each key, as float32
  keys.resize(CK);
  vals.resize(CK);
  const C** kr = keys.data();
  const float** vp = vals.data();
  for (int64_t pos0 = from; pos0 < L; pos0 += CK) {
    const int64_t nk = std::min(CK, L - pos0);
    for (int64_t t = 0; t < nk; t += BS) {
      const C* kb = p.k + block_at((pos0 + t) / BS) * BS * row;
      for (int64_t u = 0; u < std::min(BS, nk - t); ++u) kr[t + u] = kb + u * row + kh0 * E;
    }
    for (int64_t kh = 0; kh < nkh; ++kh) {
      // This head's keys and values two chunks ahead, fetched into L2 while this one is worked on, a
      // head at a time: a whole chunk's prefetches into L1 at once (as a decode does) filled the
      // queue of misses and stalled on it; one chunk ahead, or into L1, was 1.2x slower at 16k.
      for (int64_t at = pos0 + 2 * CK, t = at; t < std::min(L, at + CK); ++t) {
        const int64_t off = (block_at(t / BS) * BS + t % BS) * row + (kh0 + kh) * E;
        Prefetch<2>(reinterpret_cast<const char*>(p.k + off), E * sizeof(C));
        Prefetch<2>(reinterpret_cast<const char*>(p.v + off), E * sizeof(C));
      }
      if (nk % Vec::KT) std::fill(kf + nk * D, kf + (nk + Vec::KT) * D, 0.f);  // the last tile's keys past the chunk
      for (int64_t t = 0; t < nk; ++t) {
        const C* key = kr[t] + kh * E;
        const C* val = p.v + (key - p.k);  // the value beside the key
        // The keys side by side (one pointer, not KT: the scores' loop would run out of registers
        // for them), as float32 (times their scale in an 8-bit cache); the values in place in a
        // float cache, else as float32 once for all the head's groups.
        const float ks = EntryScale(key, D);
        for (int64_t d = 0; d < D; ++d) kf[t * D + d] = ToFloat(key[d]) * ks;
        if constexpr (kFloatCache) {
          vp[t] = val;
        } else {
          const float vs = EntryScale(val, D);
          for (int64_t d = 0; d < D; ++d) vf[t * D + d] = ToFloat(val[d]) * vs;
          vp[t] = vf + t * D;
        }
      }
      for (int64_t j = 0; j < groups; ++j) {
        TileGroup& g = gs[kh * groups + j];
        g.t_lo = std::clamp<int64_t>(g.key_lo - pos0, 0, nk);
        g.t_hi = std::clamp<int64_t>(g.key_hi - pos0, 0, nk);
        if (g.t_lo >= g.t_hi) continue;  // no lane sees a key of this chunk
        AttendTileGroup<kD>(g, kf, vp, nk, pos0, D, p.soft_cap, pt);
      }
    }
  }
  for (int64_t kh = 0; kh < nkh; ++kh)
    for (int64_t j = 0; j < groups; ++j) {
      const TileGroup& g = gs[kh * groups + j];
      for (int l = 0; l < W; ++l) {
        const int64_t r = j * W + l, h = kh * G + r / n, i = r % n;
        if (r >= G * n) break;
        const float inv = g.den[l] > 0.f ? 1.f / g.den[l] : 0.f;  // a query that saw no key: zeros
        T* result = p.out + ((p.starts[s] + i0 + i) * p.H + kh0 * G + h) * D;
        for (int64_t d = 0; d < D; ++d) FromFloat(g.ot[d * W + l] * inv, result + d);
      }
    }
}
#endif

// Queries i0 .. i0 + n - 1 of row s, all heads, over the keys the last of them sees, a chunk of
// blocks (KeysPerChunk) at a time with an online softmax. Query rows are kept head-major (row
// h * n + i: query i, head h), so the G * n rows that share a KV head are contiguous. A head with
// few rows (a decode) scores each key by a dot product; a head with many (a prefill chunk) has the
// chunk's keys transposed into kt, so that its scores come kLanes keys to a vector, kRowTile rows
// at a time. The weighted values accumulate in registers, kValueRows rows at a time. A key past a
// query's position, or before its sliding window, gets no weight.
template <int kD, typename T, typename C>
void AttendRows(const Problem<T, C>& p, int64_t s, int64_t i0, int64_t n, int64_t kh0, int64_t nkh,
                std::vector<float>& scratch) {
  // KV heads kh0 .. kh0 + nkh - 1 and their query heads: H and KVH count this item's heads, p.H and
  // p.KVH stride the queries and the cache.
  const int64_t G = p.H / p.KVH, KVH = nkh, H = nkh * G, h0 = kh0 * G;
  const int64_t D = p.D, E = p.E, BS = p.BS, row = p.KVH * E, nh = n * H;
  const int64_t CK = KeysPerChunk(BS), nl = (CK + kLanes - 1) / kLanes * kLanes;  // scores per row, whole vectors
  const bool transpose = G * n >= kMinTransposeRows;
#if defined(PAGED_JAX_ATTENTION_TILES)
  // At least half a vector of rows (fewer, as a speculative tile of 4 queries: transposed keys, which
  // do not compute the empty lanes)
  if (G * n >= Vec::W / 2) return AttendTiles<kD>(p, s, i0, n, kh0, nkh, scratch);
#endif
  scratch.resize(nh * nl + 2 * nh + 2 * nh * D + D * nl + CK * D + D);
  float* sc = scratch.data();  // [H, n, nl] this chunk's scores, then weights
  float* m = sc + nh * nl;     // [H, n] running max
  float* den = m + nh;         // [H, n] running sum of exp
  float* q = den + nh;         // [H, n, D] the queries
  float* out = q + nh * D;     // [H, n, D] accumulated output
  float* kt = out + nh * D;    // [D, nl] one KV head's keys of the chunk, transposed (times their scale if 8-bit)
  float* vf = kt + D * nl;     // [CK, D] one KV head's values of the chunk as float32, scaled (not a float cache)
  float* zeros = vf + CK * D;  // [D] the key read for lanes past the chunk's keys
  // Each key's row in the cache (all KV heads), for this chunk (kr) and the next (nkr); one KV head's
  // value of each key, as float32 (vr).
  thread_local std::vector<const C*> keys;
  thread_local std::vector<const float*> vals;
  keys.resize(2 * CK);
  vals.resize(CK);
  const C** kr = keys.data();
  const C** nkr = kr + CK;
  const float** vr = vals.data();
  std::fill(out, out + nh * D, 0.f);
  std::fill(zeros, zeros + D, 0.f);
  // The online softmax starts from the sink, a key with no value: max = sink, sum = exp(0).
  for (int64_t r = 0; r < nh; ++r) {
    m[r] = p.sinks ? p.sinks[h0 + r / n] : -INFINITY;
    den[r] = p.sinks ? 1.f : 0.f;
  }
  const int64_t first = int64_t{p.lens[s]} - p.qlens[s] + i0;  // position of query i0
  const T* query = p.q + ((p.starts[s] + i0) * p.H + h0) * D;
  T* result = p.out + ((p.starts[s] + i0) * p.H + h0) * D;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) q[(h * n + i) * D + d] = ToFloat(query[(i * p.H + h) * D + d]) * p.scale;
  const int64_t L = std::min<int64_t>({first + n, p.lens[s], p.MB * BS});  // keys the last query sees
  const int32_t* table = p.bt + s * p.MB;
  auto block_at = [&](int64_t j) {  // as jnp's gather: a negative entry counts from the end, then clamped
    int64_t b = table[j];
    return std::clamp<int64_t>(b < 0 ? b + p.NB : b, 0, p.NB - 1);
  };
  // Query i's keys in a chunk starting at pos0: seen_from(i, pos0, nk) <= t < visible(i, pos0, nk)
  // (causal, and within the sliding window, within nk).
  auto visible = [&](int64_t i, int64_t pos0, int64_t nk) { return std::clamp<int64_t>(first + i - pos0 + 1, 0, nk); };
  auto seen_from = [&](int64_t i, int64_t pos0, int64_t nk) {
    return p.window > 0 ? std::clamp<int64_t>(first + i - p.window + 1 - pos0, 0, nk) : int64_t{0};
  };
  // Chunks wholly before the first query's window are not read (nor their blocks, which a windowed
  // sequence may have given back).
  const int64_t from = p.window > 0 ? std::max<int64_t>(0, first - p.window + 1) / CK * CK : 0;
  auto rows_of = [&](int64_t pos0, int64_t nk, const C** to) {  // the key rows of the chunk at pos0
    for (int64_t t = 0; t < nk; t += BS) {
      const C* kb = p.k + block_at((pos0 + t) / BS) * BS * row;
      for (int64_t u = 0; u < std::min(BS, nk - t); ++u) to[t + u] = kb + u * row + kh0 * E;  // this item's first head
    }
  };
  if (from < L) rows_of(from, std::min(CK, L - from), kr);
  for (int64_t pos0 = from; pos0 < L; pos0 += CK) {
    const int64_t nk = std::min(CK, L - pos0);
    // The next chunk's keys and values are fetched while this one is worked on (the hardware
    // prefetchers stop at page boundaries, and blocks lie anywhere): by a decode a row at a time
    // beside the rows it reads (about 1.3x faster, where fetching whole blocks at once was 1.25x
    // slower at batch 128), by a prefill chunk all at once.
    const int64_t next = std::min(CK, L - pos0 - CK);  // keys in the next chunk (<= 0: none)
    if (next > 0) rows_of(pos0 + CK, next, nkr);
    if (!transpose) {
      for (int64_t t = 0; t < nk; ++t) {
        if (t < next) {
          Prefetch(reinterpret_cast<const char*>(nkr[t]), KVH * E * sizeof(C));
          Prefetch(reinterpret_cast<const char*>(p.v + (nkr[t] - p.k)), KVH * E * sizeof(C));
        }
        for (int64_t kh = 0; kh < KVH; ++kh) {
          const C* key = kr[t] + kh * E;
          const float ks = EntryScale(key, D);
          for (int64_t r = kh * G * n; r < (kh + 1) * G * n; ++r) sc[r * nl + t] = Dot<kD>(q + r * D, key, D) * ks;
        }
      }
    } else {
      for (int64_t t = 0; t < next; t += BS) {
        const int64_t bytes = std::min(BS, next - t) * row * sizeof(C);
        Prefetch(reinterpret_cast<const char*>(nkr[t]), bytes);
        Prefetch(reinterpret_cast<const char*>(p.v + (nkr[t] - p.k)), bytes);
      }
      for (int64_t kh = 0; kh < KVH; ++kh) {
        // kt[d, t] = key t's d-th value (times its scale in an 8-bit cache), whole vectors of kLanes
        // keys (past nk: zeros).
        for (int64_t c = 0; c < nl; c += kLanes) {
          const int64_t nc = std::clamp<int64_t>(nk - c, 0, kLanes);
#ifdef __AVX512F__
          if constexpr (std::is_same_v<C, float> && kLanes == 16) {
            if (D % 16 == 0) {
              const float* src[16];
              for (int64_t l = 0; l < 16; ++l) src[l] = l < nc ? kr[c + l] + kh * E : zeros;
              for (int64_t d0 = 0; d0 < D; d0 += 16) {
                Transpose16(src, kt + d0 * nl + c, nl);
                for (auto& x : src) x += 16;
              }
              continue;
            }
          }
#elif defined(PAGED_JAX_ATTENTION_AVX2)
          if constexpr (std::is_same_v<C, float> && kLanes == 16) {
            if (D % 8 == 0) {
              const float* src[16];
              for (int64_t l = 0; l < 16; ++l) src[l] = l < nc ? kr[c + l] + kh * E : zeros;
              for (int64_t d0 = 0; d0 < D; d0 += 8) {
                Transpose8(src, kt + d0 * nl + c, nl);
                Transpose8(src + 8, kt + d0 * nl + c + 8, nl);
                for (auto& x : src) x += 8;
              }
              continue;
            }
          }
#endif
          for (int64_t l = 0; l < kLanes; ++l) {
            const C* key = l < nc ? kr[c + l] + kh * E : nullptr;
            const float ks = key ? EntryScale(key, D) : 0.f;
            for (int64_t d = 0; d < D; ++d) kt[d * nl + c + l] = key ? ToFloat(key[d]) * ks : 0.f;
          }
        }
        for (int64_t r0 = kh * G * n; r0 < (kh + 1) * G * n; r0 += kRowTile)
          for (int64_t c = 0; c < nl; c += kLanes)
            ScoreTile<kD>(q + r0 * D, std::min(kRowTile, (kh + 1) * G * n - r0), D, kt, nl, c, sc + r0 * nl, nl);
      }
    }
    // The online softmax of each row over its visible keys, in whole vectors of kLanes (a fixed trip
    // count, so the loops vectorize without a scalar tail; lanes past the visible keys are masked).
    for (int64_t r = 0; r < nh; ++r) {
      float* x = sc + r * nl;
      const int64_t lo = seen_from(r % n, pos0, nk), nv = visible(r % n, pos0, nk);
      if (p.soft_cap > 0.f) {
        const float cap = p.soft_cap, inv_cap = 1.f / p.soft_cap;
        for (int64_t c = 0; c < nl; c += kLanes)
#pragma omp simd
          for (int64_t l = 0; l < kLanes; ++l) x[c + l] = cap * Tanh(x[c + l] * inv_cap);
      }
      float mx = m[r];
      for (int64_t c = 0; c < nl; c += kLanes)
#pragma omp simd reduction(max : mx)
        for (int64_t l = 0; l < kLanes; ++l) {
          const float v = x[c + l];
          mx = c + l >= lo && c + l < nv && v > mx ? v : mx;
        }
      if (nv <= lo || mx == -INFINITY) {  // this query sees none of these keys: nothing to add
        std::fill(x, x + nl, 0.f);
        continue;
      }
      const float correction = std::exp(m[r] - mx);  // 0 on the row's first keys (m = -inf)
      float sum = 0.f;
#if defined(PAGED_JAX_ATTENTION_AVX2)
      {
        const __m256 vmx = _mm256_set1_ps(mx);
        const __m256i vlo = _mm256_set1_epi32(static_cast<int32_t>(lo)), vnv = _mm256_set1_epi32(static_cast<int32_t>(nv));
        __m256 vsum = _mm256_setzero_ps();
        for (int64_t c = 0; c < nl; c += 8) {
          const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(c)),
                                               _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
          const __m256 z = _mm256_min_ps(_mm256_sub_ps(_mm256_loadu_ps(x + c), vmx), _mm256_setzero_ps());
          const __m256i sees = _mm256_andnot_si256(_mm256_cmpgt_epi32(vlo, idx), _mm256_cmpgt_epi32(vnv, idx));
          const __m256 w = _mm256_and_ps(ExpNonPositive8(z), _mm256_castsi256_ps(sees));  // 0: a key it does not see
          _mm256_storeu_ps(x + c, w);
          vsum = _mm256_add_ps(vsum, w);
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, vsum);
        for (float l : lanes) sum += l;
      }
#else
      for (int64_t c = 0; c < nl; c += kLanes) {
        float e[kLanes];
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) {
          const float z = x[c + l] - mx;  // <= 0 for the keys it sees
          e[l] = ExpNonPositive(z < 0.f ? z : 0.f);
        }
#pragma omp simd reduction(+ : sum)
        for (int64_t l = 0; l < kLanes; ++l) {
          const float w = c + l >= lo && c + l < nv ? e[l] : 0.f;  // 0: a key it does not see
          x[c + l] = w;
          sum += w;
        }
      }
#endif
      den[r] = den[r] * correction + sum;
      m[r] = mx;
      if (correction != 1.f) {
        float* o = out + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= correction;
      }
    }
    for (int64_t kh = 0; kh < KVH; ++kh) {
      for (int64_t t = 0; t < nk; ++t) {
        const C* val = p.v + (kr[t] - p.k) + kh * E;  // the value beside the key
        if constexpr (std::is_same_v<C, float>) {
          vr[t] = val;
        } else {  // 8-bit or bfloat16: this head's values as float32 once, for all its rows
          const float vs = EntryScale(val, D);
          for (int64_t d = 0; d < D; ++d) vf[t * D + d] = ToFloat(val[d]) * vs;
          vr[t] = vf + t * D;
        }
      }
      for (int64_t r0 = kh * G * n; r0 < (kh + 1) * G * n; r0 += kValueRows) {
        const int64_t rows = std::min(kValueRows, (kh + 1) * G * n - r0);
        int64_t t0 = nk, t1 = 0;
        for (int64_t r = r0; r < r0 + rows; ++r) {
          t0 = std::min(t0, seen_from(r % n, pos0, nk));
          t1 = std::max(t1, visible(r % n, pos0, nk));
        }
        WeightedValueRows<kD>(sc + r0 * nl, nl, rows, t0, t1, vr, D, out + r0 * D);
      }
    }
    std::swap(kr, nkr);  // the next chunk's rows become this one's
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t r = h * n + i;
      const float inv = den[r] > 0.f ? 1.f / den[r] : 0.f;  // a query that saw no key: zeros
      for (int64_t d = 0; d < D; ++d) FromFloat(out[r * D + d] * inv, result + (i * p.H + h) * D + d);
    }
}

#ifndef PAGED_JAX_ITEM_FLOATS
#define PAGED_JAX_ITEM_FLOATS 8192
#endif
constexpr int64_t kItemFloats = PAGED_JAX_ITEM_FLOATS;
// Query-key pairs below which an item is not split by heads (see Run).
constexpr int64_t kMinSplitCost = 4096;

// Queries per work item: their float32 queries and outputs, n * H * D each, stay in L1 and L2
// (16 for 8 heads of 64; one for very wide models).
inline int64_t QueriesPerItem(int64_t H, int64_t D) {
  return std::clamp<int64_t>(kItemFloats / std::max<int64_t>(1, H * D), 1, 64);
}

// The row arrays every variant takes: block tables [S, MB], and per row its keys, first new token
// and new tokens ([S] each).
struct Rows {
  ffi::Buffer<ffi::S32> tables, lens, starts, qlens;
};

template <typename T, typename C>
ffi::Error Run(ffi::ThreadPool pool, const T* q, ffi::Span<const int64_t> qd, const C* k, const C* v,
               ffi::Span<const int64_t> kd, ffi::Span<const int64_t> vd, const Rows& rows, float scale,
               int64_t window, float soft_cap, const ffi::Buffer<ffi::F32>& sinks, T* out, int64_t extra) {
  auto bd = rows.tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || bd.size() != 2 || vd.size() != 4 || !std::equal(kd.begin(), kd.end(), vd.begin()))
    return ffi::Error::InvalidArgument("paged_attention: expected q [T,H,D], caches [NB,BS,KVH,D(+2)], tables [S,MB]");
  Problem<T, C> p{q, k, v, rows.tables.typed_data(), rows.lens.typed_data(), rows.starts.typed_data(),
                  rows.qlens.typed_data(), out, qd[0], bd[0], qd[1], qd[2], kd[0], kd[1], kd[2], bd[1], scale, kd[3],
                  window, soft_cap, sinks.element_count() ? sinks.typed_data() : nullptr};
  if (sinks.element_count() != 0 && static_cast<int64_t>(sinks.element_count()) != p.H)
    return ffi::Error::InvalidArgument("paged_attention: sinks need one entry a query head, or none");
  for (const auto* r : {&rows.lens, &rows.starts, &rows.qlens})
    if (r->dimensions().size() != 1 || r->dimensions()[0] != p.S)
      return ffi::Error::InvalidArgument("paged_attention: lengths, starts and query lengths need one entry a row");
  if (kd[3] != p.D + extra || p.KVH <= 0 || p.NB <= 0 || p.BS <= 0 || p.H % p.KVH != 0)
    return ffi::Error::InvalidArgument("paged_attention: head counts or sizes do not match");
  // Work items (row, first query, queries, first KV head, KV heads); tokens no row covers come out zero.
  struct Item {
    int64_t s, i0, n, cost, kh0, nkh;
  };
  std::vector<Item> items;
  std::vector<uint8_t> covered(p.NT, 0);
  const int64_t per_item = QueriesPerItem(p.H, p.D);
  bool decode = true;
  for (int64_t s = 0; s < p.S; ++s) {
    const int64_t n = p.qlens[s], start = p.starts[s];
    if (n <= 0) continue;
    if (start < 0 || start + n > p.NT)
      return ffi::Error::InvalidArgument("paged_attention: a row's new tokens lie outside the queries");
    if (std::any_of(covered.begin() + start, covered.begin() + start + n, [](uint8_t c) { return c; }))
      return ffi::Error::InvalidArgument("paged_attention: two rows own the same query token");
    std::fill(covered.begin() + start, covered.begin() + start + n, 1);
    decode = decode && n == 1;
    for (int64_t i0 = 0; i0 < n; i0 += per_item) {
      const int64_t len = std::min(per_item, n - i0);
      items.push_back({s, i0, len, len * std::max<int64_t>(1, p.lens[s] - n + i0 + len), 0, p.KVH});
    }
  }
  // An item costing more than a thread's share of the step (a lone decode over a long context, a
  // one-block chunk late in a long prompt beside short decodes) is split by KV heads, which attend
  // independently, so that every thread has work: on 8 heads of 64 and 2 cores, a 16-token chunk
  // beside 16 decodes ran in 5.8 instead of 9.0 ms at a 16k context, 1.4 instead of 2.1 at 4k
  // (experiments/bench_attention_step.py). Small items stay whole (a task costs more than it saves).
  {
    const int64_t threads = std::max<int64_t>(1, pool.num_threads());
    int64_t total = 0;
    for (const Item& it : items) total += it.cost;
    std::vector<Item> split;
    for (const Item& it : items) {
      const int64_t parts = it.cost < kMinSplitCost ? 1 : std::min<int64_t>(p.KVH, (it.cost * threads + total - 1) / total);
      for (int64_t j = 0; j < parts; ++j) {
        const int64_t k0 = p.KVH * j / parts, k1 = p.KVH * (j + 1) / parts;
        split.push_back({it.s, it.i0, it.n, it.cost * (k1 - k0) / p.KVH, k0, k1 - k0});
      }
    }
    items.swap(split);
  }
  for (int64_t t = 0; t < p.NT; ++t)
    if (!covered[t]) std::fill(p.out + t * p.H * p.D, p.out + (t + 1) * p.H * p.D, T{});
  // The costliest items first (late queries of a long context), one item a range, so that the
  // threads finish together; a decode step's rows cost alike and go a few to a range.
  if (!decode) std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t n_items = static_cast<int64_t>(items.size());
  paged_jax_native::ParallelRanges(pool, n_items, decode ? 4 : n_items, [&p, &items](int64_t u0, int64_t u1) {
    thread_local std::vector<float> scratch;
    for (int64_t u = u0; u < u1; ++u) {
      const Item& it = items[u];
      switch (p.D) {  // the common head sizes get unrolled loops
        case 64: AttendRows<64>(p, it.s, it.i0, it.n, it.kh0, it.nkh, scratch); break;
        case 128: AttendRows<128>(p, it.s, it.i0, it.n, it.kh0, it.nkh, scratch); break;
        default: AttendRows<0>(p, it.s, it.i0, it.n, it.kh0, it.nkh, scratch);
      }
    }
  });
  return ffi::Error::Success();
}

template <ffi::DataType DT>
ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<DT> q, ffi::Buffer<DT> k, ffi::Buffer<DT> v,
                ffi::Buffer<ffi::S32> bt, ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> starts,
                ffi::Buffer<ffi::S32> qlens, ffi::Buffer<ffi::F32> sinks, float scale, int64_t window, float soft_cap,
                ffi::ResultBuffer<DT> out) {
  return Run(pool, q.typed_data(), q.dimensions(), k.typed_data(), v.typed_data(), k.dimensions(), v.dimensions(),
             Rows{bt, lens, starts, qlens}, scale, window, soft_cap, sinks, out->typed_data(), 0);
}

// float32 queries over an int8 cache with a float16 scale per token and head (kv_quant's layout).
ffi::Error ImplQ8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k, ffi::Buffer<ffi::S8> v,
                  ffi::Buffer<ffi::S32> bt, ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> starts,
                  ffi::Buffer<ffi::S32> qlens, ffi::Buffer<ffi::F32> sinks, float scale, int64_t window, float soft_cap,
                  ffi::ResultBuffer<ffi::F32> out) {
  return Run(pool, q.typed_data(), q.dimensions(), k.typed_data(), v.typed_data(), k.dimensions(), v.dimensions(),
             Rows{bt, lens, starts, qlens}, scale, window, soft_cap, sinks, out->typed_data(), 2);
}

// The same over an fp8 cache: e4m3 bits in uint8 (as kv_quant stores them), a float16 scale each.
ffi::Error ImplFp8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> k, ffi::Buffer<ffi::U8> v,
                   ffi::Buffer<ffi::S32> bt, ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> starts,
                   ffi::Buffer<ffi::S32> qlens, ffi::Buffer<ffi::F32> sinks, float scale, int64_t window, float soft_cap,
                   ffi::ResultBuffer<ffi::F32> out) {
  return Run(pool, q.typed_data(), q.dimensions(), reinterpret_cast<const Fp8E4M3*>(k.typed_data()),
             reinterpret_cast<const Fp8E4M3*>(v.typed_data()), k.dimensions(), v.dimensions(),
             Rows{bt, lens, starts, qlens}, scale, window, soft_cap, sinks, out->typed_data(), 2);
}

}  // namespace

// Which code the kernel was built with (keys transposed in registers, weighted values in
// registers): 2 AVX-512, 1 AVX2 with FMA3, 0 the plain loops: native.status() reports which one a run tests.
extern "C" int PagedJaxAttentionIsa() {
#if defined(__AVX512F__)
  return 2;
#elif defined(PAGED_JAX_ATTENTION_AVX2)
  return 1;
#else
  return 0;
#endif
}

#define PAGED_ATTENTION_BINDING(QT, CT)      \
  ffi::Ffi::Bind()                           \
      .Ctx<ffi::ThreadPool>()                \
      .Arg<ffi::Buffer<QT>>()                \
      .Arg<ffi::Buffer<CT>>()                \
      .Arg<ffi::Buffer<CT>>()                \
      .Arg<ffi::Buffer<ffi::S32>>()          \
      .Arg<ffi::Buffer<ffi::S32>>()          \
      .Arg<ffi::Buffer<ffi::S32>>()          \
      .Arg<ffi::Buffer<ffi::S32>>()          \
      .Arg<ffi::Buffer<ffi::F32>>()          \
      .Attr<float>("scale")                  \
      .Attr<int64_t>("window")               \
      .Attr<float>("soft_cap")               \
      .Ret<ffi::Buffer<QT>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionF32, Impl<ffi::F32>, PAGED_ATTENTION_BINDING(ffi::F32, ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionBF16, Impl<ffi::BF16>, PAGED_ATTENTION_BINDING(ffi::BF16, ffi::BF16));
// float32 queries and output over an 8-bit cache
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionQ8, ImplQ8, PAGED_ATTENTION_BINDING(ffi::F32, ffi::S8));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionFp8, ImplFp8, PAGED_ATTENTION_BINDING(ffi::F32, ffi::U8));

// Keys in lanes for the ragged paged-attention kernel (paged_attention.cc): a KV head with fewer query
// rows than half a vector (a decode, a chunk of a few tokens, a few query heads sharing a KV head)
// scores W keys to a vector for each of its rows, each key read once for all of them. Included by
// paged_attention.cc alone; its own anonymous namespace, as attention_tiles.h.
#pragma once

#include <vector>

#include "attention_loops.h"
#include "attention_tiles.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Few query rows (fewer than W / 2: query tiles in registers would leave most lanes empty). A step of
// W keys: each row's W scores come out as one vector (a key's products with the query, D / W vectors
// summed, then the W keys' sums gathered lane by lane: no scalar dot product, no scalar softmax);
// the online softmax's exp and denominator are vectors; the weighted values are WeightedValueRows'
// registers, every value loaded once for all the rows. The keys and values a few steps ahead are
// fetched into L2 (blocks lie anywhere, and the hardware prefetchers stop at page boundaries). Late
// in a long prompt a chunk of a few tokens then costs about what reading its context costs, instead
// of as much as a block's (experiments/bench_attention_step.py, "4 queries at N").
#if defined(PAGED_JAX_ATTENTION_TILES)
#define PAGED_JAX_ATTENTION_LANES 1

// Lane t of the result: the sum of the lanes of x[t] (W vectors to one, by pairs, as a transposition).
#if defined(__AVX512F__)
inline __m512 SumLanes(const __m512* x) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // in each 128-bit lane: x[2i] and x[2i + 1], two partial sums each
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // in each 128-bit lane: x[4i .. 4i + 4), one partial sum each
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // 128-bit lanes summed in pairs
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
inline float MaxOfLanes(__m512 x) { return _mm512_reduce_max_ps(x); }
inline float SumOfLanes(__m512 x) { return _mm512_reduce_add_ps(x); }
#else
inline __m256 SumLanes(const __m256* x) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
inline float MaxOfLanes(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float SumOfLanes(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// Scores of one query row (scaled, D floats) against W keys (float32 rows of D; past the step's
// keys, rows of zeros), key t in lane t.
template <int kD>
inline Vec::F LaneScores(const float* q, const float* const* keys, int64_t D_) {
  constexpr int W = Vec::W;
  const int64_t D = kD > 0 ? kD : D_;
  Vec::F acc[W];
  for (int t = 0; t < W; ++t) acc[t] = Vec::Zero();
  for (int64_t d = 0; d < D; d += W) {
    const Vec::F x = Vec::Load(q + d);
    for (int t = 0; t < W; ++t) acc[t] = Vec::Fma(x, Vec::Load(keys[t] + d), acc[t]);
  }
  return SumLanes(acc);
}

// AttendRows for a KV head with few query rows (R = G * n < W / 2) and a head size a multiple of W:
// rows head-major as AttendRows' (row kh * R + r: KV head kh, query head kh * G + r / n, query r % n).
template <int kD, typename T, typename C>
void AttendLanes(const Problem<T, C>& p, int64_t s, int64_t i0, int64_t n, int64_t kh0, int64_t nkh,
                 std::vector<float>& scratch) {
  using F = Vec::F;
  constexpr int W = Vec::W;
  constexpr bool kFloatCache = std::is_same_v<C, float>;
#ifndef PAGED_JAX_LANES_AHEAD
#define PAGED_JAX_LANES_AHEAD 4
#endif
  // Steps of W keys fetched ahead, into L2. On contiguous blocks the hardware prefetchers do as well
  // (0, 4 and 12 steps ran alike on 16 decodes at 300 keys and a row at 16,000).
  constexpr int64_t kAhead = PAGED_JAX_LANES_AHEAD;
  const int64_t G = p.H / p.KVH, R = G * n, nr = nkh * R, D = kD > 0 ? kD : p.D, E = p.E, BS = p.BS;
  const int64_t row = p.KVH * E;
  scratch.resize(nr * (2 * D + 2 * W) + nr + (kFloatCache ? 1 : 2 * W) * D);
  float* q = scratch.data();  // [nr, D] the queries, scaled
  float* out = q + nr * D;    // [nr, D] accumulated output
  float* den = out + nr * D;  // [nr, W] running sums of exp, lane by lane
  float* w = den + nr * W;    // [nr, W] this step's weights
  float* m = w + nr * W;      // [nr] running max
  float* conv = m + nr;       // zeros (D) for a float cache; else [2 W, D]: one head's keys and values as float32
  std::fill(out, out + nr * D, 0.f);
  std::fill(den, den + nr * W, 0.f);
  if constexpr (kFloatCache) std::fill(conv, conv + D, 0.f);
  const int64_t first = int64_t{p.lens[s]} - p.qlens[s] + i0;  // position of query i0
  for (int64_t kh = 0; kh < nkh; ++kh)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t rr = kh * R + r, h = (kh0 + kh) * G + r / n, i = r % n;
      const T* query = p.q + ((p.starts[s] + i0 + i) * p.H + h) * D;
      for (int64_t d = 0; d < D; ++d) q[rr * D + d] = ToFloat(query[d]) * p.scale;
      // The online softmax starts from the sink, a key with no value: max = sink, sum = exp(0).
      m[rr] = p.sinks ? p.sinks[h] : -INFINITY;
      den[rr * W] = p.sinks ? 1.f : 0.f;
    }
  const int64_t L = std::min<int64_t>({first + n, p.lens[s], p.MB * BS});  // keys the last query sees
  const int32_t* table = p.bt + s * p.MB;
  auto slot = [&](int64_t t) {  // key t's entry (this item's first KV head); blocks as jnp's gather
    int64_t b = table[t / BS];
    b = std::clamp<int64_t>(b < 0 ? b + p.NB : b, 0, p.NB - 1);
    return (b * BS + t % BS) * row + kh0 * E;
  };
  // Keys before the first query's window are not read (nor their blocks, which a windowed sequence
  // may have given back); each row's own window and causal limit mask its lanes.
  const int64_t from = p.window > 0 ? std::max<int64_t>(0, first - p.window + 1) : 0;
  const int64_t fetch = nkh * E * static_cast<int64_t>(sizeof(C));  // bytes of a key (or value) for the item's heads
  for (int64_t t = from; t < std::min(L, from + kAhead * W); ++t) {
    Prefetch<2>(reinterpret_cast<const char*>(p.k + slot(t)), fetch);
    Prefetch<2>(reinterpret_cast<const char*>(p.v + slot(t)), fetch);
  }
  int64_t at[W];  // the step's key entries
  const float* kp[W];
  const float* vp[W];
  alignas(64) float kpos[W];
  for (int64_t pos0 = from; pos0 < L; pos0 += W) {
    const int64_t nk = std::min<int64_t>(W, L - pos0);
    for (int64_t t = 0; t < W; ++t) {
      at[t] = t < nk ? slot(pos0 + t) : -1;
      kpos[t] = t < nk ? static_cast<float>(pos0 + t) : INFINITY;  // past the keys: no lane sees it
    }
    for (int64_t t = pos0 + kAhead * W; t < std::min(L, pos0 + (kAhead + 1) * W); ++t) {
      Prefetch<2>(reinterpret_cast<const char*>(p.k + slot(t)), fetch);
      Prefetch<2>(reinterpret_cast<const char*>(p.v + slot(t)), fetch);
    }
    const F key_pos = Vec::Load(kpos);
    for (int64_t kh = 0; kh < nkh; ++kh) {
      for (int64_t t = 0; t < W; ++t) {
        if (t >= nk) {
          kp[t] = kFloatCache ? conv : conv + t * D;
          if constexpr (!kFloatCache) std::fill(conv + t * D, conv + (t + 1) * D, 0.f);
          continue;
        }
        const C* key = p.k + at[t] + kh * E;
        const C* val = p.v + at[t] + kh * E;
        if constexpr (kFloatCache) {
          kp[t] = key;
          vp[t] = val;
        } else {  // 8-bit or bfloat16: this head's keys and values as float32 once, for all its rows
          float* kf = conv + t * D;
          float* vf = conv + (W + t) * D;
          const float ks = EntryScale(key, D), vs = EntryScale(val, D);
          for (int64_t d = 0; d < D; ++d) kf[d] = ToFloat(key[d]) * ks;
          for (int64_t d = 0; d < D; ++d) vf[d] = ToFloat(val[d]) * vs;
          kp[t] = kf;
          vp[t] = vf;
        }
      }
      int64_t t0 = nk, t1 = 0;  // the keys of this step some row sees (the others may hold anything)
      for (int64_t r = 0; r < R; ++r) {
        const int64_t rr = kh * R + r, pos = first + r % n;
        const int64_t lo = p.window > 0 ? pos - p.window + 1 : 0;
        const int64_t seen_from = std::clamp<int64_t>(lo - pos0, 0, nk), seen_to = std::clamp<int64_t>(pos + 1 - pos0, 0, nk);
        float* wr = w + rr * W;
        if (seen_from >= seen_to) {  // this query sees none of these keys
          std::fill(wr, wr + W, 0.f);
          continue;
        }
        t0 = std::min(t0, seen_from);
        t1 = std::max(t1, seen_to);
        F x = LaneScores<kD>(q + rr * D, kp, D);
        if (p.soft_cap > 0.f) x = SoftCap(x, p.soft_cap);
        x = Vec::Visible(x, key_pos, Vec::Set(static_cast<float>(pos)), Vec::Set(static_cast<float>(lo)));
        const float mx = std::max(m[rr], MaxOfLanes(x));
        if (mx == -INFINITY) {  // no finite score yet (a -inf sink, scores of -inf): nothing to add
          std::fill(wr, wr + W, 0.f);
          continue;
        }
        const float correction = m[rr] == -INFINITY ? 0.f : ExpNonPositive(m[rr] - mx);  // 0 on the first keys
        const F e = Vec::Exp(Vec::Sub(x, Vec::Set(mx)));  // 0 for a key the query does not see
        Vec::Store(wr, e);
        Vec::Store(den + rr * W, Vec::Fma(Vec::Load(den + rr * W), Vec::Set(correction), e));
        m[rr] = mx;
        if (correction != 1.f) {
          float* o = out + rr * D;
          for (int64_t d = 0; d < D; d += W) Vec::Store(o + d, Vec::Mul(Vec::Load(o + d), Vec::Set(correction)));
        }
      }
      for (int64_t r0 = 0; t0 < t1 && r0 < R; r0 += kValueRows) {
        const int64_t rr = kh * R + r0;
        WeightedValueRows<kD>(w + rr * W, W, std::min(kValueRows, R - r0), t0, t1, vp, D, out + rr * D);
      }
    }
  }
  for (int64_t kh = 0; kh < nkh; ++kh)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t rr = kh * R + r, h = (kh0 + kh) * G + r / n, i = r % n;
      const float sum = SumOfLanes(Vec::Load(den + rr * W));
      const float inv = sum > 0.f ? 1.f / sum : 0.f;  // a query that saw no key: zeros
      T* result = p.out + ((p.starts[s] + i0 + i) * p.H + h) * D;
      for (int64_t d = 0; d < D; ++d) FromFloat(out[rr * D + d] * inv, result + d);
    }
}
#endif

}  // namespace

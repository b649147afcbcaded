// One work item of the ragged paged-attention kernel (paged_attention.cc): some queries of one row,
// all heads, over the keys they see, with an online softmax. Included by paged_attention.cc alone;
// its own anonymous namespace, as attention_tiles.h: an inlined template.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "attention_loops.h"
#include "attention_tiles.h"

namespace {

// AVX-512 and a head of 16s: a float32 or bfloat16 cache's decode scores 16 keys at a time (Dot16), and a
// bfloat16 cache's values, for at most kValueRows rows of a KV head, widened in registers as they are
// weighted (WeightedValueRows) instead of into a float32 copy first: each value is read once either way.
template <int kD, typename C>
constexpr bool kDecodeBy16 =
#if defined(__AVX512F__)
    kD > 0 && kD % 16 == 0 && (std::is_same_v<C, float> || std::is_same_v<C, uint16_t>);
#else
    false;
#endif

// Queries i0 .. i0 + n - 1 of row s, all heads, over the keys the last of them sees, a chunk of
// blocks (KeysPerChunk) at a time with an online softmax. Query rows are kept head-major (row
// h * n + i: query i, head h), so the G * n rows that share a KV head are contiguous. A head with
// few rows (a decode) scores each key by a dot product (kDecodeBy16: 16 keys at a time); a head with
// many (a prefill chunk) has the chunk's keys transposed into kt, so that its scores come kLanes keys
// to a vector, kRowTile rows at a time. The weighted values accumulate in registers, kValueRows rows
// at a time. A key past a query's position, or before its sliding window, gets no weight.
template <int kD, typename T, typename C>
void AttendRows(const Problem<T, C>& p, int64_t s, int64_t i0, int64_t n, int64_t kh0, int64_t nkh,
                const KeyPart& part, std::vector<float>& scratch) {
  // KV heads kh0 .. kh0 + nkh - 1 and their query heads: H and KVH count this item's heads, p.H and
  // p.KVH stride the queries and the cache.
  const int64_t G = p.H / p.KVH, KVH = nkh, H = nkh * G, h0 = kh0 * G;
  const int64_t D = p.D, E = p.E, BS = p.BS, row = p.KVH * E, nh = n * H;
  const int64_t CK = KeysPerChunk(BS), nl = (CK + kLanes - 1) / kLanes * kLanes;  // scores per row, whole vectors
  const bool transpose = G * n >= kMinTransposeRows;
#if defined(PAGED_JAX_ATTENTION_TILES)
  // At least half a vector of rows (fewer, as a speculative tile of 4 queries: transposed keys, which
  // do not compute the empty lanes)
  if (G * n >= Vec::W / 2) return AttendTiles<kD>(p, s, i0, n, kh0, nkh, part, scratch);
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
  thread_local std::vector<const C*> cache_vals_store;  // one KV head's values in the cache (kDecodeBy16)
  keys.resize(2 * CK);
  vals.resize(CK);
  cache_vals_store.resize(CK);
  const C** cache_vals = cache_vals_store.data();
  const C** kr = keys.data();
  const C** nkr = kr + CK;
  const float** vr = vals.data();
  std::fill(out, out + nh * D, 0.f);
  std::fill(zeros, zeros + D, 0.f);
  // The online softmax starts from the sink, a key with no value: max = sink, sum = exp(0).
  const bool sink = p.sinks && part.first;
  for (int64_t r = 0; r < nh; ++r) {
    m[r] = sink ? p.sinks[h0 + r / n] : -INFINITY;
    den[r] = sink ? 1.f : 0.f;
  }
  const int64_t first = int64_t{p.lens[s]} - p.qlens[s] + i0;  // position of query i0
  const T* query = p.q + ((p.starts[s] + i0) * p.H + h0) * D;
  T* result = p.out + ((p.starts[s] + i0) * p.H + h0) * D;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) q[(h * n + i) * D + d] = ToFloat(query[(i * p.H + h) * D + d]) * p.scale;
  const int64_t L = std::min<int64_t>({first + n, p.lens[s], p.MB * BS, part.k1});  // keys the last query sees
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
  const int64_t from = std::max(WindowStart(p, first) / CK * CK, part.k0);
  auto rows_of = [&](int64_t pos0, int64_t nk, const C** to) {  // the key rows of the chunk at pos0
    for (int64_t t = 0; t < nk; t += BS) {
      const C* kb = p.k + block_at((pos0 + t) / BS) * BS * row;
      for (int64_t u = 0; u < std::min(BS, nk - t); ++u) to[t + u] = kb + u * row + kh0 * E;  // this item's first head
    }
  };
  auto fetch_next = [&](int64_t t, int64_t bytes) {  // the next chunk's key rows from nkr[t], and their values
    Prefetch(reinterpret_cast<const char*>(nkr[t]), bytes);
    Prefetch(reinterpret_cast<const char*>(p.v + (nkr[t] - p.k)), bytes);
  };
  // The keys [t0, t1) of a chunk at pos0 (nk keys) that rows r0 .. r0 + rows - 1 see between them.
  auto keys_seen = [&](int64_t r0, int64_t rows, int64_t pos0, int64_t nk) {
    int64_t t0 = nk, t1 = 0;
    for (int64_t r = r0; r < r0 + rows; ++r) {
      t0 = std::min(t0, seen_from(r % n, pos0, nk));
      t1 = std::max(t1, visible(r % n, pos0, nk));
    }
    return std::make_pair(t0, t1);
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
    if (!transpose && kDecodeBy16<kD, C>) {
#if defined(__AVX512F__)
      if constexpr (kDecodeBy16<kD, C>) {
        for (int64_t t = 0; t < next; ++t) fetch_next(t, KVH * E * sizeof(C));
        for (int64_t kh = 0; kh < KVH; ++kh)
          for (int64_t c = 0; c < nl; c += kLanes) {
            const C* lane_keys[16];  // lanes past the chunk's keys read zeros (their scores are masked below)
            for (int64_t l = 0; l < 16; ++l)
              lane_keys[l] = c + l < nk ? kr[c + l] + kh * E : reinterpret_cast<const C*>(zeros);
            for (int64_t r = kh * G * n; r < (kh + 1) * G * n; ++r)
              _mm512_storeu_ps(sc + r * nl + c, Dot16<kD>(q + r * D, lane_keys));
          }
      }
#endif
    } else if (!transpose) {
      for (int64_t t = 0; t < nk; ++t) {
        if (t < next) fetch_next(t, KVH * E * sizeof(C));
        for (int64_t kh = 0; kh < KVH; ++kh) {
          const C* key = kr[t] + kh * E;
          const float ks = EntryScale(key, D);
          for (int64_t r = kh * G * n; r < (kh + 1) * G * n; ++r) sc[r * nl + t] = Dot<kD>(q + r * D, key, D) * ks;
        }
      }
    } else {
      for (int64_t t = 0; t < next; t += BS) fetch_next(t, std::min(BS, next - t) * row * sizeof(C));
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
      if constexpr (kDecodeBy16<kD, C> && std::is_same_v<C, uint16_t>) {
        if (G * n <= kValueRows) {  // bfloat16 values widened in registers (kDecodeBy16)
          for (int64_t t = 0; t < nk; ++t) cache_vals[t] = p.v + (kr[t] - p.k) + kh * E;
          const int64_t r0 = kh * G * n;
          const auto [t0, t1] = keys_seen(r0, G * n, pos0, nk);
          WeightedValueRows<kD>(sc + r0 * nl, nl, G * n, t0, t1, cache_vals, D, out + r0 * D);
          continue;
        }
      }
      for (int64_t t = 0; t < nk; ++t) {
        const C* val = p.v + (kr[t] - p.k) + kh * E;  // the value beside the key
        if constexpr (std::is_same_v<C, float>) {
          vr[t] = val;
        } else {  // 8-bit or bfloat16: this head's values as float32 once, for all its rows
          const float vs = EntryScale(val, D);
          Widen(val, vs, vf + t * D, D);
          vr[t] = vf + t * D;
        }
      }
      for (int64_t r0 = kh * G * n; r0 < (kh + 1) * G * n; r0 += kValueRows) {
        const int64_t rows = std::min(kValueRows, (kh + 1) * G * n - r0);
        const auto [t0, t1] = keys_seen(r0, rows, pos0, nk);
        WeightedValueRows<kD>(sc + r0 * nl, nl, rows, t0, t1, vr, D, out + r0 * D);
      }
    }
    std::swap(kr, nkr);  // the next chunk's rows become this one's
  }
  if (part.partial) {  // a part of a long row: MergeParts normalizes
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t r = h * n + i;
        float* rec = part.partial + (i * p.H + h0 + h) * (D + 2);
        std::copy(out + r * D, out + (r + 1) * D, rec);
        rec[D] = m[r];
        rec[D + 1] = den[r];
      }
    return;
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t r = h * n + i;
      const float inv = den[r] > 0.f ? 1.f / den[r] : 0.f;  // a query that saw no key: zeros
      for (int64_t d = 0; d < D; ++d) FromFloat(out[r * D + d] * inv, result + (i * p.H + h) * D + d);
    }
}

}  // namespace

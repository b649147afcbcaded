// Query tiles in registers for the ragged paged-attention kernel (paged_attention.cc): a KV head with
// many query rows (a prefill chunk, a speculative tile) attends W rows at a time, one per lane. Included
// by the kernel's work item alone (attention_item.h); its own anonymous namespace, as panel_tiles.h:
// inlined templates.
#pragma once

#include <vector>

#include "attention_loops.h"

namespace {

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
    {
      // Scores: each key element broadcast to the W rows. The KT sums stay in registers through the
      // loop and go to pt once after it: with the later loops reading them, GCC kept them in memory
      // and stored all KT every step, a 256-bit store per FMA (AVX2: twice the FMAs' time).
      F acc[KT];
      for (int t = 0; t < KT; ++t) acc[t] = Vec::Zero();
      for (int64_t d = 0; d < D; ++d) {
        const F q = Vec::Load(g.qt + d * W);
        for (int t = 0; t < KT; ++t) acc[t] = Vec::Fma(Vec::Set(k[t * D + d]), q, acc[t]);
      }
      for (int t = 0; t < KT; ++t) Vec::Store(pt + t * W, acc[t]);
    }
    F s[KT];
    F mx = Vec::Load(g.m);
    const F m_old = mx;
    for (int t = 0; t < KT; ++t) {
      s[t] = Vec::Load(pt + t * W);
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
                 const KeyPart& part, std::vector<float>& scratch) {
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
        const bool sink = real && p.sinks && part.first;  // the sink: a key with no value
        g.m[l] = sink ? p.sinks[kh0 * G + h] : -INFINITY;
        g.den[l] = sink ? 1.f : 0.f;
        const T* query = p.q + ((p.starts[s] + i0 + i) * p.H + kh0 * G + h) * D;
        for (int64_t d = 0; d < D; ++d) g.qt[d * W + l] = real ? ToFloat(query[d]) * p.scale : 0.f;
        if (real) {
          g.key_lo = std::min<int64_t>(g.key_lo, p.window > 0 ? first + i - p.window + 1 : 0);
          g.key_hi = std::max<int64_t>(g.key_hi, first + i + 1);
        }
      }
    }
  const int64_t L = std::min<int64_t>({first + n, p.lens[s], p.MB * BS, part.k1});  // keys the last query sees
  const int32_t* table = p.bt + s * p.MB;
  auto block_at = [&](int64_t j) {  // as jnp's gather: a negative entry counts from the end, then clamped
    int64_t b = table[j];
    return std::clamp<int64_t>(b < 0 ? b + p.NB : b, 0, p.NB - 1);
  };
  const int64_t from = std::max(WindowStart(p, first) / CK * CK, part.k0);
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
        Widen(key, ks, kf + t * D, D);
        if constexpr (kFloatCache) {
          vp[t] = val;
        } else {
          const float vs = EntryScale(val, D);
          Widen(val, vs, vf + t * D, D);
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
        if (part.partial) {  // a part of a long row: MergeParts normalizes
          float* rec = part.partial + (i * p.H + kh0 * G + h) * (D + 2);
          for (int64_t d = 0; d < D; ++d) rec[d] = g.ot[d * W + l];
          rec[D] = g.m[l];
          rec[D + 1] = g.den[l];
          continue;
        }
        const float inv = g.den[l] > 0.f ? 1.f / g.den[l] : 0.f;  // a query that saw no key: zeros
        T* result = p.out + ((p.starts[s] + i0 + i) * p.H + kh0 * G + h) * D;
        for (int64_t d = 0; d < D; ++d) FromFloat(g.ot[d * W + l] * inv, result + d);
      }
    }
}
#endif

}  // namespace

// Paged decode attention for the CPU, called from JAX through the XLA FFI.
//
// The same function as paged_jax.attention.reference.paged_attention_reference with one
// query per sequence: for each sequence s and KV head h, the G = H / KVH query heads that
// share h attend over the first context_lens[s] tokens, read through block_tables[s]
// straight from the paged cache (nothing is gathered into a temporary), softmax in
// float32. Slots past a sequence's context are never read. Work is split over
// sequences and shared with XLA's intra-op thread pool. Caches and queries are float32 or
// bfloat16 (read as float32; the output rounded to bfloat16 to nearest even, as astype), or
// float32 queries over an 8-bit cache (paged_jax.attention.kv_quant: each head's entry is D int8
// or fp8 e4m3 values and a float16 scale, D + 2 bytes; the scales multiply the dot products and
// the weights).

#include <algorithm>
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
  const T* q;           // [S, H, D]
  const C* k;           // [NB, BS, KVH, E], E = D (float caches) or D + 2 (8-bit values, float16 scale)
  const C* v;           // [NB, BS, KVH, E]
  const int32_t* bt;    // [S, MB]
  const int32_t* lens;  // [S]
  T* out;               // [S, H, D]
  int64_t S, H, D, NB, BS, KVH, MB;
  float scale;
  int64_t E;  // elements per token and head in the cache
};

inline float ToFloat(float x) { return x; }
inline float ToFloat(int8_t x) { return static_cast<float>(x); }

inline float ToFloat(Fp8E4M3 x) { return paged_jax_native::Fp8E4M3ToFloat(x.bits); }

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
inline float ToFloat(uint16_t bf16) { return __builtin_bit_cast(float, static_cast<uint32_t>(bf16) << 16); }

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

inline void Prefetch(const char* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// One sequence: all its query heads over its context, block by block with an online
// softmax. A token's K (and V) row holds every KV head ([KVH, D], contiguous), so each
// block is read in order, once, K and V together.
template <int kD, typename T, typename C>
void AttendOne(const Problem<T, C>& p, int64_t s, std::vector<float>& scratch) {
  const int64_t H = p.H, KVH = p.KVH, G = H / KVH, D = p.D, E = p.E, BS = p.BS, row = KVH * E;
  scratch.resize(H * BS + 2 * H + 2 * H * D);
  float* sc = scratch.data();        // [H, BS] this block's scores, then weights
  float* m = sc + H * BS;            // [H] running max
  float* den = m + H;                // [H] running sum of exp
  float* q = den + H;                // [H, D] this sequence's queries
  float* out = q + H * D;            // [H, D] accumulated output
  std::fill(out, out + H * D, 0.f);
  T* result = p.out + s * H * D;
  const int64_t L = std::min<int64_t>(p.lens[s], p.MB * BS);
  if (L <= 0) {  // padding row
    for (int64_t i = 0; i < H * D; ++i) FromFloat(0.f, result + i);
    return;
  }
  std::fill(m, m + H, -INFINITY);
  std::fill(den, den + H, 0.f);
  for (int64_t i = 0; i < H * D; ++i) q[i] = ToFloat(p.q[s * H * D + i]);
  const int32_t* table = p.bt + s * p.MB;
  auto block_at = [&](int64_t j) {  // as jnp's gather: a negative entry counts from the end, then clamped
    int64_t b = table[j];
    return std::clamp<int64_t>(b < 0 ? b + p.NB : b, 0, p.NB - 1);
  };
  const int64_t nblocks = (L + BS - 1) / BS;
  for (int64_t j = 0; j < nblocks; ++j) {
    const int64_t b = block_at(j), n = std::min(BS, L - j * BS);
    const C* kb = p.k + b * BS * row;
    const C* vb = p.v + b * BS * row;
    // The next block is fetched a row at a time alongside this one's rows: the hardware
    // prefetchers stop at page boundaries, and blocks lie anywhere (about 1.3x faster).
    const char* k_next = nullptr;
    const char* v_next = nullptr;
    if (j + 1 < nblocks) {
      const int64_t nb = block_at(j + 1);
      k_next = reinterpret_cast<const char*>(p.k + nb * BS * row);
      v_next = reinterpret_cast<const char*>(p.v + nb * BS * row);
    }
    for (int64_t t = 0; t < n; ++t) {
      const C* key = kb + t * row;
      if (k_next) Prefetch(k_next + t * row * sizeof(C), row * sizeof(C));
      for (int64_t kh = 0, h = 0; kh < KVH; ++kh) {
        const float ks = EntryScale(key + kh * E, D) * p.scale;
        for (int64_t g = 0; g < G; ++g, ++h) sc[h * BS + t] = Dot<kD>(q + h * D, key + kh * E, D) * ks;
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      float* x = sc + h * BS;
      float mx = m[h];
      for (int64_t t = 0; t < n; ++t) mx = std::max(mx, x[t]);
      const float correction = std::exp(m[h] - mx);  // 0 on the first block (m = -inf)
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        x[t] = std::exp(x[t] - mx);
        sum += x[t];
      }
      den[h] = den[h] * correction + sum;
      m[h] = mx;
      if (correction != 1.f) {
        float* o = out + h * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= correction;
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      const C* val = vb + t * row;
      if (v_next) Prefetch(v_next + t * row * sizeof(C), row * sizeof(C));
      for (int64_t kh = 0, h = 0; kh < KVH; ++kh) {
        const float vs = EntryScale(val + kh * E, D);
        for (int64_t g = 0; g < G; ++g, ++h) Axpy<kD>(sc[h * BS + t] * vs, val + kh * E, out + h * D, D);
      }
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    const float inv = 1.f / den[h];
    const float* o = out + h * D;
    for (int64_t d = 0; d < D; ++d) FromFloat(o[d] * inv, result + h * D + d);
  }
}

template <typename T, typename C>
ffi::Error Run(ffi::ThreadPool pool, const T* q, ffi::Span<const int64_t> qd, const C* k, const C* v,
               ffi::Span<const int64_t> kd, ffi::Span<const int64_t> vd, ffi::Buffer<ffi::S32> bt,
               ffi::Buffer<ffi::S32> lens, float scale, T* out, int64_t extra) {
  auto bd = bt.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || bd.size() != 2 || vd.size() != 4 || !std::equal(kd.begin(), kd.end(), vd.begin()))
    return ffi::Error::InvalidArgument("paged_decode: expected q [S,H,D], caches [NB,BS,KVH,D(+2)], tables [S,MB]");
  Problem<T, C> p{q, k, v, bt.typed_data(), lens.typed_data(), out, qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], bd[1],
                  scale, kd[3]};
  if (kd[3] != p.D + extra || p.KVH <= 0 || p.NB <= 0 || p.BS <= 0 || p.H % p.KVH != 0 || bd[0] != p.S ||
      lens.dimensions().size() != 1 || lens.dimensions()[0] != p.S)
    return ffi::Error::InvalidArgument("paged_decode: head counts or sizes do not match");
  paged_jax_native::ParallelRanges(pool, p.S, 4, [&p](int64_t s0, int64_t s1) {
    thread_local std::vector<float> scratch;
    for (int64_t s = s0; s < s1; ++s)
      switch (p.D) {  // the common head sizes get unrolled loops
        case 64: AttendOne<64>(p, s, scratch); break;
        case 128: AttendOne<128>(p, s, scratch); break;
        default: AttendOne<0>(p, s, scratch);
      }
  });
  return ffi::Error::Success();
}

template <ffi::DataType DT>
ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<DT> q, ffi::Buffer<DT> k, ffi::Buffer<DT> v,
                ffi::Buffer<ffi::S32> bt, ffi::Buffer<ffi::S32> lens, float scale, ffi::ResultBuffer<DT> out) {
  return Run(pool, q.typed_data(), q.dimensions(), k.typed_data(), v.typed_data(), k.dimensions(), v.dimensions(),
             bt, lens, scale, out->typed_data(), 0);
}

// float32 queries over an int8 cache with a float16 scale per token and head (kv_quant's layout).
ffi::Error ImplQ8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k, ffi::Buffer<ffi::S8> v,
                  ffi::Buffer<ffi::S32> bt, ffi::Buffer<ffi::S32> lens, float scale, ffi::ResultBuffer<ffi::F32> out) {
  return Run(pool, q.typed_data(), q.dimensions(), k.typed_data(), v.typed_data(), k.dimensions(), v.dimensions(),
             bt, lens, scale, out->typed_data(), 2);
}

// The same over an fp8 cache: e4m3 bits in uint8 (as kv_quant stores them), a float16 scale each.
ffi::Error ImplFp8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> k, ffi::Buffer<ffi::U8> v,
                   ffi::Buffer<ffi::S32> bt, ffi::Buffer<ffi::S32> lens, float scale,
                   ffi::ResultBuffer<ffi::F32> out) {
  return Run(pool, q.typed_data(), q.dimensions(), reinterpret_cast<const Fp8E4M3*>(k.typed_data()),
             reinterpret_cast<const Fp8E4M3*>(v.typed_data()), k.dimensions(), v.dimensions(), bt, lens, scale,
             out->typed_data(), 2);
}

}  // namespace

#define PAGED_DECODE_BINDING(DT)             \
  ffi::Ffi::Bind()                           \
      .Ctx<ffi::ThreadPool>()                \
      .Arg<ffi::Buffer<DT>>()                \
      .Arg<ffi::Buffer<DT>>()                \
      .Arg<ffi::Buffer<DT>>()                \
      .Arg<ffi::Buffer<ffi::S32>>()          \
      .Arg<ffi::Buffer<ffi::S32>>()          \
      .Attr<float>("scale")                  \
      .Ret<ffi::Buffer<DT>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedDecodeF32, Impl<ffi::F32>, PAGED_DECODE_BINDING(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedDecodeBF16, Impl<ffi::BF16>, PAGED_DECODE_BINDING(ffi::BF16));

// float32 queries and output over an 8-bit cache of element type CT.
#define PAGED_DECODE_8BIT_BINDING(CT)        \
  ffi::Ffi::Bind()                           \
      .Ctx<ffi::ThreadPool>()                \
      .Arg<ffi::Buffer<ffi::F32>>()          \
      .Arg<ffi::Buffer<CT>>()                \
      .Arg<ffi::Buffer<CT>>()                \
      .Arg<ffi::Buffer<ffi::S32>>()          \
      .Arg<ffi::Buffer<ffi::S32>>()          \
      .Attr<float>("scale")                  \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedDecodeQ8, ImplQ8, PAGED_DECODE_8BIT_BINDING(ffi::S8));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedDecodeFp8, ImplFp8, PAGED_DECODE_8BIT_BINDING(ffi::U8));

// Paged decode attention for the CPU, called from JAX through the XLA FFI.
//
// The same function as paged_jax.attention.reference.paged_attention_reference with one
// query per sequence: for each sequence s and KV head h, the G = H / KVH query heads that
// share h attend over the first context_lens[s] tokens, read through block_tables[s]
// straight from the paged cache (nothing is gathered into a temporary), softmax in
// float32. Slots past a sequence's context are never read. Work is split over
// sequences and shared with XLA's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const float* q;       // [S, H, D]
  const float* k;       // [NB, BS, KVH, D]
  const float* v;       // [NB, BS, KVH, D]
  const int32_t* bt;    // [S, MB]
  const int32_t* lens;  // [S]
  float* out;           // [S, H, D]
  int64_t S, H, D, NB, BS, KVH, MB;
  float scale;
};

inline float Dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void Prefetch(const char* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// One sequence: all its query heads over its context, block by block with an online
// softmax. A token's K (and V) row holds every KV head ([KVH, D], contiguous), so each
// block is read in order, once, K and V together.
void AttendOne(const Problem& p, int64_t s, std::vector<float>& scratch) {
  const int64_t H = p.H, KVH = p.KVH, G = H / KVH, D = p.D, BS = p.BS, row = KVH * D;
  float* out = p.out + s * H * D;
  std::fill(out, out + H * D, 0.f);
  const int64_t L = std::min<int64_t>(p.lens[s], p.MB * BS);
  if (L <= 0) return;  // padding row
  scratch.resize(H * BS + 2 * H);
  float* sc = scratch.data();        // [H, BS] this block's scores, then weights
  float* m = sc + H * BS;            // [H] running max
  float* den = m + H;                // [H] running sum of exp
  std::fill(m, m + H, -INFINITY);
  std::fill(den, den + H, 0.f);
  const float* q = p.q + s * H * D;
  const int32_t* table = p.bt + s * p.MB;
  auto block_at = [&](int64_t j) {  // as jnp's gather: a negative entry counts from the end, then clamped
    int64_t b = table[j];
    return std::clamp<int64_t>(b < 0 ? b + p.NB : b, 0, p.NB - 1);
  };
  const int64_t nblocks = (L + BS - 1) / BS;
  for (int64_t j = 0; j < nblocks; ++j) {
    const int64_t b = block_at(j), n = std::min(BS, L - j * BS);
    const float* kb = p.k + b * BS * row;
    const float* vb = p.v + b * BS * row;
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
      const float* key = kb + t * row;
      if (k_next) Prefetch(k_next + t * row * 4, row * 4);
      for (int64_t h = 0; h < H; ++h) sc[h * BS + t] = Dot(q + h * D, key + (h / G) * D, D) * p.scale;
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
      const float* val = vb + t * row;
      if (v_next) Prefetch(v_next + t * row * 4, row * 4);
      for (int64_t h = 0; h < H; ++h) {
        const float w = sc[h * BS + t];
        const float* vh = val + (h / G) * D;
        float* o = out + h * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += w * vh[d];
      }
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    const float inv = 1.f / den[h];
    float* o = out + h * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

struct Shared {
  Problem p;
  int64_t num_chunks, per_chunk;
  std::atomic<int64_t> next{0}, done{0};
};

void Work(Shared& sh) {
  thread_local std::vector<float> scratch;
  const int64_t pairs = sh.p.S;
  for (int64_t c; (c = sh.next.fetch_add(1)) < sh.num_chunks;) {
    for (int64_t i = c * sh.per_chunk, e = std::min(pairs, i + sh.per_chunk); i < e; ++i)
      AttendOne(sh.p, i, scratch);
    sh.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> bt, ffi::Buffer<ffi::S32> lens,
                float scale, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), bd = bt.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || bd.size() != 2 || v.dimensions().size() != 4 ||
      !std::equal(kd.begin(), kd.end(), v.dimensions().begin()))
    return ffi::Error::InvalidArgument("paged_decode: expected q [S,H,D], caches [NB,BS,KVH,D], tables [S,MB]");
  Problem p{q.typed_data(), k.typed_data(), v.typed_data(), bt.typed_data(), lens.typed_data(),
            out->typed_data(), qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], bd[1], scale};
  if (kd[3] != p.D || p.KVH <= 0 || p.NB <= 0 || p.BS <= 0 || p.H % p.KVH != 0 || bd[0] != p.S || lens.dimensions().size() != 1 ||
      lens.dimensions()[0] != p.S)
    return ffi::Error::InvalidArgument("paged_decode: head counts or sizes do not match");
  const int64_t pairs = p.S;
  if (pairs == 0) return ffi::Error::Success();
  int64_t workers = std::max<int64_t>(1, pool.num_threads());
  auto sh = std::make_shared<Shared>();
  sh->p = p;
  sh->num_chunks = std::min<int64_t>(pairs, 4 * (workers + 1));
  sh->per_chunk = (pairs + sh->num_chunks - 1) / sh->num_chunks;
  sh->num_chunks = (pairs + sh->per_chunk - 1) / sh->per_chunk;
  for (int64_t w = 0; w < std::min(workers, sh->num_chunks - 1); ++w) pool.Schedule([sh] { Work(*sh); });
  Work(*sh);  // the calling thread takes chunks too, so nothing waits on a task that never started
  while (sh->done.load(std::memory_order_acquire) < sh->num_chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedDecodeF32, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());

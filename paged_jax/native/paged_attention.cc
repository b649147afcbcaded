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
// into (row, block of queries, part of the keys, KV heads) items, shared with XLA's intra-op thread
// pool (a row of more than kPartKeys keys is read in parts, merged at the end; an item covers every
// head unless it costs more than a thread's share of the step); the queries of one
// item share each K/V block they read, so a long chunk reads its context once per block of
// queries, not once per query. Caches and queries are float32 or bfloat16 (read as float32; the
// output rounded to bfloat16 to nearest even, as astype), or float32 queries over an 8-bit cache
// (paged_jax.attention.kv_quant: each head's entry is D int8 or fp8 e4m3 values and a float16
// scale, D + 2 bytes; the scales multiply the dot products and the weights).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_item.h"
#include "attention_loops.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The output of a long row's queries i0 .. i0 + n - 1 from its parts' records ([parts, n, H, D + 2]:
// unnormalized output, running max, running sum): each part's sums rescaled to the largest max, as
// the online softmax rescales a chunk's.
template <typename T, typename C>
void MergeParts(const Problem<T, C>& p, int64_t s, int64_t i0, int64_t n, int64_t parts, const float* rec) {
  const int64_t D = p.D, size = n * p.H * (D + 2);
  std::vector<float> acc(D);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < p.H; ++h) {
      const int64_t at = (i * p.H + h) * (D + 2);
      float mx = -INFINITY;
      for (int64_t j = 0; j < parts; ++j) mx = std::max(mx, rec[j * size + at + D]);
      float den = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < parts; ++j) {
        const float* r = rec + j * size + at;
        if (r[D] == -INFINITY) continue;  // a part with no key this query sees
        const float w = std::exp(r[D] - mx);
        den += r[D + 1] * w;
        for (int64_t d = 0; d < D; ++d) acc[d] += r[d] * w;
      }
      const float inv = den > 0.f ? 1.f / den : 0.f;  // a query that saw no key: zeros
      T* result = p.out + ((p.starts[s] + i0 + i) * p.H + h) * D;
      for (int64_t d = 0; d < D; ++d) FromFloat(acc[d] * inv, result + d);
    }
}

// Keys from which a row is read in parts (whole chunks of the online softmax), over the threads
// with every KV head in each: a thread reading whole key rows (all heads, 2 KB on 8 heads of 64) of
// its blocks streams its memory faster than one reading every block's rows in halves (split by heads).
#ifndef PAGED_JAX_PART_KEYS
#define PAGED_JAX_PART_KEYS 2048
#endif
constexpr int64_t kPartKeys = PAGED_JAX_PART_KEYS;

#ifndef PAGED_JAX_ITEM_FLOATS
#define PAGED_JAX_ITEM_FLOATS 8192
#endif
constexpr int64_t kItemFloats = PAGED_JAX_ITEM_FLOATS;
// Query-key pairs below which an item is not split by heads (see Run).
constexpr int64_t kMinSplitCost = 4096;
// The same for a decode of a few rows, whose helper spins (parallel.h) and joins within a microsecond:
// one row of 8 heads over 96 / 300 / 1,000 keys ran in 8.2 / 18 / 49 instead of 11 / 30 / 83 us
// split in two.
constexpr int64_t kMinSplitCostSmall = 64;

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
    KeyPart part;
    int64_t partial_at;  // a part of a long row: where its records start in `partials` (-1: a whole row)
  };
  struct LongRow {  // a row's queries i0 .. i0 + n - 1 read in `parts` parts, at `offset` in `partials`
    int64_t s, i0, n, parts, offset;
  };
  std::vector<Item> items;
  std::vector<LongRow> long_rows;
  int64_t partial_floats = 0;
  // Keys per part of a long row: whole chunks of the online softmax, boundaries at fixed positions
  // (a row's numbers depend on its own keys alone, not on the step around it).
  const int64_t CK = KeysPerChunk(p.BS), part_keys = (kPartKeys + CK - 1) / CK * CK;
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
      const int64_t len = std::min(per_item, n - i0), first = int64_t{p.lens[s]} - n + i0;
      const int64_t keys = std::min<int64_t>(first + len, p.MB * p.BS);  // keys the item's last query sees
      const int64_t seen = WindowStart(p, first);  // its first query's first key
      const int64_t part0 = seen / part_keys, parts = std::max<int64_t>(1, (keys + part_keys - 1) / part_keys - part0);
      if (parts == 1) {
        items.push_back({s, i0, len, len * std::max<int64_t>(1, keys), 0, p.KVH, KeyPart{}, -1});
        continue;
      }
      const int64_t size = len * p.H * (p.D + 2);
      long_rows.push_back({s, i0, len, parts, partial_floats});
      for (int64_t j = 0; j < parts; ++j) {
        const int64_t k0 = (part0 + j) * part_keys, k1 = k0 + part_keys;
        const int64_t cost = len * std::max<int64_t>(1, std::min(k1, keys) - std::max(k0, seen));
        items.push_back({s, i0, len, cost, 0, p.KVH, KeyPart{k0, k1, j == 0, nullptr}, partial_floats + j * size});
      }
      partial_floats += parts * size;
    }
  }
  std::vector<float> partials(partial_floats);
  for (Item& it : items)
    if (it.partial_at >= 0) it.part.partial = partials.data() + it.partial_at;
  // An item still costing more than a thread's share of the step (a chunk of a row under kPartKeys
  // keys beside short decodes) is split by KV heads, which attend independently, so that every thread
  // has work: on 8 heads of 64 and 2 cores, a 16-token chunk beside 16 decodes ran in 5.8 instead of
  // 9.0 ms at a 16k context, 1.4 instead of 2.1 at 4k (experiments/bench_attention_step.py, before
  // long rows were read in parts). Small items stay whole (a task costs more than it saves).
  const bool small = decode && p.NT <= 8;  // a decode of a few rows: the spinning helpers (parallel.h)
  bool uneven = false;  // a row was cut into several items: they must not share a range (see below)
  {
    const int64_t threads = std::max<int64_t>(1, pool.num_threads());
    const int64_t min_split = small ? kMinSplitCostSmall : kMinSplitCost;
    int64_t total = 0;
    for (const Item& it : items) total += it.cost;
    std::vector<Item> split;
    for (const Item& it : items) {
      const int64_t parts = it.cost < min_split ? 1 : std::min<int64_t>(p.KVH, (it.cost * threads + total - 1) / total);
      for (int64_t j = 0; j < parts; ++j) {
        const int64_t k0 = p.KVH * j / parts, k1 = p.KVH * (j + 1) / parts;
        split.push_back({it.s, it.i0, it.n, it.cost * (k1 - k0) / p.KVH, k0, k1 - k0, it.part, it.partial_at});
      }
    }
    uneven = !long_rows.empty() || split.size() > items.size();
    items.swap(split);
  }
  for (int64_t t = 0; t < p.NT; ++t)
    if (!covered[t]) std::fill(p.out + t * p.H * p.D, p.out + (t + 1) * p.H * p.D, T{});
  // The costliest items first (late queries of a long context), one item a range, so that the
  // threads finish together; a decode step's rows cost alike and go a few to a range, unless one
  // of them was split (a long context among short ones: a range holding both of its parts ran them
  // on one thread: one row at 16k beside 16 short ones took 4.4-4.5 instead of 2.2-2.7 ms a layer).
  const bool alike = decode && !uneven;
  if (!alike) std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t n_items = static_cast<int64_t>(items.size());
  paged_jax_native::ParallelRanges(pool, n_items, alike ? 4 : n_items, [&p, &items](int64_t u0, int64_t u1) {
    thread_local std::vector<float> scratch;
    for (int64_t u = u0; u < u1; ++u) {
      const Item& it = items[u];
      switch (p.D) {  // the common head sizes get unrolled loops
        case 64: AttendRows<64>(p, it.s, it.i0, it.n, it.kh0, it.nkh, it.part, scratch); break;
        case 128: AttendRows<128>(p, it.s, it.i0, it.n, it.kh0, it.nkh, it.part, scratch); break;
        default: AttendRows<0>(p, it.s, it.i0, it.n, it.kh0, it.nkh, it.part, scratch);
      }
    }
  }, small);
  for (const LongRow& r : long_rows) MergeParts(p, r.s, r.i0, r.n, r.parts, partials.data() + r.offset);
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

// float32 queries and output over a bfloat16 cache held as its bits in uint16 (kv_cache_dtype="bfloat16"
// beside float32 weights, paged_jax.attention.kv_quant: half the bytes a step reads from the cache, each
// entry widened to float32 as it is read).
ffi::Error ImplF32Bf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U16> k,
                       ffi::Buffer<ffi::U16> v, ffi::Buffer<ffi::S32> bt, ffi::Buffer<ffi::S32> lens,
                       ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::S32> qlens, ffi::Buffer<ffi::F32> sinks,
                       float scale, int64_t window, float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  return Run(pool, q.typed_data(), q.dimensions(), reinterpret_cast<const uint16_t*>(k.typed_data()),
             reinterpret_cast<const uint16_t*>(v.typed_data()), k.dimensions(), v.dimensions(),
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
// float32 queries and output over a bfloat16 cache, or an 8-bit one
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionF32BF16, ImplF32Bf16, PAGED_ATTENTION_BINDING(ffi::F32, ffi::U16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionQ8, ImplQ8, PAGED_ATTENTION_BINDING(ffi::F32, ffi::S8));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionFp8, ImplFp8, PAGED_ATTENTION_BINDING(ffi::F32, ffi::U8));

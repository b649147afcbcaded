// The float32 panel matmul's register tiles (y = x @ panel, R rows x W columns at a time), shared by
// the float32 matmul (linear.cc) and the grouped matmul of a mixture's experts (grouped_linear.cc).
// Each including file gets its own copy (an anonymous namespace): they are inlined templates.
#pragma once

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define PAGED_JAX_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGED_JAX_AVX2 1
#endif

namespace {

#if defined(PAGED_JAX_AVX2)
constexpr int64_t kRows = 6;  // rows of x per register tile: 6 x 16 columns fill AVX2's 16 registers
#else
constexpr int64_t kRows = 8;  // rows of x per register tile
#endif
constexpr int kStrip = 16;    // AVX2: columns per strip of a multi-row tile
using paged_jax_native::ForEachPanelChunk;
// Tunable when building: PAGED_JAX_NATIVE_FLAGS=-DPAGED_JAX_PREFETCH=... (1536 to 12288 measured alike here).
#ifndef PAGED_JAX_PREFETCH
#define PAGED_JAX_PREFETCH 3072
#endif
constexpr int64_t kPrefetch = PAGED_JAX_PREFETCH;  // floats ahead in the panel stream

inline void PrefetchRow(const float* p, int64_t w) {
  for (int64_t off = 0; off < w; off += 16) __builtin_prefetch(p + off, 0, 3);
}

// y[0:R, 0:W] = x[0:R, 0:K] @ panel[0:K, 0:W] (Add: y += ...); x rows ldx apart, y rows ldy apart.
template <int R, int W, bool Add = false>
inline void Tile(const float* x, int64_t ldx, const float* panel, float* y, int64_t ldy, int64_t K,
                 bool prefetch) {
#if defined(PAGED_JAX_AVX512)
  constexpr int V = W / 16;
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = Add ? _mm512_loadu_ps(y + r * ldy + 16 * v) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* b = panel + k * W;
    if (prefetch) PrefetchRow(b + kPrefetch, W);
    __m512 bv[V];
    for (int v = 0; v < V; ++v) bv[v] = _mm512_loadu_ps(b + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(a, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y + r * ldy + 16 * v, acc[r][v]);
#elif defined(PAGED_JAX_AVX2)
  // one row: the whole panel width at once; more: 16-column strips (R x 2 accumulators)
  constexpr int C = R == 1 ? W : kStrip, V = C / 8;
  for (int c0 = 0; c0 < W; c0 += C) {
    __m256 acc[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = Add ? _mm256_loadu_ps(y + r * ldy + c0 + 8 * v) : _mm256_setzero_ps();
    const bool pf = prefetch && c0 == 0;
    for (int64_t k = 0; k < K; ++k) {
      const float* b = panel + k * W + c0;
      if (pf) PrefetchRow(b + kPrefetch, W);
      __m256 bv[V];
      for (int v = 0; v < V; ++v) bv[v] = _mm256_loadu_ps(b + 8 * v);
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
        for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(a, bv[v], acc[r][v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) _mm256_storeu_ps(y + r * ldy + c0 + 8 * v, acc[r][v]);
  }
#else
  float acc[R][W] = {};
  if (Add)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < W; ++c) acc[r][c] = y[r * ldy + c];
  for (int64_t k = 0; k < K; ++k) {
    const float* b = panel + k * W;
    if (prefetch) PrefetchRow(b + kPrefetch, W);
    for (int r = 0; r < R; ++r) {
      const float a = x[r * ldx + k];
#pragma omp simd
      for (int c = 0; c < W; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) y[r * ldy + c] = acc[r][c];
#endif
}

// Rows m0 .. m1 of y (y += with Add) = x @ panel, 8 rows at a time; x rows ldx apart (a slab of
// weight rows: x offset to its first column), y rows ldy apart. prefetch: the first pass reads the
// panel from memory, and prefetches ahead of itself.
template <int W, bool Add = false>
void Tiles(const float* x, int64_t ldx, int64_t m0, int64_t m1, const float* panel, float* y, int64_t ldy,
           int64_t K, bool prefetch) {
  for (int64_t m = m0; m < m1; m += kRows) {
    const float* xs = x + m * ldx;
    float* ys = y + m * ldy;
    const bool pf = prefetch && m == m0;
    switch (std::min<int64_t>(kRows, m1 - m)) {
      case 8: Tile<8, W, Add>(xs, ldx, panel, ys, ldy, K, pf); break;
      case 7: Tile<7, W, Add>(xs, ldx, panel, ys, ldy, K, pf); break;
      case 6: Tile<6, W, Add>(xs, ldx, panel, ys, ldy, K, pf); break;
      case 5: Tile<5, W, Add>(xs, ldx, panel, ys, ldy, K, pf); break;
      case 4: Tile<4, W, Add>(xs, ldx, panel, ys, ldy, K, pf); break;
      case 3: Tile<3, W, Add>(xs, ldx, panel, ys, ldy, K, pf); break;
      case 2: Tile<2, W, Add>(xs, ldx, panel, ys, ldy, K, pf); break;
      default: Tile<1, W, Add>(xs, ldx, panel, ys, ldy, K, pf); break;
    }
  }
}

}  // namespace

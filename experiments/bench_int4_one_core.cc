// One core's int4 x int8 matmul at one row against a plain read of the same bytes: does the kernel's
// loop stream its weights as fast as the core can read them? Built and run by
// bench_int4_call.py --one-core (KERNEL: the linear_int4.cc to include; thread CPU time, so that
// time the process spends descheduled on a shared machine does not count).
//
//   bench_int4_one_core MB ROUNDS
//
// The LLaMA layer shapes of bench_int4_call.py as distinct random weights (panels and scales, groups
// of 32 rows) until MB megabytes, then per round, the best of ROUNDS kept:
// - streamed: quantizing x and every panel of every weight in order (Panel<W> at one row), one thread;
// - quantize: quantizing x alone, once a weight;
// - read: the same bytes (panels, then scales, of each weight) summed 64 bytes at a time, prefetched
//   as the kernel prefetches: the core's read rate, the kernel's floor;
// - cached: the first four weights over and over (in L2 / L3).
#include KERNEL

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>

namespace {

double CpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

struct Weight {
  int64_t K, N, W;
  std::vector<uint8_t> panels;  // [N / W, K / 8, W * 4]
  std::vector<float> scales;    // [N / W, K / 32, W]
};

float MatmulRow(const Weight& m, const float* x, float* y) {
  std::vector<int8_t> q(m.K);
  std::vector<float> d(m.K / 32);
  std::vector<int32_t> s(m.K / 32);
  QuantizeRows(x, 1, m.K, q.data(), d.data(), s.data());
  const QuantizedRows a{q.data(), d.data(), s.data(), m.K};
  for (int64_t p = 0; p < m.N / m.W; ++p) {
    const uint8_t* panel = m.panels.data() + p * m.K * m.W / 2;
    const float* sc = m.scales.data() + p * (m.K / 32) * m.W;
    if (m.W == 48)
      Panel<48>(a, 0, 1, panel, sc, 32, y + p * m.W, m.N);
    else
      Panel<32>(a, 0, 1, panel, sc, 32, y + p * m.W, m.N);
  }
  return y[0];
}

uint64_t ReadSum(const uint8_t* b, int64_t n) {
  uint64_t acc[8] = {};
  for (int64_t i = 0; i + 64 <= n; i += 64) {
    __builtin_prefetch(b + i + kAhead, 0, 3);
    for (int j = 0; j < 8; ++j) {
      uint64_t v;
      std::memcpy(&v, b + i + 8 * j, 8);
      acc[j] += v;
    }
  }
  uint64_t t = 0;
  for (uint64_t v : acc) t += v;
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  const double mb = argc > 1 ? std::atof(argv[1]) : 64;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 10;
  const int64_t shapes[4][3] = {{512, 1536, 48}, {512, 512, 32}, {512, 2816, 32}, {1408, 512, 32}};
  std::mt19937 rng(0);
  std::vector<Weight> ws;
  double bytes = 0;
  while (bytes < mb * 1e6) {
    for (const auto& sh : shapes) {
      Weight m{sh[0], sh[1], sh[2], std::vector<uint8_t>(sh[0] * sh[1] / 2), std::vector<float>(sh[0] / 32 * sh[1])};
      for (auto& b : m.panels) b = static_cast<uint8_t>(rng());
      for (auto& f : m.scales) f = static_cast<float>(rng() % 2000) * 1e-4f - 0.1f;
      bytes += m.panels.size() + 4.0 * m.scales.size();
      ws.push_back(std::move(m));
    }
  }
  std::vector<float> x(1408), y(2816);
  for (auto& v : x) v = static_cast<float>(rng() % 2000) * 1e-3f - 1;
  std::vector<int8_t> q(1408);
  std::vector<float> d(44);
  std::vector<int32_t> s(44);
  double best[4] = {1e9, 1e9, 1e9, 1e9};  // streamed, quantize, read, cached
  double sink = 0;
  for (int r = 0; r < rounds; ++r) {
    double t[5];
    t[0] = CpuSeconds();
    for (const auto& m : ws) sink += MatmulRow(m, x.data(), y.data());
    t[1] = CpuSeconds();
    for (const auto& m : ws) QuantizeRows(x.data(), 1, m.K, q.data(), d.data(), s.data());
    t[2] = CpuSeconds();
    for (const auto& m : ws)
      sink += ReadSum(m.panels.data(), m.panels.size()) +
              ReadSum(reinterpret_cast<const uint8_t*>(m.scales.data()), 4 * m.scales.size());
    t[3] = CpuSeconds();
    for (size_t i = 0; i < ws.size(); ++i) sink += MatmulRow(ws[i % 4], x.data(), y.data());
    t[4] = CpuSeconds();
    for (int k = 0; k < 4; ++k) best[k] = std::min(best[k], t[k + 1] - t[k]);
  }
  const double n = static_cast<double>(ws.size());
  std::printf("one core, %zu weights, %.0f MB: streamed %.2f us a weight (%.1f GB/s), read alone %.2f us (%.1f GB/s), "
              "quantizing x %.3f us, cached %.2f us (%.1f GB/s) [%g]\n",
              ws.size(), bytes / 1e6, 1e6 * best[0] / n, bytes / best[0] / 1e9, 1e6 * best[2] / n, bytes / best[2] / 1e9,
              1e6 * best[1] / n, 1e6 * best[3] / n, bytes / best[3] / 1e9, sink != 0 ? 0.0 : 1.0);
}

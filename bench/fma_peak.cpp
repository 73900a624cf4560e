// fp32 FMA peak of this CPU: `threads` threads, each running 12 independent FMA chains on
// vector registers (enough to cover FMA latency x ports), for `seconds`. Prints GFLOP/s.
// Prints GFLOP/s of wall time, GFLOP per CPU second (all threads), and a sink value.
// Built by bench/encoder.py with -mavx2 -mfma (WIDTH 8) or -mavx512f (WIDTH 16).
#include <immintrin.h>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#if WIDTH == 16
typedef __m512 vec;
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
static float hsum(vec v) { return _mm512_reduce_add_ps(v); }
#else
typedef __m256 vec;
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
static float hsum(vec v) { float t[8]; _mm256_storeu_ps(t, v); float s = 0; for (float x : t) s += x; return s; }
#endif

static double run(long iters, float seed) {
  vec a = SET1(0.999999f), b = SET1(1e-7f * seed);
  vec c0 = SET1(seed), c1 = SET1(1), c2 = SET1(2), c3 = SET1(3), c4 = SET1(4), c5 = SET1(5);
  vec c6 = SET1(6), c7 = SET1(7), c8 = SET1(8), c9 = SET1(9), c10 = SET1(10), c11 = SET1(11);
  for (long i = 0; i < iters; i++) {
    c0 = FMA(c0, a, b); c1 = FMA(c1, a, b); c2 = FMA(c2, a, b); c3 = FMA(c3, a, b);
    c4 = FMA(c4, a, b); c5 = FMA(c5, a, b); c6 = FMA(c6, a, b); c7 = FMA(c7, a, b);
    c8 = FMA(c8, a, b); c9 = FMA(c9, a, b); c10 = FMA(c10, a, b); c11 = FMA(c11, a, b);
  }
  vec s = ADD(ADD(ADD(c0, c1), ADD(c2, c3)), ADD(ADD(c4, c5), ADD(c6, c7)));
  s = ADD(s, ADD(ADD(c8, c9), ADD(c10, c11)));
  return hsum(s);
}

int main(int argc, char** argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 2;
  double seconds = argc > 2 ? atof(argv[2]) : 0.5;
  long iters = 1 << 20;
  volatile double keep = run(iters, 1);  // warm up, and find the iterations for `seconds`
  auto t0 = std::chrono::steady_clock::now();
  keep = keep + run(iters, 2);
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  iters = (long)(iters * seconds / dt) + 1;
  std::vector<std::thread> pool;
  std::vector<double> sink(threads);
  t0 = std::chrono::steady_clock::now();
  std::clock_t c0 = std::clock();
  for (int t = 0; t < threads; t++) pool.emplace_back([&, t] { sink[t] = run(iters, t + 1.0f); });
  for (auto& th : pool) th.join();
  dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double cpu = double(std::clock() - c0) / CLOCKS_PER_SEC;  // CPU seconds of all threads
  double flops = 2.0 * WIDTH * 12 * iters * threads;
  printf("%.2f %.2f %g\n", flops / dt / 1e9, flops / cpu / 1e9, sink[0] + keep);
  return 0;
}

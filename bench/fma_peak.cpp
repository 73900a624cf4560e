// fp32 FMA peak of this CPU: `threads` threads, each running 12 independent FMA chains on
// vector registers (enough to cover FMA latency x ports), for `seconds`. Prints GFLOP/s.
// Prints GFLOP/s of wall time, GFLOP per CPU second (all threads), and a sink value.
// Built by bench/encoder.py with -mavx2 -mfma (WIDTH 8) or -mavx512f (WIDTH 16).
// With a third argument `madd16`: the same for the 16-bit integer multiply-adds of the target's
// screened head (csrc/decode_ops.cpp: vpmaddwd then vpaddd; with AVX512-VNNI, built with
// -mavx512vnni, vpdpwssd), counting a multiply-add as 2 operations as for the FMAs.
#include <immintrin.h>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <string>
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

static double run_fma(long iters, float seed) {
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

#if WIDTH == 16
typedef __m512i ivec;
#define ISET1 _mm512_set1_epi16
#define IADD _mm512_add_epi32
#define TMP "%%zmm"
static double ihsum(ivec v) { return _mm512_reduce_add_epi32(v); }
#else
typedef __m256i ivec;
#define ISET1 _mm256_set1_epi16
#define IADD _mm256_add_epi32
#define TMP "%%ymm"
static double ihsum(ivec v) { int t[8]; _mm256_storeu_si256((__m256i*)t, v); double s = 0; for (int x : t) s += x; return s; }
#endif
// one 16-bit multiply-add into 32-bit sums, as the screen makes it: vpdpwssd (AVX512-VNNI), else
// vpmaddwd into a scratch register (t: 14 or 15), then vpaddd
#ifdef __AVX512VNNI__
#define MADD(c, a, b, t) "vpdpwssd %[" b "], %[" a "], %[" c "]\n\t"
#else
#define MADD(c, a, b, t) "vpmaddwd %[" b "], %[" a "], " TMP t "\n\tvpaddd " TMP t ", %[" c "], %[" c "]\n\t"
#endif

// Chains of 16-bit multiply-adds into 32-bit sums, each over its own pair of operands: 6 (3 x 2
// registers) with AVX2's 16 registers, 12 (3 x 4) with AVX-512's 32, enough for vpdpwssd's latency
// of about 5 cycles on two ports. Written as asm: with intrinsics the compiler shared or hoisted the
// loop-invariant products, or, kept from that, spilled and moved registers every iteration (rates
// of 70-136 G operations a second from one loop, run to run)
constexpr int kMaddChains = WIDTH == 16 ? 12 : 6;

// One step of six chains: c0..c2 += a0..a2 * b0, c3..c5 += a0..a2 * b1
__attribute__((always_inline)) static inline void madd6(ivec& c0, ivec& c1, ivec& c2, ivec& c3, ivec& c4, ivec& c5,
                                                       ivec a0, ivec a1, ivec a2, ivec b0, ivec b1) {
  __asm__ volatile(MADD("c0", "a0", "b0", "14") MADD("c1", "a1", "b0", "15") MADD("c2", "a2", "b0", "14")
                   MADD("c3", "a0", "b1", "15") MADD("c4", "a1", "b1", "14") MADD("c5", "a2", "b1", "15")
                   : [c0] "+v"(c0), [c1] "+v"(c1), [c2] "+v"(c2), [c3] "+v"(c3), [c4] "+v"(c4), [c5] "+v"(c5)
                   : [a0] "v"(a0), [a1] "v"(a1), [a2] "v"(a2), [b0] "v"(b0), [b1] "v"(b1)
                   : "xmm14", "xmm15");
}

static double run_madd(long iters, float seed) {
  ivec a0 = ISET1(3), a1 = ISET1(5), a2 = ISET1(7), b0 = ISET1((short)seed), b1 = ISET1(2);
  ivec c0 = ISET1(0), c1 = ISET1(1), c2 = ISET1(2), c3 = ISET1(3), c4 = ISET1(4), c5 = ISET1(5);
#if WIDTH == 16
  ivec b2 = ISET1(4), b3 = ISET1(6);
  ivec c6 = ISET1(6), c7 = ISET1(7), c8 = ISET1(8), c9 = ISET1(9), c10 = ISET1(10), c11 = ISET1(11);
  for (long i = 0; i < iters; i++) {
    madd6(c0, c1, c2, c3, c4, c5, a0, a1, a2, b0, b1);
    madd6(c6, c7, c8, c9, c10, c11, a0, a1, a2, b2, b3);
  }
  c0 = IADD(c0, IADD(IADD(c6, c7), IADD(c8, c9)));
  c1 = IADD(c1, IADD(c10, c11));
#else
  for (long i = 0; i < iters; i++) madd6(c0, c1, c2, c3, c4, c5, a0, a1, a2, b0, b1);
#endif
  return ihsum(IADD(IADD(IADD(c0, c1), IADD(c2, c3)), IADD(c4, c5)));
}

int main(int argc, char** argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 2;
  double seconds = argc > 2 ? atof(argv[2]) : 0.5;
  const std::string kind = argc > 3 ? argv[3] : "fma";
  if (kind != "fma" && kind != "madd16") {
    fprintf(stderr, "fma_peak: kind must be fma or madd16, got %s\n", kind.c_str());
    return 2;
  }
  const bool madd = kind == "madd16";
  double (*run)(long, float) = madd ? run_madd : run_fma;
  const double per_iter = madd ? 2.0 * 2 * WIDTH * kMaddChains : 2.0 * WIDTH * 12;  // operations an iteration a thread
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
  double flops = per_iter * iters * threads;
  printf("%.2f %.2f %g\n", flops / dt / 1e9, flops / cpu / 1e9, sink[0] + keep);
  return 0;
}

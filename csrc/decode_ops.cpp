// Decoder-step ops for the CPU: small-row linear layers, decode attention, cache writes.
//
// Reference and spec: specwhisper/backends/cpu_ops.py (`linear_reference`, `attention_reference`,
// `kv_write_reference`). A decode step multiplies a handful of rows (1..k+1 per batch row) by
// every weight matrix; what matters is reading each weight byte once, at memory bandwidth.
// torch's CPU GEMM runs 2-3 rows as repeated GEMVs and a 1-row GEMV at about half the bandwidth
// here, so these ops stream each weight block once for all rows.
//
// Determinism contract (what exact speculative decoding rests on): every output element is
// computed by the same sequence of floating-point operations whatever the number of rows, the
// batch composition, the tiling or the thread count: an 8-lane FMA accumulation over K in
// order, a fixed horizontal sum, a scalar FMA tail, then the bias. A row's result therefore
// never depends on the other rows. Arithmetic is float32 (bfloat16 and float16 weights are widened
// exactly; bfloat16 outputs are rounded to nearest even once, at the end).
//
// Vector code needs AVX2 + FMA + F16C (checked at run time; a scalar path with the same operation order
// serves other CPUs, so results are identical either way). The int8 screen of the output head
// multiplies in exact integers (the same products at every vector level), and its exact recheck
// keeps linear_rows' order, so the argmax is the same.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cpuid.h>
#include <immintrin.h>

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <cstring>
#include <type_traits>
#include <vector>

namespace specwhisper_decode {
namespace {

using bf16 = c10::BFloat16;
using f16 = c10::Half;

// ------------------------------------------------------------------ thread pool
// Sections started from any thread but the main one run on the ops' own persistent workers, not on
// OpenMP's. libgomp keeps one pool per thread that starts parallel regions; once two threads
// have one (the main thread, which loaded the models, and an engine's loop thread), it manages
// more threads than the CPU has and its idle workers stop spinning, so each of a decode step's
// ~50 short sections waited ~100 us for a sleeping worker: a step ran at one thread's speed
// (base, 2 threads: 3.4 ms in the main thread, 7.2 ms in any other; `Engine.submit` and servers
// decode in a loop thread). These workers serve whichever thread calls, spin ~200 us after a
// section (a step's sections follow each other closely), then sleep. The main thread keeps
// OpenMP's pool, whose workers spin after its sections: two spinning pools there (torch's own ops
// start OpenMP sections in every step) took turns on the cores, 16 ms a step. One caller at a
// time: a second caller meanwhile (or a call from inside a section) runs its sections itself.
// Work is split as at::parallel_for splits it, contiguous chunks of the range, one per thread,
// and each output is computed the same way wherever it is computed.
class SpinPool {
 public:
  static SpinPool& get() {
    static std::mutex creating;
    static const bool registered = [] {
      pthread_atfork(nullptr, nullptr, [] { instance() = nullptr; });  // a fork child has no workers
      return true;
    }();
    (void)registered;
    std::lock_guard<std::mutex> lock(creating);
    SpinPool*& pool = instance();
    if (pool == nullptr) pool = new SpinPool();  // never freed: detached workers use it until exit
    return *pool;
  }

  // f(t) for t in [0, n): t = 0 on the calling thread, the rest on workers.
  void run(int n, const std::function<void(int)>& f) {
    std::unique_lock<std::mutex> caller(busy_, std::try_to_lock);
    if (n <= 1 || in_section() || !caller.owns_lock()) {
      for (int t = 0; t < n; ++t) f(t);
      return;
    }
    while (started_ < n - 1) start_worker();
    job_ = &f;
    participants_ = n;
    error_ = nullptr;
    // every worker checks in, a task or not: the next section's job is set only after all have
    // read this one's
    remaining_.store(started_, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    in_section() = true;
    std::exception_ptr mine;
    try {
      f(0);
    } catch (...) {
      mine = std::current_exception();
    }
    in_section() = false;
    while (remaining_.load(std::memory_order_acquire) > 0) _mm_pause();
    if (mine) std::rethrow_exception(mine);
    if (error_) std::rethrow_exception(error_);
  }

  static int& task_id() {
    static thread_local int id = 0;
    return id;
  }

 private:
  static SpinPool*& instance() {
    static SpinPool* p = nullptr;
    return p;
  }
  static bool& in_section() {
    static thread_local bool inside = false;
    return inside;
  }

  void start_worker() {  // called by the caller holding busy_, between sections
    const int id = ++started_;
    std::thread([this, id, g = generation_.load()] { work(id, g); }).detach();
  }

  void work(int id, uint64_t seen) {
    task_id() = id;
    in_section() = true;  // sections started by a task run on its thread
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 0; generation_.load(std::memory_order_acquire) == seen; ++spins) {
        _mm_pause();
        if ((spins & 63) == 63 && std::chrono::steady_clock::now() - start > std::chrono::microseconds(200)) {
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          sleepers_.fetch_add(1, std::memory_order_acq_rel);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        }
      }
      ++seen;  // one section at a time: the caller waits for every worker before the next
      if (id < participants_) {
        try {
          (*job_)(id);
        } catch (...) {
          std::lock_guard<std::mutex> lock(sleep_mutex_);
          if (!error_) error_ = std::current_exception();
        }
      }
      remaining_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::mutex busy_;  // held by the one caller whose sections run on the workers
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
  std::atomic<int> sleepers_{0};
  int started_ = 0;  // workers (changed only by the caller holding busy_)
  const std::function<void(int)>* job_ = nullptr;
  int participants_ = 0;
  std::exception_ptr error_;
};

// MXCSR's flush-to-zero and denormals-are-zero for the scope (restored after): subnormal float32
// results and inputs are 0 instead of each costing a microcode assist (encoder_ops.h says where).
struct FlushDenormals {
  const unsigned int saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040u); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushDenormals() { _mm_setcsr(saved); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

// at::parallel_for's contract on SpinPool: f(b, e) over contiguous chunks of [begin, end), at
// most at::get_num_threads() of them and none smaller than `grain` (except the last).
inline bool main_thread() {
  static thread_local const bool main = static_cast<pid_t>(syscall(SYS_gettid)) == getpid();
  return main;
}

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t range = end - begin;
  if (range <= 0) return;
  if (main_thread()) {  // OpenMP's pool of the main thread spins between sections: the fastest there
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunks = std::min(threads, (range + std::max<int64_t>(1, grain) - 1) / std::max<int64_t>(1, grain));
  if (chunks <= 1) {
    f(begin, end);
    return;
  }
  const int64_t size = (range + chunks - 1) / chunks;
  SpinPool::get().run(static_cast<int>(chunks), [&](int t) {
    const int64_t b = begin + t * size, e = std::min(end, b + size);
    if (b < e) f(b, e);
  });
}

constexpr int64_t kNR = 4;  // weight rows per tile (independent FMA chains)
constexpr int64_t kMR = 3;  // input rows per tile (accumulators: kNR * kMR <= 12 ymm registers)

// Vector level: 0 scalar, 1 AVX2 + FMA + F16C, 2 AVX-512 (F, DQ, BW). The detected
// level can be lowered (`set_vector_level`) so tests compare every path on one machine.
int detected_level() {
  static const int level = !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                             __builtin_cpu_supports("f16c")) ? 0
                           : (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                              __builtin_cpu_supports("avx512bw")) ? 2 : 1;
  return level;
}
int g_level_limit = 2;
int vector_level() { return std::min(detected_level(), g_level_limit); }
bool has_avx2() { return vector_level() >= 1; }

// n floats from a 64-byte boundary in a caller's (thread_local) buffer, grown as needed: a 512-bit
// load or store across two cache lines costs two.
inline float* aligned_floats(std::vector<float>& buffer, int64_t n) {
  buffer.resize(std::max(buffer.size(), static_cast<size_t>(n + 16)));
  return buffer.data() + (16 - reinterpret_cast<uintptr_t>(buffer.data()) / sizeof(float) % 16) % 16;
}

// ------------------------------------------------------------------ scalar twins
// The scalar path reproduces the vector path's operation order exactly: 8 lane accumulators,
// the same pairwise horizontal sum, then the tail.
inline float widen(float v) { return v; }
inline float widen(bf16 v) { return static_cast<float>(v); }
inline float widen(f16 v) { return static_cast<float>(v); }

// hsum8's additions (below): (l0+l4, l1+l5, l2+l6, l3+l7) -> (a0+a2, a1+a3) -> b0+b1
inline float hsum8_scalar(const float* lane) {
  const float a0 = lane[0] + lane[4], a1 = lane[1] + lane[5], a2 = lane[2] + lane[6], a3 = lane[3] + lane[7];
  return (a0 + a2) + (a1 + a3);
}

template <typename W>
float dot_scalar(const float* x, const W* w, int64_t K) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8)
    for (int l = 0; l < 8; ++l) lane[l] = std::fma(widen(w[k + l]), x[k + l], lane[l]);
  float s = hsum8_scalar(lane);
  for (; k < K; ++k) s = std::fma(widen(w[k]), x[k], s);
  return s;
}

// ------------------------------------------------------------------ AVX2 path
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const bf16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const f16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

__attribute__((target("avx2,fma,f16c"))) inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 a = _mm_add_ps(lo, hi);                  // (l0+l4, l1+l5, l2+l6, l3+l7)
  __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));  // (a0+a2, a1+a3, ...)
  __m128 c = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));  // b0+b1
  return _mm_cvtss_f32(c);
}

// hsum8 of 8 (or 4) registers at once, the same additions in the same pairs (so the same bits):
// halves added (l_j + l_{j+4}), then (a0 + a2, a1 + a3), then b0 + b1, across registers by
// shuffles instead of one register at a time: 21 vector operations for 8 sums (13 for 4) against
// about 7 per sum. A dot product of 64 features (attention's scores) spends 8 fmas per sum, so the
// one-at-a-time sums were nearly as much work as the products. -> [hsum8(a[0]), ..., hsum8(a[N-1])].
template <int N>
__attribute__((target("avx2,fma,f16c"))) inline void hsum8_many(const __m256* a, float* out) {
  static_assert(N == 4 || N == 8, "hsum8_many: 4 or 8 registers");
  __m256 s[4];
  for (int p = 0; p < N / 2; ++p)  // [a0..a3 of a[2p] | a0..a3 of a[2p+1]]
    s[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31));
  // [b0 b1 of a[0], b0 b1 of a[2] | the same of a[1], a[3]] (t1: a[4..7])
  const __m256 t0 = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], 0x44), _mm256_shuffle_ps(s[0], s[1], 0xEE));
  const __m256 t1 = N == 8 ? _mm256_add_ps(_mm256_shuffle_ps(s[2], s[3], 0x44), _mm256_shuffle_ps(s[2], s[3], 0xEE))
                           : t0;
  // [r0 r2 r4 r6 | r1 r3 r5 r7] (N = 4: [r0 r2 r0 r2 | r1 r3 r1 r3]), then in order
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(t0, t1, 0x88), _mm256_shuffle_ps(t0, t1, 0xDD));
  const __m256 ordered = _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (N == 8) _mm256_storeu_ps(out, ordered);
  else _mm_storeu_ps(out, _mm256_castps256_ps128(ordered));
}

template <typename W>
__attribute__((target("avx2,fma,f16c"))) float dot_avx2(const float* x, const W* w, int64_t K) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) acc = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(x + k), acc);
  float s = hsum8(acc);
  for (; k < K; ++k) s = std::fma(widen(w[k]), x[k], s);
  return s;
}

// Software prefetches of the weight streams while several rows compute (a verify pass) go to L2,
// not L1: prefetcht0 of the next tile held the next tile's misses in L1's few miss buffers, so the
// memory stream stalled behind the arithmetic instead of running under it. Base's 36 decoder
// linears, cold, 2 threads of a Zen 4 EPYC, the hints alternated 30 times in one process (medians):
// 5 rows 3.58 -> 2.95 ms (1 row: 2.81), 9 rows 4.32 -> 3.60; held to AVX2 4.06 -> 3.48 and
// 5.01 -> 4.30. Prefetching 1-4 KB ahead in each stream instead of the next tile measured the same.
// The AVX2 screen of the output head too (held to AVX2, 5 / 9 rows: 1.58 -> 1.48, 2.92 -> 2.59 ms);
// its AVX-512 form kept prefetcht0 (T1 there: 1 row 0.86 -> 0.92 ms).
//
// Non-temporal (prefetchnta) on AMD, as the target's value rows and the AVX-512 screen: a step reads
// each of the target's ≈ 110 MB once (float16 weights, float32 cross K/V, the head's int8 copy),
// and with T0/T1 fills it pushed everything else out of L2 and L3: the draft's ≈ 17 MB read again
// at every draft step, and the engine's own Python objects between the C++ calls. A draft's
// bfloat16 streams (its cross keys) keep T1. Base drafted by base-2l, 3 bench windows, 2 threads of
// a Zen 4 EPYC, the hints alternated in one process (6 rounds, twice): decode (call − encoder −
// admissions) paired 1.033× / 1.033× at k = 3 (an iteration's draft 1.96 -> 1.87 ms and 1.98 -> 1.92,
// its verify 4.58 -> 4.52 and 4.56 -> 4.43, the rest 0.83 -> 0.76 and 0.80 -> 0.70), target-only
// 1.006× / 1.034× (a step 3.48 -> 3.34 and 2.47 -> 2.40 ms); held to AVX2 1.011× and 1.034× (the
// 4-row verify pass 4.84 / 4.85: no slower). A 96 MB stream read between two reads of a 12 MB
// buffer left it at 28 GB/s (DRAM) with plain loads, 39-43 GB/s with NTA prefetches (68 hot).
// On Intel the same prefetches go to L2 (prefetcht1): there prefetchnta fills L1 alone, and a tile
// ahead of the arithmetic its lines can leave L1 before they are read. Base on 2 threads of a Xeon
// with AVX-512 and AMX, the two alternated in one process (8 rounds): a step at position 64, one row
// 8.68 -> 6.67 ms, 5 rows 11.36 -> 8.03; whole calls over 3 of the demo's 30 s windows paired 1.107×
// faster target-only (0.94-1.21), 1.129× drafted by base-2l (1.07-1.25). `set_stream_l2` sets it.
static bool g_stream_l2 = [] {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  return b == 0x756e6547 && d == 0x49656e69 && c == 0x6c65746e;  // "GenuineIntel"
}();

inline void prefetch_stream(const void* p) {
  if (g_stream_l2) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
  else _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_NTA);
}

// prefetch_stream for a tile of W (a linear's weights, or keys read as one): a draft's bfloat16
// cross keys keep T1 (reread every draft step).
template <typename W>
inline void weight_prefetch(const void* p) {
  if (std::is_same<W, bf16>::value) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
  else prefetch_stream(reinterpret_cast<const char*>(p));
}

// out[i * ldo + j * os] (float) for rows i < MR of x and the tile's weight rows j < NR, which start
// at w + j * ws: one pass over the weight tile per group of input rows. PF: also prefetch the next
// tile (at w + next), one cache line per 16 floats, so memory streams while several rows compute.
// Part: only features k0..k1 (k0 a multiple of 32: the prefetches fall on the same lines as over
// all of K), the accumulators taken from `part` (k0 > 0) and left there (k1 < K), so one tile's
// rows can be run a span of features at a time.
template <typename W, int MR, int NR, bool PF = false, bool Part = false>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const float* x, int64_t ldx, const W* w, int64_t K, int64_t ws,
                                                        int64_t next, float* out, int64_t ldo, int64_t os,
                                                        int64_t k0 = 0, int64_t k1 = 0, __m256* part = nullptr) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = Part && k0 > 0 ? part[i * NR + j] : _mm256_setzero_ps();
  // float16 weights in two-row halves (halves_tile, 4-5 input rows): both weight registers first,
  // then one input row at a time held in a register, where GCC otherwise reloads every row's
  // features once per weight row as an fma's memory operand (12 loads for 10 fmas, 7 this way),
  // and the sums 8 at a time (hsum8_many). The same fmas in the same order, the same sums: the
  // same bits. Base's blocks are float16 (Whisper's checkpoints); 2 threads of a Zen 3 EPYC, its 36
  // linears (real weights, cold), alternated in one process: 4 / 5 / 6 / 9 rows 0.93 / 0.88 / 0.90 /
  // 0.86 of their time (5 rows 3.56 -> 3.21 ms, 1 row 2.23), the whole step at 5 rows 0.96. In a
  // standalone copy of these tiles (64 MB, cold) float32 weights ran 3-6% slower this way, and
  // 2-row and 3-row tiles slower too: they keep the loop below.
  constexpr bool row_outer = NR == 2 && std::is_same<W, f16>::value;
  int64_t k = Part ? k0 : 0;
  const int64_t end = Part && k1 < K ? k1 : K;
  for (; k + 8 <= end; k += 8) {
    if (PF && (k * sizeof(W)) % 64 == 0)
      for (int j = 0; j < NR; ++j) weight_prefetch<W>(w + next + j * ws + k);
    if (row_outer) {
      __m256 wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = load8(w + j * ws + k);
      for (int i = 0; i < MR; ++i) {
        __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
        asm("" : "+x"(xv));  // kept in a register, not folded into each fma as a memory operand
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(wv[j], xv, acc[i][j]);
      }
    } else {
      // the rows' features, then one weight register at a time: 12 accumulators + 3 + 1 = 16
      // registers for 3 rows (4 weight registers made 17 and GCC kept an accumulator on the stack,
      // a store-to-load round trip in its chain every step)
      __m256 xv[MR];
      for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) {
        const __m256 wv = load8(w + j * ws + k);
        for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(wv, xv[i], acc[i][j]);
      }
    }
  }
  if (Part && end < K) {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) part[i * NR + j] = acc[i][j];
    return;
  }
  float sums[MR][NR];
  int i = 0;
  if (row_outer && MR * NR >= 8) {  // the first 8 sums at once (rows 0-3), then row 4's alone
    // from a copy: handing hsum8_many acc's own address made GCC store all 10 accumulators to
    // the stack on every step of the loop above (1.4-1.6x slower)
    __m256 first[8];
    for (int a = 0; a < 8; ++a) first[a] = acc[a / NR][a % NR];
    hsum8_many<8>(first, &sums[0][0]);
    i = 8 / NR;
  }
  if (NR == 4)  // two rows' 8 sums at once, then a lone row's 4
    for (; i < MR; i += 2) {
      if (i + 1 < MR) hsum8_many<8>(&acc[0][0] + i * NR, &sums[0][0] + i * NR);  // rows i, i + 1
      else hsum8_many<4>(&acc[0][0] + i * NR, &sums[0][0] + i * NR);
    }
  for (; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i][j] = hsum8(acc[i][j]);
  for (i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = sums[i][j];
      for (int64_t t = k; t < K; ++t) s = std::fma(widen(w[j * ws + t]), x[i * ldx + t], s);
      out[i * ldo + j * os] = s;
    }
}

// Rows m0..m0+R-1 of x (R = 4 or 5) against a tile of 4 weight rows in two passes over 2 of its
// rows each (R x 2 accumulators + R + 1 registers: 16 for 5 rows): each weight byte is loaded once,
// where groups of 3 + 2 rows against all 4 read the tile twice. PF: prefetch the next tile.
//
// Features of more than kHalvesSpan go a span at a time, both halves per span (their accumulators
// kept in between: the same fmas in the same order, the same bits), so the rows' span stays in L1
// for both: 5 rows of K = 2048 (an MLP's second product) are 40 KB, more than a Zen's 32 KB L1, and
// read whole twice a tile they came from L2 at 32 bytes a cycle beside the weights. K <= kHalvesSpan
// keeps the whole-tile calls: run as one span, the Part form's 4- and 5-row halves were 3-5% slower
// (384 x 512 float16, one thread, weights in L2: 5 rows 76 against 79-81 GFLOP/s, three runs each).
constexpr int64_t kHalvesSpan = 512;
template <typename W, bool PF>
void halves_tile(int64_t R, const float* x, int64_t K, const W* w, int64_t ws, int64_t next, float* out, int64_t ldo,
                 int64_t os) {
  if (K > kHalvesSpan) {
    __m256 part[2][5 * 2];
    for (int64_t k0 = 0; k0 < K; k0 += kHalvesSpan)
      for (int h = 0; h < 2; ++h) {
        const W* wh = w + 2 * h * ws;
        float* oh = out + 2 * h * os;
        const int64_t k1 = std::min(K, k0 + kHalvesSpan);
        if (R == 5) tile_avx2<W, 5, 2, PF, true>(x, K, wh, K, ws, next, oh, ldo, os, k0, k1, part[h]);
        else tile_avx2<W, 4, 2, PF, true>(x, K, wh, K, ws, next, oh, ldo, os, k0, k1, part[h]);
      }
    return;
  }
  for (int h = 0; h < 2; ++h) {
    const W* wh = w + 2 * h * ws;
    float* oh = out + 2 * h * os;
    if (R == 5) tile_avx2<W, 5, 2, PF>(x, K, wh, K, ws, next, oh, ldo, os);
    else tile_avx2<W, 4, 2, PF>(x, K, wh, K, ws, next, oh, ldo, os);
  }
}

// All rows of x against one weight tile (rows at w + j * ws, outputs at out + j * os); the first
// group of rows prefetches the next tile (at w + next; with several rows the arithmetic would
// otherwise stall the memory stream), unless `more` is false. With K >= 128, groups of 4-5 rows
// take halves_tile: base's 36 decoder linears, cold, held to AVX2 on a Zen 4 EPYC, alternated in
// one process: 5 rows 3.79 -> 3.18 ms (1 row 2.86), 4 rows 3.48 -> 3.25. Attention's 64-feature
// keys keep the 4-row tiles (the halves' one-register sums made 5 queries 1.84 -> 2.13 ms there).
// 2-3 rows whose streams are prefetched non-temporally (AMD) take no software prefetch: their
// arithmetic is light, and the hardware prefetchers alone stream faster than beside the next
// tile's prefetchnta. Base's whole pass held to AVX2 on a Zen 4, alternated in one process (four
// runs): 2 rows 3.65 -> 3.49, 3.43 -> 3.34, 4.27 -> 4.06, 3.86 -> 3.66 ms; 3 rows -1.6 / -1.7 / -2.4
// / +3.7%. 4-5 rows keep it (without it 5 rows 5.28 -> 5.58 and 5.70 -> 6.05 ms), as do the
// AVX-512 tiles (2 rows without it 3.95 -> 4.32 ms) and Intel's prefetches to L2 (not measured).
template <typename W, int NR>
void rows_tile(const float* x, int64_t M, int64_t K, const W* w, int64_t ws, int64_t next, float* out, int64_t ldo,
               int64_t os, bool more, bool halves = true) {
  if (M <= 3 && !g_stream_l2) more = false;
  int64_t m = 0;
  if (NR == 4 && K >= 128 && halves)
    for (int64_t R; M - m >= 4; m += R, more = false) {
      R = std::min<int64_t>(5, M - m);
      if (more) halves_tile<W, true>(R, x + m * K, K, w, ws, next, out + m * ldo, ldo, os);
      else halves_tile<W, false>(R, x + m * K, K, w, ws, 0, out + m * ldo, ldo, os);
    }
  if (M - m > 1 && more) {
    if (M - m >= 3) tile_avx2<W, 3, NR, true>(x + m * K, K, w, K, ws, next, out + m * ldo, ldo, os), m += 3;
    else tile_avx2<W, 2, NR, true>(x + m * K, K, w, K, ws, next, out + m * ldo, ldo, os), m += 2;
  }
  for (; m + 3 <= M; m += 3) tile_avx2<W, 3, NR>(x + m * K, K, w, K, ws, 0, out + m * ldo, ldo, os);
  if (M - m == 2) tile_avx2<W, 2, NR>(x + m * K, K, w, K, ws, 0, out + m * ldo, ldo, os);
  if (M - m == 1) tile_avx2<W, 1, NR>(x + m * K, K, w, K, ws, 0, out + m * ldo, ldo, os);
}

// The same tiles with AVX-512: one zmm holds a pair of weight rows (lanes 0-7 row j, 8-15 row
// j+1) against the input's 8 features broadcast to both halves, so every lane runs exactly the
// AVX2 lane's chain of fmas and each half is summed by hsum8: the same bits, half the fma
// instructions (several input rows: a verify pass).
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) inline __m512 pair8(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) inline __m512 pair8(const bf16* a, const bf16* b) {
  const __m256i h = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) inline __m512 pair8(const f16* a, const f16* b) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}

// One input row's 4 outputs of a tile (out[j * os]) from its two pair accumulators (lanes 0-7 and
// 8-15: weight rows 0 and 1, then 2 and 3): each half summed by hsum8, then the scalar tail of the
// features from k on (rows at w + j * ws), as the AVX2 lanes are.
template <typename W>
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) inline void pair_outputs(__m512 a0, __m512 a1, const W* w,
                                                                                  int64_t ws, const float* x, int64_t k,
                                                                                  int64_t K, float* out, int64_t os) {
  __m256 halves[kNR];
  for (int j = 0; j < kNR; ++j) {
    const __m512 a = j < 2 ? a0 : a1;
    halves[j] = j % 2 ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)) : _mm512_castps512_ps256(a);
  }
  float sums[kNR];
  hsum8_many<kNR>(halves, sums);
  for (int j = 0; j < kNR; ++j) {
    float s = sums[j];
    for (int64_t t = k; t < K; ++t) s = std::fma(widen(w[j * ws + t]), x[t], s);
    out[j * os] = s;
  }
}

template <typename W, int MR, bool PF>
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) void tile512(const float* x, int64_t ldx, const W* w, int64_t K,
                                                                      int64_t ws, int64_t next, float* out, int64_t ldo,
                                                                      int64_t os) {
  static_assert(kNR == 4, "tile512 pairs 4 weight rows");
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m512 w0 = pair8(w + k, w + ws + k), w1 = pair8(w + 2 * ws + k, w + 3 * ws + k);
    if (PF && (k * sizeof(W)) % 64 == 0)
      for (int j = 0; j < kNR; ++j) weight_prefetch<W>(w + next + j * ws + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + i * ldx + k));
      acc[i][0] = _mm512_fmadd_ps(w0, xv, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(w1, xv, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) pair_outputs(acc[i][0], acc[i][1], w, ws, x + i * ldx, k, K, out + i * ldo, os);
}

// Two adjacent tiles (weight rows t and t + 1 of each of the 4 streams) against MR input rows:
// 4 weight pairs x MR accumulators (24 + 4 + 1 of the 32 zmm for 6 rows), each output's chain as
// tile512's (the same bits). `pairs(k, p)` gives the 4 pairs of features k..k+7: p[0], p[1] the first
// tile's rows 0 and 1, 2 and 3, p[2], p[3] the second's (`PairedTiles`: widened and paired
// before); the features past the last 8 (K % 8) are the scalar tail from w.
template <typename W, int MR, typename Pairs>
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) void tile512x2(const float* x, int64_t ldx, const Pairs& pairs,
                                                                        const W* w, int64_t K, int64_t ws, float* out,
                                                                        int64_t ldo, int64_t os) {
  __m512 acc[MR][4];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m512 p[4];
    pairs(k, p);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + i * ldx + k));
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(p[j], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    pair_outputs(acc[i][0], acc[i][1], w, ws, x + i * ldx, k, K, out + i * ldo, os);
    pair_outputs(acc[i][2], acc[i][3], w + K, ws, x + i * ldx, k, K, out + i * ldo + 1, os);
  }
}

// The pairs of two adjacent tiles, widened and paired in float32 before (`pair_tiles`: per 8
// features, the zmm of rows 0 and 1, then of rows 2 and 3; a tile kPairedFloats floats a feature,
// 64-byte aligned), so each pair is one aligned load: no insert or F16C conversion on the ports the
// FMAs use (a 6-row group against two tiles in L1, one thread of a Xeon: 66% of its FMA peak with
// float16 pairs read as they are, 81% paired).
constexpr int64_t kPairedFloats = 4;
struct PairedTiles {
  const float *a, *b;  // the two tiles' pairs
  __attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) inline void operator()(int64_t k, __m512* p) const {
    const float *pa = a + kPairedFloats * k, *pb = b + kPairedFloats * k;
    p[0] = _mm512_load_ps(pa), p[1] = _mm512_load_ps(pa + 16), p[2] = _mm512_load_ps(pb), p[3] = _mm512_load_ps(pb + 16);
  }
};

// Tiles t0..t1-1 (tile t: weight rows w + t * K + j * ws, j < 4) widened and paired into `paired`
// (64-byte aligned; tile t - t0 at (t - t0) * kPairedFloats * K), as PairedTiles reads them.
template <typename W>
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) void pair_tiles(const W* w, int64_t K, int64_t ws, int64_t t0,
                                                                         int64_t t1, float* paired) {
  for (int64_t t = t0; t < t1; ++t) {
    const W* wt = w + t * K;
    float* p = paired + (t - t0) * kPairedFloats * K;
    for (int64_t k = 0; k + 8 <= K; k += 8, p += 32) {
      _mm512_store_ps(p, pair8(wt + k, wt + ws + k));
      _mm512_store_ps(p + 16, pair8(wt + 2 * ws + k, wt + 3 * ws + k));
    }
  }
}

// MR = rows (1..9) input rows against one weight tile with tile512.
template <typename W, bool PF>
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) void group512(int64_t rows, const float* x, int64_t K,
                                                                       const W* w, int64_t ws, int64_t next, float* out,
                                                                       int64_t ldo, int64_t os) {
  switch (rows) {
    case 1: tile512<W, 1, PF>(x, K, w, K, ws, next, out, ldo, os); break;
    case 2: tile512<W, 2, PF>(x, K, w, K, ws, next, out, ldo, os); break;
    case 3: tile512<W, 3, PF>(x, K, w, K, ws, next, out, ldo, os); break;
    case 4: tile512<W, 4, PF>(x, K, w, K, ws, next, out, ldo, os); break;
    case 5: tile512<W, 5, PF>(x, K, w, K, ws, next, out, ldo, os); break;
    case 6: tile512<W, 6, PF>(x, K, w, K, ws, next, out, ldo, os); break;
    case 7: tile512<W, 7, PF>(x, K, w, K, ws, next, out, ldo, os); break;
    case 8: tile512<W, 8, PF>(x, K, w, K, ws, next, out, ldo, os); break;
    default: tile512<W, 9, PF>(x, K, w, K, ws, next, out, ldo, os); break;
  }
}

// All rows of x against one weight tile with tile512: a verify pass of up to kPass512 rows in one
// group (18 accumulators + 2 weight pairs + 1 row of the 32 zmm registers for 9 rows; GCC keeps
// them in registers), more rows (a prompt pass) 6 at a time; the first group prefetches the next
// tile (unless `more` is false). Base's 36 decoder linears (float16 weights, cold, 2 threads of a
// Zen 4 EPYC, alternated in one process), 7 / 8 / 9 rows in one group instead of 6 + 1..3:
// 2.67 / 2.95 / 3.20 -> 2.41 / 2.69 / 2.95 ms (1..6 rows unchanged).
constexpr int64_t kPass512 = 9;
template <typename W>
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) void rows_tile512(const float* x, int64_t M, int64_t K, const W* w,
                                                                           int64_t ws, int64_t next, float* out, int64_t ldo,
                                                                           int64_t os, bool more) {
  const int64_t most = M <= kPass512 ? M : 6;
  for (int64_t m = 0; m < M; m += most) {
    const int64_t rows = std::min<int64_t>(most, M - m);
    if (more && m == 0)
      group512<W, true>(rows, x, K, w, ws, next, out, ldo, os);
    else
      group512<W, false>(rows, x + m * K, K, w, ws, 0, out + m * ldo, ldo, os);
  }
}

// wide[j * K + i] = w[j * ws + i] widened to float32 (exact) for the kNR rows of a tile.
template <typename W>
__attribute__((target("avx2,fma,f16c"))) void widen_rows(const W* w, int64_t ws, int64_t K, float* wide) {
  for (int64_t j = 0; j < kNR; ++j) {
    int64_t i = 0;
    for (; i + 8 <= K; i += 8) _mm256_storeu_ps(wide + j * K + i, load8(w + j * ws + i));
    for (; i < K; ++i) wide[j * K + i] = widen(w[j * ws + i]);
  }
}

// acc[m, n] = x[m] . w[n] (float32) for weight rows n0..n1-1, on this thread.
//
// A tile's kNR weight rows are Q = (n1 - n0) / kNR rows apart, not adjacent: tile t takes rows
// n0 + t, n0 + Q + t, n0 + 2Q + t, n0 + 3Q + t, so the thread reads its rows as kNR long
// sequential streams, one per quarter of its range. Adjacent rows made kNR streams of one row
// each (2 KB for K = 512), too short for the hardware prefetchers to get ahead: one input row
// against base's 2048 x 512 matrices streamed 11.5 GB/s on one core of a Zen 4 EPYC, 23 GB/s
// this way (2 cores: 20 -> 31 GB/s). Each output's arithmetic is unchanged (the same bits); the
// last n1 - n0 - kNR * Q rows (at most kNR - 1) are single dot products. bfloat16 weights no
// longer prefetch each stream ahead in software: with the long streams that made a 2-layer
// draft's linears slower (cold, 1 row, alternated in one process: 0.49 -> 0.61 ms; held to AVX2
// 0.49 -> 0.59), where it had helped adjacent rows (1.0 -> 0.7 ms).
constexpr int64_t kManyRows = 16;           // rows from which matmul_range blocks them
constexpr int kManyGroup = 6;               // ... in groups of this many rows (AVX-512: tile512x2)
constexpr int64_t kManyBytes = 96 * 1024;  // float32 features per block of rows
constexpr int64_t kPairedBytes = 256 * 1024;   // AVX-512: the paired float32 tiles of a block ...
constexpr int64_t kManyRowBytes = 1024 * 1024;  // ... against rows of up to this many bytes of features
constexpr int64_t kWidenRows = 24;  // AVX2 tiles, many rows: blocks of at least this many rows widen each tile first

template <typename W>
void matmul_range(const float* x, int64_t M, int64_t K, const W* w, int64_t n0, int64_t n1, float* acc,
                  int64_t ldo, bool vec) {
  const int64_t Q = vec ? (n1 - n0) / kNR : 0, ws = Q * K;
  // several rows: the AVX-512 tiles, unless the rows are short. Attention's 64-feature keys spend
  // as much on each tile's sums as on its products, and tile512 sums a row's 4 outputs alone where
  // the AVX2 tiles sum two rows' 8 at once: base's six cross-attention layers, cold, alternated in
  // one process on a Zen 4 EPYC, 5 queries 2.05 -> 1.87 ms, 9 queries 2.76 -> 2.54 with the AVX2
  // tiles for K < 128 (the linears, K = 512 and 2048, unchanged)
  const bool pairs = vec && M >= 2 && vector_level() >= 2 && K >= 128;
  // many rows (a prompt pass, the cross K/V projections, the logits of a window's tokens): blocks
  // of rows that stay in L2 (kManyBytes of features) against every tile, in groups of 3 (16 bytes
  // of features a cycle from L2, where the 4-5 row halves that read each weight byte once for a
  // verify pass need 32), instead of every row against each tile (all of x through L2 per tile:
  // from L3 for 1500 rows). Each output's arithmetic is the tiles' own: the same bits. Two
  // threads of a Zen 3 EPYC, alternated in one process (GFLOP/s, before -> after): 1500 x 512 x
  // 512 float32 74 -> 115, float16 85 -> 107; 200 rows of base's float16 projections 97-115 ->
  // 143-158; 95 x 51865 x 512 (a window's logits) 102 -> 120; 16-48 rows parity (so from 16).
  // 96 KB blocks measured alike to 128 KB, 64 KB slower; the demo's whole call 0.986x (paired).
  const bool many = vec && M >= kManyRows;
  const int64_t block = many ? std::max<int64_t>(kMR, kManyBytes / (K * int64_t{sizeof(float)}) / kMR * kMR) : M;
  // bfloat16 weights with several row groups: widen each weight tile once into float32 (exact,
  // so the same bits) instead of once per group of kMR rows. float16 weights are widened as they
  // are read (one instruction, F16C): widened first, without the next tile's prefetch, base's 4-
  // and 5-row verify passes ran 1.2x slower than on float32 weights (2 threads, Zen 3 EPYC, cold,
  // alternated in one process), widened as read 0.77-0.89x at 1..9 rows
  // With many rows (the AVX2 tiles: AVX2, or K < 128) float16 and bfloat16 tiles are widened too,
  // once per block of rows, in vector code (`widen_rows`), where the block has at least 24 rows to
  // share each widening: a widening on the FMAs' ports costs more than a load there (Intel's cores;
  // held to AVX2 on the Xeon, alternated in one process 8 times: float16 200 x 512 x 2048 108 -> 124
  // GFLOP/s, 200 x 512 x 1536 108 -> 126, 48 x 512 x 2048 106 -> 125, 100 x 512 x 51865 100 -> 105;
  // K = 2048, 12-row blocks, widened 0.86x: not widened)
  const bool widen_tile = vec && !pairs && M > kMR && !std::is_same<W, float>::value &&
                          (many ? block >= kWidenRows : std::is_same<W, bf16>::value);
  std::vector<float> wide(widen_tile ? kNR * K : 0);
  if (pairs && many) {
    // AVX-512, many rows: each group of kManyGroup rows (its features in L1) against a block of
    // tiles (in L2), two tiles at a time (tile512x2: 24 accumulators where tile512 keeps 12), the
    // block's weights read from L2 once per group. Base's 36 decoder linears, float16 weights, 2
    // threads of a Zen 4 EPYC (GFLOP/s): 150 rows 134-150 -> 170-172, 100 rows 127-130 -> 163-166;
    // the float16 head (51865 x 512) over 100 rows 131-135 -> 154-157. The same bits.
    //
    // Each block of tiles is first widened and paired into float32 (`pair_tiles`, at most
    // kPairedBytes: in L2) and every group of kManyGroup rows, of a span of up to kManyRowBytes of
    // features, reads the pairs (tile512x2 on PairedTiles: one aligned load a pair where float16
    // pairs took two loads, an insert and a conversion on the FMA ports). 2 threads of a Xeon, alternated in one process 10 times, float16
    // weights (GFLOP/s): 200 x 512 x 2048 97 -> 127, 200 x 2048 x 512 112 -> 150, 200 x 512 x 1536
    // 99 -> 128, 100 x 512 x 51865 (a window's logits) 81 -> 101, 48 x 512 x 2048 98 -> 114; the
    // demo recording's target-only call 5.15 -> 4.99 s (paired 1.038x over 6 rounds: its prompt
    // passes and logits). The same bits. On an AMD Zen 4, whose AVX-512 runs on 256-bit units, the
    // tiles had been read as they are (float16 pairs: loads, an insert, a conversion); paired they
    // are faster there too: 2 threads, alternated in one process (GFLOP/s), 1500 x 512 x 6144
    // float16 120 -> 131 (float32 113 -> 125), 100 x 512 x 51865 109 -> 114, 200 x 2048 x 512
    // 160 -> 165, 200 x 512 x 1536 141 -> 144, 48 x 512 x 2048 115 -> 118.
    {
      const int64_t tiles = std::clamp<int64_t>(kPairedBytes / (kPairedFloats * K * int64_t{sizeof(float)}) / 2 * 2, 2, 64);
      const int64_t span = std::max<int64_t>(kManyGroup, kManyRowBytes / (K * int64_t{sizeof(float)}) / kManyGroup * kManyGroup);
      thread_local std::vector<float> scratch;
      float* pairs_at = aligned_floats(scratch, tiles * kPairedFloats * K);
      for (int64_t m0 = 0; m0 < M; m0 += span) {
        const int64_t rows = std::min(span, M - m0), full = rows / kManyGroup * kManyGroup;
        for (int64_t t0 = 0; t0 < Q; t0 += tiles) {
          const int64_t t1 = std::min(Q, t0 + tiles), even = t0 + (t1 - t0) / 2 * 2;
          if (full > 0) pair_tiles(w + n0 * K, K, ws, t0, even, pairs_at);
          for (int64_t g = m0; g < m0 + full; g += kManyGroup)
            for (int64_t t = t0; t < even; t += 2)
              tile512x2<W, kManyGroup>(x + g * K, K,
                                       PairedTiles{pairs_at + (t - t0) * kPairedFloats * K,
                                                   pairs_at + (t + 1 - t0) * kPairedFloats * K},
                                       w + (n0 + t) * K, K, ws, acc + g * ldo + n0 + t, ldo, Q);
          // the odd tile of the block, and the last rows (fewer than a group) against every tile
          for (int64_t g = m0; g < m0 + rows; g += kManyGroup) {
            const int64_t gr = std::min<int64_t>(kManyGroup, m0 + rows - g);
            for (int64_t t = (gr == kManyGroup ? even : t0); t < t1; ++t)
              group512<W, false>(gr, x + g * K, K, w + (n0 + t) * K, ws, 0, acc + g * ldo + n0 + t, ldo, Q);
          }
        }
      }
    }
  } else
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t rows = std::min(block, M - m0);
    const float* xb = x + m0 * K;
    for (int64_t t = 0; t < Q; ++t) {
      const W* wt = w + (n0 + t) * K;
      float* out = acc + m0 * ldo + n0 + t;
      const bool more = t + 1 < Q;
      if (widen_tile) {
        widen_rows(wt, ws, K, wide.data());
        rows_tile<float, kNR>(xb, rows, K, wide.data(), K, 0, out, ldo, Q, false, !many);
        continue;
      }
      if (pairs)
        rows_tile512<W>(xb, rows, K, wt, ws, K, out, ldo, Q, more);
      else
        rows_tile<W, kNR>(xb, rows, K, wt, ws, K, out, ldo, Q, more, !many);
    }
  }
  for (int64_t n = n0 + kNR * Q; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m)
      acc[m * ldo + n] = vec ? dot_avx2(x + m * K, w + n * K, K) : dot_scalar(x + m * K, w + n * K, K);
}

// What a step's linear does to its outputs in its own section, columns n0..n1 of every row, once
// the thread has computed them (`apply`): the scales of int8 projections and the bias, then gelu or
// a residual add: the operations linear_rows / linear_q8, step_gelu and step_add do after the
// products, in their order (so the same bits), where those ran on the calling thread between
// sections while the others waited (decoder_layers_lean).
struct Epilogue {
  const float* row_scale = nullptr;  // int8 projections: fl(fl(P[m, n] * row_scale[m]) * scale[n]) + bias[n]
  const float* scale = nullptr;     // int8 projections: x . q[n] * scale[n] + bias[n]
  const float* bias = nullptr;
  bool gelu = false;
  const float* residual = nullptr;  // [M, N]: out = residual + (x @ w^T + b)

  void apply(float* acc, int64_t M, int64_t N, int64_t n0, int64_t n1, bool vec) const;
};

// acc[M, N] = x[M, K] @ w[N, K]^T (float32), parallel over weight rows; `finish` (if any) applied to
// each thread's columns in its section. (Chunks of a quarter of a thread's share taken from a
// shared counter instead, so a thread slowed by its memory share waits less at the section's end:
// no faster, base's pass held to AVX2 on a Zen 4, 1 / 5 rows 3.86 / 5.35 against 3.72 / 5.26 ms.)
template <typename W>
void matmul_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* acc,
                 const Epilogue* finish = nullptr) {
  const bool vec = has_avx2();
  const int64_t blocks = (N + kNR - 1) / kNR;
  // grain: at least ~64 KB of weights per task so small matrices stay on one thread
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, kNR * K * sizeof(W)));
  parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * kNR, n1 = std::min(N, b1 * kNR);
    matmul_range(x, M, K, w, n0, n1, acc, N, vec);
    if (finish != nullptr) finish->apply(acc, M, N, n0, n1, vec);
  });
}

at::Tensor as_float_rows(const at::Tensor& x) {
  return x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
}

// ------------------------------------------------------------------ linear
// acc[M, N] = x @ weight^T for float32, float16 (a float16 checkpoint's weights, widened exactly)
// or bfloat16 weights [N, K], then `finish` in each section.
void linear_float(const float* x, int64_t M, int64_t K, const at::Tensor& weight, int64_t N, float* acc,
                  const Epilogue& finish) {
  if (weight.scalar_type() == at::kFloat)
    matmul_rows(x, M, K, weight.data_ptr<float>(), N, acc, &finish);
  else if (weight.scalar_type() == at::kHalf)
    matmul_rows(x, M, K, reinterpret_cast<const f16*>(weight.data_ptr()), N, acc, &finish);
  else
    matmul_rows(x, M, K, reinterpret_cast<const bf16*>(weight.data_ptr()), N, acc, &finish);
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       c10::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "linear_rows: CPU tensors only");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "linear_rows: weight must be a contiguous [N, K] matrix");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16 ||
                  weight.scalar_type() == at::kHalf,
              "linear_rows: weight must be float32, bfloat16 or float16");
  const int64_t K = weight.size(1), N = weight.size(0);
  TORCH_CHECK(x.size(-1) == K, "linear_rows: x has ", x.size(-1), " features, weight expects ", K);
  at::Tensor xf = as_float_rows(x);
  const int64_t M = xf.size(0);
  Epilogue finish;  // the bias, in each thread's section
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "linear_rows: bias has ", bias->numel(), " entries, expected ", N);
    bf = bias->to(at::kFloat).contiguous();
    finish.bias = bf.data_ptr<float>();
  }
  at::Tensor acc = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M > 0) linear_float(xf.data_ptr<float>(), M, K, weight, N, acc.data_ptr<float>(), finish);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  const at::ScalarType dtype = out_dtype.value_or(x.scalar_type());
  return acc.to(dtype).view(shape);  // bfloat16: round to nearest even, once
}

// out[m, c] = x[m] . weight[ids[m, c]] (float32), with exactly linear_rows' arithmetic: the
// exact logits of a few candidate tokens per row.
at::Tensor gather_dot(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ids) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "gather_dot: weight must be a contiguous float32 [V, K] matrix");
  const int64_t K = weight.size(1), V = weight.size(0);
  at::Tensor xf = as_float_rows(x);
  at::Tensor idc = ids.to(at::kLong).contiguous();
  TORCH_CHECK(idc.dim() == 2 && idc.size(0) == xf.size(0), "gather_dot: ids must be [rows, C]");
  const int64_t M = idc.size(0), C = idc.size(1);
  at::Tensor out = at::empty({M, C}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t* ip = idc.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const bool vec = has_avx2();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < C; ++c) {
      const int64_t v = ip[m * C + c];
      TORCH_CHECK(v >= 0 && v < V, "gather_dot: id ", v, " out of range");
      op[m * C + c] = vec ? dot_avx2(xp + m * K, wp + v * K, K) : dot_scalar(xp + m * K, wp + v * K, K);
    }
  return out;
}

// Exact greedy argmax through an int8 screen (spec: specwhisper/model/head.py ScreenedHead).
// packed: int8 weights q in blocks of 8 vocabulary rows, [ceil(V/8), K/8, 8, 8] (row j of a block
// and features 8c..8c+7 at [block, c, j, :]), so one block streams as one sequential run.
// Approximate logit a_v = fl(fl(P_v) * fl(scale_v * s_h)) with P_v = q_v . p the exact int32 product
// of the row rounded to 16 bits (quantize_rows16); bound b_v = fl(|h| * bound_v) + tiny with
// bound_v >= (|w_v - scale_v q_v| + the rounding of h + float error terms) per unit |h| (see head.py). Candidates: v with fl(a_v + b_v) >= max_w fl(a_w - b_w);
// their exact float32 logits (linear_rows' arithmetic) decide, ties to the lowest id.
// banned: bool [V] or [N, V]. Any number of candidates.
constexpr int64_t kQB = 8;  // vocabulary rows per int8 block
// The AVX-512 screen for one row too (false: the AVX2 form). Fixed, not chosen per machine: on a
// Zen 4 EPYC (double-pumped AVX-512) the AVX2 form screened base's head for one row about 5%
// faster (1.14 against 1.21 ms, cold, alternated in one process).
bool wide_single_row = true;

// ---- the screen's integer products (spec: head.py `ScreenedHead.approx`)
// A row h is quantized once to 16-bit integers p = round(h / s_h), s_h = max|h| / R, and the
// screen's products P_v = q_v . p are exact int32 sums (R keeps |P| < 2^31 for any K: q16_range),
// so every vector level and the reference get the same P (any order of summation) and the same
// approximate logit fl(fl(P) * fl(s_v * s_h)). 16-bit multiply-adds do 16 products per
// instruction against 8 for float32 FMAs after a widening of the int8 weights: with several rows
// (a verify pass) the AVX2 screen was bound by arithmetic, not by its 26 MB of int8 weights.
int64_t q16_range(int64_t K) { return std::min<int64_t>(32767, int64_t{2147483647} / (127 * std::max<int64_t>(1, K))); }

// max |x[k]| over a row of K; `finite` becomes false if the row holds a NaN or an infinity.
inline float abs_max(const float* x, int64_t K, bool& finite) {
  float mx = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    finite = finite && std::isfinite(x[k]);
    mx = std::max(mx, std::fabs(x[k]));
  }
  return mx;
}

// p [N, K] and s_h [N] from h [N, K] float32: s_h = fl(max|h| / R), p = round-half-even(fl(h / s_h))
// (torch's float32 division and round); a zero row gives s_h = 0, p = 0; a row with a NaN or an
// infinity gives s_h = NaN (its approximate logits are NaN, so it keeps no candidate).
// The same with AVX2, 8 features at a time (the same divisions and roundings: the same p): a
// compact draft's linears quantize their rows every step (4.8% of base-2l's step in scalar code;
// three of its steps after a verify pass, alternated in one process: 1.043x).
__attribute__((target("avx2,fma,f16c"))) float abs_max_avx2(const float* x, int64_t K, bool& finite) {
  const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
  __m256 mx = zero, ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_sub_ps(v, v), zero, _CMP_EQ_OQ));  // inf - inf, NaN: NaN
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float best = 0.0f;
  for (float l : lanes) best = std::max(best, l);  // a finite row's maximum: any order
  finite = finite && _mm256_movemask_ps(ok) == 0xFF;
  for (; k < K; ++k) {
    finite = finite && std::isfinite(x[k]);
    best = std::max(best, std::fabs(x[k]));
  }
  return best;
}

__attribute__((target("avx2,fma,f16c"))) void divide_round16_avx2(const float* x, int64_t K, float s, int16_t* q) {
  const __m256 d = _mm256_set1_ps(s);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i i = _mm256_cvtps_epi32(r);  // |r| <= 32767: exact
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k),
                     _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
  }
  for (; k < K; ++k) q[k] = static_cast<int16_t>(std::nearbyint(x[k] / s));
}

void quantize_rows16(const float* h, int64_t N, int64_t K, int16_t* p, float* sh) {
  const float range = static_cast<float>(q16_range(K));
  const bool vec = has_avx2();
  for (int64_t r = 0; r < N; ++r) {
    const float* x = h + r * K;
    bool finite = true;
    const float mx = vec ? abs_max_avx2(x, K, finite) : abs_max(x, K, finite);
    int16_t* q = p + r * K;
    if (!finite || mx == 0.0f) {
      sh[r] = finite ? 0.0f : NAN;
      std::fill(q, q + K, int16_t{0});
      continue;
    }
    const float s = mx / range;
    sh[r] = s;
    if (vec) {
      divide_round16_avx2(x, K, s, q);
      continue;
    }
    for (int64_t k = 0; k < K; ++k) q[k] = static_cast<int16_t>(std::nearbyint(x[k] / s));
  }
}

// out[m, j] = float(P) for MR input rows (16-bit, row stride K) and the 8 rows of one int8 block:
// a 16-byte load holds rows 2j and 2j+1 (8 features each), widened to 16 bits and multiplied by the
// row's 8 features in both halves; lanes 0-3 sum row 2j, lanes 4-7 row 2j+1. PF: prefetch the next block.
template <int MR, bool PF>
__attribute__((target("avx2,fma,f16c"))) void q16_block(const int16_t* x, int64_t K, const int8_t* blk, float* out,
                                                        int64_t ldo, const int8_t* next) {
  __m256i acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; k += 8) {
    const int8_t* p = blk + k * kQB;
    if (PF) prefetch_stream(reinterpret_cast<const char*>(next + k * kQB));
    __m256i xv[MR];
    for (int i = 0; i < MR; ++i)
      xv[i] = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i * K + k)));
    for (int j = 0; j < 4; ++j) {
      const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * j)));
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(w, xv[i]));
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) {
      alignas(32) int32_t l[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(l), acc[i][j]);
      out[i * ldo + 2 * j] = static_cast<float>((l[0] + l[1]) + (l[2] + l[3]));
      out[i * ldo + 2 * j + 1] = static_cast<float>((l[4] + l[5]) + (l[6] + l[7]));
    }
}

// q16_block's products for one half of the block (rows 4h..4h+3, the second 32 bytes of each
// 64-byte step for h = 1) and MR (1..6) input rows: 2 accumulators a row instead of 4, so one
// widening of the weights serves more rows in one group (a verify pass of 4 rows: 1.35 -> 1.02 ms
// for base's head held to AVX2). The accumulators are named registers, not an array: GCC kept an
// array's 10 accumulators for 5 rows partly on the stack (5 stores, a load and 10 register copies
// every step); named, base's head on 2 threads of a Zen 3 EPYC (real hidden states, cold, alternated
// in one process 30 times) 4 / 5 / 9 rows 2.99 / 3.39 / 5.42 -> 2.78 / 2.96 / 4.44 ms (1 row 2.26,
// its own kernel). 12 accumulators + 2 weight registers + 1 row's features: 16 registers for 6 rows.
//
// With AVX-VNNI (Intel's AVX2-level CPUs since Alder Lake, AMD's since Zen 5: `avx_vnni`) each
// product and its accumulation are one vpdpwssd instead of vpmaddwd + vpaddd: the same int32 sums
// (neither saturates), half the arithmetic instructions of a multi-row screen (q16_half_vnni):
// base's whole pass at the AVX2 level on 2 threads of a Xeon with AVX-VNNI, alternated in one
// process 12 times, 3 / 5 / 9 rows 6.43 / 8.89 / 14.42 -> 5.97 / 8.20 / 13.37 ms (paired 1.09 /
// 1.06 / 1.06x). `set_vnni(false)` switches it off with AVX512-VNNI.
// Q16_HALF_FN(NAME, TARGET, ACC) defines NAME<MR, PF> with ACC(a, w, x) = a + the pairs' products.
// (q16_block, 1-2 rows, keeps vpmaddwd + vpaddd: with one row its 4 accumulators would each wait on
// vpdpwssd's 5-cycle latency every step, where vpaddd's is 1. Tried: tiny.en's compact step, whose
// int8 projections run it, read 0.97x with vpdpwssd, alternated in one process on the Xeon held to
// AVX2 (within that VM's noise, but no gain), so it stays.)
#define Q16_ACC_MADD(a, w, x) _mm256_add_epi32(a, _mm256_madd_epi16(w, x))
#define Q16_ACC_DPWSSD(a, w, x) _mm256_dpwssd_avx_epi32(a, w, x)
#define Q16_ROW(r, ACC)                                                                                                \
  if constexpr (r < MR) {                                                                                              \
    const __m256i xv = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + r * K + k))); \
    a##r##0 = ACC(a##r##0, w0, xv);                                                                                    \
    a##r##1 = ACC(a##r##1, w1, xv);                                                                                    \
  }
#define Q16_HALF_FN(NAME, TARGET, ACC)                                                                                    \
  template <int MR, bool PF>                                                                                               \
  __attribute__((target(TARGET))) void NAME(const int16_t* x, int64_t K, const int8_t* blk, int h, float* out,             \
                                            int64_t ldo, const int8_t* next) {                                             \
    static_assert(MR >= 1 && MR <= 6, #NAME ": 1 to 6 rows");                                                              \
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,    \
            a40 = a00, a41 = a00, a50 = a00, a51 = a00; /* rows past MR stay zero, unused */                               \
    for (int64_t k = 0; k < K; k += 8) {                                                                                   \
      const int8_t* p = blk + k * kQB + 32 * h;                                                                            \
      if (PF) prefetch_stream(reinterpret_cast<const char*>(next + k * kQB));                                              \
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));                      \
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));                 \
      Q16_ROW(0, ACC) Q16_ROW(1, ACC) Q16_ROW(2, ACC) Q16_ROW(3, ACC) Q16_ROW(4, ACC) Q16_ROW(5, ACC)                       \
    }                                                                                                                      \
    const __m256i acc[6][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};                    \
    for (int i = 0; i < MR; ++i)                                                                                           \
      for (int j = 0; j < 2; ++j) {                                                                                        \
        alignas(32) int32_t l[8];                                                                                          \
        _mm256_store_si256(reinterpret_cast<__m256i*>(l), acc[i][j]);                                                      \
        out[i * ldo + 4 * h + 2 * j] = static_cast<float>((l[0] + l[1]) + (l[2] + l[3]));                                 \
        out[i * ldo + 4 * h + 2 * j + 1] = static_cast<float>((l[4] + l[5]) + (l[6] + l[7]));                             \
      }                                                                                                                    \
  }
Q16_HALF_FN(q16_half, "avx2,fma,f16c", Q16_ACC_MADD)
Q16_HALF_FN(q16_half_vnni, "avx2,fma,f16c,avxvnni", Q16_ACC_DPWSSD)
#undef Q16_HALF_FN
#undef Q16_ROW
#undef Q16_ACC_MADD
#undef Q16_ACC_DPWSSD

// MR = rows (1..6) input rows against both halves of one int8 block; PF: prefetch the next block;
// dp: q16_half_vnni (`has_avx_vnni`, decided once by the caller).
template <bool PF>
__attribute__((target("avx2,fma,f16c"))) void q16_halves(int64_t rows, const int16_t* x, int64_t K, const int8_t* blk,
                                                         float* out, int64_t ldo, const int8_t* next, bool dp) {
  for (int h = 0; h < 2; ++h) {
    const bool pf = PF && h == 0;
#define Q16_HALF(MR)                                                                              \
  (dp ? (pf ? q16_half_vnni<MR, true>(x, K, blk, h, out, ldo, next) : q16_half_vnni<MR, false>(x, K, blk, h, out, ldo, next)) \
      : (pf ? q16_half<MR, true>(x, K, blk, h, out, ldo, next) : q16_half<MR, false>(x, K, blk, h, out, ldo, next)))
    switch (rows) {
      case 1: Q16_HALF(1); break;
      case 2: Q16_HALF(2); break;
      case 3: Q16_HALF(3); break;
      case 4: Q16_HALF(4); break;
      case 5: Q16_HALF(5); break;
      default: Q16_HALF(6); break;
    }
#undef Q16_HALF
  }
}

// Calls f(m, rows) for M rows in the fewest groups of at most `most` rows, balanced (7 of at most
// 6: 4 + 3): the int8 screens' row groups.
template <typename F>
inline void balanced_groups(int64_t M, int64_t most, F&& f) {
  const int64_t groups = (M + most - 1) / most, base = M / groups, extra = M % groups;
  for (int64_t g = 0, m = 0; g < groups; m += base + (g < extra), ++g) f(m, base + (g < extra));
}

// Every row against one int8 block: 1 or 2 rows in one pass over the block (q16_block: the
// one-row step's path; the halves measured slower there), 3 and more in balanced groups of at most
// 6 over each half (6 rows: one group, 7: 4 + 3, 9: 5 + 4); the first group prefetches the next block.
// Base's head held to AVX2, rows 3 4 5 6 9: 1.08 1.35 1.58 2.05 3.07 -> 0.90 1.02 1.39 1.57 2.35 ms
// (ScreenedHead.argmax timed alone on 1..9 rows); 6 rows in one group against 3 + 3 (named
// accumulators, Zen 3, alternated): 3.37 -> 2.90 ms. The products are exact integer sums: the same
// bits in any grouping. dp: the groups' products with AVX-VNNI (`has_avx_vnni`).
__attribute__((target("avx2,fma,f16c"))) void q16_rows(const int16_t* x, int64_t M, int64_t K, const int8_t* blk,
                                                       const int8_t* next, float* out, int64_t ldo, bool dp) {
  if (M > 2) {
    balanced_groups(M, 6, [&](int64_t m, int64_t rows) {
      if (m == 0 && next != nullptr) q16_halves<true>(rows, x, K, blk, out, ldo, next, dp);
      else q16_halves<false>(rows, x + m * K, K, blk, out + m * ldo, ldo, next, dp);
    });
    return;
  }
  if (next == nullptr) M == 2 ? q16_block<2, false>(x, K, blk, out, ldo, next) : q16_block<1, false>(x, K, blk, out, ldo, next);
  else if (M == 2) q16_block<2, true>(x, K, blk, out, ldo, next);
  else q16_block<1, true>(x, K, blk, out, ldo, next);
}

// The totals of the four 128-bit lanes of a (int32 lanes 0-3 of the result) and of b (lanes 4-7):
// a block's 8 row products from its two accumulators (exact integers: any order, the same sums).
__attribute__((target("avx512f,avx512bw,avx512dq,avx2,fma,f16c"))) inline __m256i lane_totals(__m512i a, __m512i b) {
  const __m512i pick = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
  a = _mm512_add_epi32(a, _mm512_shuffle_epi32(a, _MM_PERM_BADC));
  a = _mm512_add_epi32(a, _mm512_shuffle_epi32(a, _MM_PERM_CDAB));
  b = _mm512_add_epi32(b, _mm512_shuffle_epi32(b, _MM_PERM_BADC));
  b = _mm512_add_epi32(b, _mm512_shuffle_epi32(b, _MM_PERM_CDAB));
  return _mm512_castsi512_si256(_mm512_permutex2var_epi32(a, pick, b));
}

// The same products with AVX-512 (BW): a 32-byte load holds rows 4h..4h+3 of the block, lanes 4r..4r+3
// sum row 4h+r. Q16_ACC: 16-bit multiply-adds into int32 lanes (AVX512-VNNI: one instruction).
// Up to 9 rows in one pass over the block (18 accumulators + 2 weight registers + 1 row's features
// of the 32 zmm registers; 6 at most before, so 7-9 rows read it twice), the accumulators named
// registers (an array of them compiled, GCC, to 20 register copies every step for 5 rows), the
// sums reduced in vector registers. Base's head on 2 threads of a Zen 4 EPYC (real hidden states,
// cold, alternated in one process 40 times), rows 4 5 6 7 8 9: 0.90 1.08 1.18 1.47 1.67 1.85 ->
// 0.84 0.97 1.10 1.28 1.39 1.55 ms; rows 1 2 3: 0.79 0.77 0.80 -> 0.79 0.80 0.86.
#define Q16_ROW512(r, Q16_ACC)                                                                                   \
  if constexpr (r < MR) {                                                                                        \
    const __m512i xv =                                                                                           \
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + r * K + k)));                \
    a##r##0 = Q16_ACC(a##r##0, w0, xv);                                                                          \
    a##r##1 = Q16_ACC(a##r##1, w1, xv);                                                                          \
  }
#define Q16_BLOCK512(NAME, TARGET, Q16_ACC)                                                                      \
  template <int MR, bool PF>                                                                                     \
  __attribute__((target(TARGET))) void NAME(const int16_t* x, int64_t K, const int8_t* blk, float* out,          \
                                            int64_t ldo, const int8_t* next) {                                   \
    static_assert(MR >= 1 && MR <= 9, #NAME ": 1 to 9 rows");                                                    \
    __m512i a00 = _mm512_setzero_si512(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,      \
            a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00, a60 = a00, a61 = a00, a70 = a00, a71 = a00,   \
            a80 = a00, a81 = a00; /* rows past MR stay zero, unused */                                           \
    for (int64_t k = 0; k < K; k += 8) {                                                                         \
      const int8_t* p = blk + k * kQB;                                                                           \
      if (PF) prefetch_stream(reinterpret_cast<const char*>(next + k * kQB));                          \
      const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));           \
      const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));      \
      Q16_ROW512(0, Q16_ACC) Q16_ROW512(1, Q16_ACC) Q16_ROW512(2, Q16_ACC) Q16_ROW512(3, Q16_ACC)                \
      Q16_ROW512(4, Q16_ACC) Q16_ROW512(5, Q16_ACC) Q16_ROW512(6, Q16_ACC) Q16_ROW512(7, Q16_ACC)                \
      Q16_ROW512(8, Q16_ACC)                                                                                     \
    }                                                                                                            \
    const __m512i acc[9][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41},                       \
                               {a50, a51}, {a60, a61}, {a70, a71}, {a80, a81}};                                  \
    for (int i = 0; i < MR; ++i) /* output 4h + r: the total of 128-bit lane r of acc[i][h] */                 \
      _mm256_storeu_ps(out + i * ldo, _mm256_cvtepi32_ps(lane_totals(acc[i][0], acc[i][1])));                  \
  }
#define Q16_MADD(acc, w, x) _mm512_add_epi32(acc, _mm512_madd_epi16(w, x))
#define Q16_DPWSSD(acc, w, x) _mm512_dpwssd_epi32(acc, w, x)
Q16_BLOCK512(q16_block512, "avx512f,avx512bw,avx512dq,avx2,fma,f16c", Q16_MADD)
Q16_BLOCK512(q16_block512_vnni, "avx512f,avx512bw,avx512dq,avx512vnni,avx2,fma,f16c", Q16_DPWSSD)
#undef Q16_BLOCK512
#undef Q16_ROW512
#undef Q16_MADD
#undef Q16_DPWSSD

// Every row against one int8 block; the first group prefetches the next block.
template <bool VNNI, int MR>
__attribute__((target("avx512f,avx512bw,avx512dq,avx2,fma,f16c"))) inline void q16_group512(
    const int16_t* x, int64_t K, const int8_t* blk, float* out, int64_t ldo, const int8_t* next, bool pf) {
  if (VNNI) {
    if (pf) q16_block512_vnni<MR, true>(x, K, blk, out, ldo, next);
    else q16_block512_vnni<MR, false>(x, K, blk, out, ldo, next);
  } else {
    if (pf) q16_block512<MR, true>(x, K, blk, out, ldo, next);
    else q16_block512<MR, false>(x, K, blk, out, ldo, next);
  }
}

constexpr int64_t kQ512Rows = 9;
// In balanced groups of at most kQ512Rows rows (a verify pass of up to 9 rows reads the block once).
template <bool VNNI>
__attribute__((target("avx512f,avx512bw,avx512dq,avx2,fma,f16c"))) void q16_rows512(
    const int16_t* x, int64_t M, int64_t K, const int8_t* blk, const int8_t* next, float* out, int64_t ldo) {
  balanced_groups(M, kQ512Rows, [&](int64_t m, int64_t rows) {
    const int16_t* xm = x + m * K;
    float* o = out + m * ldo;
    const bool pf = m == 0 && next != nullptr;
    switch (rows) {
      case 1: q16_group512<VNNI, 1>(xm, K, blk, o, ldo, next, pf); break;
      case 2: q16_group512<VNNI, 2>(xm, K, blk, o, ldo, next, pf); break;
      case 3: q16_group512<VNNI, 3>(xm, K, blk, o, ldo, next, pf); break;
      case 4: q16_group512<VNNI, 4>(xm, K, blk, o, ldo, next, pf); break;
      case 5: q16_group512<VNNI, 5>(xm, K, blk, o, ldo, next, pf); break;
      case 6: q16_group512<VNNI, 6>(xm, K, blk, o, ldo, next, pf); break;
      case 7: q16_group512<VNNI, 7>(xm, K, blk, o, ldo, next, pf); break;
      case 8: q16_group512<VNNI, 8>(xm, K, blk, o, ldo, next, pf); break;
      default: q16_group512<VNNI, 9>(xm, K, blk, o, ldo, next, pf); break;
    }
  });
}

// AVX512-VNNI for the screen's products at the AVX-512 level, unless switched off (`set_vnni`: tests
// run the AVX512-BW path of a CPU without VNNI on one with it)
bool g_vnni = true;
bool has_vnni() {
  static const bool v = __builtin_cpu_supports("avx512vnni");
  return v && g_vnni;
}
// ... and AVX-VNNI for the AVX2 level's integer products (q16_half_vnni, q4_block_vnni, q2_block_vnni), under the same switch
bool has_avx_vnni() {
  static const bool v = __builtin_cpu_supports("avxvnni");
  return v && g_vnni;
}

float q16_dot_scalar(const int16_t* x, int64_t K, const int8_t* blk, int j) {
  int32_t s = 0;
  for (int64_t k = 0; k < K; k += 8)
    for (int l = 0; l < 8; ++l) s += int32_t{blk[k * kQB + 8 * j + l]} * int32_t{x[k + l]};
  return static_cast<float>(s);
}

// The screen's bookkeeping, 8 tokens v..v+7 (all < V) of one row at a time, with the scalar
// loops' operations in the same order (so the same bits). banned_mask: lanes whose token is banned.
__attribute__((target("avx2,fma,f16c"))) inline __m256 banned_mask(const bool* bn) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bn)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(b, _mm256_setzero_si256()));
}

// Scales the products a[0..7] in place to approximate logits a * (s * sh) and raises fl[0..7] to their lower
// bounds a - (hn * c + tiny), banned tokens skipped; a NaN bound keeps fl, like std::max(fl, bound).
__attribute__((target("avx2,fma,f16c"))) inline void screen8_floor(float* a, const float* s, float sh, const float* c,
                                                                   float hn, float tiny, const bool* bn, float* fl) {
  const __m256 av = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_mul_ps(_mm256_loadu_ps(s), _mm256_set1_ps(sh)));
  _mm256_storeu_ps(a, av);
  const __m256 b = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(hn), _mm256_loadu_ps(c)), _mm256_set1_ps(tiny));
  __m256 lower = _mm256_sub_ps(av, b);
  if (bn) lower = _mm256_blendv_ps(lower, _mm256_set1_ps(-INFINITY), banned_mask(bn));
  _mm256_storeu_ps(fl, _mm256_max_ps(lower, _mm256_loadu_ps(fl)));
}

// Bit l set: token l is a candidate (upper bound a + (hn * c + tiny) >= floor, not banned).
__attribute__((target("avx2,fma,f16c"))) inline int screen8_candidates(const float* a, const float* c, float hn,
                                                                       float tiny, const bool* bn, float floor) {
  const __m256 b = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(hn), _mm256_loadu_ps(c)), _mm256_set1_ps(tiny));
  int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(_mm256_loadu_ps(a), b), _mm256_set1_ps(floor), _CMP_GE_OQ));
  if (bn) bits &= ~_mm256_movemask_ps(banned_mask(bn));
  return bits;
}

// A banned-token mask, bool [V] (every row) or [N, V]: row r's flags at data + r * stride.
struct BannedRows {
  at::Tensor mask;  // the contiguous bool copy the pointer reads
  const bool* data = nullptr;
  int64_t stride = 0;
  BannedRows(const c10::optional<at::Tensor>& banned, int64_t N, int64_t V, const char* op) {
    if (!banned.has_value()) return;
    mask = banned->to(at::kBool).contiguous();
    TORCH_CHECK(mask.size(-1) == V && (mask.dim() == 1 || (mask.dim() == 2 && mask.size(0) == N)), op,
                ": banned must be [V] or [N, V]");
    data = mask.data_ptr<bool>();
    stride = mask.dim() == 2 ? V : 0;
  }
};

// The screen with the vocabulary split at `split` (Whisper's first timestamp; V: no split)
// -> (the exact argmax over the allowed tokens below it [N] (0 if none), its exact float32 logit
// [N] (gather_dot's arithmetic; -inf if none), and an upper bound on the log-sum-exp of the
// allowed tokens' logits from it on [N] float64: log Σ exp(fl(a_v + b_v)) in float64, each term
// bounding its exact logit from above (-inf if none)). Spec: head.py `ScreenedHead.split_reference`.
std::tuple<at::Tensor, at::Tensor, at::Tensor> screened_split(const at::Tensor& hidden, const at::Tensor& packed,
                                                              const at::Tensor& scale, const at::Tensor& bound,
                                                              const at::Tensor& weight, double tiny,
                                                              const c10::optional<at::Tensor>& banned, int64_t split) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 2,
              "screened_argmax: weight must be a contiguous float32 [V, K] matrix");
  const int64_t V = weight.size(0), K = weight.size(1), blocks = (V + kQB - 1) / kQB;
  TORCH_CHECK(K % 8 == 0, "screened_argmax: K must be a multiple of 8");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.numel() == blocks * kQB * K,
              "screened_argmax: packed must be int8 [ceil(V/8), K/8, 8, 8]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && bound.scalar_type() == at::kFloat && scale.numel() == V &&
              bound.numel() == V && scale.is_contiguous() && bound.is_contiguous(),
              "screened_argmax: scale and bound must be contiguous float32 [V]");
  at::Tensor h = as_float_rows(hidden);
  TORCH_CHECK(h.size(1) == K, "screened_argmax: hidden has ", h.size(1), " features, expected ", K);
  const int64_t N = h.size(0);
  const BannedRows ban(banned, N, V, "screened_argmax");
  const bool* bp = ban.data;
  const int64_t banned_stride = ban.stride;
  TORCH_CHECK(split >= 0 && split <= V, "screened_argmax: split ", split, " outside 0..", V);
  at::Tensor out = at::empty({N}, h.options().dtype(at::kLong));
  at::Tensor out_best = at::empty({N}, h.options());
  at::Tensor out_lse = at::empty({N}, h.options().dtype(at::kDouble));
  if (N == 0) return {out, out_best, out_lse};
  TORCH_CHECK(K <= 65536, "screened_argmax: at most 65536 features");
  at::Tensor hnorm = h.norm(2, {1}).contiguous();  // same as torch's hidden.norm(dim=1)
  at::Tensor approx = at::empty({N, blocks * kQB}, h.options());
  std::vector<int16_t> hq(N * K);  // the rows in 16 bits, and their scales (quantize_rows16)
  std::vector<float> hs(N);
  quantize_rows16(h.data_ptr<float>(), N, K, hq.data(), hs.data());
  const int16_t* xq = hq.data();
  const float* hp = h.data_ptr<float>();
  const int8_t* qp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* cp = bound.data_ptr<float>();
  const float* hn = hnorm.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* ap = approx.data_ptr<float>();
  const int64_t ld = blocks * kQB;
  const bool vec = has_avx2();
  const bool wide = vector_level() >= 2 && (N > 1 || wide_single_row);
  const bool vnni = wide && has_vnni(), avx_vnni = has_avx_vnni();
  const float tiny_f = static_cast<float>(tiny);
  // pass 1 (parallel over vocabulary blocks): approximate logits, and each chunk's best lower
  // bound per row
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / (kQB * K));
  const int64_t chunks = std::max<int64_t>(1, at::get_num_threads()) * 4;
  const int64_t per_chunk = std::max(grain, (blocks + chunks - 1) / chunks);
  const int64_t n_chunks = (blocks + per_chunk - 1) / per_chunk;
  std::vector<float> floors(n_chunks * N, -INFINITY);
  parallel_for(0, n_chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> lanes(vec ? N * kQB : 0);  // per row: the chunk's best lower bound in 8 lanes
    for (int64_t c = c0; c < c1; ++c) {
      std::fill(lanes.begin(), lanes.end(), -INFINITY);
      const int64_t b_end = std::min(blocks, (c + 1) * per_chunk);
      for (int64_t b = c * per_chunk; b < b_end; ++b) {
        const int8_t* blk = qp + b * kQB * K;
        float* o = ap + b * kQB;
        const int8_t* next = b + 1 < blocks ? blk + kQB * K : blk;
        if (wide) {
          if (vnni) q16_rows512<true>(xq, N, K, blk, next, o, ld);
          else q16_rows512<false>(xq, N, K, blk, next, o, ld);
        } else if (vec) {
          q16_rows(xq, N, K, blk, next, o, ld, avx_vnni);
        } else {
          for (int64_t m = 0; m < N; ++m)
            for (int j = 0; j < kQB; ++j) o[m * ld + j] = q16_dot_scalar(xq + m * K, K, blk, j);
        }
        for (int64_t r = 0; r < N; ++r) {
          const bool* bn = bp ? bp + r * banned_stride : nullptr;
          const int64_t v0 = b * kQB;
          if (vec && v0 + kQB <= split) {
            screen8_floor(ap + r * ld + v0, sp + v0, hs[r], cp + v0, hn[r], tiny_f, bn ? bn + v0 : nullptr,
                          lanes.data() + r * kQB);
            continue;
          }
          float& fl = floors[c * N + r];
          for (int64_t v = v0; v < std::min(V, v0 + kQB); ++v) {
            const float a = ap[r * ld + v] * (sp[v] * hs[r]);
            ap[r * ld + v] = a;
            if ((bn && bn[v]) || v >= split) continue;
            fl = std::max(fl, a - (hn[r] * cp[v] + tiny_f));
          }
        }
      }
      for (int64_t r = 0; r < (vec ? N : 0); ++r)
        for (int l = 0; l < kQB; ++l) floors[c * N + r] = std::max(floors[c * N + r], lanes[r * kQB + l]);
    }
  });
  int64_t* op = out.data_ptr<int64_t>();
  float* obest = out_best.data_ptr<float>();
  double* olse = out_lse.data_ptr<double>();
  // pass 2 (parallel over rows): candidates below the split and their exact logits; the upper
  // log-sum-exp from the split on
  parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float floor = -INFINITY;
      for (int64_t c = 0; c < n_chunks; ++c) floor = std::max(floor, floors[c * N + r]);
      const float* a = ap + r * ld;
      const bool* bn = bp ? bp + r * banned_stride : nullptr;
      const float* x = hp + r * K;
      int64_t best_id = -1;
      float best = -INFINITY;
      auto consider = [&](int64_t v) {
        const float exact = vec ? dot_avx2(x, wp + v * K, K) : dot_scalar(x, wp + v * K, K);
        if (best_id < 0 || exact > best) best = exact, best_id = v;  // ascending ids: ties keep the lowest
      };
      int64_t v = 0;
      if (vec)
        for (; v + kQB <= split; v += kQB)
          for (int bits = screen8_candidates(a + v, cp + v, hn[r], tiny_f, bn ? bn + v : nullptr, floor); bits;
               bits &= bits - 1)
            consider(v + __builtin_ctz(bits));
      for (; v < split; ++v) {
        if (bn && bn[v]) continue;
        if (a[v] + (hn[r] * cp[v] + tiny_f) >= floor) consider(v);
      }
      op[r] = best_id < 0 ? 0 : best_id;  // every token banned: 0, like argmax over all -inf
      obest[r] = best_id < 0 ? -INFINITY : best;
      olse[r] = -INFINITY;
      if (split == V) continue;
      // the upper bounds fl(a + b) as the screen's comparisons form them; a NaN bound makes the
      // sum NaN (a NaN row: no bound decides anything)
      double top = -INFINITY, total = 0.0;
      bool nan = false;
      for (int64_t u = split; u < V; ++u) {
        if (bn && bn[u]) continue;
        const float up = a[u] + (hn[r] * cp[u] + tiny_f);
        nan |= std::isnan(up);
        top = std::max(top, static_cast<double>(up));
      }
      if (nan || top == -INFINITY || top == INFINITY) {
        olse[r] = nan ? NAN : top;
        continue;
      }
      for (int64_t u = split; u < V; ++u) {
        if (bn && bn[u]) continue;
        total += std::exp(static_cast<double>(a[u] + (hn[r] * cp[u] + tiny_f)) - top);
      }
      olse[r] = top + std::log(total);
    }
  });
  return {out, out_best, out_lse};
}

at::Tensor screened_argmax(const at::Tensor& hidden, const at::Tensor& packed, const at::Tensor& scale,
                           const at::Tensor& bound, const at::Tensor& weight, double tiny,
                           const c10::optional<at::Tensor>& banned) {
  return std::get<0>(screened_split(hidden, packed, scale, bound, weight, tiny, banned, weight.size(0)));
}

// ------------------------------------------------------------------ int4 draft head
// A draft's greedy head (spec: specwhisper/model/head.py `Q4Head.argmax_reference`). Not exact, and
// it need not be: a draft only proposes, the target verifies every proposal. The vocabulary is
// screened in 4 bits (half the int8 screen's bytes: base's head 26.5 -> 13.3 MB a draft step), the
// `candidates` best approximations are rechecked in float32 (gather_dot's arithmetic) and the best
// of those is the proposal.
// packed: uint8 [ceil(V/8), K/32, 8, 16]: per block of 8 vocabulary rows and chunk of 32 features,
// row j's 16 bytes hold u = q + 8 (q = round(w / scale) in -7..7, scale = max|w| / 7) of feature b in the low nibble
// and of feature b + 16 in the high nibble, so one block streams as one sequential run.
// Row h is quantized to int8 p = round(h / s_h), s_h = max|h| / 127 (a zero or non-finite row:
// p = 0). P_v = sum_k q_vk p_k is an exact integer (the same at every vector level, in any order);
// the approximate logit is fl(fl(P_v) * scale_v) (s_h > 0 scales a row's logits alike).
// Candidates: the `candidates` largest approximate logits of unbanned tokens (ties to the lower id);
// the proposal: the candidate with the largest exact float32 logit (ties to the lower id; a NaN
// never wins: then the lowest candidate), 0 when every token is banned.
constexpr int64_t kQ4Chunk = 32;  // features per packed chunk (16 bytes a row)

// p [N, K] int8, sum(p) [N] and, if asked, the step s [N] (p = round(h / s), s = max|h| / 127; a
// zero or non-finite row: p = 0, s = 0) from h [N, K] float32 (torch's float32 division and round).
void quantize_rows8(const float* h, int64_t N, int64_t K, int8_t* p, int32_t* psum, float* step = nullptr) {
  for (int64_t r = 0; r < N; ++r) {
    const float* x = h + r * K;
    bool finite = true;
    const float mx = abs_max(x, K, finite);
    int8_t* q = p + r * K;
    int32_t sum = 0;
    const bool none = !finite || mx == 0.0f;
    const float s = mx / 127.0f;
    if (step) step[r] = none ? 0.0f : s;
    if (none) {
      std::fill(q, q + K, int8_t{0});
    } else {
      for (int64_t k = 0; k < K; ++k) {
        q[k] = static_cast<int8_t>(std::nearbyint(x[k] / s));
        sum += q[k];
      }
    }
    psum[r] = sum;
  }
}

// sum_k u[j, k] * p[k] for row j of one block (the scalar twin of q4_block).
int32_t q4_dot_scalar(const int8_t* x, int64_t K, const uint8_t* blk, int j) {
  int32_t acc = 0;
  for (int64_t c = 0; c < K / kQ4Chunk; ++c) {
    const uint8_t* w = blk + (c * kQB + j) * 16;
    const int8_t* xc = x + c * kQ4Chunk;
    for (int b = 0; b < 16; ++b) acc += (w[b] & 0x0F) * xc[b] + (w[b] >> 4) * xc[b + 16];
  }
  return acc;
}

// q4_block prefetches the copy this many bytes ahead of its reads (into L1): base's distilled draft's
// head (51865 x 512, 13 MB), 2 threads of a Zen 3 EPYC, alternated in one process: 1 row 0.90 -> 0.76
// ms (0.78-0.91 of the time over four runs), 2 rows 0.91-1.01, 4 rows 0.95; 8 KB ahead or into L2
// the same. Without it a thread's chunk of blocks is one sequential stream the hardware prefetchers
// alone do not keep ahead of (interleaving the thread's chunks block by block instead: 1.27x slower).
constexpr int64_t kQ4Prefetch = 4096;

// out[i * ldo + 2 j (+ 1)] = the sums of lanes 0-3 (4-7) of acc[i][j]: the 8 rows of a block (the
// 4-bit and 2-bit heads' kernels).
template <int MR>
__attribute__((target("avx2,fma,f16c"))) inline void store_block_sums(const __m256i (&acc)[MR][4], int32_t* out,
                                                                       int64_t ldo) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) {
      alignas(32) int32_t l[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(l), acc[i][j]);
      out[i * ldo + 2 * j] = (l[0] + l[1]) + (l[2] + l[3]);
      out[i * ldo + 2 * j + 1] = (l[4] + l[5]) + (l[6] + l[7]);
    }
}

// out[i * ldo + j] = sum_k u[j, k] * p_i[k] for MR int8 rows of x and the 8 rows of one block: a
// 32-byte load holds rows 2jj and 2jj+1 (16 bytes each); maddubs multiplies the unsigned nibbles
// by the row's signed features (|pair sum| <= 2 * 15 * 127: no saturation), madd sums pairs into
// int32 lanes 0-3 (row 2jj) and 4-7 (row 2jj+1). PF: prefetch kQ4Prefetch ahead, in the first group
// of rows only (the others read the lines it brought in; as q16_rows does). Against
// prefetching in every group, alternated 60 rounds (base-2l's head, 2 Zen 3 threads): 3 / 4 / 8 rows
// 0.955 / 0.962 / 0.971 of the time, within the noise (1 and 2 rows, the same code both ways, read
// 0.976 / 0.955).
//
// QUANT_BLOCK_FN(NAME, TARGET, FIELDS, STEP) defines NAME<MR, PF>: q4_block (FIELDS 2: a byte's low
// and high nibbles) or q2_block (FIELDS 4: its bit pairs); STEP(acc, u, xs) adds to the int32 lanes
// acc the products of a 32-byte load's FIELDS fields u[f] with the row's 16 features xs[f]
// broadcast to both halves: maddubs and madd (Q4_STEP_MADD, Q2_STEP_MADD) or, with AVX-VNNI (Intel's
// AVX2-level CPUs since Alder Lake, AMD's since Zen 5), vpdpbusd, which sums each 4 byte products
// into an int32 lane without saturating (Q4_STEP_DPBUSD, Q2_STEP_DPBUSD): 3 instructions a row for a
// 4-bit load where maddubs took 5, 6 for a 2-bit one where it took 9; the same exact sums, so the same bits.
// Each step's dpbusd chain starts from zero and is added to acc once, so the steps of successive
// chunks do not wait on each other's 5-cycle latency.
#define QUANT_BLOCK_FN(NAME, TARGET, FIELDS, STEP)                                                                   \
  template <int MR, bool PF>                                                                                         \
  __attribute__((target(TARGET))) void NAME(const int8_t* x, int64_t K, const uint8_t* blk, int32_t* out,            \
                                            int64_t ldo) {                                                           \
    constexpr int kFields = FIELDS, kBits = 8 / FIELDS, kChunk = 16 * FIELDS;                                        \
    const __m256i mask = _mm256_set1_epi8(static_cast<char>((1 << kBits) - 1)), ones = _mm256_set1_epi16(1);         \
    (void)ones;                                                                                                      \
    __m256i acc[MR][4];                                                                                              \
    for (int i = 0; i < MR; ++i)                                                                                     \
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_si256();                                                \
    for (int64_t c = 0; c < K / kChunk; ++c) {                                                                       \
      const uint8_t* p = blk + c * kQB * 16; /* 128 bytes: two cache lines */                                        \
      if (PF) {                                                                                                      \
        _mm_prefetch(reinterpret_cast<const char*>(p + kQ4Prefetch), _MM_HINT_T0);                                   \
        _mm_prefetch(reinterpret_cast<const char*>(p + kQ4Prefetch + 64), _MM_HINT_T0);                              \
      }                                                                                                              \
      __m256i xs[MR][kFields];                                                                                       \
      for (int i = 0; i < MR; ++i)                                                                                   \
        for (int f = 0; f < kFields; ++f)                                                                            \
          xs[i][f] = _mm256_broadcastsi128_si256(                                                                    \
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i * K + c * kChunk + 16 * f)));                   \
      for (int j = 0; j < 4; ++j) {                                                                                  \
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j));                          \
        __m256i u[kFields];                                                                                          \
        for (int f = 0; f < kFields; ++f) u[f] = _mm256_and_si256(_mm256_srli_epi16(w, kBits * f), mask);            \
        for (int i = 0; i < MR; ++i) acc[i][j] = STEP(acc[i][j], u, xs[i]);                                          \
      }                                                                                                              \
    }                                                                                                                \
    store_block_sums<MR>(acc, out, ldo);                                                                             \
  }
// |pair sum| <= 2 * 15 * 127 (4 bits), <= 2 * 3 * 127 and four of them <= 3048 (2 bits): no int16 saturation
#define Q4_STEP_MADD(acc, u, xs) \
  _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u[0], xs[0]), _mm256_maddubs_epi16(u[1], xs[1])), ones))
#define Q2_STEP_MADD(acc, u, xs)                                                                                      \
  _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u[0], xs[0]),       \
                                                                            _mm256_maddubs_epi16(u[1], xs[1])),      \
                                                           _mm256_add_epi16(_mm256_maddubs_epi16(u[2], xs[2]),       \
                                                                            _mm256_maddubs_epi16(u[3], xs[3]))),     \
                                          ones))
#define QB_DP(a, u, x) _mm256_dpbusd_avx_epi32(a, u, x)
#define Q4_STEP_DPBUSD(acc, u, xs) _mm256_add_epi32(acc, QB_DP(QB_DP(_mm256_setzero_si256(), u[0], xs[0]), u[1], xs[1]))
#define Q2_STEP_DPBUSD(acc, u, xs)                                                                           \
  _mm256_add_epi32(acc, _mm256_add_epi32(QB_DP(QB_DP(_mm256_setzero_si256(), u[0], xs[0]), u[1], xs[1]),     \
                                         QB_DP(QB_DP(_mm256_setzero_si256(), u[2], xs[2]), u[3], xs[3])))

// The 2-bit head (spec: head.py `Q2Head`): row v's u in 0..3 (2q = 2u - 3 in {-3, -1, 1, 3}), stored
// [ceil(V/8), K/64, 8, 16]: per block of 8 rows and chunk of 64 features, row j's byte b holds u of
// features b, b + 16, b + 32 and b + 48 in its bit pairs 0-1, 2-3, 4-5 and 6-7. Half the 4-bit
// copy's bytes; the products are exact integers as there.
constexpr int64_t kQ2Chunk = 64;  // features per packed chunk (16 bytes a row)

// sum_k u[j, k] * p[k] for row j of one block (the scalar twin of q2_block).
int32_t q2_dot_scalar(const int8_t* x, int64_t K, const uint8_t* blk, int j) {
  int32_t acc = 0;
  for (int64_t c = 0; c < K / kQ2Chunk; ++c) {
    const uint8_t* w = blk + (c * kQB + j) * 16;
    const int8_t* xc = x + c * kQ2Chunk;
    for (int b = 0; b < 16; ++b)
      acc += (w[b] & 3) * xc[b] + ((w[b] >> 2) & 3) * xc[b + 16] + ((w[b] >> 4) & 3) * xc[b + 32] +
             (w[b] >> 6) * xc[b + 48];
  }
  return acc;
}

// The 4-bit and 2-bit block products (QUANT_BLOCK_FN above): a 32-byte load holds rows 2jj and 2jj+1,
// each of its bit fields multiplies its 16 features.
QUANT_BLOCK_FN(q4_block, "avx2,fma,f16c", 2, Q4_STEP_MADD)
QUANT_BLOCK_FN(q4_block_vnni, "avx2,fma,f16c,avxvnni", 2, Q4_STEP_DPBUSD)
QUANT_BLOCK_FN(q2_block, "avx2,fma,f16c", 4, Q2_STEP_MADD)
QUANT_BLOCK_FN(q2_block_vnni, "avx2,fma,f16c,avxvnni", 4, Q2_STEP_DPBUSD)
#undef QUANT_BLOCK_FN
#undef Q4_STEP_MADD
#undef Q2_STEP_MADD
#undef Q4_STEP_DPBUSD
#undef Q2_STEP_DPBUSD
#undef QB_DP

// The same products with AVX512-VNNI: a 64-byte load holds rows 4h..4h+3 of a chunk (128-bit
// lane r: row 4h+r's 16 bytes), each bit field of it (4 bits: 2 fields, 2 bits: 4) multiplies its
// 16 features broadcast to every lane, vpdpbusd summing 4 byte products into each int32 lane; row
// 4h+r's product is the sum of lane r's 4 int32s. Exact integer sums (|a lane's step| <= 4 * 15 *
// 128), so the same values as q4_block / q2_block. base-2l's 2-bit head (Q2Head.argmax, cold, 2
// threads of a Zen 4 EPYC, alternated in one process), 1 / 2 / 3 rows: 0.385 / 0.580 / 0.851 ->
// 0.348 / 0.461 / 0.670 ms.
template <int Bits, int MR, bool PF>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni,avx2,fma,f16c"))) void quant_block512(
    const int8_t* x, int64_t K, const uint8_t* blk, int32_t* out, int64_t ldo) {
  constexpr int kFields = 8 / Bits, kChunk = 16 * kFields;  // bit fields a byte, features a chunk
  const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << Bits) - 1));
  __m512i a00 = _mm512_setzero_si512(), a01 = a00, a10 = a00, a11 = a00;  // row i, rows 4h..4h+3
  for (int64_t c = 0; c < K / kChunk; ++c) {
    const uint8_t* p = blk + c * kQB * 16;  // 128 bytes: two cache lines
    if (PF) {
      _mm_prefetch(reinterpret_cast<const char*>(p + kQ4Prefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + kQ4Prefetch + 64), _MM_HINT_T0);
    }
    const __m512i w0 = _mm512_loadu_si512(p), w1 = _mm512_loadu_si512(p + 64);
    for (int f = 0; f < kFields; ++f) {
      const __m512i u0 = _mm512_and_si512(_mm512_srli_epi16(w0, Bits * f), mask);
      const __m512i u1 = _mm512_and_si512(_mm512_srli_epi16(w1, Bits * f), mask);
      const int8_t* xc = x + c * kChunk + 16 * f;
      const __m512i x0 = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xc)));
      a00 = _mm512_dpbusd_epi32(a00, u0, x0);
      a01 = _mm512_dpbusd_epi32(a01, u1, x0);
      if constexpr (MR == 2) {
        const __m512i x1 = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xc + K)));
        a10 = _mm512_dpbusd_epi32(a10, u0, x1);
        a11 = _mm512_dpbusd_epi32(a11, u1, x1);
      }
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), lane_totals(a00, a01));
  if constexpr (MR == 2) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + ldo), lane_totals(a10, a11));
}

// Bits-bit heads (4: `Q4Head`, 2: `Q2Head`): one block's kernel, the products of a block, and a
// token's centered integer product (the exact q_v . p in the copy's integer units: 4-bit q = u - 8;
// 2-bit 2q = 2u - 3).
// vnni: AVX512-VNNI (quant_block512); avx_vnni: AVX-VNNI at the AVX2 level (q4_block_vnni, q2_block_vnni).
template <int Bits, int MR, bool PF>
inline void quant_block(const int8_t* x, int64_t K, const uint8_t* blk, int32_t* out, int64_t ldo, bool vnni,
                        bool avx_vnni) {
  if (vnni) quant_block512<Bits, MR, PF>(x, K, blk, out, ldo);
  else if constexpr (Bits == 4) avx_vnni ? q4_block_vnni<MR, PF>(x, K, blk, out, ldo) : q4_block<MR, PF>(x, K, blk, out, ldo);
  else avx_vnni ? q2_block_vnni<MR, PF>(x, K, blk, out, ldo) : q2_block<MR, PF>(x, K, blk, out, ldo);
}

// products[m * 8 + j] = sum_k u[j, k] * p_m[k] for the N int8 rows of x and the 8 rows of one block.
template <int Bits>
void quant_products(const int8_t* x, int64_t N, int64_t K, const uint8_t* blk, bool vec, int32_t* products) {
  int64_t m = 0;
  const bool vnni = vec && vector_level() >= 2 && has_vnni();  // AVX512-VNNI: quant_block512
  const bool avx_vnni = vec && has_avx_vnni();
  if (vec) {
    if (N == 1) {
      quant_block<Bits, 1, true>(x, K, blk, products, kQB, vnni, avx_vnni);
      return;
    }
    for (; m + 2 <= N; m += 2) {
      if (m == 0) quant_block<Bits, 2, true>(x, K, blk, products, kQB, vnni, avx_vnni);
      else quant_block<Bits, 2, false>(x + m * K, K, blk, products + m * kQB, kQB, vnni, avx_vnni);
    }
    if (m < N) quant_block<Bits, 1, false>(x + m * K, K, blk, products + m * kQB, kQB, vnni, avx_vnni);
  } else {
    for (; m < N; ++m)
      for (int j = 0; j < kQB; ++j)
        products[m * kQB + j] = Bits == 4 ? q4_dot_scalar(x + m * K, K, blk, j) : q2_dot_scalar(x + m * K, K, blk, j);
  }
}

template <int Bits>
inline int32_t centered(int32_t product, int32_t hsum) {
  return Bits == 4 ? product - 8 * hsum : 2 * product - 3 * hsum;
}

// The `count` best (value, id) of a list kept in descending value, ascending id among equal
// values; ids arrive in ascending order, so a later id never displaces an equal value.
struct TopList {
  std::vector<std::pair<float, int64_t>> items;
  int64_t count;
  explicit TopList(int64_t n) : count(n) { items.reserve(n + 1); }
  void offer(float a, int64_t v) {
    if (static_cast<int64_t>(items.size()) == count && !(a > items.back().first)) return;
    auto at = items.end();
    while (at != items.begin() && (at - 1)->first < a) --at;
    items.insert(at, {a, v});
    if (static_cast<int64_t>(items.size()) > count) items.pop_back();
  }
};

// A block's kQB approximate logits fl(fl(centered) * scale_v) (tokens v0.. v0 + kQB - 1 of a row whose
// int8 sum is hsum) offered to `top` in ascending id, banned ones (bn[v]) skipped. Once the list is
// full, a logit at or below its last entry is turned away by `offer`, and its last entry only rises
// as tokens are offered: so the 8 logits are first computed and compared at once, and a block
// with none above the last entry (almost every block: a few candidates among 51865 tokens) offers
// none, where each token's offer cost a dozen scalar operations (a compact draft's step, base-2l
// drafting base: 12% of its time). Three draft steps right after a 4-row verify pass, alternated in
// one process on a Zen 4 EPYC: base-2l 1.057x (2.05 -> 1.91 ms; held to AVX2 1.039x), tiny.en 1.057x.
template <int Bits>
__attribute__((target("avx2,fma,f16c"))) void offer_block_avx2(const int32_t* products, int32_t hsum, const float* scale,
                                                               int64_t v0, const bool* bn, TopList& top) {
  __m256i P = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(products));
  const __m256i h = _mm256_set1_epi32(hsum);
  P = Bits == 4 ? _mm256_sub_epi32(P, _mm256_slli_epi32(h, 3))
                : _mm256_sub_epi32(_mm256_add_epi32(P, P), _mm256_add_epi32(_mm256_add_epi32(h, h), h));
  const __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(P), _mm256_loadu_ps(scale + v0));
  int mask = 0xFF;
  if (static_cast<int64_t>(top.items.size()) == top.count)
    mask = _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(top.items.back().first), _CMP_GT_OQ));
  if (mask == 0) return;
  alignas(32) float vals[kQB];
  _mm256_store_ps(vals, a);
  for (int j = 0; j < kQB; ++j)
    if ((mask >> j & 1) && !(bn && bn[v0 + j])) top.offer(vals[j], v0 + j);
}

// The checked arguments of the 4-bit ops: sizes, the hidden rows in float32, and the vocabulary
// blocks split into chunks (about 4 a thread, at least 16 blocks each) for the parallel pass.
struct Q4Shape {
  int64_t V, K, blocks, per_chunk, n_chunks;
  at::Tensor h;
  Q4Shape(const at::Tensor& hidden, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& weight,
          const char* op, int bits = 4) {
    const int64_t chunk = bits == 4 ? kQ4Chunk : kQ2Chunk;
    TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 2, op,
                ": weight must be a contiguous float32 [V, K] matrix");
    V = weight.size(0), K = weight.size(1), blocks = (V + kQB - 1) / kQB;
    TORCH_CHECK(K % chunk == 0 && K <= 16384, op, ": K must be a multiple of ", chunk, ", at most 16384");
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                packed.numel() == blocks * kQB * K * bits / 8,
                op, ": packed must be uint8 [ceil(V/8), K/", chunk, ", 8, 16]");
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == V, op,
                ": scale must be contiguous float32 [V]");
    h = as_float_rows(hidden);
    TORCH_CHECK(h.size(1) == K, op, ": hidden has ", h.size(1), " features, expected ", K);
    const int64_t chunks = std::max<int64_t>(1, at::get_num_threads()) * 4;
    per_chunk = std::max<int64_t>(16, (blocks + chunks - 1) / chunks);
    n_chunks = (blocks + per_chunk - 1) / per_chunk;
  }
};

// Row r's best `count` over every chunk's list (tops[c * N + r]), in chunk order (ascending ids).
TopList merged(const std::vector<TopList>& tops, int64_t n_chunks, int64_t N, int64_t r, int64_t count) {
  TopList all(count);
  for (int64_t c = 0; c < n_chunks; ++c)
    for (const auto& item : tops[c * N + r].items) all.offer(item.first, item.second);
  return all;
}

// The proposal of a Bits-bit head (spec: head.py `Q4Head.argmax_reference`, `Q2Head`'s): the
// `candidates` best approximate logits fl(fl(centered) * scale_v) (ties to the lower id, banned tokens
// skipped), rechecked in float32.
template <int Bits>
at::Tensor quant_argmax(const at::Tensor& hidden, const at::Tensor& packed, const at::Tensor& scale,
                        const at::Tensor& weight, int64_t candidates, const c10::optional<at::Tensor>& banned,
                        const char* name, float* margins = nullptr) {
  const Q4Shape shape(hidden, packed, scale, weight, name, Bits);
  const int64_t V = shape.V, K = shape.K, blocks = shape.blocks;
  TORCH_CHECK(candidates >= 1, name, ": candidates must be >= 1");
  const at::Tensor& h = shape.h;
  const int64_t N = h.size(0);
  const BannedRows ban(banned, N, V, name);
  const bool* bp = ban.data;
  const int64_t banned_stride = ban.stride;
  at::Tensor out = at::empty({N}, h.options().dtype(at::kLong));
  if (N == 0) return out;
  std::vector<int8_t> hq(N * K);
  std::vector<int32_t> hsum(N);
  quantize_rows8(h.data_ptr<float>(), N, K, hq.data(), hsum.data());
  const int8_t* xq = hq.data();
  const uint8_t* qp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const bool vec = has_avx2();
  const int64_t per_chunk = shape.per_chunk, n_chunks = shape.n_chunks;
  std::vector<TopList> tops(n_chunks * N, TopList(candidates));
  parallel_for(0, n_chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<int32_t> products(N * kQB);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b_end = std::min(blocks, (c + 1) * per_chunk);
      for (int64_t b = c * per_chunk; b < b_end; ++b) {
        quant_products<Bits>(xq, N, K, qp + b * kQB * K * Bits / 8, vec, products.data());
        for (int64_t r = 0; r < N; ++r) {
          const bool* bn = bp ? bp + r * banned_stride : nullptr;
          TopList& top = tops[c * N + r];
          if (vec && (b + 1) * kQB <= V) {
            offer_block_avx2<Bits>(products.data() + r * kQB, hsum[r], sp, b * kQB, bn, top);
            continue;
          }
          for (int64_t v = b * kQB; v < std::min(V, (b + 1) * kQB); ++v) {
            if (bn && bn[v]) continue;
            const int32_t P = centered<Bits>(products[r * kQB + v - b * kQB], hsum[r]);
            top.offer(static_cast<float>(P) * sp[v], v);
          }
        }
      }
    }
  });
  const float* hp = h.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r) {
    const TopList all = merged(tops, n_chunks, N, r, candidates);
    std::vector<int64_t> ids;
    for (const auto& item : all.items) ids.push_back(item.second);
    std::sort(ids.begin(), ids.end());
    int64_t best_id = -1;
    float best = -INFINITY, second = -INFINITY;
    for (int64_t v : ids) {
      const float exact = vec ? dot_avx2(hp + r * K, wp + v * K, K) : dot_scalar(hp + r * K, wp + v * K, K);
      if (best_id < 0 || exact > best) {
        if (best_id >= 0) second = best;
        best = exact, best_id = v;
      } else if (exact > second) {
        second = exact;
      }
    }
    op[r] = best_id < 0 ? 0 : best_id;
    // the proposal's lead over the next candidate, exact logits (none above -inf: infinite)
    if (margins) margins[r] = second == -INFINITY ? INFINITY : best - second;
  }
  return out;
}

// margins (optional, float32 [N], written): each proposal's exact logit minus the best other
// candidate's (`draft_greedy`'s stopping rule; spec: head.py `Q4Head.argmax_reference`).
inline float* margin_rows(const c10::optional<at::Tensor>& margins, const at::Tensor& hidden, const char* name) {
  if (!margins) return nullptr;
  TORCH_CHECK(margins->scalar_type() == at::kFloat && margins->is_contiguous() &&
                  margins->numel() == hidden.numel() / std::max<int64_t>(1, hidden.size(-1)),
              name, ": margins must be contiguous float32 [N]");
  return margins->data_ptr<float>();
}

at::Tensor q4_argmax(const at::Tensor& hidden, const at::Tensor& packed, const at::Tensor& scale,
                     const at::Tensor& weight, int64_t candidates, const c10::optional<at::Tensor>& banned,
                     const c10::optional<at::Tensor>& margins) {
  return quant_argmax<4>(hidden, packed, scale, weight, candidates, banned, "q4_argmax",
                         margin_rows(margins, hidden, "q4_argmax"));
}

at::Tensor q2_argmax(const at::Tensor& hidden, const at::Tensor& packed, const at::Tensor& scale,
                     const at::Tensor& weight, int64_t candidates, const c10::optional<at::Tensor>& banned,
                     const c10::optional<at::Tensor>& margins) {
  return quant_argmax<2>(hidden, packed, scale, weight, candidates, banned, "q2_argmax",
                         margin_rows(margins, hidden, "q2_argmax"));
}

// A sampled draft's logits from the same 4-bit copy (spec: head.py `Q4Head.logits_reference`):
// every token's approximate logit fl(fl(P_v) * fl(scale_v * s_h)) (s_h = max|h| / 127, the row's
// int8 step; 0 for a zero or non-finite row), then the `candidates` largest (ties to the lower id)
// replaced by their exact float32 logits (gather_dot's arithmetic), where the race's winner lies.
// Not the draft's exact logits: its proposals (the target's race decides) and, under rejection
// sampling, the distribution they are drawn from and tested against, consistently.
at::Tensor q4_logits(const at::Tensor& hidden, const at::Tensor& packed, const at::Tensor& scale,
                     const at::Tensor& weight, int64_t candidates) {
  const Q4Shape shape(hidden, packed, scale, weight, "q4_logits");
  const int64_t V = shape.V, K = shape.K, blocks = shape.blocks;
  TORCH_CHECK(candidates >= 0, "q4_logits: candidates must be >= 0");
  const at::Tensor& h = shape.h;
  const int64_t N = h.size(0);
  at::Tensor out = at::empty({N, V}, h.options());
  if (N == 0) return out;
  std::vector<int8_t> hq(N * K);
  std::vector<int32_t> hsum(N);
  std::vector<float> step(N);  // the rows' int8 steps: their approximate logits' scale
  quantize_rows8(h.data_ptr<float>(), N, K, hq.data(), hsum.data(), step.data());
  const float* hp = h.data_ptr<float>();
  const int8_t* xq = hq.data();
  const uint8_t* qp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool vec = has_avx2();
  const int64_t per_chunk = shape.per_chunk, n_chunks = shape.n_chunks;
  const int64_t keep = std::min(candidates, V);
  std::vector<TopList> tops(n_chunks * N, TopList(std::max<int64_t>(keep, 1)));
  parallel_for(0, n_chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<int32_t> products(N * kQB);
    for (int64_t c = c0; c < c1; ++c) {
      for (int64_t b = c * per_chunk; b < std::min(blocks, (c + 1) * per_chunk); ++b) {
        quant_products<4>(xq, N, K, qp + b * kQB * K / 2, vec, products.data());
        for (int64_t r = 0; r < N; ++r)
          for (int64_t v = b * kQB; v < std::min(V, (b + 1) * kQB); ++v) {
            const float a = static_cast<float>(products[r * kQB + v - b * kQB] - 8 * hsum[r]) * (sp[v] * step[r]);
            op[r * V + v] = a;
            if (keep > 0) tops[c * N + r].offer(a, v);
          }
      }
    }
  });
  const float* wp = weight.data_ptr<float>();
  for (int64_t r = 0; r < N && keep > 0; ++r) {
    const TopList all = merged(tops, n_chunks, N, r, keep);
    for (const auto& item : all.items) {
      const int64_t v = item.second;
      op[r * V + v] = vec ? dot_avx2(hp + r * K, wp + v * K, K) : dot_scalar(hp + r * K, wp + v * K, K);
    }
  }
  return out;
}

// ------------------------------------------------------------------ int8 linear (drafts)
// out[M, N] = fl(fl(P[m, n] * s_m) * scale[n]) + bias[n] for packed int8 projections q [N/8, K/8, 8,
// 8] (the screen's block layout), P = q_n . p_m the exact integer product of row m rounded to 16
// bits (p_m = round(x_m / s_m), s_m = max|x_m| / q16_range(K): quantize_rows16, as the screen's),
// parallel over blocks of kQB rows, `finish` (its scale at least) applied in each section. The
// screen's 16-bit multiply-adds (AVX512-VNNI: vpdpwssd, 32 products an instruction) where float32
// FMAs of the widened int8 weights took four instructions for 16 products. Exact integer sums:
// the same outputs at every vector level. A draft only proposes (its rows' 16-bit rounding is
// ≈ 1e-4 of their largest feature): compact drafts' three steps after a 4-row verify pass,
// alternated in one process on a Zen 4 EPYC, base-2l 1.086x, tiny.en 1.039x (held to AVX2:
// vpmaddwd, 1.044x / 1.037x); k = 3 acceptance unchanged on six bench windows (base-2l 0.822,
// tiny.en 0.778) and the demo recording (0.723; tiny.en 0.825 -> 0.814).
constexpr int64_t kQ8OwnRows = 16;  // rows each thread quantizes for itself
void q8_matmul(const float* xp, int64_t M, int64_t K, const int8_t* qp, int64_t N, float* op, const Epilogue& finish) {
  const int64_t blocks = N / kQB;
  const int level = vector_level();
  const bool vnni = has_vnni(), avx_vnni = has_avx_vnni();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / (kQB * K));
  // the rows in 16 bits: a draft step's few quantized by each thread for itself (no serial gap
  // before the section), a prompt pass's many once
  const bool own = M <= kQ8OwnRows;
  std::vector<int16_t> shared_q(own ? 0 : M * K);
  std::vector<float> shared_s(own ? 0 : M);
  if (!own) quantize_rows16(xp, M, K, shared_q.data(), shared_s.data());
  parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<int16_t> own_q;
    thread_local std::vector<float> own_s;
    if (own) {
      own_q.resize(std::max(own_q.size(), static_cast<size_t>(M * K)));
      own_s.resize(std::max(own_s.size(), static_cast<size_t>(M)));
      quantize_rows16(xp, M, K, own_q.data(), own_s.data());
    }
    const int16_t* xq = own ? own_q.data() : shared_q.data();
    for (int64_t b = b0; b < b1; ++b) {
      const int8_t* blk = qp + b * kQB * K;
      float* o = op + b * kQB;
      if (level >= 2 && vnni) {
        q16_rows512<true>(xq, M, K, blk, nullptr, o, N);
      } else if (level >= 2) {
        q16_rows512<false>(xq, M, K, blk, nullptr, o, N);
      } else if (level >= 1) {
        q16_rows(xq, M, K, blk, nullptr, o, N, avx_vnni);
      } else {
        for (int64_t m = 0; m < M; ++m)
          for (int j = 0; j < kQB; ++j) o[m * N + j] = q16_dot_scalar(xq + m * K, K, blk, j);
      }
    }
    Epilogue scaled = finish;
    scaled.row_scale = own ? own_s.data() : shared_s.data();
    scaled.apply(op, M, N, b0 * kQB, b1 * kQB, level >= 1);
  });
}

// x [..., K] @ (scale[n] * q[n])^T + bias -> float32, with q int8 in the screen's block layout
// [N/8, K/8, 8, 8]: a quarter of float32's bytes, x's rows rounded to 16 bits (q8_matmul). For
// drafts only (proposals; the target verifies them). The same outputs at every vector level.
at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 4 &&
              packed.size(2) == kQB && packed.size(3) == 8, "linear_q8: packed must be int8 [N/8, K/8, 8, 8]");
  const int64_t N = packed.size(0) * kQB, K = packed.size(1) * 8;
  TORCH_CHECK(x.size(-1) == K, "linear_q8: x has ", x.size(-1), " features, weight expects ", K);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N,
              "linear_q8: scale must be float32 [N]");
  at::Tensor xf = as_float_rows(x);
  const int64_t M = xf.size(0);
  Epilogue finish;
  finish.scale = scale.data_ptr<float>();
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "linear_q8: bias has ", bias->numel(), " entries, expected ", N);
    bf = bias->to(at::kFloat).contiguous();
    finish.bias = bf.data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, xf.options());
  if (M > 0) q8_matmul(xf.data_ptr<float>(), M, K, packed.data_ptr<int8_t>(), N, out.data_ptr<float>(), finish);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.to(x.scalar_type()).view(shape);
}

// ------------------------------------------------------------------ attention
// exp for softmax weights: Cephes-style range reduction and polynomial, identical in the vector
// and scalar forms (no FMA contraction in the scalar form: explicit operations only).
constexpr float kExpHi = 88.3762626647949f, kExpLo = -88.3762626647949f;
constexpr float kLog2e = 1.44269504088896341f, kC1 = 0.693359375f, kC2 = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500E-4f, kP1 = 1.3981999507E-3f, kP2 = 8.3334519073E-3f,
                kP3 = 4.1665795894E-2f, kP4 = 1.6666665459E-1f, kP5 = 5.0000001201E-1f;

// Attention streams its values with prefetches this many bytes ahead (measured on a 2-core Xeon,
// cold caches, 6 layers of base's cross-attention, keys and values: 1.85 -> 1.3 ms at one query;
// without them, the values alone, on a Zen 4 EPYC, two pairs of alternating processes: 1 query
// 0.82 / 1.11 -> 0.86 / 1.36 ms, 5 queries 1.49 / 1.79 -> 2.11 / 2.25). Its keys are read as
// matmul_range's 4 long streams instead (attention_impl).
constexpr int64_t kAttnPrefetch = 4096;
constexpr int64_t kOwnValuePass = 9;  // AVX-512: 2..this many queries in groups of up to 6, more of up to 8
constexpr int64_t kValueChunk = 64;  // value rows per chunk (softmax_values_chunked_avx2)

// Prefetch value row `row` (64 elements) kAttnPrefetch bytes ahead: float32 rows (the target's,
// read once a step) as the weight streams (prefetch_stream), a draft's bfloat16 ones to L1.
template <typename T>
inline void prefetch_value_row(const T* row) {
  for (int l = 0; l < 64 * int(sizeof(T)); l += 64) {
    if (sizeof(T) == 4) prefetch_stream(reinterpret_cast<const char*>(row) + kAttnPrefetch + l);
    else _mm_prefetch(reinterpret_cast<const char*>(row) + kAttnPrefetch + l, _MM_HINT_T0);
  }
}

inline float exp_scalar(float x) {
  x = std::min(std::max(x, kExpLo), kExpHi);
  float fx = std::nearbyint(x * kLog2e);
  float t = fx * kC1;
  x = x - t;
  t = fx * kC2;
  x = x - t;
  float z = x * x;
  float y = kP0;
  y = y * x + kP1;
  y = y * x + kP2;
  y = y * x + kP3;
  y = y * x + kP4;
  y = y * x + kP5;
  y = y * z + x;
  y = y + 1.0f;
  int32_t e = static_cast<int32_t>(fx) + 127;
  float scale;
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 exp_avx2(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpHi));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(kC1)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(kC2)));
  __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(kP0);
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(kP1));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(kP2));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(kP3));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(kP4));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(kP5));
  y = _mm256_add_ps(_mm256_mul_ps(y, z), x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

// The largest of scores[0..n) (max is exact: any order gives the same value).
__attribute__((target("avx2,fma,f16c"))) inline float max_avx2(const float* scores, int64_t n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(scores + j));
  float lanes[8], best = -INFINITY;
  _mm256_storeu_ps(lanes, m);
  for (float v : lanes) best = std::max(best, v);
  for (; j < n; ++j) best = std::max(best, scores[j]);
  return best;
}

// exp(scores - best) in place for scores[0..n) -> their sum: 8 lane sums over the full groups of
// 8, hsum8's order, then the tail (softmax_weights_scalar is the same order).
__attribute__((target("avx2,fma,f16c"))) inline float softmax_weights_avx2(float* scores, int64_t n, float best) {
  int64_t j = 0;
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(best)));
    _mm256_storeu_ps(scores + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float total = hsum8(acc);
  for (; j < n; ++j) total += scores[j] = exp_scalar(scores[j] - best);
  return total;
}

float softmax_weights_scalar(float* scores, int64_t n, float best) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) lane[l] += scores[j + l] = exp_scalar(scores[j + l] - best);
  float total = hsum8_scalar(lane);
  for (; j < n; ++j) total += scores[j] = exp_scalar(scores[j] - best);
  return total;
}

__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The value sums of G queries (D == 64) with AVX-512, R registers (16 dimensions each) a query per
// pass over the value rows: w[g][0..n[g]) are the softmax weights of query g, total[g] their sum.
// R = 4 (a verify pass, G <= 6: 24 accumulators + 4 + 1 of the 32 zmm): one pass, each row's 64
// values serving every query, so the loop that streams V from memory does all the queries'
// arithmetic, where the chunks below stream a chunk for the first query, then compute the
// others' from L1 with the memory idle (base's six cross-attention layers, 1500 keys, cold, 2
// threads of a Zen 4 EPYC, alternated in one process against the chunks, paired: 2 / 3 / 5 / 9
// queries 1.036 / 1.046 / 1.094 / 1.087, 5: 1.471 -> 1.333 ms, keys included; one query keeps the
// chunks, 0.98; base's whole verify pass, blocks and head, cold: 2 / 3 / 4 / 5 rows 1.035 / 1.043 /
// 1.061 / 1.046). R = 2 (a prompt pass, groups of 8 queries): two passes of 32 dimensions. Each
// output element is the same chain of fmas over j ascending from zero as in
// softmax_values_chunked_avx2, then the same division: the same bits.
template <int G, int R, typename T>
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) void values512(const float* const* w, const int64_t* n,
                                                                        const float* total, const T* v, int64_t vs,
                                                                        float* const* out) {
  int64_t n_max = 0;
  for (int g = 0; g < G; ++g) n_max = std::max(n_max, n[g]);
  for (int c = 0; c < 64; c += 16 * R) {
    __m512 acc[G][R];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) acc[g][r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n_max; ++j) {
      const T* vj = v + j * vs + c;
      if (c == 0) prefetch_value_row(v + j * vs);
      __m512 vr[R];
      for (int r = 0; r < R; ++r) vr[r] = load16(vj + 16 * r);
      for (int g = 0; g < G; ++g)
        if (j < n[g]) {
          const __m512 p = _mm512_set1_ps(w[g][j]);
          for (int r = 0; r < R; ++r) acc[g][r] = _mm512_fmadd_ps(p, vr[r], acc[g][r]);
        }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 div = _mm512_set1_ps(total[g]);
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[g] + c + 16 * r, _mm512_div_ps(acc[g][r], div));
    }
  }
}

// Softmax-weighted value sums of Tq >= 2 queries (D == 64) with AVX-512: weights per query, then the
// value sums in balanced groups (values512): up to kOwnValuePass queries (a verify pass) in groups of
// up to 6, each in one pass over the value rows (R = 4), more (a prompt pass) in groups of up to 8
// (7 or 8: two passes, R = 2).
template <typename T>
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) void softmax_values_multi512(float* scores, int64_t ld,
                                                                                     const int64_t* n, int64_t Tq,
                                                                                     const T* v, int64_t vs,
                                                                                     float* out) {
  std::vector<float> total(Tq);
  std::vector<const float*> w(Tq);
  std::vector<float*> o(Tq);
  for (int64_t t = 0; t < Tq; ++t) {
    float* st = scores + t * ld;
    total[t] = softmax_weights_avx2(st, n[t], max_avx2(st, n[t]));
    w[t] = st, o[t] = out + t * 64;
  }
  // balanced groups: of up to 6 queries (a verify pass) or 8 (a prompt pass); up to 6 in one pass
  const int64_t most = Tq <= kOwnValuePass ? 6 : 8, groups = (Tq + most - 1) / most, per = (Tq + groups - 1) / groups;
  for (int64_t t = 0; t < Tq; t += per) {
    switch (std::min<int64_t>(per, Tq - t)) {
      case 1: values512<1, 4>(&w[t], n + t, &total[t], v, vs, &o[t]); break;
      case 2: values512<2, 4>(&w[t], n + t, &total[t], v, vs, &o[t]); break;
      case 3: values512<3, 4>(&w[t], n + t, &total[t], v, vs, &o[t]); break;
      case 4: values512<4, 4>(&w[t], n + t, &total[t], v, vs, &o[t]); break;
      case 5: values512<5, 4>(&w[t], n + t, &total[t], v, vs, &o[t]); break;
      case 6: values512<6, 4>(&w[t], n + t, &total[t], v, vs, &o[t]); break;
      case 7: values512<7, 2>(&w[t], n + t, &total[t], v, vs, &o[t]); break;
      default: values512<8, 2>(&w[t], n + t, &total[t], v, vs, &o[t]); break;
    }
  }
}

// Softmax-weighted value sums of Tq >= 1 queries (D == 64) through the value rows in chunks of
// kValueChunk: a chunk, still in L1, serves every query in turn (each query's 8 accumulators stored
// between chunks, exactly), where each query's own pass re-read V (the first from memory, the
// others from L2) and 16-dimension groups of queries re-read each row 4 times. Each output element
// is the same chain of fmas over j ascending from zero, then the same division, as the scalar form
// in softmax_values: the same bits for a query alone or among others. Base's six cross-attention
// layers (1500 keys), two Zen 3 cores, alternated in one process against a pass per query: 2 / 3 /
// 5 / 9 queries 0.89 / 0.84 / 0.82 / 0.83 of their time (5: 3.18 -> 2.60 ms), 16 / 40 / 140 queries
// 0.85 of the groups' time; one query 0.997 of its own pass's time (median of five runs), so it
// takes the chunks too. Chunks of 128 rows measured 0.85-0.87; prefetching a chunk ahead the same.
// Not kept (2026-12-01, held to AVX2 on a Zen 4, base's whole pass alternated in one process): each
// chunk in 4 passes of 16 dimensions with up to 6 queries' sums in registers (values512's form at
// AVX2), each pass prefetching its cache line of the rows a chunk or 16 rows ahead: 2 / 5 rows
// 4.24 -> 4.71 and 5.41 -> 5.70 ms (a line in 4 of each row, strided, is a slower stream).
template <typename T>
__attribute__((target("avx2,fma,f16c"))) void softmax_values_chunked_avx2(float* scores, int64_t ld, const int64_t* n,
                                                                          int64_t Tq, const T* v, int64_t vs,
                                                                          float* out) {
  std::vector<float> total(Tq);
  int64_t n_max = 0;
  for (int64_t t = 0; t < Tq; ++t) {
    float* st = scores + t * ld;
    total[t] = softmax_weights_avx2(st, n[t], max_avx2(st, n[t]));
    n_max = std::max(n_max, n[t]);
    std::fill(out + t * 64, out + t * 64 + 64, 0.0f);
  }
  for (int64_t j0 = 0; j0 < n_max; j0 += kValueChunk) {
    for (int64_t t = 0; t < Tq; ++t) {
      const int64_t j1 = std::min(j0 + kValueChunk, n[t]);
      float* o = out + t * 64;
      const float* w = scores + t * ld;
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_loadu_ps(o + 8 * i);
      for (int64_t j = j0; j < j1; ++j) {
        const __m256 p = _mm256_set1_ps(w[j]);
        const T* vj = v + j * vs;
        if (t == 0) prefetch_value_row(vj);
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(p, load8(vj + 8 * i), acc[i]);
      }
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(o + 8 * i, acc[i]);
    }
  }
  for (int64_t t = 0; t < Tq; ++t) {
    const __m256 div = _mm256_set1_ps(total[t]);
    float* o = out + t * 64;
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(o + 8 * i, _mm256_div_ps(_mm256_loadu_ps(o + 8 * i), div));
  }
}

// Softmax-weighted sum of values for one query whose scores[0..n) are computed (any D; the scalar
// level, and the form whose bits softmax_values_chunked_avx2 keeps for D == 64).
template <typename T>
void softmax_values(float* scores, const T* v, int64_t vs, int64_t n, int64_t D, bool vec, float* out) {
  float best = -INFINITY;
  if (vec) {
    best = max_avx2(scores, n);
  } else {
    for (int64_t j = 0; j < n; ++j) best = std::max(best, scores[j]);
  }
  const float total = vec ? softmax_weights_avx2(scores, n, best) : softmax_weights_scalar(scores, n, best);
  for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float p = scores[j];
    const T* vj = v + j * vs;
    for (int64_t d = 0; d < D; ++d) out[d] = std::fma(p, widen(vj[d]), out[d]);
  }
  for (int64_t d = 0; d < D; ++d) out[d] = out[d] / total;
}

// The scores of many queries (a prompt pass: attention_impl from kManyQueries queries, D a
// multiple of 8) with the keys packed transposed, 32 keys a block (kt[d * 32 + c] = key c's
// feature d, widened exactly): a query's feature d broadcast against 8 keys' in one register, so
// 3 queries x 32 keys take 12 accumulators and no horizontal sum per score. Each score is still
// matmul_range's dot product: lane l of its sum is the chain of fmas over features l, l + 8, ...
// from zero, and the 8 lanes are added in hsum8's pairs ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)):
// the same bits as one query alone. Base's six cross-attention layers (1500 keys, cold), 2 threads
// of a Zen 3 EPYC, alternated in one process against matmul_range's tiles: 200 queries (a
// long-form prompt) 0.67-0.81 of the time, 24 / 40 queries 0.85 / 0.94, 16 queries 0.94, 9 queries
// 1.05 (the packing then costs more than the sums it saves: from 16 queries); base's 200-position
// prompt pass 104.9 -> 97.3 ms.
constexpr int64_t kScoreKeys = 32;     // keys per packed block (4 registers)
constexpr int64_t kManyQueries = 16;  // queries from which attention_impl packs the keys

__attribute__((target("avx2,fma,f16c"))) inline void transpose8x8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20), r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20), r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31), r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31), r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// kt[d * 32 + c] = k[c * ks + d] (widened) for keys c < n (n <= 32; zero past n), d < D.
template <typename C>
__attribute__((target("avx2,fma,f16c"))) void pack_keys(const C* k, int64_t ks, int64_t n, int64_t D, float* kt) {
  for (int64_t c0 = 0; c0 < kScoreKeys; c0 += 8) {
    if (c0 + 8 <= n) {
      for (int64_t d0 = 0; d0 < D; d0 += 8) {
        __m256 r[8];
        for (int c = 0; c < 8; ++c) r[c] = load8(k + (c0 + c) * ks + d0);
        transpose8x8(r);
        for (int d = 0; d < 8; ++d) _mm256_storeu_ps(kt + (d0 + d) * kScoreKeys + c0, r[d]);
      }
    } else {
      for (int64_t d = 0; d < D; ++d)
        for (int64_t c = c0; c < c0 + 8; ++c) kt[d * kScoreKeys + c] = c < n ? widen(k[c * ks + d]) : 0.0f;
    }
  }
}

// scores[t * ldo + c] for MQ queries (rows of D at q) against a packed block of keys, c < width.
template <int MQ>
__attribute__((target("avx2,fma,f16c"))) void score_block(const float* q, int64_t D, const float* kt, float* out,
                                                          int64_t ldo, int64_t width) {
  __m256 part[8][MQ][4];
  for (int l = 0; l < 8; ++l) {
    __m256 acc[MQ][4];
    for (int t = 0; t < MQ; ++t)
      for (int v = 0; v < 4; ++v) acc[t][v] = _mm256_setzero_ps();
    for (int64_t d = l; d < D; d += 8) {
      __m256 qb[MQ];
      for (int t = 0; t < MQ; ++t) qb[t] = _mm256_broadcast_ss(q + t * D + d);
      for (int v = 0; v < 4; ++v) {
        const __m256 kv = _mm256_loadu_ps(kt + d * kScoreKeys + 8 * v);
        for (int t = 0; t < MQ; ++t) acc[t][v] = _mm256_fmadd_ps(kv, qb[t], acc[t][v]);
      }
    }
    for (int t = 0; t < MQ; ++t)
      for (int v = 0; v < 4; ++v) part[l][t][v] = acc[t][v];
  }
  for (int t = 0; t < MQ; ++t) {
    float s[kScoreKeys];
    for (int v = 0; v < 4; ++v) {
      const __m256 a0 = _mm256_add_ps(part[0][t][v], part[4][t][v]), a1 = _mm256_add_ps(part[1][t][v], part[5][t][v]);
      const __m256 a2 = _mm256_add_ps(part[2][t][v], part[6][t][v]), a3 = _mm256_add_ps(part[3][t][v], part[7][t][v]);
      const __m256 sum = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));
      if (width == kScoreKeys) _mm256_storeu_ps(out + t * ldo + 8 * v, sum);
      else _mm256_storeu_ps(s + 8 * v, sum);
    }
    if (width < kScoreKeys) std::copy(s, s + width, out + t * ldo);
  }
}

// scores[t * n + j] = q[t] . k[j] for Tq queries (rows of D at q) and keys j < n (rows at k, ks
// apart): matmul_range's bits (score_block).
template <typename C>
__attribute__((target("avx2,fma,f16c"))) void many_scores_avx2(const float* q, int64_t Tq, int64_t D, const C* k,
                                                               int64_t ks, int64_t n, float* scores) {
  std::vector<float> kt(D * kScoreKeys);
  for (int64_t j0 = 0; j0 < n; j0 += kScoreKeys) {
    const int64_t width = std::min(kScoreKeys, n - j0);
    pack_keys(k + j0 * ks, ks, width, D, kt.data());
    // the next block's keys into L1 while this one computes (its packing waited on memory)
    for (int64_t c = 0; c < std::min(kScoreKeys, n - j0 - kScoreKeys); ++c)
      for (int64_t b = 0; b < D * int64_t{sizeof(C)}; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(k + (j0 + kScoreKeys + c) * ks) + b, _MM_HINT_T0);
    int64_t t = 0;
    for (; t + 3 <= Tq; t += 3) score_block<3>(q + t * D, D, kt.data(), scores + t * n + j0, n, width);
    if (Tq - t == 2) score_block<2>(q + t * D, D, kt.data(), scores + t * n + j0, n, width);
    if (Tq - t == 1) score_block<1>(q + t * D, D, kt.data(), scores + t * n + j0, n, width);
  }
}

// q [B, T, H, D] (last dim contiguous, any other strides), caches [B, H, S, D] (rows of D
// contiguous), n_keys [B, T] int64 (keys 0..n-1 are read, n <= S) -> out [B, T, H * D] in q's
// dtype. q is scaled by `scale` (rounded to q's dtype, as the reference does) before the
// products. The scores of all T queries of a head come from one pass over its keys. T: q's
// dtype; C: the caches' (bfloat16 caches with float32 queries widen exactly, so they give the
// bits of float32 caches holding the same values).
// The same on raw pointers: q's strides qs[0..2] (b, t, h), the caches' ks / vs[0..2] (b, h, key).
template <typename T, typename C = T>
void attention_rows(const T* qp, const int64_t* qs, const C* kp, const int64_t* ks, const C* vp, const int64_t* vs,
                    const int64_t* np, int64_t B, int64_t Tq, int64_t H, int64_t D, double scale, T* op) {
  const bool vec = has_avx2();
  parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / H, h = task % H;
      int64_t n_max = 0;
      for (int64_t t = 0; t < Tq; ++t) n_max = std::max(n_max, np[b * Tq + t]);
      std::vector<float> qf(Tq * D), scores(Tq * n_max), of(Tq * D);
      for (int64_t t = 0; t < Tq; ++t) {
        const T* qv = qp + b * qs[0] + t * qs[1] + h * qs[2];
        for (int64_t d = 0; d < D; ++d) qf[t * D + d] = widen(static_cast<T>(widen(qv[d]) * static_cast<float>(scale)));
      }
      const C* kbh = kp + b * ks[0] + h * ks[1];
      const C* vbh = vp + b * vs[0] + h * vs[1];
      // all the keys in one matmul_range: its tiles read them as 4 long streams (a quarter of the
      // keys each), which the hardware prefetchers follow; chunks of 16 keys, each prefetching
      // kAttnPrefetch bytes ahead, were slower (base's six cross-attention layers, 1500 keys,
      // cold, 2 threads of a Zen 4 EPYC, alternated in one process: 1 query 1.60 -> 1.50 ms,
      // 5 queries 2.60 -> 1.95; held to AVX2 1.32 -> 1.22, 2.21 -> 1.84). A score is one dot
      // product whatever the tiling
      if (vec && Tq >= kManyQueries && D % 8 == 0)
        many_scores_avx2(qf.data(), Tq, D, kbh, ks[2], n_max, scores.data());
      else
        matmul_range(qf.data(), Tq, D, kbh, 0, n_max, scores.data(), n_max, vec);
      // one pass over V in chunks that serve every query (softmax_values_chunked_avx2), or with
      // AVX-512 and several queries one pass whose rows serve them all (a verify pass) or the
      // 32-dimension groups (a prompt pass; all read contiguous value rows: decode_attention
      // checks the caches' last stride)
      if (vec && D == 64 && Tq >= 2 && vector_level() >= 2) {
        softmax_values_multi512(scores.data(), n_max, np + b * Tq, Tq, vbh, vs[2], of.data());
      } else if (vec && D == 64) {
        softmax_values_chunked_avx2(scores.data(), n_max, np + b * Tq, Tq, vbh, vs[2], of.data());
      } else {
        for (int64_t t = 0; t < Tq; ++t)
          softmax_values(scores.data() + t * n_max, vbh, vs[2], np[b * Tq + t], D, vec, of.data() + t * D);
      }
      for (int64_t t = 0; t < Tq; ++t) {
        T* o = op + ((b * Tq + t) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(of[t * D + d]);
      }
    }
  });
}

template <typename T, typename C = T>
void attention_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& n_keys,
                    double scale, at::Tensor& out) {
  const auto qs = q.strides(), ks = kc.strides(), vs = vc.strides();
  attention_rows<T, C>(reinterpret_cast<const T*>(q.data_ptr()), qs.data(), reinterpret_cast<const C*>(kc.data_ptr()),
                       ks.data(), reinterpret_cast<const C*>(vc.data_ptr()), vs.data(), n_keys.data_ptr<int64_t>(),
                       q.size(0), q.size(1), q.size(2), q.size(3), scale, reinterpret_cast<T*>(out.data_ptr()));
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& n_keys, double scale) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4, "decode_attention: q [B,T,H,D], caches [B,H,S,D]");
  TORCH_CHECK(q.stride(3) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
              k_cache.stride(2) == k_cache.size(3), "decode_attention: last dims and key rows must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
              (q.scalar_type() == k_cache.scalar_type() ||
               (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16)),
              "decode_attention: q and caches must share a dtype (or float32 q with bfloat16 caches)");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == q.size(0) && k_cache.size(1) == q.size(2) &&
              k_cache.size(3) == q.size(3), "decode_attention: shape mismatch");
  TORCH_CHECK(n_keys.scalar_type() == at::kLong && n_keys.is_contiguous() && n_keys.dim() == 2 &&
              n_keys.size(0) == q.size(0) && n_keys.size(1) == q.size(1), "decode_attention: n_keys must be int64 [B, T]");
  const int64_t* np = n_keys.data_ptr<int64_t>();
  for (int64_t i = 0; i < n_keys.numel(); ++i)
    TORCH_CHECK(np[i] >= 1 && np[i] <= k_cache.size(2), "decode_attention: n_keys ", np[i], " outside 1..", k_cache.size(2));
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2) * q.size(3)}, q.options());
  if (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16)
    attention_impl<float, bf16>(q, k_cache, v_cache, n_keys, scale, out);
  else if (q.scalar_type() == at::kFloat)
    attention_impl<float>(q, k_cache, v_cache, n_keys, scale, out);
  else if (q.scalar_type() == at::kBFloat16)
    attention_impl<bf16>(q, k_cache, v_cache, n_keys, scale, out);
  else
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16 only");
  return out;
}

// cache[b, h, pos[b, t], :] = new[b, t, h, :] for both caches (new: [B, T, H, D], last dim
// contiguous; caches [B, H, S, D]).
void kv_write(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos) {
  TORCH_CHECK(k.dim() == 4 && k.stride(3) == 1 && v.stride(3) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "kv_write: last dims must be contiguous");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(), "kv_write: dtype mismatch");
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_contiguous() && pos.size(0) == k.size(0) && pos.size(1) == k.size(1),
              "kv_write: pos must be int64 [B, T]");
  const int64_t B = k.size(0), T = k.size(1), H = k.size(2), D = k.size(3), S = k_cache.size(2);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t es = k.element_size();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = pp[b * T + t];
      TORCH_CHECK(p >= 0 && p < S, "kv_write: position ", p, " outside the cache");
      for (int64_t h = 0; h < H; ++h) {
        for (auto [cache, src] : {std::pair<at::Tensor*, const at::Tensor*>{&k_cache, &k}, {&v_cache, &v}}) {
          char* dst = static_cast<char*>(cache->data_ptr()) +
                      (b * cache->stride(0) + h * cache->stride(1) + p * cache->stride(2)) * es;
          const char* s = static_cast<const char*>(src->data_ptr()) +
                          (b * src->stride(0) + t * src->stride(1) + h * src->stride(2)) * es;
          std::memcpy(dst, s, D * es);
        }
      }
    }
}

// ------------------------------------------------------------------ appending a pass's tokens
// The bookkeeping of `Runner.commit_target` in one call (spec: backends/cpu_ops.py
// commit_tokens_reference): per row i of slot s = slots[i], append the first m of choice[i]
// (m = n_emit[i], cut after the first EOT among them and at the budget; 0 for a done row) to
// tokens[s] at n_tokens[s], advance n_tokens[s] by m and set done[s] when the row's last token is
// EOT or its length reached the budget -> m [B]. A step's ≈ 30 tiny tensor ops on a CPU, which
// cost more than they compute.
at::Tensor commit_tokens(at::Tensor tokens, at::Tensor n_tokens, at::Tensor done, const at::Tensor& budget,
                         const at::Tensor& slots, const at::Tensor& choice, const at::Tensor& n_emit, int64_t eot) {
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 2 && tokens.stride(1) == 1,
              "commit_tokens: tokens must be int64 [S, L] with contiguous rows");
  TORCH_CHECK(n_tokens.scalar_type() == at::kLong && budget.scalar_type() == at::kLong && done.scalar_type() == at::kBool
              && n_tokens.dim() == 1 && budget.dim() == 1 && done.dim() == 1,
              "commit_tokens: n_tokens, budget int64 [S], done bool [S]");
  TORCH_CHECK(choice.scalar_type() == at::kLong && choice.dim() == 2 && slots.scalar_type() == at::kLong
              && n_emit.scalar_type() == at::kLong && slots.dim() == 1 && n_emit.dim() == 1
              && slots.size(0) == choice.size(0) && n_emit.size(0) == choice.size(0),
              "commit_tokens: choice int64 [B, T], slots and n_emit int64 [B]");
  const int64_t B = choice.size(0), T = choice.size(1), S = tokens.size(0), L = tokens.size(1);
  auto m_out = at::empty({B}, choice.options());
  int64_t* mp = m_out.data_ptr<int64_t>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  int64_t* np = n_tokens.data_ptr<int64_t>();
  bool* dp = done.data_ptr<bool>();
  const int64_t* bp = budget.data_ptr<int64_t>();
  const auto ch = choice.accessor<int64_t, 2>();
  const auto sl = slots.accessor<int64_t, 1>();
  const auto ne = n_emit.accessor<int64_t, 1>();
  const int64_t ts = tokens.stride(0), ns = n_tokens.stride(0), ds = done.stride(0), bs = budget.stride(0);
  for (int64_t i = 0; i < B; ++i) {
    const int64_t s = sl[i];
    TORCH_CHECK(s >= 0 && s < S, "commit_tokens: slot ", s, " outside the pool");
    const int64_t n = np[s * ns], cap = bp[s * bs];
    int64_t m = std::min(ne[i], T + 1);
    for (int64_t t = 0; t < std::min(ne[i], T); ++t)
      if (ch[i][t] == eot) { m = std::min(m, t + 1); break; }
    m = dp[s * ds] ? 0 : std::max<int64_t>(0, std::min(m, cap - n));
    TORCH_CHECK(m <= T && n + m <= L, "commit_tokens: row ", s, " would append past its buffer");
    for (int64_t t = 0; t < m; ++t) tp[s * ts + n + t] = ch[i][t];
    const int64_t n_new = n + m;
    np[s * ns] = n_new;
    if (n_new >= 1 && (tp[s * ts + n_new - 1] == eot || n_new >= cap)) dp[s * ds] = true;
    mp[i] = m;
  }
  return m_out;
}

// Whisper's rule mask [N, V] bool (spec: specwhisper/engine/rules.py `rule_mask_reference`;
// `rules.rule_mask` builds the same from column ranges in ~15 tensor ops, which cost a long-form
// step more than the mask's 52 KB a row of writes). Every state argument is [N]: at_begin,
// timestamps bool; n_sampled, last, penultimate, last_timestamp, max_initial int64. suppress:
// bool [V]; blank_ids: int64 ids. Needs eot < no_timestamps < timestamp_begin <= V.
at::Tensor rule_mask(const at::Tensor& at_begin, const at::Tensor& timestamps, const at::Tensor& n_sampled,
                     const at::Tensor& last, const at::Tensor& penultimate, const at::Tensor& last_timestamp,
                     const at::Tensor& max_initial, const at::Tensor& suppress, const at::Tensor& blank_ids,
                     int64_t eot, int64_t no_timestamps, int64_t tb) {
  const int64_t N = at_begin.size(0), V = suppress.size(0);
  TORCH_CHECK(suppress.scalar_type() == at::kBool && suppress.dim() == 1 && blank_ids.scalar_type() == at::kLong,
              "rule_mask: suppress bool [V], blank_ids int64");
  TORCH_CHECK(0 <= eot && eot < no_timestamps && no_timestamps < tb && tb <= V,
              "rule_mask: needs eot < no_timestamps < timestamp_begin <= V");
  for (const at::Tensor* t : {&at_begin, &timestamps})
    TORCH_CHECK(t->scalar_type() == at::kBool && t->dim() == 1 && t->size(0) == N, "rule_mask: flags bool [N]");
  for (const at::Tensor* t : {&n_sampled, &last, &penultimate, &last_timestamp, &max_initial})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == N, "rule_mask: states int64 [N]");
  at::Tensor mask = at::empty({N, V}, suppress.options());
  const at::Tensor sup = suppress.contiguous(), blank = blank_ids.contiguous();
  const bool* sp = sup.data_ptr<bool>();
  const int64_t* bl = blank.data_ptr<int64_t>();
  const int64_t n_blank = blank.numel();
  const auto ab = at_begin.accessor<bool, 1>(), ts = timestamps.accessor<bool, 1>();
  const auto ns = n_sampled.accessor<int64_t, 1>(), la = last.accessor<int64_t, 1>(),
             pe = penultimate.accessor<int64_t, 1>(), lt = last_timestamp.accessor<int64_t, 1>(),
             mi = max_initial.accessor<int64_t, 1>();
  bool* mp = mask.data_ptr<bool>();
  for (int64_t r = 0; r < N; ++r) {
    bool* row = mp + r * V;
    const bool begin = ab[r], stamped = ts[r];
    const bool last_was_ts = ns[r] >= 1 && la[r] >= tb;
    const bool penultimate_was_ts = ns[r] < 2 || pe[r] >= tb;
    const bool open_pair = last_was_ts && !penultimate_was_ts;
    // timestamps from `upper` on are allowed (upper <= tb: no timestamp yet), up to `limit`
    const int64_t upper = open_pair ? lt[r] : lt[r] + 1;
    const int64_t limit = begin && mi[r] >= 0 ? tb + mi[r] : V;  // the last allowed first timestamp
    std::memset(row, stamped && (open_pair || begin), eot);  // text
    std::memset(row + eot, stamped && begin, tb - eot);  // EOT and the other special tokens
    if (stamped) row[no_timestamps] = true;
    if (!stamped) {
      std::memset(row + tb, 0, V - tb);
    } else if (last_was_ts && penultimate_was_ts) {
      std::memset(row + tb, 1, V - tb);  // after a closed pair: text or EOT
    } else {
      const int64_t lo = std::min(std::max(upper, tb), V), hi = std::min(std::max(limit + 1, lo), V);
      std::memset(row + tb, 1, lo - tb);
      std::memset(row + lo, 0, hi - lo);
      std::memset(row + hi, 1, V - hi);
    }
    if (begin)
      for (int64_t i = 0; i < n_blank; ++i) row[bl[i]] = true;
    for (int64_t v = 0; v < V; ++v) row[v] |= sp[v];
  }
  return mask;
}

// The rules' per-position state (spec: specwhisper/engine/choosing.py `rule_state_reference`):
// for pass row b (slot slots[b]) and position t, predicting token index p = predicted[b, t], over
// the slot's tokens with the row's `proposed` [B, k] written at n_tokens.. (k may be 0):
// (at_begin, timestamps, n_sampled, last, penultimate, last_timestamp, max_initial), each [B * T].
std::vector<at::Tensor> rule_state(const at::Tensor& tokens, const at::Tensor& n_tokens, const at::Tensor& prompt_len,
                                   const at::Tensor& timestamps, const at::Tensor& max_initial,
                                   const at::Tensor& slots, const at::Tensor& predicted, const at::Tensor& proposed,
                                   int64_t tb) {
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 2, "rule_state: tokens int64 [S, L]");
  TORCH_CHECK(predicted.scalar_type() == at::kLong && predicted.dim() == 2 && slots.scalar_type() == at::kLong &&
              slots.dim() == 1 && slots.size(0) == predicted.size(0),
              "rule_state: slots int64 [B], predicted int64 [B, T]");
  TORCH_CHECK(proposed.scalar_type() == at::kLong && proposed.dim() == 2 &&
              (proposed.size(1) == 0 || proposed.size(0) == predicted.size(0)),
              "rule_state: proposed int64 [B, k]");
  TORCH_CHECK(timestamps.scalar_type() == at::kBool, "rule_state: timestamps bool [S]");
  const int64_t B = predicted.size(0), T = predicted.size(1), S = tokens.size(0), L = tokens.size(1);
  const int64_t k = proposed.size(1);
  const auto tok = tokens.accessor<int64_t, 2>();
  const auto nt = n_tokens.accessor<int64_t, 1>(), pl = prompt_len.accessor<int64_t, 1>(),
             mi = max_initial.accessor<int64_t, 1>(), sl = slots.accessor<int64_t, 1>();
  const auto tsf = timestamps.accessor<bool, 1>();
  const auto pred = predicted.accessor<int64_t, 2>(), prop = proposed.accessor<int64_t, 2>();
  const auto i64 = predicted.options(), b8 = predicted.options().dtype(at::kBool);
  at::Tensor at_begin = at::empty({B * T}, b8), stamped = at::empty({B * T}, b8);
  at::Tensor n_sampled = at::empty({B * T}, i64), last = at::empty({B * T}, i64), pen = at::empty({B * T}, i64),
             last_ts = at::empty({B * T}, i64), max_init = at::empty({B * T}, i64);
  bool* abp = at_begin.data_ptr<bool>();
  bool* stp = stamped.data_ptr<bool>();
  int64_t *nsp = n_sampled.data_ptr<int64_t>(), *lap = last.data_ptr<int64_t>(), *pep = pen.data_ptr<int64_t>(),
          *ltp = last_ts.data_ptr<int64_t>(), *mip = max_init.data_ptr<int64_t>();
  std::vector<int64_t> seq(L), running(L);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s = sl[b];
    TORCH_CHECK(s >= 0 && s < S, "rule_state: slot ", s, " outside the pool");
    for (int64_t j = 0; j < L; ++j) seq[j] = tok[s][j];
    for (int64_t j = 0; j < k; ++j) {
      const int64_t at = nt[s] + j;
      TORCH_CHECK(at >= 0 && at < L, "rule_state: proposal ", j, " of row ", b, " past the buffer");
      seq[at] = std::max<int64_t>(prop[b][j], 0);
    }
    const int64_t start = pl[s];
    int64_t best = -1;  // the largest timestamp among the generated tokens up to j (cummax)
    for (int64_t j = 0; j < L; ++j) {
      if (j >= start && seq[j] >= tb) best = std::max(best, seq[j]);
      running[j] = best;
    }
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = pred[b][t], i = b * T + t;
      TORCH_CHECK(p >= 0 && p <= L, "rule_state: predicted index ", p, " outside 0..", L);
      const int64_t before = std::max<int64_t>(p - 1, 0), before2 = std::max<int64_t>(p - 2, 0);
      TORCH_CHECK(before < L, "rule_state: predicted index past the buffer");
      abp[i] = p == start;
      stp[i] = tsf[s];
      nsp[i] = p - start;
      lap[i] = seq[before];
      pep[i] = seq[before2];
      ltp[i] = p - start > 0 ? running[before] : -1;
      mip[i] = mi[s];
    }
  }
  return {at_begin, stamped, n_sampled, last, pen, last_ts, max_init};
}

// ------------------------------------------------------------------ layer norm and gelu
// A step's layer norms, gelu and residual adds (spec: backends/cpu_ops.py `layer_norm_reference`,
// `gelu_reference`; equal to float rounding, the gelu's erf within 1.5e-7). torch's own norm and
// gelu took 12 and 27 us a call in a profiled step (on the caches a step's streaming leaves cold);
// with these, alternated in one process (2 threads of a Zen 4 EPYC, cold): base's step for 1 row
// 5.40 -> 5.07 ms, 5 rows 6.26 -> 5.99 (held to AVX2 5.03 -> 4.77, 6.07 -> 6.02); compact draft
// steps base-2l 0.94 -> 0.82 ms, tiny.en 2.09 -> 1.81 (AVX2 1.04 -> 0.94, 1.54 -> 1.32). And
// no torch op of a step starts an OpenMP team of its own off the main thread (see SpinPool). The
// AVX2 and scalar forms do the same operations in the same order.

// The mean of x[0..d) and the mean of (x - mean)^2: 8 lane sums over whole groups of 8 (the
// squares as a product then a sum), hsum8's order, then the tail.
__attribute__((target("avx2,fma,f16c"))) std::pair<float, float> moments(const float* x, int64_t d, bool vec) {
  int64_t i = 0;
  float total;
  if (vec) {
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= d; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + i));
    total = hsum8(acc);
  } else {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; i + 8 <= d; i += 8)
      for (int l = 0; l < 8; ++l) lane[l] = lane[l] + x[i + l];
    total = hsum8_scalar(lane);
  }
  for (; i < d; ++i) total = total + x[i];
  const float mean = total / static_cast<float>(d);
  i = 0;
  if (vec) {
    const __m256 mean8 = _mm256_set1_ps(mean);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= d; i += 8) {
      const __m256 t = _mm256_sub_ps(_mm256_loadu_ps(x + i), mean8);
      acc = _mm256_add_ps(acc, _mm256_mul_ps(t, t));
    }
    total = hsum8(acc);
  } else {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; i + 8 <= d; i += 8)
      for (int l = 0; l < 8; ++l) {
        const float t = x[i + l] - mean;
        lane[l] = lane[l] + t * t;
      }
    total = hsum8_scalar(lane);
  }
  for (; i < d; ++i) {
    const float t = x[i] - mean;
    total = total + t * t;
  }
  return {mean, total / static_cast<float>(d)};
}

// y = (x - mean) * rstd * w + b over each row of x [M, d]; mean and the (biased) variance in
// float32, rstd = 1 / sqrt(var + eps). T: x's and y's dtype, P: the parameters'.
template <typename T, typename P>
__attribute__((target("avx2,fma,f16c"))) void layer_norm_rows(const T* x, int64_t M, int64_t d, const P* w, const P* b,
                                                             float eps, T* y, bool vec) {
  std::vector<float> row(d), wf(d), bf(d);
  for (int64_t i = 0; i < d; ++i) wf[i] = widen(w[i]), bf[i] = widen(b[i]);
  for (int64_t m = 0; m < M; ++m) {
    float* r = row.data();  // the row in float32, normalized in place, then rounded to T
    for (int64_t i = 0; i < d; ++i) r[i] = widen(x[m * d + i]);
    const auto [mean, var] = moments(r, d, vec);
    const float rstd = 1.0f / std::sqrt(var + eps);
    int64_t i = 0;
    if (vec) {
      const __m256 mean8 = _mm256_set1_ps(mean), rstd8 = _mm256_set1_ps(rstd);
      for (; i + 8 <= d; i += 8) {
        const __m256 t = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(r + i), mean8), rstd8);
        _mm256_storeu_ps(r + i, _mm256_add_ps(_mm256_mul_ps(t, _mm256_loadu_ps(&wf[i])), _mm256_loadu_ps(&bf[i])));
      }
    }
    for (; i < d; ++i) r[i] = (r[i] - mean) * rstd * wf[i] + bf[i];
    for (int64_t j = 0; j < d; ++j) y[m * d + j] = static_cast<T>(r[j]);
  }
}

// erf (Abramowitz & Stegun 7.1.26, absolute error below 1.5e-7): for a = |x|, t = 1 / (1 + p a),
// erf = 1 - t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) exp(-a^2), with x's sign.
constexpr float kErfP = 0.3275911f, kErfA1 = 0.254829592f, kErfA2 = -0.284496736f, kErfA3 = 1.421413741f,
                kErfA4 = -1.453152027f, kErfA5 = 1.061405429f;

inline float gelu_scalar(float x) {
  const float a = std::fabs(x * 0.70710678118654752f);
  const float t = 1.0f / (1.0f + kErfP * a);
  float poly = kErfA5;
  poly = poly * t + kErfA4;
  poly = poly * t + kErfA3;
  poly = poly * t + kErfA2;
  poly = poly * t + kErfA1;
  const float e = 1.0f - poly * t * exp_scalar(-(a * a));
  const float erf = x < 0.0f ? -e : e;
  return 0.5f * x * (1.0f + erf);
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 gelu_avx2(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 a = _mm256_andnot_ps(sign, _mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f)));
  const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(_mm256_set1_ps(kErfP), a)));
  __m256 poly = _mm256_set1_ps(kErfA5);
  poly = _mm256_add_ps(_mm256_mul_ps(poly, t), _mm256_set1_ps(kErfA4));
  poly = _mm256_add_ps(_mm256_mul_ps(poly, t), _mm256_set1_ps(kErfA3));
  poly = _mm256_add_ps(_mm256_mul_ps(poly, t), _mm256_set1_ps(kErfA2));
  poly = _mm256_add_ps(_mm256_mul_ps(poly, t), _mm256_set1_ps(kErfA1));
  const __m256 ex = exp_avx2(_mm256_xor_ps(sign, _mm256_mul_ps(a, a)));
  const __m256 e = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(_mm256_mul_ps(poly, t), ex));
  const __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 erf = _mm256_blendv_ps(e, _mm256_xor_ps(sign, e), negative);
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(_mm256_set1_ps(1.0f), erf));
}

template <typename T>
__attribute__((target("avx2,fma,f16c"))) void gelu_values(const T* x, int64_t n, T* y, bool vec) {
  int64_t i = 0;
  if (vec && std::is_same<T, float>::value) {
    const float* xf = reinterpret_cast<const float*>(x);
    float* yf = reinterpret_cast<float*>(y);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(yf + i, gelu_avx2(_mm256_loadu_ps(xf + i)));
  }
  for (; i < n; ++i) y[i] = static_cast<T>(gelu_scalar(widen(x[i])));
}

at::Tensor step_layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  const int64_t d = x.size(-1);
  TORCH_CHECK(x.device().is_cpu() && weight.numel() == d && bias.numel() == d && weight.is_contiguous() &&
              bias.is_contiguous() && weight.scalar_type() == bias.scalar_type(),
              "layer_norm: x [..., d] with contiguous weight and bias [d] of one dtype on the CPU");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t M = d > 0 ? xc.numel() / d : 0;
  const bool vec = has_avx2();
  const float e = static_cast<float>(eps);
  auto run = [&](auto tag_t, auto tag_p) {
    using T = decltype(tag_t);
    using P = decltype(tag_p);
    layer_norm_rows(reinterpret_cast<const T*>(xc.data_ptr()), M, d, reinterpret_cast<const P*>(weight.data_ptr()),
                    reinterpret_cast<const P*>(bias.data_ptr()), e, reinterpret_cast<T*>(y.data_ptr()), vec);
  };
  const bool xb = x.scalar_type() == at::kBFloat16, pb = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK((xb || x.scalar_type() == at::kFloat) && (pb || weight.scalar_type() == at::kFloat),
              "layer_norm: float32 or bfloat16");
  if (xb && pb) run(bf16(), bf16());
  else if (xb) run(bf16(), 0.0f);
  else if (pb) run(0.0f, bf16());
  else run(0.0f, 0.0f);
  return y;
}

at::Tensor step_gelu(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "gelu: float32 or bfloat16 CPU tensors");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  if (x.scalar_type() == at::kFloat)
    gelu_values(xc.data_ptr<float>(), xc.numel(), y.data_ptr<float>(), has_avx2());
  else
    gelu_values(reinterpret_cast<const bf16*>(xc.data_ptr()), xc.numel(), reinterpret_cast<bf16*>(y.data_ptr()),
                has_avx2());
  return y;
}

// a + b for same-shaped float32 or bfloat16 tensors: torch's add (a float32 sum, rounded once).
at::Tensor step_add(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type(), "step_add: same shapes and dtypes");
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor out = at::empty_like(ac);
  const int64_t n = ac.numel();
  if (a.scalar_type() == at::kFloat) {
    const float *x = ac.data_ptr<float>(), *y = bc.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
  } else {
    TORCH_CHECK(a.scalar_type() == at::kBFloat16, "step_add: float32 or bfloat16");
    const bf16 *x = reinterpret_cast<const bf16*>(ac.data_ptr()), *y = reinterpret_cast<const bf16*>(bc.data_ptr());
    bf16* o = reinterpret_cast<bf16*>(out.data_ptr());
    for (int64_t i = 0; i < n; ++i) o[i] = static_cast<bf16>(widen(x[i]) + widen(y[i]));
  }
  return out;
}

void Epilogue::apply(float* acc, int64_t M, int64_t N, int64_t n0, int64_t n1, bool vec) const {
  if (n1 <= n0) return;
  for (int64_t m = 0; m < M; ++m) {
    float* a = acc + m * N;
    if (row_scale != nullptr)
      for (int64_t n = n0; n < n1; ++n) a[n] = a[n] * row_scale[m];
    if (scale != nullptr)
      for (int64_t n = n0; n < n1; ++n) a[n] = a[n] * scale[n] + (bias != nullptr ? bias[n] : 0.0f);
    else if (bias != nullptr)
      for (int64_t n = n0; n < n1; ++n) a[n] += bias[n];
    if (gelu) gelu_values(a + n0, n1 - n0, a + n0, vec);  // elementwise, in place
    if (residual != nullptr) {
      const float* r = residual + m * N;
      for (int64_t n = n0; n < n1; ++n) a[n] = r[n] + a[n];  // step_add(x, y): x + y
    }
  }
}

// ------------------------------------------------------------------ whole decoder blocks
// Whether decoder_layers runs decoder_layers_lean where it applies (`set_lean_step`: the two
// compared in one process; the same bits), and how many calls it has run (tests: that it applies).
bool g_lean_step = true;
std::atomic<int64_t> g_lean_calls{0};

// decoder_layers for float32 rows (the target's steps and verify passes, the int8 drafts' steps) on
// raw pointers into buffers of one call: the same kernels and operations in the same order (so the
// same bits), without the ≈ 30 tensor operations a layer (views, allocations, argument checks:
// ≈ 20 us a layer where a model too small to compute anything measured its step) and with the
// biases, scales, gelu and residual adds in the linears' own sections (Epilogue), where the other
// threads had waited for them. Between those sections the calling thread ran alone 0.23 ms of
// base's 2.5 ms step, 0.16 of tiny.en's 0.52 (compact draft). 2 threads of a Zen 4 EPYC, 20
// alternated rounds in one process against the general path (the C++ step alone, repeated, ms):
// base 1 row 1.89 -> 1.65 (paired 1.14x), 5 rows 4.27 -> 4.00 (1.07x); the compact int8 drafts'
// steps, tiny.en 0.63 -> 0.49 (1.30x), base-2l 0.40 -> 0.33 (1.18x). An undefined tensor where
// it does not apply (other dtypes or layouts: the general path below).
at::Tensor decoder_layers_lean(const at::Tensor& x_in, at::TensorList params, const at::Tensor& self_k,
                               const at::Tensor& self_v, const at::Tensor& cross_k, const at::Tensor& cross_v,
                               const at::Tensor& write_pos, const at::Tensor& n_self, const at::Tensor& n_cross,
                               int64_t n_heads, double eps, int64_t keep) {
  const int64_t L = self_k.size(0), per = L > 0 ? static_cast<int64_t>(params.size()) / L : 0;
  if (!g_lean_step || L == 0 || x_in.scalar_type() != at::kFloat || x_in.dim() != 3 || !x_in.is_contiguous() ||
      n_heads <= 0 || x_in.size(2) % n_heads != 0)
    return {};
  const int64_t B = x_in.size(0), T = x_in.size(1), d = x_in.size(2), H = n_heads, Dh = d / H;
  const bool cross_bf16 = cross_k.scalar_type() == at::kBFloat16;
  if (self_k.scalar_type() != at::kFloat || self_v.scalar_type() != at::kFloat ||
      cross_k.scalar_type() != cross_v.scalar_type() || !(cross_bf16 || cross_k.scalar_type() == at::kFloat))
    return {};
  for (const at::Tensor* c : {&self_k, &self_v, &cross_k, &cross_v})
    if (c->dim() != 5 || c->size(0) != L || c->size(1) != B || c->size(2) != H || c->size(4) != Dh ||
        c->stride(4) != 1 || c->stride(3) != Dh)
      return {};
  for (const at::Tensor* t : {&write_pos, &n_self, &n_cross})
    if (t->scalar_type() != at::kLong || !t->is_contiguous() || t->numel() != B * T) return {};
  // the parameters: float32 norms and biases, projections float32 / float16 / bfloat16 [N, K] or int8
  // packs [N/8, K/8, 8, 8] with float32 scales (24 a layer)
  auto rows_of = [](const at::Tensor& w) { return w.scalar_type() == at::kChar ? w.size(0) * kQB : w.size(0); };
  auto cols_of = [](const at::Tensor& w) { return w.scalar_type() == at::kChar ? w.size(1) * 8 : w.size(1); };
  auto is_f32 = [](const at::Tensor& t, int64_t n) { return t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n; };
  if (per != 18 && per != 24) return {};
  int64_t F = 0;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* p = params.data() + per * l;
    const int64_t f = rows_of(p[14]);
    F = std::max(F, f);
    const int64_t shapes[6][3] = {{2, 3 * d, d}, {4, d, d}, {8, d, d}, {10, d, d}, {14, f, d}, {16, d, f}};
    for (int i = 0; i < 3; ++i)
      if (!is_f32(p[6 * i], d) || !is_f32(p[6 * i + 1], d)) return {};
    for (int i = 0; i < 6; ++i) {
      const at::Tensor& w = p[shapes[i][0]];
      const bool q8 = w.scalar_type() == at::kChar;
      if (!w.is_contiguous() || rows_of(w) != shapes[i][1] || cols_of(w) != shapes[i][2] ||
          !is_f32(p[shapes[i][0] + 1], shapes[i][1]))
        return {};
      if (q8 ? (per != 24 || w.dim() != 4 || w.size(2) != kQB || w.size(3) != 8 || !is_f32(p[18 + i], shapes[i][1]))
             : (w.dim() != 2 || !(w.scalar_type() == at::kFloat || w.scalar_type() == at::kHalf ||
                                  w.scalar_type() == at::kBFloat16)))
        return {};
    }
  }
  const int64_t S = self_k.size(3), Sc = cross_k.size(3), M = B * T;
  const int64_t *wp = write_pos.data_ptr<int64_t>(), *nsp = n_self.data_ptr<int64_t>(), *ncp = n_cross.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i) {  // decode_attention's and kv_write's checks
    TORCH_CHECK(wp[i] >= 0 && wp[i] < S, "kv_write: position ", wp[i], " outside the cache");
    TORCH_CHECK(nsp[i] >= 1 && nsp[i] <= S, "decode_attention: n_keys ", nsp[i], " outside 1..", S);
    TORCH_CHECK(ncp[i] >= 1 && ncp[i] <= Sc, "decode_attention: n_keys ", ncp[i], " outside 1..", Sc);
  }
  const bool vec = has_avx2();
  const double scale = std::pow(static_cast<double>(Dh), -0.5);
  const int64_t Tk_last = keep > 0 && keep < T ? keep : T;
  // buffers: two for the rows between residual adds (x_in is only read), the rest in one
  at::Tensor xbuf[2] = {at::empty_like(x_in), at::empty_like(x_in)};
  at::Tensor work = at::empty({M * (d + 3 * d + d + d + F)}, x_in.options());
  float* xn = work.data_ptr<float>();
  float* qkv = xn + M * d;
  float* att = qkv + M * 3 * d;
  float* qc = att + M * d;
  float* ff = qc + M * d;
  std::vector<int64_t> n_kept(2 * B * Tk_last);
  const float* x = x_in.data_ptr<float>();
  int cur = -1;  // which xbuf holds x (-1: x_in)
  auto next_buf = [&]() { return cur == 0 ? 1 : 0; };
  const auto sks = self_k.strides(), svs = self_v.strides(), cks = cross_k.strides(), cvs = cross_v.strides();
  float *skp = self_k.data_ptr<float>(), *svp = self_v.data_ptr<float>();
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* p = params.data() + per * l;
    int64_t rows = M;
    int scale_at = 18;
    auto linear = [&](const float* in, int j, float* out, Epilogue finish) {
      const at::Tensor& w = p[j];
      finish.bias = p[j + 1].data_ptr<float>();
      if (w.scalar_type() == at::kChar) {
        finish.scale = p[scale_at++].data_ptr<float>();
        q8_matmul(in, rows, cols_of(w), w.data_ptr<int8_t>(), rows_of(w), out, finish);
      } else {
        linear_float(in, rows, w.size(1), w, w.size(0), out, finish);
      }
    };
    auto norm = [&](int i) { layer_norm_rows(x, rows, d, p[i].data_ptr<float>(), p[i + 1].data_ptr<float>(),
                                             static_cast<float>(eps), xn, vec); };
    auto residual = [&](const float* in, int j) {  // x = x + (in @ w^T + b), into the other buffer
      const int o = next_buf();
      Epilogue finish;
      finish.residual = x;
      float* out = xbuf[o].data_ptr<float>();
      linear(in, j, out, finish);
      x = out, cur = o;
    };
    norm(0);
    linear(xn, 2, qkv, Epilogue{});
    float* sk = skp + l * sks[0];
    float* sv = svp + l * svs[0];
    for (int64_t b = 0; b < B; ++b)  // kv_write: every position's keys and values
      for (int64_t t = 0; t < T; ++t) {
        const float* src = qkv + (b * T + t) * 3 * d;
        const int64_t at_pos = wp[b * T + t];
        for (int64_t h = 0; h < H; ++h) {
          std::memcpy(sk + b * sks[1] + h * sks[2] + at_pos * sks[3], src + d + h * Dh, Dh * sizeof(float));
          std::memcpy(sv + b * svs[1] + h * svs[2] + at_pos * svs[3], src + 2 * d + h * Dh, Dh * sizeof(float));
        }
      }
    int64_t Tk = T;
    const int64_t *ns = nsp, *nc = ncp;
    if (l == L - 1 && Tk_last < T) {
      // the last layer past its key/value projections for the last `keep` positions only: their
      // rows of x and their key counts, compact (decoder_layers' narrow(...).contiguous())
      Tk = Tk_last;
      const int o = next_buf();
      float* kept = xbuf[o].data_ptr<float>();
      for (int64_t b = 0; b < B; ++b) {
        std::memcpy(kept + b * Tk * d, x + (b * T + T - Tk) * d, Tk * d * sizeof(float));
        for (int64_t t = 0; t < Tk; ++t) {
          n_kept[b * Tk + t] = nsp[b * T + T - Tk + t];
          n_kept[B * Tk + b * Tk + t] = ncp[b * T + T - Tk + t];
        }
      }
      x = kept, cur = o, rows = B * Tk;
      ns = n_kept.data(), nc = n_kept.data() + B * Tk;
    }
    {  // self-attention: the queries of the kept positions, from qkv
      const int64_t qs[3] = {T * 3 * d, 3 * d, Dh};
      const int64_t ks[3] = {sks[1], sks[2], sks[3]}, vs[3] = {svs[1], svs[2], svs[3]};
      attention_rows<float, float>(qkv + (T - Tk) * 3 * d, qs, sk, ks, sv, vs, ns, B, Tk, H, Dh, scale, att);
    }
    residual(att, 4);
    norm(6);
    linear(xn, 8, qc, Epilogue{});
    {  // cross-attention
      const int64_t qs[3] = {Tk * d, d, Dh};
      const int64_t ks[3] = {cks[1], cks[2], cks[3]}, vs[3] = {cvs[1], cvs[2], cvs[3]};
      if (cross_bf16) {
        const bf16* ck = reinterpret_cast<const bf16*>(cross_k.data_ptr()) + l * cks[0];
        const bf16* cv = reinterpret_cast<const bf16*>(cross_v.data_ptr()) + l * cvs[0];
        attention_rows<float, bf16>(qc, qs, ck, ks, cv, vs, nc, B, Tk, H, Dh, scale, att);
      } else {
        const float* ck = cross_k.data_ptr<float>() + l * cks[0];
        const float* cv = cross_v.data_ptr<float>() + l * cvs[0];
        attention_rows<float, float>(qc, qs, ck, ks, cv, vs, nc, B, Tk, H, Dh, scale, att);
      }
    }
    residual(att, 10);
    norm(12);
    Epilogue gelu;
    gelu.gelu = true;
    linear(xn, 14, ff, gelu);
    residual(ff, 16);
  }
  g_lean_calls.fetch_add(1, std::memory_order_relaxed);
  return xbuf[cur].view({-1}).narrow(0, 0, B * Tk_last * d).view({B, Tk_last, d});
}

// All decoder layers of one step in one call (spec: specwhisper/model/whisper.py DecoderLayer.forward_rows,
// the same ops in the same order, so the same bits), sparing the per-op Python overhead of a
// step (≈ 16 ops a layer): decoder_layers_lean where it applies, else the tensor ops below.
// params: 18 tensors per layer, in the order of `layer_params` in model/whisper.py. Caches:
// [n_layers, B, H, S, D] views.
at::Tensor decoder_layers(const at::Tensor& x_in, at::TensorList params, const at::Tensor& self_k,
                          const at::Tensor& self_v, const at::Tensor& cross_k, const at::Tensor& cross_v,
                          const at::Tensor& write_pos, const at::Tensor& n_self, const at::Tensor& n_cross,
                          int64_t n_heads, double eps, int64_t keep) {
  const int64_t L = self_k.size(0);
  const int64_t per = static_cast<int64_t>(params.size()) / std::max<int64_t>(1, L);
  TORCH_CHECK((per == 18 || per == 24) && per * L == static_cast<int64_t>(params.size()),
              "decoder_layers: 18 parameters per layer (24: int8 projections with their 6 scales last)");
  at::Tensor lean = decoder_layers_lean(x_in, params, self_k, self_v, cross_k, cross_v, write_pos, n_self, n_cross,
                                        n_heads, eps, keep);
  if (lean.defined()) return lean;
  const int64_t B = x_in.size(0), T = x_in.size(1), d = x_in.size(2), Dh = d / n_heads;
  const double scale = std::pow(static_cast<double>(Dh), -0.5);
  at::Tensor x = x_in;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* p = params.data() + per * l;
    int scale_at = 18;  // int8 projections: their scales follow the 18 parameters, in order
    auto linear = [&](const at::Tensor& a, const at::Tensor& w, const at::Tensor& b) {
      if (w.scalar_type() == at::kChar) return linear_q8(a, w, p[scale_at++], b);
      return linear_rows(a, w, b, c10::nullopt);
    };
    auto norm = [&](int i) { return step_layer_norm(x, p[i], p[i + 1], eps); };
    auto residual = [&](const at::Tensor& y) { x = step_add(x, y); };
    at::Tensor qkv = linear(norm(0), p[2], p[3]).view({B, T, 3, n_heads, Dh});
    at::Tensor sk = self_k.select(0, l), sv = self_v.select(0, l);
    kv_write(sk, sv, qkv.select(2, 1), qkv.select(2, 2), write_pos);
    at::Tensor ns = n_self, nc = n_cross;
    int64_t Tk = T;
    if (l == L - 1 && keep > 0 && keep < T) {
      // the last layer: every position's keys and values are written (later steps read them), the
      // rest only for the `keep` last positions, the only outputs the caller reads. Each kept
      // row gets the same bits (every op here computes a row alone, whatever the others)
      Tk = keep;
      x = x.narrow(1, T - keep, keep).contiguous();
      qkv = qkv.narrow(1, T - keep, keep);
      ns = n_self.narrow(1, T - keep, keep).contiguous(), nc = n_cross.narrow(1, T - keep, keep).contiguous();
    }
    at::Tensor a = decode_attention(qkv.select(2, 0), sk, sv, ns, scale);
    residual(linear(a, p[4], p[5]));
    at::Tensor q = linear(norm(6), p[8], p[9]);
    a = decode_attention(q.view({B, Tk, n_heads, Dh}), cross_k.select(0, l), cross_v.select(0, l), nc, scale);
    residual(linear(a, p[10], p[11]));
    at::Tensor f = linear(norm(12), p[14], p[15]);
    at::Tensor h = step_gelu(f);
    residual(linear(h, p[16], p[17]));
  }
  return x;
}

// A whole decoder step (spec: model/whisper.py `Decoder.hidden`): the embeddings of tokens [B, T] at
// positions input_pos [B, T], every layer (decoder_layers) and the last norm, on the first B rows of
// the whole caches ([n_layers, rows, H, S, D]) with kv_len slots attended; a position past the
// embeddings' last writes the scratch slot. keep in 1..T-1: only the last `keep` positions' hidden
// states are made ([B, keep, d]; every position's keys and values are still written). The same
// bits as Decoder.hidden's ops from Python, without their ~12 calls, each slow on the caches a
// step's streaming leaves cold (base, 2 threads, cold, alternated in one process: 1 row 4.61 ->
// 4.50 ms, 5 rows 5.47 -> 5.34; held to AVX2 4.63 -> 4.51, 5.58 -> 5.52).
template <typename T>
void embed_rows(const int64_t* tok, const int64_t* pos, int64_t M, int64_t last, const T* te, const T* pe, int64_t d,
                T* x) {
  for (int64_t m = 0; m < M; ++m) {
    const T* a = te + tok[m] * d;
    const T* b = pe + std::min(pos[m], last) * d;
    for (int64_t i = 0; i < d; ++i) x[m * d + i] = static_cast<T>(widen(a[i]) + widen(b[i]));  // torch's add
  }
}

at::Tensor decoder_step(const at::Tensor& tokens, const at::Tensor& input_pos, const at::Tensor& token_embedding,
                        const at::Tensor& position_embedding, at::TensorList params, const at::Tensor& self_k,
                        const at::Tensor& self_v, const at::Tensor& cross_k, const at::Tensor& cross_v, int64_t kv_len,
                        int64_t n_heads, double eps, const at::Tensor& final_weight, const at::Tensor& final_bias,
                        int64_t keep) {
  TORCH_CHECK(tokens.dim() == 2 && input_pos.sizes() == tokens.sizes(), "decoder_step: tokens and input_pos [B, T]");
  TORCH_CHECK(token_embedding.dim() == 2 && position_embedding.dim() == 2 && token_embedding.is_contiguous() &&
              position_embedding.is_contiguous() && token_embedding.scalar_type() == position_embedding.scalar_type() &&
              token_embedding.size(1) == position_embedding.size(1),
              "decoder_step: embeddings must be contiguous [N, d] matrices of one dtype");
  TORCH_CHECK(token_embedding.scalar_type() == at::kFloat || token_embedding.scalar_type() == at::kBFloat16,
              "decoder_step: float32 or bfloat16 embeddings");
  const int64_t B = tokens.size(0), T = tokens.size(1), M = B * T, d = token_embedding.size(1);
  TORCH_CHECK(self_k.dim() == 5 && B <= self_k.size(1) && B <= cross_k.size(1), "decoder_step: ", B,
              " rows, the caches hold ", self_k.size(1));
  const int64_t V = token_embedding.size(0), last = position_embedding.size(0) - 1, S = self_k.size(3);
  TORCH_CHECK(kv_len >= 1, "decoder_step: kv_len ", kv_len, " < 1");
  TORCH_CHECK(keep >= 0, "decoder_step: keep ", keep, " < 0");
  const at::Tensor tok = tokens.to(at::kLong).contiguous(), pos = input_pos.to(at::kLong).contiguous();
  const int64_t *tp = tok.data_ptr<int64_t>(), *pp = pos.data_ptr<int64_t>();
  const auto long_opts = tok.options();
  at::Tensor write_pos = at::empty({B, T}, long_opts), n_self = at::empty({B, T}, long_opts),
             n_cross = at::full({B, T}, cross_k.size(3), long_opts);
  int64_t *wp = write_pos.data_ptr<int64_t>(), *np = n_self.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(tp[m] >= 0 && tp[m] < V, "decoder_step: token ", tp[m], " outside the vocabulary (", V, ")");
    TORCH_CHECK(pp[m] >= 0, "decoder_step: negative position ", pp[m]);
    wp[m] = std::min(pp[m], std::min(last + 1, kv_len - 1));  // past the end: the scratch slot
    np[m] = std::min(pp[m], std::min(last, kv_len - 1)) + 1;  // real slots up to the position
  }
  at::Tensor x = at::empty({B, T, d}, token_embedding.options());
  if (token_embedding.scalar_type() == at::kFloat)
    embed_rows(tp, pp, M, last, token_embedding.data_ptr<float>(), position_embedding.data_ptr<float>(), d,
               x.data_ptr<float>());
  else
    embed_rows(tp, pp, M, last, reinterpret_cast<const bf16*>(token_embedding.data_ptr()),
               reinterpret_cast<const bf16*>(position_embedding.data_ptr()), d, reinterpret_cast<bf16*>(x.data_ptr()));
  auto rows = [&](const at::Tensor& c, bool self) {
    at::Tensor r = c.narrow(1, 0, B);
    return self ? r.narrow(3, 0, std::min(kv_len, S)) : r;  // Python's [:kv_len]
  };
  x = decoder_layers(x, params, rows(self_k, true), rows(self_v, true), rows(cross_k, false), rows(cross_v, false),
                     write_pos, n_self, n_cross, n_heads, eps, keep);
  return step_layer_norm(x, final_weight, final_bias, eps);  // the decoder's last norm
}

// k greedy draft proposals in one call (spec: engine/drafting.py `DraftSide.propose`'s loop for
// greedy rows of a compact draft): decoder_step over tokens [B, T] at input_pos (keep = 1), the
// draft's Bits-bit head (quant_argmax) on its last position, then k - 1 times the proposal fed back
// at position next_pos + j (j = 0..k-2) and proposed from. The same ops in the same order as the
// Python loop, so the same proposals and cache entries, without the ~40 small torch calls and
// argument conversions a draft iteration's loop cost in Python (≈ 0.1 ms a draft step, each
// slow on the caches the step's streaming leaves cold). stop_margin > 0: a row (of those `stops`
// marks; all without it) whose proposal leads the head's next candidate by less than stop_margin
// (exact logits, `quant_argmax`'s margins) proposes nothing after it, and the loop ends once no
// row proposes further (`DraftSide.propose`'s stopping rule); rows `idle` marks (their draft off:
// no usable proposal) then count as stopped after the first step. -> (proposals [B, k] draft ids,
// -1 in the columns of steps not run; made [B], each row's proposals).
std::tuple<at::Tensor, at::Tensor> draft_greedy(
    const at::Tensor& tokens, const at::Tensor& input_pos, const at::Tensor& token_embedding,
    const at::Tensor& position_embedding, at::TensorList params, const at::Tensor& self_k, const at::Tensor& self_v,
    const at::Tensor& cross_k, const at::Tensor& cross_v, int64_t kv_len, int64_t n_heads, double eps,
    const at::Tensor& final_weight, const at::Tensor& final_bias, const at::Tensor& packed, const at::Tensor& scale,
    const at::Tensor& weight, int64_t candidates, const c10::optional<at::Tensor>& banned, int64_t bits,
    const at::Tensor& next_pos, int64_t k, double stop_margin, const c10::optional<at::Tensor>& stops,
    const c10::optional<at::Tensor>& idle) {
  TORCH_CHECK(bits == 2 || bits == 4, "draft_greedy: a 2- or 4-bit head, got ", bits);
  TORCH_CHECK(k >= 1, "draft_greedy: k ", k, " < 1");
  const int64_t B = tokens.size(0);
  TORCH_CHECK(next_pos.dim() == 1 && next_pos.size(0) == B, "draft_greedy: next_pos [B]");
  TORCH_CHECK(!stops || (stops->scalar_type() == at::kBool && stops->is_contiguous() && stops->numel() == B),
              "draft_greedy: stops must be contiguous bool [B]");
  const bool stopping = stop_margin > 0;
  TORCH_CHECK(!idle || (idle->scalar_type() == at::kBool && idle->is_contiguous() && idle->numel() == B),
              "draft_greedy: idle must be contiguous bool [B]");
  std::vector<float> margins(B);
  auto propose = [&](const at::Tensor& hidden) {  // [B, 1, d] -> [B]
    const at::Tensor h = hidden.reshape({B, hidden.size(2)});
    float* m = stopping ? margins.data() : nullptr;
    return bits == 2 ? quant_argmax<2>(h, packed, scale, weight, candidates, banned, "draft_greedy", m)
                     : quant_argmax<4>(h, packed, scale, weight, candidates, banned, "draft_greedy", m);
  };
  const int64_t T = tokens.size(1);
  at::Tensor out = at::full({B, k}, -1, tokens.options().dtype(at::kLong));
  at::Tensor made = at::full({B}, k, tokens.options().dtype(at::kLong));
  int64_t* mp = made.data_ptr<int64_t>();
  const bool* sp = stops ? stops->data_ptr<bool>() : nullptr;
  int64_t going = B;  // rows that propose further (an idle row only with the others, when stopping)
  if (stopping && idle)
    for (int64_t b = 0; b < B; ++b)
      if (idle->data_ptr<bool>()[b]) mp[b] = std::min<int64_t>(1, k), --going;
  at::Tensor hidden = decoder_step(tokens, input_pos, token_embedding, position_embedding, params, self_k, self_v,
                                   cross_k, cross_v, kv_len, n_heads, eps, final_weight, final_bias, T > 1 ? 1 : 0);
  const at::Tensor pos0 = next_pos.to(at::kLong);
  for (int64_t j = 0; j < k; ++j) {
    const at::Tensor x = propose(hidden);
    out.select(1, j).copy_(x);
    if (stopping)
      for (int64_t b = 0; b < B; ++b)
        if (mp[b] == k && (!sp || sp[b]) && margins[b] < static_cast<float>(stop_margin)) mp[b] = j + 1, --going;
    if (going <= 0) break;
    if (j + 1 < k)
      hidden = decoder_step(x.view({B, 1}), (pos0 + j).view({B, 1}), token_embedding, position_embedding, params,
                            self_k, self_v, cross_k, cross_v, kv_len, n_heads, eps, final_weight, final_bias, 0);
  }
  return {out, made};
}

// DraftSide.propose for greedy rows, eager (spec: engine/drafting.py, its loop and bookkeeping):
// each of the first B slots feeds its `width` uncached draft tokens (right-aligned; shorter rows
// repeat their first uncached position, `uncached_positions`; width 0: the widest row's count,
// `uncached_width`), draft_greedy proposes k tokens, and
// the slot state is updated in place as `propose` does it: draft_passes += k for rows whose draft
// runs, raw[:, :k] = the draft ids, dcached = dn + k - 1, proposals[:, :k] = the target ids of the
// usable prefix (mapped by d2t, the row's draft on, dn + k <= max_pos, within the row's own k),
// NO_PROPOSAL (-1) after it. Long [S] / [S, L] state tensors, bool draft_on. One call for the
// ~37 small torch calls of the Python form (≈ 0.35 ms an iteration on cold caches). stop_margin
// > 0: adaptive rows (row_k 0) stop as draft_greedy's do (rows whose draft is off do not keep
// the loop going), and only the steps run count (draft
// passes, raw, dcached, the proposals' columns: the later ones NO_PROPOSAL) -> the steps run.
int64_t draft_propose(const at::Tensor& token_embedding, const at::Tensor& position_embedding, at::TensorList params,
                      const at::Tensor& self_k, const at::Tensor& self_v, const at::Tensor& cross_k,
                      const at::Tensor& cross_v, int64_t kv_len, int64_t n_heads, double eps,
                      const at::Tensor& final_weight, const at::Tensor& final_bias, const at::Tensor& packed,
                      const at::Tensor& scale, const at::Tensor& weight, int64_t candidates,
                      const c10::optional<at::Tensor>& banned, int64_t bits, const at::Tensor& dtokens,
                      const at::Tensor& dn, const at::Tensor& dcached, const at::Tensor& draft_on,
                      const at::Tensor& row_k, const at::Tensor& d2t, const at::Tensor& raw,
                      const at::Tensor& proposals, const at::Tensor& draft_passes, int64_t B, int64_t k,
                      int64_t width, int64_t max_pos, double stop_margin) {
  for (const at::Tensor* t : {&dtokens, &dn, &dcached, &row_k, &d2t, &raw, &proposals, &draft_passes})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "draft_propose: contiguous int64 CPU state tensors");
  TORCH_CHECK(draft_on.scalar_type() == at::kBool && draft_on.is_contiguous(), "draft_propose: bool draft_on");
  TORCH_CHECK(dtokens.dim() == 2 && raw.dim() == 2 && proposals.dim() == 2, "draft_propose: [S, L] / [S, K] tables");
  const int64_t S = dn.size(0), L = dtokens.size(1), K = raw.size(1), V = d2t.size(0);
  TORCH_CHECK(B >= 1 && B <= S && width >= 0 && k >= 1 && k <= K && proposals.size(1) >= k,
              "draft_propose: B ", B, ", width ", width, ", k ", k, " for ", S, " slots of ", K, " proposals");
  const int64_t *dt = dtokens.data_ptr<int64_t>(), *dnp = dn.data_ptr<int64_t>(), *rk = row_k.data_ptr<int64_t>(),
                *map = d2t.data_ptr<int64_t>();
  int64_t *dc = dcached.data_ptr<int64_t>(), *rw = raw.data_ptr<int64_t>(), *pr = proposals.data_ptr<int64_t>(),
          *dp = draft_passes.data_ptr<int64_t>();
  if (width == 0) {  // the widest row's uncached positions (`DraftSide.uncached_width`), at least 1
    width = 1;
    for (int64_t b = 0; b < B; ++b) width = std::max(width, dnp[b] - std::max<int64_t>(0, std::min(dc[b], dnp[b] - 1)));
  }
  const bool* on = draft_on.data_ptr<bool>();
  at::Tensor src = at::empty({B, width}, dtokens.options()), feed = at::empty({B, width}, dtokens.options());
  int64_t *sp = src.data_ptr<int64_t>(), *fp = feed.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = std::max<int64_t>(0, std::min(dc[b], dnp[b] - 1)), shift = width - (dnp[b] - start);
    for (int64_t j = 0; j < width; ++j) {
      const int64_t at = start + std::max<int64_t>(0, j - shift);
      TORCH_CHECK(at < L, "draft_propose: position ", at, " past the draft tokens (", L, ")");
      sp[b * width + j] = at, fp[b * width + j] = dt[b * L + at];
    }
  }
  const auto [out, made] = draft_greedy(feed, src, token_embedding, position_embedding, params, self_k, self_v,
                                        cross_k, cross_v, kv_len, n_heads, eps, final_weight, final_bias, packed, scale,
                                        weight, candidates, banned, bits, dn.narrow(0, 0, B), k, stop_margin,
                                        row_k.narrow(0, 0, B).eq(0),  // adaptive rows stop (fixed k: 0)
                                        draft_on.narrow(0, 0, B).logical_not());  // rows not drafting
  const int64_t *op = out.data_ptr<int64_t>(), *mp = made.data_ptr<int64_t>();
  const int64_t steps = *std::max_element(mp, mp + B);  // draft steps run (the proposals' columns)
  for (int64_t b = 0; b < B; ++b) {
    dp[b] += on[b] ? steps : 0;
    const int64_t limit = rk[b] > 0 ? rk[b] : k;
    bool usable = on[b] && dnp[b] + k <= max_pos;
    for (int64_t j = 0; j < k; ++j) {
      if (j >= steps) {
        pr[b * proposals.size(1) + j] = -1;
        continue;
      }
      const int64_t id = op[b * k + j];
      TORCH_CHECK(id >= 0 && id < V, "draft_propose: draft token ", id, " outside the map (", V, ")");
      rw[b * K + j] = id;
      usable = usable && map[id] >= 0 && j < limit && j < mp[b];
      pr[b * proposals.size(1) + j] = usable ? map[id] : -1;  // NO_PROPOSAL
    }
    dc[b] = dnp[b] + steps - 1;
  }
  return steps;
}

// The proposals' rows [S, K] (int64, contiguous) a greedy verify pass with k proposals reads
// (nullptr for k = 0, where there are none), checked.
inline const int64_t* proposal_rows(const c10::optional<at::Tensor>& proposals, int64_t k, const char* name) {
  if (k == 0) return nullptr;
  TORCH_CHECK(proposals && proposals->scalar_type() == at::kLong && proposals->is_contiguous() &&
                  proposals->dim() == 2 && proposals->size(1) >= k,
              name, ": k > 0 needs int64 proposals [S, K]");
  return proposals->data_ptr<int64_t>();
}

// The bookkeeping of a greedy verify pass (spec: engine/runner.py `verify_step` after its choice,
// the `commit_target` it calls and DraftSide.commit), for the first B slots in place, given the
// choices [B, k + 1] of the pass over each row's pending token and its k proposals: target_passes
// += 1; the accepted prefix n_acc (proposals equal to the choices); commit_tokens of n_acc + 1
// choices; with `hidden` [B, k + 1, d] (float32: greedy rows whose log-probabilities are wanted)
// the outputs that predicted the appended tokens kept in hidden_state [S, L, d]; drafted,
// accepted_total, accepted_now; and with `draft_commit` the draft's state (the raw proposals, then
// the last token's spelling t2d written at dn.., dcached = min(dcached, dn + n_acc), dn past the
// spelling where the row goes on drafting). One call for the Python form's ~35 small torch calls.
void accept_greedy(const at::Tensor& choice, const c10::optional<at::Tensor>& hidden, const at::Tensor& tokens,
                   const at::Tensor& n_tokens, const at::Tensor& done, const at::Tensor& budget,
                   const c10::optional<at::Tensor>& proposals, const at::Tensor& target_passes,
                   const at::Tensor& drafted, const at::Tensor& accepted_total, const at::Tensor& accepted_now,
                   const c10::optional<at::Tensor>& hidden_state, int64_t eot, int64_t k, bool draft_commit,
                   const c10::optional<at::Tensor>& dtokens, const c10::optional<at::Tensor>& dn,
                   const c10::optional<at::Tensor>& dcached, const c10::optional<at::Tensor>& draft_on,
                   const c10::optional<at::Tensor>& raw, const c10::optional<at::Tensor>& t2d,
                   const c10::optional<at::Tensor>& t2d_len) {
  for (const at::Tensor* t : {&choice, &tokens, &n_tokens, &budget, &target_passes, &drafted, &accepted_total,
                              &accepted_now})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "accept_greedy: contiguous int64 CPU state tensors");
  TORCH_CHECK(done.scalar_type() == at::kBool && done.is_contiguous(), "accept_greedy: bool done");
  TORCH_CHECK(tokens.dim() == 2 && choice.dim() == 2 && choice.size(1) == k + 1, "accept_greedy: choice [B, k + 1]");
  const int64_t* pr = proposal_rows(proposals, k, "accept_greedy");
  const int64_t B = choice.size(0), T = k + 1, S = n_tokens.size(0), L = tokens.size(1);
  const int64_t K = k > 0 ? proposals->size(1) : 0;
  TORCH_CHECK(B >= 1 && B <= S, "accept_greedy: ", B, " rows for ", S, " slots");
  const int64_t *ch = choice.data_ptr<int64_t>(), *tk = tokens.data_ptr<int64_t>(), *nt = n_tokens.data_ptr<int64_t>();
  int64_t *tp = target_passes.data_ptr<int64_t>(), *dr = drafted.data_ptr<int64_t>(),
          *at_ = accepted_total.data_ptr<int64_t>(), *an = accepted_now.data_ptr<int64_t>();
  bool* dn_done = done.data_ptr<bool>();
  at::Tensor n_acc = at::zeros({B}, tokens.options());
  int64_t* na = n_acc.data_ptr<int64_t>();
  std::vector<int64_t> valid(B, 0), before(B);
  std::vector<char> live(B);
  for (int64_t b = 0; b < B; ++b) {
    tp[b] += 1;
    while (na[b] < k && pr[b * K + na[b]] == ch[b * T + na[b]]) ++na[b];
    for (int64_t j = 0; j < k; ++j) valid[b] += pr[b * K + j] >= 0;
    live[b] = !dn_done[b];
    before[b] = nt[b];
  }
  const at::Tensor emitted = commit_tokens(tokens, n_tokens, done, budget, at::arange(B, tokens.options()), choice,
                                           n_acc + 1, eot);
  const int64_t* em = emitted.data_ptr<int64_t>();
  if (hidden) {
    TORCH_CHECK(hidden_state && hidden->scalar_type() == at::kFloat && hidden_state->scalar_type() == at::kFloat &&
                hidden->dim() == 3 && hidden->size(0) == B && hidden->size(1) == T && hidden_state->dim() == 3 &&
                hidden_state->is_contiguous() && hidden_state->size(2) == hidden->size(2),
                "accept_greedy: float32 hidden [B, k + 1, d] and hidden_state [S, L, d]");
    const at::Tensor h = hidden->contiguous();
    const int64_t d = h.size(2), HL = hidden_state->size(1);
    const float* hp = h.data_ptr<float>();
    float* sp = hidden_state->data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < em[b]; ++t) {
        TORCH_CHECK(before[b] + t < HL, "accept_greedy: row ", b, " would keep past its buffer");
        std::copy(hp + (b * T + t) * d, hp + (b * T + t + 1) * d, sp + (b * HL + before[b] + t) * d);
      }
  }
  for (int64_t b = 0; b < B; ++b) {
    if (k > 0) {
      if (live[b]) dr[b] += dn_done[b] ? std::min(valid[b], em[b]) : valid[b];
      const int64_t accepted = std::min(na[b], em[b]);
      if (live[b]) at_[b] += accepted;
      an[b] = live[b] ? accepted : -1;
    } else {
      an[b] = dn_done[b] ? -1 : 0;
    }
  }
  if (!draft_commit) return;
  TORCH_CHECK(dtokens && dn && dcached && draft_on && raw && t2d && t2d_len, "accept_greedy: the draft's state");
  for (const at::Tensor* t : {&*dtokens, &*dn, &*dcached, &*raw, &*t2d, &*t2d_len})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "accept_greedy: contiguous int64 draft state");
  const int64_t DL = dtokens->size(1), RK = raw->size(1), W = t2d->size(1), V = t2d->size(0);
  int64_t *dt = dtokens->data_ptr<int64_t>(), *dnp = dn->data_ptr<int64_t>(), *dc = dcached->data_ptr<int64_t>();
  const int64_t *rw = raw->data_ptr<int64_t>(), *sp = t2d->data_ptr<int64_t>(), *sl = t2d_len->data_ptr<int64_t>();
  const bool* on = draft_on->data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t d0 = dnp[b];
    if (k > 0) {
      TORCH_CHECK(d0 >= 0 && d0 + k <= DL, "accept_greedy: draft row ", b, " would write past its buffer");
      for (int64_t j = 0; j < k; ++j) dt[b * DL + d0 + j] = rw[b * RK + j];
      dc[b] = std::min(dc[b], d0 + na[b]);
    }
    const int64_t last = tk[b * L + nt[b] - 1], base = d0 + na[b];
    TORCH_CHECK(last >= 0 && last < V && base >= 0 && base + W <= DL, "accept_greedy: draft row ", b,
                " would write past its buffer");
    for (int64_t w = 0; w < W; ++w) dt[b * DL + base + w] = sp[last * W + w];
    if (!(dn_done[b] || !on[b])) dnp[b] = base + sl[last];
  }
}

// Runner.verify_step for plain greedy rows, eager (every row plain greedy, no log-probabilities
// kept): each of the first B slots' pending token and its k proposals (-1 read as 0) at positions
// n - 1.. (n = n_tokens), decoder_step over them, the target's exact screened argmax (suppress
// banned) at every position, then accept_greedy. One call for the Python form's ~45 small torch
// calls (≈ 0.47 ms an iteration at k = 3 on cold caches).
void verify_greedy(const at::Tensor& token_embedding, const at::Tensor& position_embedding, at::TensorList params,
                   const at::Tensor& self_k, const at::Tensor& self_v, const at::Tensor& cross_k,
                   const at::Tensor& cross_v, int64_t kv_len, int64_t n_heads, double eps,
                   const at::Tensor& final_weight, const at::Tensor& final_bias, const at::Tensor& packed,
                   const at::Tensor& scale, const at::Tensor& bound, const at::Tensor& weight, double tiny,
                   const at::Tensor& suppress, const at::Tensor& tokens, const at::Tensor& n_tokens,
                   const at::Tensor& done, const at::Tensor& budget, const c10::optional<at::Tensor>& proposals,
                   const at::Tensor& target_passes, const at::Tensor& drafted, const at::Tensor& accepted_total,
                   const at::Tensor& accepted_now, int64_t eot, int64_t B, int64_t k, bool draft_commit,
                   const c10::optional<at::Tensor>& dtokens, const c10::optional<at::Tensor>& dn,
                   const c10::optional<at::Tensor>& dcached, const c10::optional<at::Tensor>& draft_on,
                   const c10::optional<at::Tensor>& raw, const c10::optional<at::Tensor>& t2d,
                   const c10::optional<at::Tensor>& t2d_len) {
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 2 && tokens.is_contiguous() &&
              n_tokens.scalar_type() == at::kLong && n_tokens.is_contiguous(), "verify_greedy: int64 tokens [S, L]");
  TORCH_CHECK(k >= 0, "verify_greedy: k ", k, " < 0");
  const int64_t* pr = proposal_rows(proposals, k, "verify_greedy");
  const int64_t S = n_tokens.size(0), L = tokens.size(1), K = k > 0 ? proposals->size(1) : 0, T = k + 1;
  TORCH_CHECK(B >= 1 && B <= S, "verify_greedy: B ", B, " for ", S, " slots");
  const int64_t *tk = tokens.data_ptr<int64_t>(), *nt = n_tokens.data_ptr<int64_t>();
  at::Tensor feed = at::empty({B, T}, tokens.options()), pos = at::empty({B, T}, tokens.options());
  int64_t *fp = feed.data_ptr<int64_t>(), *pp = pos.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t last = nt[b] - 1;
    TORCH_CHECK(last >= 0 && last < L, "verify_greedy: row ", b, " has no pending token");
    fp[b * T] = tk[b * L + last], pp[b * T] = last;
    for (int64_t j = 0; j < k; ++j) fp[b * T + 1 + j] = std::max<int64_t>(pr[b * K + j], 0), pp[b * T + 1 + j] = last + 1 + j;
  }
  const at::Tensor hidden = decoder_step(feed, pos, token_embedding, position_embedding, params, self_k, self_v, cross_k,
                                         cross_v, kv_len, n_heads, eps, final_weight, final_bias, 0);
  const at::Tensor choice = screened_argmax(hidden.reshape({B * T, hidden.size(2)}), packed, scale, bound, weight, tiny,
                                            suppress).view({B, T});
  accept_greedy(choice, c10::nullopt, tokens, n_tokens, done, budget, proposals, target_passes, drafted,
                accepted_total, accepted_now, c10::nullopt, eot, k, draft_commit, dtokens, dn, dcached, draft_on, raw,
                t2d, t2d_len);
}

// ------------------------------------------------------------------ the screened head's int8 copy
// One row of quantize_head: q into its block rows (out[(k / 8) * 64 + k % 8]), and the three
// float64 sums of squares, each over 4 lanes (feature k in lane k % 4) added as (l0 + l2) + (l1 + l3).
// The scalar form keeps the same lanes and order: the same bits.
inline void quantize_row_scalar(const float* row, int64_t K, float s, int8_t* out, double* sums) {
  const double sd = s;
  double lane[3][4] = {};
  for (int64_t k = 0; k < K; ++k) {
    const double x = row[k];
    const double q = std::min(127.0, std::max(-127.0, std::nearbyint(x / sd)));
    const double sq = sd * q, e = x - sq;
    lane[0][k % 4] += e * e, lane[1][k % 4] += sq * sq, lane[2][k % 4] += x * x;
    out[(k / 8) * 64 + k % 8] = static_cast<int8_t>(q);
  }
  for (int i = 0; i < 3; ++i) sums[i] = (lane[i][0] + lane[i][2]) + (lane[i][1] + lane[i][3]);
}

__attribute__((target("avx2,fma,f16c"))) void quantize_row_avx2(const float* row, int64_t K, float s, int8_t* out,
                                                                 double* sums) {
  const __m256d sd = _mm256_set1_pd(s), lo = _mm256_set1_pd(-127.0), hi = _mm256_set1_pd(127.0);
  __m256d acc[3] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  for (int64_t k = 0; k < K; k += 4) {  // K is a multiple of 8
    const __m256d x = _mm256_cvtps_pd(_mm_loadu_ps(row + k));
    const __m256d q = _mm256_min_pd(hi, _mm256_max_pd(lo, _mm256_round_pd(_mm256_div_pd(x, sd),
                                                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    const __m256d sq = _mm256_mul_pd(sd, q), e = _mm256_sub_pd(x, sq);
    acc[0] = _mm256_add_pd(acc[0], _mm256_mul_pd(e, e));
    acc[1] = _mm256_add_pd(acc[1], _mm256_mul_pd(sq, sq));
    acc[2] = _mm256_add_pd(acc[2], _mm256_mul_pd(x, x));
    const __m128i qi = _mm256_cvtpd_epi32(q);  // exact: integers in [-127, 127]
    alignas(16) int32_t v[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(v), qi);
    for (int j = 0; j < 4; ++j) out[((k + j) / 8) * 64 + (k + j) % 8] = static_cast<int8_t>(v[j]);
  }
  for (int i = 0; i < 3; ++i) {
    alignas(32) double l[4];
    _mm256_store_pd(l, acc[i]);
    sums[i] = (l[0] + l[2]) + (l[1] + l[3]);
  }
}

// weight [V, K] float32 -> packed [ceil(V/8), K/8, 8, 8] int8 (rows past V zero), scale [V], bound
// [V] (spec: model/head.py `quantize`, then its packing): per row in float64, s = fl32(max|w| / 127)
// (1 where 0), q = clamp(round-half-even(w / s), -127, 127), and the bound
// c = up(fl32((‖w − s q‖ + coef ‖s q‖ + gamma ‖w‖) (1 + 2^-12))). q and s are quantize's bits; the
// norms sum over 4 lanes where torch's reduction has its own order, so c could differ from
// quantize's in its last float64 bits, far inside the 2^-12 margin that makes it a bound either
// way (on base's head and the tests' weights every c is quantize's). One pass over the head, its
// divisions 4 at a time, instead of quantize's float64 temporaries, padding and packing (base's
// head, 2 threads of a Zen 3 EPYC: 0.14 + 0.05 s -> 0.065 s).
void quantize_head(const at::Tensor& weight, at::Tensor packed, at::Tensor scale, at::Tensor bound, double coef,
                   double gamma) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(1) % 8 == 0,
              "quantize_head: weight must be a contiguous float32 [V, K] matrix, K a multiple of 8");
  const int64_t V = weight.size(0), K = weight.size(1), blocks = (V + kQB - 1) / kQB;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.numel() == blocks * kQB * K &&
                  scale.scalar_type() == at::kFloat && bound.scalar_type() == at::kFloat && scale.numel() == V &&
                  bound.numel() == V && scale.is_contiguous() && bound.is_contiguous(),
              "quantize_head: packed int8 [ceil(V/8), K/8, 8, 8], scale and bound float32 [V]");
  const float* w = weight.data_ptr<float>();
  int8_t* pk = packed.data_ptr<int8_t>();
  float *sp = scale.data_ptr<float>(), *cp = bound.data_ptr<float>();
  const bool vec = has_avx2();
  parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int8_t* blk = pk + b * kQB * K;
      for (int64_t r = 0; r < kQB; ++r) {
        const int64_t v = b * kQB + r;
        if (v >= V) {
          for (int64_t k = 0; k < K; ++k) blk[(k / 8) * 64 + r * 8 + k % 8] = 0;
          continue;
        }
        const float* row = w + v * K;
        float amax = 0.0f;
        bool nan = false;
        for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k])), nan = nan || std::isnan(row[k]);
        float s = static_cast<float>(static_cast<double>(amax) / 127.0);
        if (nan || !(s > 0.0f)) s = 1.0f;  // an all-zero row: q = 0 exactly (a NaN: quantize's 1 too)
        double sums[3];  // ‖w − s q‖², ‖s q‖², ‖w‖²
        if (vec) quantize_row_avx2(row, K, s, blk + r * 8, sums);
        else quantize_row_scalar(row, K, s, blk + r * 8, sums);
        const double c =
            (std::sqrt(sums[0]) + coef * std::sqrt(sums[1]) + gamma * std::sqrt(sums[2])) * (1.0 + std::ldexp(1.0, -12));
        sp[v] = s;
        cp[v] = std::nextafter(static_cast<float>(c), INFINITY);
      }
    }
  });
}

// ------------------------------------------------------------------ float16 copies
// dst = src rounded to float16 (both contiguous, the same number of elements) -> whether every
// value widens back to its float32 bits (a float16 checkpoint loaded as float32; NaN or a value
// float16 cannot hold: false). One pass over src (the Python check took three: the rounding, its
// widening and the comparison; base's projections and head 0.33 s at an engine's first step).
bool half_exact_scalar(const float* s, at::Half* d, int64_t n) {
  bool exact = true;
  for (int64_t i = 0; i < n; ++i) {
    d[i] = static_cast<at::Half>(s[i]);
    exact = exact && static_cast<float>(d[i]) == s[i];
  }
  return exact;
}

__attribute__((target("avx2,fma,f16c"))) bool half_exact_avx2(const float* s, at::Half* d, int64_t n) {
  int64_t i = 0;
  __m256 same = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(s + i);
    const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), h);
    same = _mm256_and_ps(same, _mm256_cmp_ps(_mm256_cvtph_ps(h), v, _CMP_EQ_OQ));
  }
  const bool tail = half_exact_scalar(s + i, d + i, n - i);  // the last n % 8, written whatever the rest
  return tail && _mm256_movemask_ps(same) == 0xFF;
}

bool half_exact(const at::Tensor& src, at::Tensor dst) {
  TORCH_CHECK(src.device().is_cpu() && dst.device().is_cpu() && src.scalar_type() == at::kFloat &&
                  dst.scalar_type() == at::kHalf && src.is_contiguous() && dst.is_contiguous() &&
                  src.numel() == dst.numel(),
              "half_exact: contiguous float32 src and float16 dst of the same size");
  const float* s = src.data_ptr<float>();
  at::Half* d = dst.data_ptr<at::Half>();
  const bool vec = has_avx2();
  std::atomic<bool> exact{true};
  parallel_for(0, src.numel(), int64_t{1} << 16, [&](int64_t a, int64_t b) {
    if (!(vec ? half_exact_avx2(s + a, d + a, b - a) : half_exact_scalar(s + a, d + a, b - a))) exact = false;
  });
  return exact;
}

#include "encoder_ops.h"

// Lower (or restore) the vector level the ops use -> the previous limit (tests: every path).
int64_t set_vector_level(int64_t level) {
  const int64_t before = g_level_limit;
  g_level_limit = static_cast<int>(level);
  return before;
}

// Prefetch the weight streams to L2 (true) or non-temporally (false) -> the previous choice.
bool set_stream_l2(bool enabled) {
  const bool before = g_stream_l2;
  g_stream_l2 = enabled;
  return before;
}

// Use (or not) AVX512-VNNI where the CPU has it -> whether it was allowed before.
bool set_vnni(bool enabled) {
  const bool before = g_vnni;
  g_vnni = enabled;
  return before;
}

// The vector level the ops use now: 0 scalar, 1 AVX2 + FMA, 2 AVX-512.
int64_t current_vector_level() { return vector_level(); }

bool set_lean_step(bool enabled) {
  const bool was = g_lean_step;
  g_lean_step = enabled;
  return was;
}

int64_t lean_step_calls() { return g_lean_calls.load(); }

// How many threads at::parallel_for really uses in this extension (a build without OpenMP
// silently runs every op on one thread; tests check this equals torch.get_num_threads()).
int64_t parallel_threads() {
  std::vector<int64_t> seen(std::max<int64_t>(1, at::get_num_threads()), 0);
  const bool omp = main_thread();  // which pool runs this thread's sections (see parallel_for)
  parallel_for(0, 1 << 12, 1, [&](int64_t, int64_t) { seen[omp ? at::get_thread_num() : SpinPool::task_id()] = 1; });
  int64_t n = 0;
  for (int64_t s : seen) n += s;
  return n;
}

}  // namespace

TORCH_LIBRARY(specwhisper_decode, m) {
  m.def("parallel_threads() -> int");
  m.def("half_exact(Tensor src, Tensor(a!) dst) -> bool");
  m.def("quantize_head(Tensor weight, Tensor(a!) packed, Tensor(b!) scale, Tensor(c!) bound, float coef, float gamma) -> ()");
  m.def("set_vector_level(int level) -> int");
  m.def("set_stream_l2(bool enabled) -> bool");
  m.def("set_vnni(bool enabled) -> bool");
  m.def("set_lean_step(bool enabled) -> bool");
  m.def("lean_step_calls() -> int");
  m.def("vector_level() -> int");
  m.def("encoder_attention(Tensor qkv, int heads, int block=0) -> Tensor");
  m.def("decoder_step(Tensor tokens, Tensor input_pos, Tensor token_embedding, Tensor position_embedding, Tensor[] params, Tensor(a!) self_k, Tensor(b!) self_v, Tensor cross_k, Tensor cross_v, int kv_len, int n_heads, float eps, Tensor final_weight, Tensor final_bias, int keep=0) -> Tensor");
  m.def("draft_greedy(Tensor tokens, Tensor input_pos, Tensor token_embedding, Tensor position_embedding, Tensor[] params, Tensor(a!) self_k, Tensor(b!) self_v, Tensor cross_k, Tensor cross_v, int kv_len, int n_heads, float eps, Tensor final_weight, Tensor final_bias, Tensor packed, Tensor scale, Tensor weight, int candidates, Tensor? banned, int bits, Tensor next_pos, int k, float stop_margin=0., Tensor? stops=None, Tensor? idle=None) -> (Tensor, Tensor)");
  m.def("draft_propose(Tensor token_embedding, Tensor position_embedding, Tensor[] params, Tensor(a!) self_k, Tensor(b!) self_v, Tensor cross_k, Tensor cross_v, int kv_len, int n_heads, float eps, Tensor final_weight, Tensor final_bias, Tensor packed, Tensor scale, Tensor weight, int candidates, Tensor? banned, int bits, Tensor dtokens, Tensor dn, Tensor(c!) dcached, Tensor draft_on, Tensor row_k, Tensor d2t, Tensor(d!) raw, Tensor(e!) proposals, Tensor(f!) draft_passes, int B, int k, int width, int max_pos, float stop_margin=0.) -> int");
  m.def("verify_greedy(Tensor token_embedding, Tensor position_embedding, Tensor[] params, Tensor(a!) self_k, Tensor(b!) self_v, Tensor cross_k, Tensor cross_v, int kv_len, int n_heads, float eps, Tensor final_weight, Tensor final_bias, Tensor packed, Tensor scale, Tensor bound, Tensor weight, float tiny, Tensor suppress, Tensor(c!) tokens, Tensor(d!) n_tokens, Tensor(e!) done, Tensor budget, Tensor? proposals, Tensor(f!) target_passes, Tensor(g!) drafted, Tensor(h!) accepted_total, Tensor(i!) accepted_now, int eot, int B, int k, bool draft_commit, Tensor(j!)? dtokens, Tensor(k!)? dn, Tensor(l!)? dcached, Tensor? draft_on, Tensor? raw, Tensor? t2d, Tensor? t2d_len) -> ()");
  m.def("accept_greedy(Tensor choice, Tensor? hidden, Tensor(a!) tokens, Tensor(b!) n_tokens, Tensor(c!) done, Tensor budget, Tensor? proposals, Tensor(d!) target_passes, Tensor(e!) drafted, Tensor(f!) accepted_total, Tensor(g!) accepted_now, Tensor(h!)? hidden_state, int eot, int k, bool draft_commit, Tensor(i!)? dtokens, Tensor(j!)? dn, Tensor(k!)? dcached, Tensor? draft_on, Tensor? raw, Tensor? t2d, Tensor? t2d_len) -> ()");
  m.def("layer_norm(Tensor x, Tensor weight, Tensor bias, float eps) -> Tensor");
  m.def("gelu(Tensor x) -> Tensor");
  m.def("linear_rows(Tensor x, Tensor weight, Tensor? bias, ScalarType? out_dtype) -> Tensor");
  m.def("gather_dot(Tensor x, Tensor weight, Tensor ids) -> Tensor");
  m.def("linear_q8(Tensor x, Tensor packed, Tensor scale, Tensor? bias) -> Tensor");
  m.def("screened_argmax(Tensor hidden, Tensor packed, Tensor scale, Tensor bound, Tensor weight, float tiny, Tensor? banned) -> Tensor");
  m.def("rule_mask(Tensor at_begin, Tensor timestamps, Tensor n_sampled, Tensor last, Tensor penultimate, Tensor last_timestamp, Tensor max_initial, Tensor suppress, Tensor blank_ids, int eot, int no_timestamps, int timestamp_begin) -> Tensor");
  m.def("rule_state(Tensor tokens, Tensor n_tokens, Tensor prompt_len, Tensor timestamps, Tensor max_initial, Tensor slots, Tensor predicted, Tensor proposed, int timestamp_begin) -> Tensor[]");
  m.def("screened_split(Tensor hidden, Tensor packed, Tensor scale, Tensor bound, Tensor weight, float tiny, Tensor? banned, int split) -> (Tensor, Tensor, Tensor)");
  m.def("q4_argmax(Tensor hidden, Tensor packed, Tensor scale, Tensor weight, int candidates, Tensor? banned, Tensor(a!)? margins=None) -> Tensor");
  m.def("q4_logits(Tensor hidden, Tensor packed, Tensor scale, Tensor weight, int candidates) -> Tensor");
  m.def("q2_argmax(Tensor hidden, Tensor packed, Tensor scale, Tensor weight, int candidates, Tensor? banned, Tensor(a!)? margins=None) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor n_keys, float scale) -> Tensor");
  m.def("kv_write(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor pos) -> ()");
  m.def("commit_tokens(Tensor(a!) tokens, Tensor(b!) n_tokens, Tensor(c!) done, Tensor budget, Tensor slots, Tensor choice, Tensor n_emit, int eot) -> Tensor");
}

TORCH_LIBRARY_IMPL(specwhisper_decode, CPU, m) {
  m.impl("linear_rows", &linear_rows);
  m.impl("gather_dot", &gather_dot);
  m.impl("linear_q8", &linear_q8);
  m.impl("screened_argmax", &screened_argmax);
  m.impl("screened_split", &screened_split);
  m.impl("rule_mask", &rule_mask);
  m.impl("rule_state", &rule_state);
  m.impl("q4_argmax", &q4_argmax);
  m.impl("q4_logits", &q4_logits);
  m.impl("q2_argmax", &q2_argmax);
  m.impl("decode_attention", &decode_attention);
  m.impl("kv_write", &kv_write);
  m.impl("commit_tokens", &commit_tokens);
  m.impl("decoder_step", &decoder_step);
  m.impl("draft_greedy", &draft_greedy);
  m.impl("draft_propose", &draft_propose);
  m.impl("verify_greedy", &verify_greedy);
  m.impl("accept_greedy", &accept_greedy);
  m.impl("layer_norm", &step_layer_norm);
  m.impl("gelu", &step_gelu);
  m.impl("encoder_attention", &encoder_attention);
  m.impl("half_exact", &half_exact);
  m.impl("quantize_head", &quantize_head);
}

TORCH_LIBRARY_IMPL(specwhisper_decode, CatchAll, m) { m.impl("parallel_threads", &parallel_threads);
  m.impl("set_vector_level", &set_vector_level);
  m.impl("set_stream_l2", &set_stream_l2);
  m.impl("set_vnni", &set_vnni);
  m.impl("set_lean_step", &set_lean_step);
  m.impl("lean_step_calls", &lean_step_calls);
  m.impl("vector_level", &current_vector_level);
}

}  // namespace specwhisper_decode

#pragma once
// Processed probabilities on the CPU, shared by the ops in csrc/: the arithmetic contract of
// specwhisper/sampling.py (fp32 exp polynomial compiled with -ffp-contract=off, integer weights
// whose float64 sums are exact in any order, sort-free top-p bisection, IEEE float64 compares and
// divides), and the counter-based noise of `sampling.exp_noise` (fmix32 hash on uint32_t lanes,
// Cephes fp32 log). Internal linkage: each op's translation unit gets its own copy.
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace specwhisper {
namespace {

// Constants of specwhisper.sampling (fp32 values written exactly).
constexpr float kExpMinArg = -64.0f;
constexpr float kLog2e = 1.4426950216293335f;
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -0.00021219444170128554f;
// Taylor coefficients 1/7! .. 1/2! (then 1, 1) in fp32, evaluated by Horner.
constexpr float kC7 = 0.00019841270113829523f, kC6 = 0.0013888889225199819f,
                kC5 = 0.008333333767950535f, kC4 = 0.0416666679084301f,
                kC3 = 0.1666666716337204f, kC2 = 0.5f;
constexpr float kWeightScale = 68719476736.0f;  // 2^36
constexpr double kRoundMagic64 = 4503599627370496.0;  // 2^52
constexpr int kWeightBits = 36;
constexpr double kInf = std::numeric_limits<double>::infinity();

inline float exp_f32(float s) {
  s = s < kExpMinArg ? kExpMinArg : s;  // also maps -inf to the clamp
  const float n = (s * kLog2e + kRoundMagic) - kRoundMagic;
  const float r = (s - n * kLn2Hi) - n * kLn2Lo;
  float poly = kC7 * r + kC6;
  poly = poly * r + kC5;
  poly = poly * r + kC4;
  poly = poly * r + kC3;
  poly = poly * r + kC2;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const float two_n = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  return poly * two_n;
}

inline double weight_of(float logit, float row_max, float inv_t) {
  const double scaled = static_cast<double>(exp_f32((logit - row_max) * inv_t) * kWeightScale);
  return (scaled + kRoundMagic64) - kRoundMagic64;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(SPECWHISPER_NO_CLONES)
// Hot loops compiled for AVX-512, AVX2 and baseline x86-64, picked at load time. Same IEEE results
// on each: no FMA contraction (-ffp-contract=off), and only exact sums and min/max are reordered.
#define SPECWHISPER_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SPECWHISPER_CLONES
#endif

SPECWHISPER_CLONES float row_max(const float* x, int64_t V) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < V; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// Integer weights of a row into w; returns their sum (exact: integers below 2^53).
SPECWHISPER_CLONES double fill_weights(const float* x, int64_t V, float m, float inv_t, double* w) {
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) w[i] = weight_of(x[i], m, inv_t);
  double total = 0.0;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < V; ++i) total += w[i];
  return total;
}

struct Split {
  double mass;         // sum of the weights >= mid
  double min_kept;     // smallest weight >= mid
  double max_dropped;  // largest weight < mid (-1 if none)
};

SPECWHISPER_CLONES Split split_at(const double* w, int64_t V, double mid) {
  double mass = 0.0, min_kept = kInf, max_dropped = -1.0;
#pragma omp simd reduction(+ : mass) reduction(min : min_kept) reduction(max : max_dropped)
  for (int64_t i = 0; i < V; ++i) {
    const bool keep = w[i] >= mid;
    mass += keep ? w[i] : 0.0;
    const double kept = keep ? w[i] : kInf;
    const double dropped = keep ? -1.0 : w[i];
    min_kept = kept < min_kept ? kept : min_kept;
    max_dropped = dropped > max_dropped ? dropped : max_dropped;
  }
  return {mass, min_kept, max_dropped};
}

struct Distribution {
  double tau = 1.0;       // kept tokens: weight >= tau
  double inv_kept = 0.0;  // 1 / kept mass
  double prob(double w) const { return w >= tau ? w * inv_kept : 0.0; }
};

// Weights of one row of fp32 logits into w; the processed distribution's top-p threshold (a
// bisection over the threshold value snapped to weights, stopping once no weight lies strictly
// between the feasible lo and the infeasible hi) and normaliser.
Distribution distribution(const float* x, int64_t V, float inv_t, bool use_top_p, float top_p,
                          double* w) {
  const double total = fill_weights(x, V, row_max(x, V), inv_t, w);
  Distribution d;
  double kept = total;
  if (use_top_p) {
    const double target = total * static_cast<double>(top_p);
    double hi = static_cast<double>(kWeightScale) + 1.0;
    while (hi - d.tau > 1.0) {
      const Split split = split_at(w, V, std::floor((d.tau + hi) * 0.5));
      if (split.mass >= target) {
        d.tau = split.min_kept;
        kept = split.mass;
      } else {
        hi = split.max_dropped + 1.0;
      }
    }
  }
  d.inv_kept = 1.0 / kept;
  return d;
}

// A row of logits as fp32: the row itself, or converted into `buffer`.
template <typename scalar_t>
const float* as_float(const scalar_t* row, int64_t V, float* buffer) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else {
    for (int64_t i = 0; i < V; ++i) buffer[i] = static_cast<float>(row[i]);
    return buffer;
  }
}

template <typename scalar_t>
int64_t argmax_row(const scalar_t* row, int64_t V) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_idx = 0;
  for (int64_t i = 0; i < V; ++i) {
    const float x = static_cast<float>(row[i]);
    if (x > best) {
      best = x;
      best_idx = i;
    }
  }
  return best_idx;
}

// First index of the maximum of scores[i] (>= 0), computed in two vectorisable passes.
SPECWHISPER_CLONES int64_t first_argmax(const double* scores, int64_t V) {
  double best = -1.0;
#pragma omp simd reduction(max : best)
  for (int64_t i = 0; i < V; ++i) best = scores[i] > best ? scores[i] : best;
  int64_t i = 0;
  while (i < V - 1 && scores[i] != best) ++i;
  return i;
}

// ---- counter-based noise (sampling.exp_noise) ----
constexpr uint32_t kFmixC1 = 0x85EBCA6Bu, kFmixC2 = 0xC2B2AE35u;
constexpr uint32_t kKeySeed = 0x9E3779B9u, kKeyB = 0x7F4A7C15u;
constexpr float kTwoM24 = 5.9604644775390625e-08f;  // 2^-24
constexpr float kSqrtHalf = 0.7071067690849304f;
constexpr float kL0 = 0.07037683576345444f, kL1 = -0.11514610052108765f,
                kL2 = 0.11676998436450958f, kL3 = -0.12420140951871872f,
                kL4 = 0.14249323308467865f, kL5 = -0.16668057441711426f,
                kL6 = 0.2000071406364441f, kL7 = -0.24999994039535522f,
                kL8 = 0.3333333134651184f;

__attribute__((always_inline)) inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= kFmixC1;
  h ^= h >> 13;
  h *= kFmixC2;
  h ^= h >> 16;
  return h;
}

struct RowKey {
  uint32_t a, b;
};

inline RowKey row_key(int64_t seed, int64_t position) {
  const uint64_t s = static_cast<uint64_t>(seed), p = static_cast<uint64_t>(position);
  uint32_t key = fmix32(static_cast<uint32_t>(s) ^ kKeySeed);
  key = fmix32(key ^ static_cast<uint32_t>(s >> 32));
  key = fmix32(key ^ static_cast<uint32_t>(p));
  key = fmix32(key ^ static_cast<uint32_t>(p >> 32));
  return {key, fmix32(key ^ kKeyB)};
}

// -log(u), u in [2^-24, 1): Cephes logf as a fixed sequence of fp32 operations (branch-free, so
// loops over it vectorise).
__attribute__((always_inline)) inline float neg_log_f32(float u) {
  const int32_t bits = __builtin_bit_cast(int32_t, u);
  const float m = __builtin_bit_cast(float, (bits & 0x7FFFFF) | 0x3F000000);  // u = m 2^e
  const bool small = m < kSqrtHalf;
  const float fe = static_cast<float>((bits >> 23) - 126 - (small ? 1 : 0));
  const float x = small ? (m + m) - 1.0f : m - 1.0f;
  const float z = x * x;
  float poly = kL0 * x + kL1;
  poly = poly * x + kL2;
  poly = poly * x + kL3;
  poly = poly * x + kL4;
  poly = poly * x + kL5;
  poly = poly * x + kL6;
  poly = poly * x + kL7;
  poly = poly * x + kL8;
  float y = (poly * x) * z;
  y = y + fe * kLn2Lo;
  y = y - z * 0.5f;
  return -((x + y) + fe * kLn2Hi);
}

// Always inlined, with fmix32 and neg_log_f32: left calls, the loop over a row's columns without
// noise ids ran scalar (the race over base's 51865 columns: 1.42 -> 0.24 ms a row, AVX2 Zen 3).
__attribute__((always_inline)) inline float exp_noise_at(RowKey key, int64_t id) {
  const uint64_t i = static_cast<uint64_t>(id);
  uint32_t h = fmix32(key.a ^ static_cast<uint32_t>(i));
  h = fmix32(h ^ key.b ^ static_cast<uint32_t>(i >> 32));
  const int32_t odd = static_cast<int32_t>((h >> 9) * 2 + 1);  // < 2^24: exact as a float
  return neg_log_f32(static_cast<float>(odd) * kTwoM24);
}

}  // namespace
}  // namespace specwhisper

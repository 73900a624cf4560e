// Speculative sampling step on the CPU: specwhisper::speculative_sample_noise.
//
// Leviathan et al. 2023 (arXiv 2211.17192), Chen et al. 2023 (arXiv 2302.01318). Reference and
// spec: specwhisper/sampling.py `speculative_sample_noise`; this op reproduces its tokens and
// counts bit for bit. It relies on the reference's arithmetic contract: the same fp32 exp
// polynomial (compiled with -ffp-contract=off, so no FMA), integer token weights in float64 whose
// sums are exact in any order (so vectorised reductions are allowed), IEEE float64 compares and
// divides. Rows run in parallel; each row walks its draft positions and stops at the first
// rejection. Top-p is a sort-free bisection over the threshold value on the stored weights.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

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

// Scratch space of one thread: weights of p and q, fp32 rows, scores.
struct Workspace {
  explicit Workspace(int64_t V) : p_w(V), q_w(V), p_x(V), q_x(V), score(V) {}
  std::vector<double> p_w, q_w;
  std::vector<float> p_x, q_x;
  std::vector<double> score;
};

SPECWHISPER_CLONES double residual_scores(const double* p_w, Distribution p, const double* q_w,
                                          Distribution q, bool use_q, const float* noise,
                                          int64_t V, double* score) {
  double residual_max = 0.0;
#pragma omp simd reduction(max : residual_max)
  for (int64_t i = 0; i < V; ++i) {
    const double diff = p.prob(p_w[i]) - (use_q ? q.prob(q_w[i]) : 0.0);
    const double residual = diff > 0.0 ? diff : 0.0;
    residual_max = residual > residual_max ? residual : residual_max;
    score[i] = residual / static_cast<double>(noise[i]);
  }
  return residual_max;
}

template <typename target_t, typename draft_t>
void sample_row(const target_t* target, const draft_t* draft, const int64_t* drafted,
                const double* uniforms, const float* noise, int64_t k, int64_t V, float inv_t,
                bool use_top_p, float top_p, int64_t* tokens, int64_t* n_emitted, Workspace& ws) {
  int64_t n = 0;
  bool rejected = false;
  Distribution p, q;
  for (; n < k; ++n) {
    p = distribution(as_float(target + n * V, V, ws.p_x.data()), V, inv_t, use_top_p, top_p,
                     ws.p_w.data());
    q = distribution(as_float(draft + n * V, V, ws.q_x.data()), V, inv_t, use_top_p, top_p,
                     ws.q_w.data());
    const int64_t x = drafted[n];
    TORCH_CHECK(x >= 0 && x < V, "draft token ", x, " outside [0, ", V, ")");
    const double p_x = p.prob(ws.p_w[x]);
    const double q_x = q.prob(ws.q_w[x]);
    if (!(q_x > 0.0 && uniforms[n] * q_x < p_x)) {
      rejected = true;
      break;
    }
    tokens[n] = x;
  }
  if (!rejected) {
    p = distribution(as_float(target + k * V, V, ws.p_x.data()), V, inv_t, use_top_p, top_p,
                     ws.p_w.data());
  }
  // Exponential race on max(p - q, 0) (q = 0 at the bonus position); on p if that is all zero.
  double* score = ws.score.data();
  if (!(residual_scores(ws.p_w.data(), p, ws.q_w.data(), q, rejected, noise, V, score) > 0.0)) {
    residual_scores(ws.p_w.data(), p, ws.q_w.data(), q, false, noise, V, score);
  }
  tokens[n] = first_argmax(score, V);
  for (int64_t i = n + 1; i <= k; ++i) tokens[i] = -1;
  *n_emitted = n + 1;
}

template <typename scalar_t>
void greedy_row(const scalar_t* target, const int64_t* drafted, int64_t k, int64_t V,
                int64_t* tokens, int64_t* n_emitted) {
  int64_t n = 0;
  int64_t best = argmax_row(target, V);
  while (n < k && drafted[n] == best) {
    tokens[n] = best;
    ++n;
    best = argmax_row(target + n * V, V);
  }
  tokens[n] = best;
  for (int64_t i = n + 1; i <= k; ++i) tokens[i] = -1;
  *n_emitted = n + 1;
}

std::tuple<at::Tensor, at::Tensor> speculative_sample_noise_cpu(
    const at::Tensor& target_logits_in, const at::Tensor& draft_logits_in,
    const at::Tensor& draft_tokens_in, double temperature, double top_p,
    const at::Tensor& uniforms_in, const at::Tensor& exp_noise_in) {
  TORCH_CHECK(target_logits_in.dim() == 3 && target_logits_in.size(1) >= 2,
              "target_logits must be [B, k+1, V] with k >= 1");
  const int64_t B = target_logits_in.size(0), k = target_logits_in.size(1) - 1,
                V = target_logits_in.size(2);
  TORCH_CHECK(draft_logits_in.sizes() == at::IntArrayRef({B, k, V}), "draft_logits must be [B, k, V]");
  TORCH_CHECK(draft_tokens_in.sizes() == at::IntArrayRef({B, k}), "draft_tokens must be [B, k]");
  TORCH_CHECK(uniforms_in.sizes() == at::IntArrayRef({B, k}), "uniforms must be [B, k]");
  TORCH_CHECK(exp_noise_in.sizes() == at::IntArrayRef({B, V}), "exp_noise must be [B, V]");
  TORCH_CHECK(draft_tokens_in.scalar_type() == at::kLong, "draft_tokens must be int64");
  TORCH_CHECK(uniforms_in.scalar_type() == at::kDouble, "uniforms must be float64");
  TORCH_CHECK(exp_noise_in.scalar_type() == at::kFloat, "exp_noise must be float32");
  TORCH_CHECK(V <= (int64_t{1} << (53 - kWeightBits)), "vocabulary too large for exact sums");
  TORCH_CHECK(temperature >= 0.0 && std::isfinite(temperature), "temperature must be >= 0");
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0, "top_p must be in (0, 1]");
  const at::Tensor target_logits = target_logits_in.contiguous();
  const at::Tensor draft_logits = draft_logits_in.contiguous();
  const at::Tensor draft_tokens = draft_tokens_in.contiguous();
  const at::Tensor uniforms = uniforms_in.contiguous();
  const at::Tensor exp_noise = exp_noise_in.contiguous();
  at::Tensor tokens = at::empty({B, k + 1}, target_logits.options().dtype(at::kLong));
  at::Tensor n_emitted = at::empty({B}, target_logits.options().dtype(at::kLong));
  int64_t* tokens_ptr = tokens.data_ptr<int64_t>();
  int64_t* n_emitted_ptr = n_emitted.data_ptr<int64_t>();
  const int64_t* drafted = draft_tokens.data_ptr<int64_t>();

  if (temperature == 0.0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, target_logits.scalar_type(),
                                    "specwhisper_greedy_accept", [&] {
      const scalar_t* target = target_logits.data_ptr<scalar_t>();
      at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b)
          greedy_row(target + b * (k + 1) * V, drafted + b * k, k, V,
                     tokens_ptr + b * (k + 1), n_emitted_ptr + b);
      });
    });
    return {tokens, n_emitted};
  }

  const float inv_t = static_cast<float>(1.0 / temperature);
  TORCH_CHECK(std::isfinite(inv_t), "temperature too small for float32");
  const bool use_top_p = top_p < 1.0;
  const float top_p32 = static_cast<float>(top_p);
  const double* u = uniforms.data_ptr<double>();
  const float* noise = exp_noise.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, target_logits.scalar_type(),
                                  "specwhisper_speculative_sample", [&] {
    using target_t = scalar_t;
    const target_t* target = target_logits.data_ptr<target_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, draft_logits.scalar_type(),
                                    "specwhisper_speculative_sample_draft", [&] {
      const scalar_t* draft = draft_logits.data_ptr<scalar_t>();
      at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
        Workspace ws(V);
        for (int64_t b = begin; b < end; ++b)
          sample_row(target + b * (k + 1) * V, draft + b * k * V, drafted + b * k, u + b * k,
                     noise + b * V, k, V, inv_t, use_top_p, top_p32, tokens_ptr + b * (k + 1),
                     n_emitted_ptr + b, ws);
      });
    });
  });
  return {tokens, n_emitted};
}

}  // namespace

TORCH_LIBRARY(specwhisper, m) {
  m.def(
      "speculative_sample_noise(Tensor target_logits, Tensor draft_logits, Tensor draft_tokens, "
      "float temperature, float top_p, Tensor uniforms, Tensor exp_noise) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specwhisper, CPU, m) {
  m.impl("speculative_sample_noise", &speculative_sample_noise_cpu);
}

}  // namespace specwhisper

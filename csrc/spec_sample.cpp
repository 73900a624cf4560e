// Speculative sampling step on the CPU: specwhisper::speculative_sample_noise.
//
// Leviathan et al. 2023 (arXiv 2211.17192), Chen et al. 2023 (arXiv 2302.01318). Reference and
// spec: specwhisper/sampling.py `speculative_sample_noise`; this op reproduces its tokens and
// counts bit for bit. It relies on the reference's arithmetic contract: the same fp32 exp
// polynomial (compiled with -ffp-contract=off, so no FMA), integer token weights in float64 whose
// sums are exact in any order (so vectorised reductions are allowed), IEEE float64 compares and
// divides. Rows run in parallel; each row walks its draft positions and stops at the first
// rejection. Top-p is a sort-free bisection over the threshold value on the stored weights.
#include "processed.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace specwhisper {
namespace {

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

// Counter-based noise and race sampling on the CPU: specwhisper::exp_noise, specwhisper::race_sample.
//
// Race sampling (Gumbel-max trick as an exponential race): token = argmax_v p(v) / E(v) with
// E(v) = exp_noise(seed, position, noise_ids[v]) ~ Exp(1). Reference and spec:
// specwhisper/sampling.py `exp_noise` and `race_sample`, reproduced bit for bit (see processed.h
// for the arithmetic contract). Rows run in parallel; a row with temperature <= 0 is the argmax of
// its logits (first index among ties) and draws no noise.
#include "processed.h"

#include <cmath>
#include <limits>
#include <memory>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace specwhisper {
namespace {

SPECWHISPER_CLONES void noise_row(RowKey key, const int64_t* ids, int64_t V, float* out) {
  if (ids) {
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) out[i] = exp_noise_at(key, ids[i]);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) out[i] = exp_noise_at(key, i);
  }
}

// score[i] = p(i) / E(i) in float64 (every score >= 0); the noise goes through `score` first.
SPECWHISPER_CLONES void race_scores(const double* w, Distribution p, RowKey key, const int64_t* ids,
                                    int64_t V, float* noise, double* score) {
  noise_row(key, ids, V, noise);
  const double tau = p.tau, inv_kept = p.inv_kept;
#pragma omp simd
  for (int64_t i = 0; i < V; ++i)
    score[i] = (w[i] >= tau ? w[i] * inv_kept : 0.0) / static_cast<double>(noise[i]);
}

// A winner's lead over the best other column (spec: sampling.py `race_leads`), in logit units:
// a raced row's T * ln(score[best] / runner-up), an argmax row's logit difference; +inf where no
// other column could win (every other score 0, every other logit -inf).
SPECWHISPER_CLONES float race_lead(const double* score, int64_t V, int64_t best, float temperature) {
  double second = 0.0;
#pragma omp simd reduction(max : second)
  for (int64_t i = 0; i < V; ++i) {
    const double x = i == best ? 0.0 : score[i];
    second = x > second ? x : second;
  }
  if (!(second > 0.0)) return std::numeric_limits<float>::infinity();
  return static_cast<float>(static_cast<double>(temperature) * (std::log(score[best]) - std::log(second)));
}

template <typename scalar_t>
float logit_lead(const scalar_t* row, int64_t V, int64_t best) {
  float second = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i) {
    const float x = static_cast<float>(row[i]);
    if (i != best && x > second) second = x;
  }
  if (second == -std::numeric_limits<float>::infinity()) return std::numeric_limits<float>::infinity();
  return static_cast<float>(row[best]) - second;
}

void check_rows(const at::Tensor& t, int64_t N, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == N, name, " must be [N] with N = ", N);
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

at::Tensor exp_noise_cpu(const at::Tensor& seed_in, const at::Tensor& position_in,
                         const at::Tensor& noise_ids_in) {
  TORCH_CHECK(seed_in.dim() == 1, "seed must be [N]");
  const int64_t N = seed_in.size(0);
  check_rows(seed_in, N, at::kLong, "seed");
  check_rows(position_in, N, at::kLong, "position");
  TORCH_CHECK(noise_ids_in.dim() == 1 && noise_ids_in.scalar_type() == at::kLong,
              "noise_ids must be [V] int64");
  const int64_t V = noise_ids_in.size(0);
  const at::Tensor seed = seed_in.contiguous(), position = position_in.contiguous(),
                   noise_ids = noise_ids_in.contiguous();
  at::Tensor out = at::empty({N, V}, seed.options().dtype(at::kFloat));
  const int64_t* s = seed.data_ptr<int64_t>();
  const int64_t* p = position.data_ptr<int64_t>();
  const int64_t* ids = noise_ids.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) noise_row(row_key(s[r], p[r]), ids, V, o + r * V);
  });
  return out;
}

at::Tensor race_sample_cpu(const at::Tensor& logits_in, const at::Tensor& temperature_in,
                           const at::Tensor& top_p_in, const at::Tensor& seed_in,
                           const at::Tensor& position_in,
                           const std::optional<at::Tensor>& noise_ids_in,
                           const std::optional<at::Tensor>& leads_in) {
  TORCH_CHECK(logits_in.dim() == 2, "logits must be [N, V]");
  const int64_t N = logits_in.size(0), V = logits_in.size(1);
  TORCH_CHECK(V >= 1, "logits must have at least one column");
  TORCH_CHECK(V <= (int64_t{1} << (53 - kWeightBits)), "vocabulary too large for exact sums");
  check_rows(temperature_in, N, at::kFloat, "temperature");
  check_rows(top_p_in, N, at::kFloat, "top_p");
  check_rows(seed_in, N, at::kLong, "seed");
  check_rows(position_in, N, at::kLong, "position");
  at::Tensor noise_ids;
  if (noise_ids_in.has_value()) {
    noise_ids = noise_ids_in->contiguous();
    TORCH_CHECK(noise_ids.dim() == 1 && noise_ids.size(0) == V &&
                    noise_ids.scalar_type() == at::kLong,
                "noise_ids must be [V] int64 with V = ", V);
  }
  // Rows may be strided (e.g. an expanded row); the vocabulary dim must be contiguous.
  const at::Tensor logits = logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
  const int64_t row_stride = logits.stride(0);
  const at::Tensor temperature = temperature_in.contiguous(), top_p = top_p_in.contiguous(),
                   seed = seed_in.contiguous(), position = position_in.contiguous();
  float* lead = nullptr;  // each winner's lead (sampling.race_leads), where asked for
  if (leads_in.has_value()) {
    TORCH_CHECK(leads_in->dim() == 1 && leads_in->size(0) == N && leads_in->scalar_type() == at::kFloat &&
                    leads_in->is_contiguous(),
                "leads must be contiguous float32 [N] with N = ", N);
    lead = leads_in->data_ptr<float>();
  }
  at::Tensor tokens = at::empty({N}, logits.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  const float* t = temperature.data_ptr<float>();
  const float* tp = top_p.data_ptr<float>();
  const int64_t* s = seed.data_ptr<int64_t>();
  const int64_t* pos = position.data_ptr<int64_t>();
  const int64_t* ids = noise_ids.defined() ? noise_ids.data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(),
                                  "specwhisper_race_sample", [&] {
    const scalar_t* base = logits.data_ptr<scalar_t>();
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      // scratch rows, written before they are read (no zero fill: 1.2 MB a call at base's vocabulary)
      std::unique_ptr<float[]> x(new float[V]), noise(new float[V]);
      std::unique_ptr<double[]> w(new double[V]), score(new double[V]);
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = base + r * row_stride;
        if (!(t[r] > 0.0f)) {
          out[r] = argmax_row(row, V);
          if (lead) lead[r] = logit_lead(row, V, out[r]);
          continue;
        }
        const float inv_t = static_cast<float>(1.0 / static_cast<double>(t[r]));
        const Distribution p =
            distribution(as_float(row, V, x.get()), V, inv_t, tp[r] < 1.0f, tp[r], w.get());
        race_scores(w.get(), p, row_key(s[r], pos[r]), ids, V, noise.get(), score.get());
        out[r] = first_argmax(score.get(), V);
        if (lead) lead[r] = race_lead(score.get(), V, out[r], t[r]);
      }
    });
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specwhisper, m) {
  m.def("exp_noise(Tensor seed, Tensor position, Tensor noise_ids) -> Tensor");
  m.def(
      "race_sample(Tensor logits, Tensor temperature, Tensor top_p, Tensor seed, Tensor position, "
      "Tensor? noise_ids, Tensor(a!)? leads=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specwhisper, CPU, m) {
  m.impl("exp_noise", &exp_noise_cpu);
  m.impl("race_sample", &race_sample_cpu);
}

}  // namespace specwhisper

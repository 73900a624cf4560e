"""Triton kernels, installed as `specwhisper.kernels`; each has its pure-PyTorch reference (the
sampling kernels' in `specwhisper/sampling.py`, with the same signature).

- `spec_sample.speculative_sample_triton`: the fused accept / reject / resample step;
- `spec_sample.exp_noise_triton`: counter-based Exp(1) noise keyed by (seed, position, id);
- `spec_sample.race_sample_triton`: race sampling (argmax p / E) with that noise in registers;
- `decode_linear.decode_linear`: a few rows' linear layer with its layer norm, bias, GELU and
  residual add fused, each row's bits independent of the others (reference: `decode_linear_reference`
  beside it). Not yet wired into the decoder: bench/gpu_profile.py times it against torch's ops.

Import the submodules lazily (specwhisper.backends.ops does): they import Triton.
"""

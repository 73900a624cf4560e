"""Triton kernels, installed as `specwhisper.kernels`; each has its pure-PyTorch reference in
`specwhisper/sampling.py` with the same signature.

- `spec_sample.speculative_sample_triton`: the fused accept / reject / resample step;
- `spec_sample.exp_noise_triton`: counter-based Exp(1) noise keyed by (seed, position, id);
- `spec_sample.race_sample_triton`: race sampling (argmax p / E) with that noise in registers.

Import the submodules lazily (specwhisper.backends.ops does): they import Triton.
"""

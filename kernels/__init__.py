"""Triton kernels, installed as `specwhisper.kernels`; each has its pure-PyTorch reference in
`specwhisper/sampling.py` with the same signature.

- `spec_sample.speculative_sample_triton`: the fused accept / reject / resample step.

Import the submodules lazily (specwhisper.backend does): they import Triton.
"""

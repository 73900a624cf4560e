"""Triton kernels, installed as `specwhisper.kernels`; each has its pure-PyTorch reference (the
sampling kernels' in `specwhisper/sampling.py`, with the same signature).

- `spec_sample.speculative_sample_triton`: the fused accept / reject / resample step;
- `spec_sample.exp_noise_triton`: counter-based Exp(1) noise keyed by (seed, position, id);
- `spec_sample.race_sample_triton`: race sampling (argmax p / E) with that noise in registers;
- `decode_ops.decode_linear`, `decode_ops.decode_attention`: the GPU decode step's linear (layer
  norm, bias, GELU, residual add fused) and chunked attention, each row's and query's bits
  independent of the others (references beside them); `Whisper.fuse_decode_ops` runs the decoder
  on them (experimental; bench/gpu_profile.py times it).

Import the submodules lazily (specwhisper.backends.ops does): they import Triton.
"""

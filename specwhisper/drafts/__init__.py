"""Drafts bundled with the package, each stored as the tensors its training changed
(`specwhisper.tools.bundled`) and assembled beside its fetched target by `specwhisper fetch NAME`.

- `base-2l.safetensors`: a 2-layer decoder for whisper-base that shares base's encoder, made by
  `specwhisper distill` (recipe and held-out agreement in the file's metadata:
  `bundled.info(path)`), for English. On a CPU its draft step reads ≈ 1/6 of base's decoder bytes and
  its start in a window is a copy of base's cross K/V for two layers, so it pays where tiny.en's own
  encoder pass does not (AVX2-only CPUs). Speculative output is base's own either way.
"""

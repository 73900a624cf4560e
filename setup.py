"""Packaging glue that pyproject.toml cannot express.

- the package's subpackages by layer (`model`, `engine`, `backends`, `longform`, `serving`, `tools`,
  `kernels`: the Triton sources) are listed one by one.
- `csrc/` ships as package data (`specwhisper.csrc`); the C++ extensions `specwhisper_C`
  (sampling ops, specwhisper/backends/ops.py) and `specwhisper_decode_ops` (decoder-step ops,
  specwhisper/backends/cpu_ops.py) are built just in time with ninja on first use, from the
  checkout's `csrc/` or, installed, from that package data: `pip install` compiles nothing, and
  the package works (with PyTorch ops and one warning) without a compiler.
"""
from setuptools import setup

setup(
    packages=["specwhisper", "specwhisper.model", "specwhisper.engine", "specwhisper.backends", "specwhisper.longform",
              "specwhisper.serving", "specwhisper.tools", "specwhisper.kernels", "specwhisper.csrc",
              "specwhisper.samples", "specwhisper.drafts"],
    package_dir={
        "specwhisper": "specwhisper",
        "specwhisper.csrc": "csrc",
        "specwhisper.samples": "specwhisper/samples",
        "specwhisper.drafts": "specwhisper/drafts",
    },
    package_data={
        "specwhisper.csrc": ["*.cpp", "*.cu", "*.h"],
        "specwhisper.samples": ["*.wav", "*.flac", "*.json", "*.txt", "*.sh"],
        "specwhisper.drafts": ["*.safetensors"],
    },
    include_package_data=True,
)

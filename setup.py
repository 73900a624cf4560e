"""Packaging glue that pyproject.toml cannot express.

- `kernels/` (Triton sources) installs as the subpackage `specwhisper.kernels`.
- `csrc/` ships as package data; the optional C++/CUDA extension `specwhisper._C` is built
  just in time with ninja on first use (see specwhisper/ops.py), so `pip install`
  compiles nothing and the package works without a compiler.
"""
from setuptools import setup

setup(
    packages=["specwhisper", "specwhisper.kernels", "specwhisper.csrc", "specwhisper.samples"],
    package_dir={
        "specwhisper": "specwhisper",
        "specwhisper.kernels": "kernels",
        "specwhisper.csrc": "csrc",
        "specwhisper.samples": "specwhisper/samples",
    },
    package_data={
        "specwhisper.csrc": ["*.cpp", "*.cu", "*.h"],
        "specwhisper.samples": ["*.wav", "*.flac", "*.json", "*.txt", "*.sh"],
    },
    include_package_data=True,
)

"""A non-editable install (`pip install .` into a fresh folder first on the path, run from another
directory) builds and uses the C++ ops from its installed package data, not from a source tree."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

CHECK = """
import pathlib, sys, warnings
warnings.simplefilter("error")  # a failed build warns: make it fail here
import torch
import specwhisper
from specwhisper.backends import cpu_ops, ops
from specwhisper.backends import backend_for
installed = pathlib.Path(specwhisper.__file__).resolve().parent
assert "site-packages" in str(installed), installed
assert str(installed) in str(ops.csrc_dir()), ops.csrc_dir()
assert cpu_ops.available(), "C++ decode ops did not build"
assert ops.cpp_ops() is not None, "C++ sampling ops did not build"
x, w = torch.randn(3, 64), torch.randn(32, 64)
with torch.inference_mode():
    assert cpu_ops.active(x)
    assert torch.allclose(cpu_ops.linear(x, w), x @ w.T, atol=1e-4)
assert len(list((installed / "samples").glob("*.wav"))) >= 8
assert backend_for("cpu").name == "cpu"  # the backends subpackage is installed
for sub in ("model", "engine", "backends", "longform", "serving", "tools", "kernels", "samples"):
    assert (installed / sub / "__init__.py").is_file(), f"subpackage {sub} is not installed"
import specwhisper.tools.cli  # the console script's module (specwhisper.tools.cli:main)
print("ok", installed)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the C++ ops build with gcc on Linux")
def test_non_editable_install_builds_and_uses_the_cpp_ops(tmp_path):
    python = sys.executable  # its torch and dependencies; specwhisper itself from the install below
    # the usual build folder: the installed sources equal the checkout's, so a build of them is
    # reused (torch versions a JIT build by its sources' text); sources it cannot find fail
    env = {**os.environ, "PYTHONNOUSERSITE": "1"}
    env.pop("SPECWHISPER_NO_EXT", None)
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(tmp_path / "site-packages"), str(REPO)],
        capture_output=True, text=True, env=env, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    env["PYTHONPATH"] = str(tmp_path / "site-packages")  # before the editable checkout
    result = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True, env=env,
                            cwd=run_dir, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert result.stdout.startswith("ok")


STALE_LOCK = """
import warnings
warnings.simplefilter("error")
from specwhisper.backends import cpu_ops, ops
assert ops.cpp_ops() is not None and cpu_ops.available()
print("ok")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the C++ ops build with gcc on Linux")
def test_a_build_killed_midway_does_not_hang_the_next_import(tmp_path):
    """torch marks a JIT build in progress with a `lock` file and waits for it to go; a build that
    was killed leaves it behind. The next import must remove it (under the OS lock that tells it no
    build is running) rather than wait forever."""
    from specwhisper.backends import ops
    directory = tmp_path / "build"
    directory.mkdir()
    for f in ops.build_dir().glob("*"):  # today's build, so the child only re-links what changed
        if f.is_file() and f.name not in ("lock", "specwhisper.lock"):
            (directory / f.name).write_bytes(f.read_bytes())
    (directory / "lock").touch()  # what a killed build leaves
    env = {**os.environ, "SPECWHISPER_BUILD_DIR": str(directory)}
    env.pop("SPECWHISPER_NO_EXT", None)
    try:
        result = subprocess.run([sys.executable, "-c", STALE_LOCK], capture_output=True, text=True, env=env,
                                timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail("the import waited on a stale build lock")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert result.stdout.strip() == "ok"
    assert not (directory / "lock").exists()

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
assert (installed / "drafts" / "base-2l.safetensors").stat().st_size > 10_000_000  # the bundled draft
assert backend_for("cpu").name == "cpu"  # the backends subpackage is installed
for sub in ("model", "engine", "backends", "longform", "serving", "tools", "kernels", "samples", "drafts"):
    assert (installed / sub / "__init__.py").is_file(), f"subpackage {sub} is not installed"
import specwhisper.tools.cli  # the console script's module (specwhisper.tools.cli:run)
print("ok", installed)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the C++ ops build with gcc on Linux")
def test_non_editable_install_builds_and_uses_the_cpp_ops(tmp_path):
    from specwhisper.backends import cpu_ops, ops

    python = sys.executable  # its torch and dependencies; specwhisper itself from the install below
    # the usual build folder: the installed sources equal the checkout's, and both build from
    # copies staged in that folder, so the checkout's build is reused, not rebuilt over
    assert ops.cpp_ops() is not None and cpu_ops.available()
    built = {f.name: f.stat().st_mtime_ns for f in ops.build_dir().glob("*.so")}
    assert len(built) == 2, built
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
    assert {f.name: f.stat().st_mtime_ns for f in ops.build_dir().glob("*.so")} == built, "rebuilt"


STALE_LOCK = """
import warnings
warnings.simplefilter("error")
from specwhisper.backends import cpu_ops, ops
assert ops.cpp_ops() is not None and cpu_ops.available()
print("ok")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the C++ ops build with gcc on Linux")
def test_a_build_killed_midway_does_not_hang_the_next_import():
    """torch marks a JIT build in progress with a `lock` file and waits for it to go; a build that
    was killed leaves it behind. The next import must remove it (under the OS lock that tells it no
    build is running) rather than wait forever."""
    from specwhisper.backends import cpu_ops, ops

    # the usual build folder, built: the child finds its build current once past the lock (a
    # copy elsewhere would rebuild, 23 s: ninja's command lines name the folder)
    assert ops.cpp_ops() is not None and cpu_ops.available()
    directory = ops.build_dir()
    (directory / "lock").touch()  # what a killed build leaves
    env = dict(os.environ)
    env.pop("SPECWHISPER_NO_EXT", None)
    try:
        result = subprocess.run([sys.executable, "-c", STALE_LOCK], capture_output=True, text=True, env=env,
                                timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail("the import waited on a stale build lock")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert result.stdout.strip() == "ok"
    assert not (directory / "lock").exists()


def test_import_asks_torch_for_huge_pages_unless_told_otherwise():
    """`import specwhisper` before torch sets THP_MEM_ALLOC_ENABLE=1 for torch's allocator (large
    tensors in transparent huge pages: a decode step's weights and caches); a value the user set
    is kept, and with torch imported first the package leaves it alone. `cpu_ops.huge_pages`
    reports what a fresh decode buffer (`model.memory.huge_zeros`) really got."""
    report = "import os; from specwhisper.backends import cpu_ops; print(os.environ.get('THP_MEM_ALLOC_ENABLE'), cpu_ops.huge_pages())"
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}

    def run(code, **extra):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, **extra},
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()[-1]

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = thp.read_text().split("[")[1].split("]")[0] if thp.exists() else None
    first = run("import specwhisper; " + report)
    assert first.startswith("1 ")
    if mode in ("madvise", "always"):
        assert "on (THP" in first, first
    else:
        assert "off" in first, first
    opted_out = run("import specwhisper; " + report, THP_MEM_ALLOC_ENABLE="0")
    assert opted_out.startswith("0 ")
    if mode == "madvise":
        assert opted_out.startswith("0 off"), opted_out
    assert run("import torch; import specwhisper; " + report).startswith("None ")


PROBE_OP = """
#include <torch/library.h>
#include <ATen/ATen.h>
at::Tensor twice(const at::Tensor& x) { return x * 2; }
TORCH_LIBRARY(sw_stamp_probe, m) { m.def("twice(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(sw_stamp_probe, CPU, m) { m.impl("twice", &twice); }
"""

RELOAD = """
import sys, torch, torch.utils.cpp_extension as ext
from pathlib import Path
from specwhisper.backends.ops import load_or_build

def refuse(*args, **kwargs):
    raise RuntimeError("went through torch's load")

ext.load = refuse
folder = Path(sys.argv[1])
load_or_build(folder, "sw_stamp_probe", [folder / "probe.cpp"], 1, ["-O1"], [])
assert torch.equal(torch.ops.sw_stamp_probe.twice(torch.ones(2)), torch.full((2,), 2.0))
print("direct")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the C++ ops build with gcc on Linux")
def test_a_built_extension_loads_without_torchs_build_check_until_it_changes(tmp_path):
    """`load_or_build`: the first process builds and stamps; the next loads the library directly
    (torch's `load`, which runs ninja, is never called); a library rebuilt by anything else, or
    changed sources, go through `load` again."""
    import torch

    from specwhisper.backends.ops import load_or_build

    (tmp_path / "probe.cpp").write_text(PROBE_OP)
    load_or_build(tmp_path, "sw_stamp_probe", [tmp_path / "probe.cpp"], 1, ["-O1"], [])
    assert torch.equal(torch.ops.sw_stamp_probe.twice(torch.ones(2)), torch.full((2,), 2.0))
    assert (tmp_path / "sw_stamp_probe.stamp").is_file()

    def reload():
        return subprocess.run([sys.executable, "-c", RELOAD, str(tmp_path)], capture_output=True, text=True,
                              timeout=300)

    done = reload()
    assert done.returncode == 0 and done.stdout.strip() == "direct", done.stderr[-2000:]
    library = tmp_path / "sw_stamp_probe.so"
    os.utime(library, ns=(library.stat().st_atime_ns, library.stat().st_mtime_ns + 10**9))  # rebuilt elsewhere
    done = reload()
    assert done.returncode != 0 and "went through torch's load" in done.stderr
    load_or_build(tmp_path, "sw_stamp_probe", [tmp_path / "probe.cpp"], 1, ["-O1"], [])  # stamped again
    assert reload().returncode == 0
    (tmp_path / "probe.cpp").write_text(PROBE_OP + "\n// edited\n")
    done = reload()
    assert done.returncode != 0 and "went through torch's load" in done.stderr


SHADOW = """
import importlib.util, pathlib, sys
root = pathlib.Path.cwd().resolve()
assert sys.path[0] in ("", str(root)), sys.path[:2]  # python -c: the checkout's root comes first
spec = importlib.util.find_spec("kernels")  # transformers >= 5 imports the `kernels` package
where = None if spec is None else pathlib.Path(spec.origin or next(iter(spec.submodule_search_locations))).resolve()
assert where is None or root not in where.parents, f"`import kernels` finds {where} in the checkout"
import transformers
from transformers import WhisperConfig, WhisperForConditionalGeneration
WhisperForConditionalGeneration(WhisperConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                              encoder_attention_heads=2, decoder_attention_heads=2,
                                              encoder_ffn_dim=16, decoder_ffn_dim=16, max_source_positions=8,
                                              max_target_positions=8, num_mel_bins=8, pad_token_id=1,
                                              bos_token_id=2, eos_token_id=3, decoder_start_token_id=2))
print("ok")
"""


def test_the_checkouts_root_shadows_no_installed_package():
    """Python run from the checkout's root (`python -m pytest`, `python -c`) puts that folder first
    on the path, so a package folder there hides an installed one of the same name: a top-level
    `kernels/` hid the `kernels` package transformers 5 imports, and every test that built a
    transformers model failed. specwhisper is the only package the root holds, and transformers
    builds a model from there."""
    packages = sorted(p.name for p in REPO.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert packages == ["specwhisper"], packages
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}  # the root first on the path, as users run
    result = subprocess.run([sys.executable, "-c", SHADOW], capture_output=True, text=True, cwd=REPO, env=env,
                            timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert result.stdout.strip() == "ok"

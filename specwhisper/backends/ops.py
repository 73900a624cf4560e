"""Sampling ops on the fastest exact backend, chosen once per device.

- `exp_noise`, `race_sample`: counter-based noise and race sampling (the reproducible coupling);
- `speculative_sample_noise` / `speculative_sample`: rejection sampling (accept / reject / resample);
- `speculative_sample_mapped`: rejection sampling with a mapped draft's exact probabilities
  (reference only); `speculative_sample_probs`: the same rule on any exact probabilities (per-row
  parameters; reference only).
Backends: CUDA tensors use the Triton kernels (`specwhisper/kernels/spec_sample.py`); CPU tensors the C++ ops
`specwhisper::*` (`csrc/`), built just in time with ninja on first use into
~/.cache/specwhisper/build (or $SPECWHISPER_BUILD_DIR; $SPECWHISPER_NO_EXT=1 turns them off);
otherwise, or when a backend cannot be loaded (announced by one warning), the reference in
`specwhisper.sampling`. All give the same results bit for bit, so the choice only changes speed.
No op validates values (that would need a host sync); shapes and dtypes are asserted. Probes are
cached with functools.cache: the only module-level state. Nothing here imports a GPU-only package.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.resources
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Callable, Literal

import torch

from specwhisper import sampling

Backend = Literal["triton", "cpp", "reference"]

_REPO_ROOT = Path(__file__).resolve().parent.parent.parent
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def which_backend(device: torch.device | str) -> Backend:
    """The implementation the ops use for tensors on `device`."""
    device = torch.device(device)
    if device.type == "cuda" and triton_kernels() is not None:
        return "triton"
    if device.type == "cpu" and cpp_ops() is not None:
        return "cpp"
    return "reference"


# --- race sampling (reproducible coupling) -------------------------------------------------------

def exp_noise(seed: torch.Tensor, position: torch.Tensor, noise_ids: torch.Tensor) -> torch.Tensor:
    """`sampling.exp_noise`: Exp(1) noise [N, V] float32 keyed by seed [N] int64, position [N]
    int64 and noise_ids [V] int64."""
    _check_rows(seed, position, noise_ids)
    backend = which_backend(seed.device)
    if backend == "triton":
        return triton_kernels().exp_noise_triton(seed.contiguous(), position.contiguous(),
                                                 noise_ids.contiguous())
    if backend == "cpp":
        return cpp_ops().exp_noise(seed, position, noise_ids)
    return sampling.exp_noise(seed, position, noise_ids)


def race_sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                seed: torch.Tensor, position: torch.Tensor,
                noise_ids: torch.Tensor | None = None, leads: torch.Tensor | None = None) -> torch.Tensor:
    """`sampling.race_sample`: one token per row of logits [N, V] (fp32 / fp16 / bf16; rows may be
    strided, the vocabulary dim must not be), temperature [N] float32 (<= 0: argmax), top_p [N]
    float32, seed [N] int64, position [N] int64, noise_ids [V] int64 or None (arange(V))
    -> tokens [N] int64. No host sync: capturable in a CUDA graph. `leads` (float32 [N],
    contiguous): written with each winner's lead (`sampling.race_leads`; in the same pass on the
    CPU, by the reference elsewhere)."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [N, V], got {tuple(logits.shape)}")
    N, V = logits.shape
    _check_rows(seed, position, noise_ids)
    for name, t, dtype in (("temperature", temperature, torch.float32),
                           ("top_p", top_p, torch.float32), ("seed", seed, torch.int64)):
        if t.shape != (N,) or t.dtype != dtype or t.device != logits.device:
            raise ValueError(f"{name} must be [{N}] {dtype} on {logits.device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if noise_ids is not None and noise_ids.shape != (V,):
        raise ValueError(f"noise_ids must be [{V}], got {tuple(noise_ids.shape)}")
    if V > sampling.MAX_VOCAB:
        raise ValueError(f"vocabulary {V} exceeds {sampling.MAX_VOCAB} (exact float64 weight sums)")
    if leads is not None and (leads.shape != (N,) or leads.dtype != torch.float32 or not leads.is_contiguous()
                              or leads.device != logits.device):
        raise ValueError(f"leads must be contiguous [{N}] float32 on {logits.device}, got "
                         f"{tuple(leads.shape)} {leads.dtype} on {leads.device}")
    backend = which_backend(logits.device)
    if backend == "cpp":
        return cpp_ops().race_sample(logits, temperature, top_p, seed, position, noise_ids, leads)
    if leads is not None:
        leads.copy_(sampling.race_leads(logits, temperature, top_p, seed, position, noise_ids))
    if backend == "triton" and logits.dtype in _TRITON_DTYPES:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        ids = None if noise_ids is None else noise_ids.contiguous()
        return triton_kernels().race_sample_triton(
            logits, temperature.contiguous(), top_p.contiguous(), seed.contiguous(),
            position.contiguous(), ids)
    return sampling.race_sample(logits, temperature, top_p, seed, position, noise_ids)


def _check_rows(seed, position, noise_ids) -> None:
    if seed.ndim != 1 or position.shape != seed.shape:
        raise ValueError(f"seed and position must be [N], got {tuple(seed.shape)}, "
                         f"{tuple(position.shape)}")
    for name, t in (("seed", seed), ("position", position), ("noise_ids", noise_ids)):
        if t is not None and (t.dtype != torch.int64 or t.device != seed.device):
            raise ValueError(f"{name} must be int64 on {seed.device}, got {t.dtype} on {t.device}")
    if noise_ids is not None and noise_ids.ndim != 1:
        raise ValueError(f"noise_ids must be [V], got {tuple(noise_ids.shape)}")


# --- rejection sampling --------------------------------------------------------------------------

def speculative_sample_noise(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                             draft_tokens: torch.Tensor, temperature: float, top_p: float,
                             uniforms: torch.Tensor, exp_noise: torch.Tensor):
    """`sampling.speculative_sample_noise` on the fastest backend for the tensors' device
    (arguments are assumed checked, as `speculative_sample` does; no host sync)."""
    args = (target_logits, draft_logits, draft_tokens, temperature, top_p, uniforms, exp_noise)
    backend = which_backend(target_logits.device)
    if backend == "triton" and target_logits.dtype in _TRITON_DTYPES \
            and draft_logits.dtype in _TRITON_DTYPES:
        contiguous = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in args]
        return triton_kernels().speculative_sample_triton(*contiguous)
    if backend == "cpp":
        return cpp_ops().speculative_sample_noise(*args)
    return sampling.speculative_sample_core(*args)


def speculative_sample(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                       draft_tokens: torch.Tensor, temperature: float, top_p: float,
                       generator: torch.Generator | None = None):
    """Rejection-sampling step: draws uniforms [B, k] and noise [B, V] with `generator` on the
    logits' device, then `speculative_sample_noise` on the fastest backend. Shapes and result
    contract of `sampling.speculative_sample_noise`."""
    sampling._check_step(target_logits, draft_logits, draft_tokens, temperature, top_p)
    if temperature == 0:
        return sampling.greedy_accept(target_logits, draft_tokens)
    B, k1, V = target_logits.shape
    u = sampling.draw_uniforms((B, k1 - 1), target_logits.device, generator)
    noise = sampling.draw_exp_noise((B, V), target_logits.device, generator)
    return speculative_sample_noise(target_logits, draft_logits, draft_tokens, temperature, top_p,
                                    u, noise)


def speculative_sample_mapped(target_logits: torch.Tensor, draft_probs: torch.Tensor,
                              draft_tokens: torch.Tensor, temperature: float, top_p: float,
                              generator: torch.Generator | None = None):
    """Rejection sampling with a mapped draft's exact probabilities (`sampling.
    speculative_sample_mapped`, reference on every device): draws uniforms [B, k] and noise
    [B, V+1] with `generator`, then accepts. draft_probs [B, k, V+1] float64 from
    `sampling.permute_probs(sampling.probs64(...), draft_to_target, V)`."""
    B, k1, V = target_logits.shape
    u = sampling.draw_uniforms((B, k1 - 1), target_logits.device, generator)
    noise = sampling.draw_exp_noise((B, V + 1), target_logits.device, generator)
    return sampling.speculative_sample_mapped(target_logits, draft_probs, draft_tokens,
                                              temperature, top_p, u, noise)


def speculative_sample_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                             draft_tokens: torch.Tensor, uniforms: torch.Tensor, exp_noise: torch.Tensor):
    """Rejection sampling on exact float64 probabilities, target_probs [B, k+1, W] and draft_probs
    [B, k, W] (per-row temperatures and top-p, or a mapped draft's probabilities in target ids:
    `sampling.permute_probs`), draft_tokens [B, k] int64 in [0, W), uniforms [B, k] float64 in
    (0, 1], exp_noise [B, W] float32 > 0 -> `sampling.accept_probs` (reference on every device:
    the probabilities already fill [B, k, W] in float64, the rule itself is a few passes over them)."""
    return sampling.accept_probs(target_probs, draft_probs, draft_tokens, uniforms, exp_noise)


# --- backends ------------------------------------------------------------------------------------

@functools.cache
def triton_kernels() -> ModuleType | None:
    """The Triton kernel module, or None (with one warning) if Triton cannot be imported."""
    try:
        return _import_kernels("spec_sample")
    except Exception as exc:  # ImportError, or a Triton that fails to initialise
        warnings.warn(f"specwhisper: Triton kernels unavailable ({exc!r}); CUDA tensors use the "
                      "PyTorch reference sampler", RuntimeWarning, stacklevel=3)
        return None


def _import_kernels(name: str) -> ModuleType:
    """`specwhisper.kernels.<name>` (the Triton sources inside the package, beside this module, so
    a checkout runs its own kernels even when another copy of specwhisper is installed)."""
    return importlib.import_module(f"..kernels.{name}", __package__)


_OPS = ("speculative_sample_noise", "exp_noise", "race_sample")
_SOURCES = ("spec_sample.cpp", "race_sample.cpp")
_HEADERS = ("processed.h",)


@functools.cache
def cpp_ops():
    """torch.ops.specwhisper (with `speculative_sample_noise`, `exp_noise`, `race_sample`), built
    on first use; None if disabled by SPECWHISPER_NO_EXT=1 or if the build fails (then with one
    warning)."""
    if os.environ.get("SPECWHISPER_NO_EXT", "") not in ("", "0"):
        return None
    if not _ops_registered():
        try:
            _build_cpp_extension()
        except Exception as exc:
            warnings.warn(f"specwhisper: could not build the C++ sampling ops ({exc}); CPU tensors "
                          "use the PyTorch reference sampler (set SPECWHISPER_NO_EXT=1 to skip the "
                          "build)", RuntimeWarning, stacklevel=3)
            return None
    _register_fake()
    return torch.ops.specwhisper


def cpp_op() -> Callable | None:
    """The C++ op `specwhisper::speculative_sample_noise`, or None (see `cpp_ops`)."""
    ops = cpp_ops()
    return None if ops is None else ops.speculative_sample_noise


@functools.cache
def _register_fake() -> None:
    """Shape functions of the C++ ops, so they trace under torch.compile / FakeTensor."""

    @torch.library.register_fake("specwhisper::speculative_sample_noise")
    def _(target_logits, draft_logits, draft_tokens, temperature, top_p, uniforms, exp_noise):
        B, k1, _ = target_logits.shape
        return (target_logits.new_empty((B, k1), dtype=torch.int64),
                target_logits.new_empty((B,), dtype=torch.int64))

    @torch.library.register_fake("specwhisper::exp_noise")
    def _(seed, position, noise_ids):
        return seed.new_empty((seed.shape[0], noise_ids.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("specwhisper::race_sample")
    def _(logits, temperature, top_p, seed, position, noise_ids, leads=None):
        return logits.new_empty((logits.shape[0],), dtype=torch.int64)


def _ops_registered() -> bool:
    try:
        for name in _OPS:
            getattr(torch.ops.specwhisper, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def machine_cache() -> Path:
    """The folder of what this machine builds and measures: ~/.cache/specwhisper ($XDG_CACHE_HOME
    respected): the extension's builds (`build_dir`), a draft's measured pass costs
    (`engine.draft.costs_folder`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specwhisper"


def kept_folder(variable: str, name: str) -> Path | None:
    """Where a process keeps what later ones read back (`machine_cache() / name`): $`variable`
    moves it, and off (or 0, none, empty) keeps nothing (None, as where there is no home folder)."""
    value = os.environ.get(variable)
    if value is not None:
        return None if value.strip().lower() in ("", "0", "off", "none") else Path(value).expanduser()
    try:
        return machine_cache() / name
    except (RuntimeError, KeyError):  # no home folder: nowhere to keep them
        return None


def build_dir() -> Path:
    """Where the JIT-built extension lives: $SPECWHISPER_BUILD_DIR, else a per-torch/per-Python
    folder under ~/.cache/specwhisper/build."""
    if os.environ.get("SPECWHISPER_BUILD_DIR"):
        return Path(os.environ["SPECWHISPER_BUILD_DIR"]).expanduser()
    tag = f"torch{torch.__version__.replace('+', '-')}-py{sys.version_info[0]}{sys.version_info[1]}"
    return machine_cache() / "build" / tag


def _build_cpp_extension() -> None:
    with contextlib.ExitStack() as stack:
        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        hold_build_lock(stack, directory)
        sources = stage_sources(directory, _SOURCES + _HEADERS)
        # -ffp-contract=off: no FMA contraction, so the fp32 exp / log match the reference bit for
        # bit; -fno-trapping-math only lets the loops vectorise (it changes no result).
        cflags = ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp", "-fopenmp-simd",
                  f"-I{sources[_HEADERS[0]].parent}", headers_flag(sources, _HEADERS)]
        load_or_build(directory, "specwhisper_C", [sources[f] for f in _SOURCES + _HEADERS], len(_SOURCES),
                      cflags, ["-fopenmp"])


def load_or_build(directory: Path, name: str, files: list[Path], n_sources: int, cflags: list[str],
                  ldflags: list[str]) -> None:
    """Load extension `name` (the first `n_sources` of the staged `files` compiled, the rest
    headers they include) from `directory`, building it first where needed (torch's JIT `load`:
    ninja). Call it holding the build lock. A stamp written after each load records what the
    library was built from (the files' text, the flags, torch and Python) and the library file's
    own size and mtime; while both still match, the library is loaded directly: `load` imports
    torch's setuptools machinery and runs ninja to find nothing to do, 0.27 s of every process
    against 0.01 s. A library rebuilt by anything else (another checkout sharing the folder) has
    another mtime, so the next process goes through `load` again."""
    library, stamp = directory / f"{name}.so", directory / f"{name}.stamp"
    key = hashlib.sha256(repr((torch.__version__, sys.version, cflags, ldflags)).encode()
                         + b"".join(f.read_bytes() for f in files)).hexdigest()

    def built() -> str:
        info = library.stat()
        return f"{key} {info.st_size} {info.st_mtime_ns}"

    if library.is_file() and stamp.is_file() and stamp.read_text() == built():
        torch.ops.load_library(str(library))
        return
    from torch.utils.cpp_extension import load  # imports setuptools machinery: only when needed

    load(name=name, sources=[str(f) for f in files[:n_sources]], build_directory=str(directory),
         extra_cflags=cflags, extra_ldflags=ldflags, is_python_module=False, verbose=False)
    if library.is_file():
        tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}")
        tmp.write_text(built())
        os.replace(tmp, stamp)


def stage_sources(directory: Path, names: tuple[str, ...]) -> dict[str, Path]:
    """Copies of the C++ sources in `directory`/src, rewritten only where their text changed, to
    build from (call it holding the build lock). ninja compares command lines, which name the
    sources' paths: built from one fixed place, a checkout and an installed copy with the same
    sources share one build instead of each rebuilding over the other's (23 s for both ops)."""
    staged = directory / "src"
    staged.mkdir(exist_ok=True)
    out = {}
    with contextlib.ExitStack() as stack:
        for name in names:
            text = stack.enter_context(importlib.resources.as_file(csrc_dir() / name)).read_bytes()
            path = out[name] = staged / name
            if not path.is_file() or path.read_bytes() != text:
                tmp = path.with_name(f".{name}.{os.getpid()}")
                tmp.write_bytes(text)
                os.replace(tmp, path)  # a new mtime: ninja rebuilds what includes it
    return out


def headers_flag(staged: dict[str, Path], headers: tuple[str, ...]) -> str:
    """A compiler flag carrying the staged headers' hash: torch's JIT build versions an extension by
    its sources' text only, so without it an edited header would not rebuild it."""
    digest = hashlib.sha256(b"".join(staged[f].read_bytes() for f in headers)).hexdigest()[:16]
    return f"-DSPECWHISPER_HEADERS={digest}"


def hold_build_lock(stack: contextlib.ExitStack, directory: Path) -> None:
    """Hold an OS file lock on `directory` for the build, then remove torch's own lock file there.
    torch marks a build in progress with a plain file (`lock`) and waits, without end, while it
    exists; a build that was killed (Ctrl-C during the first import) leaves it behind and every later
    import would hang. The OS releases our lock when its holder dies, so whoever holds it knows no
    other specwhisper build is running in this folder and that a `lock` file there is stale."""
    try:
        import fcntl
    except ImportError:  # not POSIX: keep torch's behaviour
        return
    handle = stack.enter_context(open(directory / "specwhisper.lock", "a"))
    fcntl.flock(handle, fcntl.LOCK_EX)  # released when the handle closes, or the process dies
    (directory / "lock").unlink(missing_ok=True)


def csrc_dir():
    """The C++ sources: `<repo>/csrc` in a source checkout (a checkout builds its own sources even
    when another copy of specwhisper is installed), else the installed package data
    `specwhisper.csrc` (a wheel or `pip install .`)."""
    repo = _REPO_ROOT / "csrc"
    if all((repo / f).is_file() for f in _SOURCES + _HEADERS):
        return repo
    return importlib.resources.files("specwhisper.csrc")

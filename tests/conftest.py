"""Markers and shared fixtures. Hardware gating lives here: `cuda` tests skip without a GPU;
`real` tests skip without the fetched checkpoints unless SPECWHISPER_REQUIRE_REAL=1 (CI), where a
missing checkpoint fails instead."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import specwhisper  # noqa: F401  before torch: the huge pages users get (specwhisper/__init__.py)
import torch

from checkpoints import make_checkpoint

# engines in tests measure their own pass costs: none read or write the user's kept costs
# (`engine.draft.costs_folder`; tests of the kept costs point it at a temporary folder)
os.environ["SPECWHISPER_COSTS_DIR"] = "off"
# vocabulary tables of draft / target pairs (`engine.vocab.vocab_tables`) are kept in a folder of
# this session's: a pair's first engine builds them, later ones read them back (as users' do)
os.environ["SPECWHISPER_VOCAB_DIR"] = tempfile.mkdtemp(prefix="specwhisper-vocab-")
atexit.register(shutil.rmtree, os.environ["SPECWHISPER_VOCAB_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)


def require_real() -> bool:
    return os.environ.get("SPECWHISPER_REQUIRE_REAL") == "1"


def real_folder(name: str):
    """The fetched, converted checkpoint `name`; skips (fails in CI) when it is absent."""
    from specwhisper.tools.fetch import cache_root, is_fetched

    if not is_fetched(name):
        if require_real():
            pytest.fail(f"real checkpoint {name!r} is missing from {cache_root()} (run `specwhisper fetch {name}`)")
        pytest.skip(f"real checkpoint {name!r} not fetched (run `specwhisper fetch {name}`)")
    return cache_root() / name


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    """Factory of cached tiny random checkpoints: ckpt(name, **make_checkpoint kwargs)."""
    root = tmp_path_factory.mktemp("ckpts")
    made = {}

    def get(name: str, **kwargs):
        if name not in made:
            made[name] = make_checkpoint(root / name, **kwargs)
        return made[name]

    return get


@pytest.fixture(scope="session")
def multilingual(ckpt_dir):
    return ckpt_dir("multilingual", vocab_size=51865, n_mels=80, d_model=64, heads=4, seed=1)


@pytest.fixture(scope="session")
def english(ckpt_dir):
    return ckpt_dir("english", vocab_size=51864, n_mels=80, d_model=48, heads=3, seed=2)


@pytest.fixture(scope="session")
def float16(ckpt_dir):
    """Stored in float16 like Whisper's checkpoints: a float32 engine's C++ step reads its
    projections in float16 (`Whisper.half_projections`)."""
    return ckpt_dir("float16", vocab_size=51865, n_mels=80, d_model=64, heads=4, seed=7, float16=True)


@pytest.fixture(scope="session")
def v3(ckpt_dir):
    return ckpt_dir("v3", vocab_size=51866, n_mels=128, d_model=80, heads=5, seed=3)


@pytest.fixture(scope="session")
def recording(tmp_path_factory):
    """≈ 62 s of flite speech (several voices, pauses), made once for the long-form, engine and
    word-timestamp modules (their openai-whisper references: `whisper_ref.openai_transcribe`)."""
    from whisper_ref import flite_audio_or_skip

    return flite_audio_or_skip(tmp_path_factory, "longform", 62.0, seed=3)


@pytest.fixture
def admitted(monkeypatch):
    """The number of windows of each `Runner.admit` call (one prefill each), recorded in order;
    the test may clear the list between calls."""
    from specwhisper.engine.runner import Runner

    sizes, admit = [], Runner.admit

    def recorded(self, s, specs, *args):
        sizes.append(len(specs))
        return admit(self, s, specs, *args)

    monkeypatch.setattr(Runner, "admit", recorded)
    return sizes

"""What a process pays before its first token: loading a model never imports torch._dynamo (torch's
random `normal_` on the meta device did: 2.4-3.7 s of every CLI call) nor initialises modules it
then overwrites, equal tokenizer.json files are parsed once, the language tokens are read where
they sit, Python's collector stays off while loading, and heads nobody proposes through are never
built."""
from __future__ import annotations

import copy
import gc
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import real_folder, require_real
from specwhisper import Engine
from specwhisper.engine.decoding import LoadedModel
from specwhisper.engine.vocab import VocabMap
from specwhisper.model.whisper import Conv1d, Embedding, Linear
from specwhisper.tokenizer import LANGUAGE_TOKEN, Tokenizer
from specwhisper.tools.fetch import is_fetched


def test_loading_a_model_does_not_import_torch_dynamo(multilingual):
    probe = ("import sys\n"
             "import specwhisper\n"
             "from specwhisper.model.weights import load_whisper\n"
             f"model = load_whisper({str(multilingual)!r})\n"
             "assert not model.decoder.embed_tokens.weight.is_meta\n"
             "loaded = sorted(m for m in sys.modules if m.startswith('torch._dynamo'))\n"
             "assert not loaded, loaded[:5]\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("make", [lambda: Embedding(2000, 16), lambda: Linear(300, 200),
                                  lambda: Conv1d(80, 64, kernel_size=3, padding=1)], ids=["embedding", "linear", "conv1d"])
def test_modules_initialise_as_torch_does_off_the_meta_device_and_not_on_it(make, monkeypatch):
    torch.manual_seed(0)
    module = make()
    ours = [p.detach().clone() for p in module.parameters()]
    torch.manual_seed(0)
    theirs = [p.detach() for p in type(module).__mro__[2](*module_args(module)).parameters()]
    assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))  # the same random init
    assert all(float(p.std()) > 0 for p in ours if p.dim() > 1)

    def refuse(*args, **kwargs):
        raise AssertionError("a random initialisation on the meta device")

    for name in ("normal_", "uniform_", "kaiming_uniform_"):
        monkeypatch.setattr(torch.nn.init, name, refuse)
    with torch.device("meta"):
        assert all(p.is_meta for p in make().parameters())
    with pytest.raises(AssertionError, match="meta device"):  # the probe bites where torch's modules initialise
        make()


def module_args(module) -> tuple:
    if isinstance(module, torch.nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    return module.in_channels, module.out_channels, module.kernel_size, module.stride, module.padding


def test_language_tokens_are_every_language_token_of_the_vocabulary_in_id_order(multilingual, english, v3):
    folders = [(multilingual, 51865), (english, 51864), (v3, 51866)]
    folders += [(real_folder(name), size) for name, size in (("base", 51865), ("tiny.en", 51864))
                if require_real() or is_fetched(name)]
    for folder, vocab_size in folders:
        tok = Tokenizer.from_folder(folder, vocab_size)
        scanned = {}
        for token, tid in sorted(tok.backend.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1]):
            if LANGUAGE_TOKEN.match(token):
                scanned[token[2:-2]] = tid
        assert tok.languages == scanned and list(tok.languages.items()) == list(scanned.items()), folder
        assert len(scanned) >= 99 and tok.languages["en"] == tok.sot + 1


def test_loading_leaves_the_collector_as_it_found_it(multilingual, english, monkeypatch):
    """Engine() loads with Python's cyclic collector off (`engine.gc_paused`) and turns it on
    again after, a failed load too, unless the caller had turned it off."""
    assert gc.isenabled()
    seen, load = [], LoadedModel.load
    monkeypatch.setattr(LoadedModel, "load", lambda *a, **k: (seen.append(gc.isenabled()), load(*a, **k))[1])
    Engine(multilingual, english, background=False)
    assert seen == [False, False] and gc.isenabled()
    with pytest.raises(FileNotFoundError):
        Engine(multilingual, english.parent / "missing", background=False)
    assert gc.isenabled()
    gc.disable()
    try:
        Engine(multilingual, background=False)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_equal_tokenizer_files_are_parsed_once(multilingual, english, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(multilingual / name, copy / name)
    a, b = Tokenizer.from_folder(multilingual, 51865), Tokenizer.from_folder(copy, 51865)
    assert a.backend is b.backend and a.languages == b.languages and a.languages is not b.languages
    assert VocabMap.build(b, a).identity
    other = Tokenizer.from_folder(english, 51864)
    assert other.backend is not a.backend and not VocabMap.build(other, a).identity
    changed = tmp_path / "changed"
    changed.mkdir()
    text = (multilingual / "tokenizer.json").read_text()
    (changed / "tokenizer.json").write_text(text.replace('"<|endoftext|>"', '"<|endoftext|>" ', 1))
    assert Tokenizer.from_folder(changed, 51865).backend is not a.backend  # content, not the path, decides


def test_a_bad_tokenizer_file_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(b"\xff\xfe not json")
    with pytest.raises(ValueError, match="tokenizer.json is not a valid tokenizer.json"):
        Tokenizer.from_folder(tmp_path, 51865)


@pytest.fixture(scope="module")
def mel():
    return torch.randn(80, 3000, generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("draft", ["self", "compact"])
def test_a_draft_proposing_through_another_head_never_builds_its_own(draft, multilingual, ckpt_dir, mel):
    folder = multilingual if draft == "self" else ckpt_dir("startup-draft", vocab_size=51865, d_model=64,
                                                           heads=4, decoder_layers=1, seed=9)
    engine = Engine(multilingual, folder, background=False)
    plain = Engine(multilingual, background=False)
    got = engine.transcribe(mel, language="en", max_new_tokens=12, num_draft_tokens=3)
    want = plain.transcribe(mel, language="en", max_new_tokens=12)
    assert got.tokens == want.tokens and got.stats.drafted > 0
    assert "head" not in engine.drafter.draft.__dict__, "the draft built a screened head it never proposes through"
    assert engine.target.screened and engine.target.head is not None
    if draft == "self":
        assert engine.drafter.head is engine.target.head
    else:
        two_bit = engine.drafter.shared_encoder and engine.drafter.draft.config.d_model % 64 == 0
        assert type(engine.drafter.head).__name__ == ("Q2Head" if two_bit else "Q4Head")


def test_the_program_freezes_its_objects_before_the_interpreter_exits():
    """`specwhisper` (the console script and `python -m specwhisper.tools.cli`) runs `cli.run`:
    the command, then `gc.freeze`, so the interpreter's last collections skip torch's objects."""
    from importlib.metadata import entry_points

    assert entry_points(group="console_scripts")["specwhisper"].value == "specwhisper.tools.cli:run"
    probe = ("import gc\n"
             "from specwhisper.tools import cli\n"
             "cli.main = lambda: 7\n"
             "assert gc.get_freeze_count() == 0\n"
             "assert cli.run() == 7 and gc.get_freeze_count() > 0\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("with_draft", [False, True], ids=["target-only", "draft"])
def test_warm_up_does_a_first_calls_work_and_teaches_the_adaptive_k_nothing(with_draft, multilingual, english):
    """`Engine.warm_up` decodes a second of faint noise (digital silence would run no model) and
    calibrates the adaptive k; what the k learns from windows stays at its priors, and what the
    engine decodes next equals a fresh engine's."""
    torch.manual_seed(11)
    mel = torch.randn(80, 3000)
    draft = english if with_draft else None
    engine = Engine(multilingual, draft, background=False)
    rule = engine.drafter.length if with_draft else None
    learned = ("accepted", "trials", "window_tokens", "windows_seen", "spec_iters", "reach", "hit", "k", "on")
    before = {name: copy.deepcopy(getattr(rule, name)) for name in learned} if rule else None
    assert engine.iterations == 0 and "head" not in vars(engine.target)
    seconds = engine.warm_up()
    assert seconds > 0 and engine.iterations >= 1 and "head" in vars(engine.target)
    if rule:
        assert rule.calibrated and engine.drafter.encodes >= 1
        assert {name: getattr(rule, name) for name in learned} == before
    fresh = Engine(multilingual, draft, background=False)
    assert engine.transcribe(mel, language="en").tokens == fresh.transcribe(mel, language="en").tokens

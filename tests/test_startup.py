"""What a process pays before its first token: loading a model never imports torch._dynamo (torch's
random `normal_` on the meta device did: 2.4-3.7 s of every CLI call), equal tokenizer.json files
are parsed once, and heads nobody proposes through are never built."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from specwhisper import Engine
from specwhisper.engine.vocab import VocabMap
from specwhisper.model.whisper import Embedding
from specwhisper.tokenizer import Tokenizer


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


def test_embedding_initialises_as_torch_does_off_the_meta_device():
    torch.manual_seed(0)
    table = Embedding(2000, 16)
    w = table.weight.detach()
    assert torch.isfinite(w).all() and 0.9 < float(w.std()) < 1.1 and abs(float(w.mean())) < 0.05
    torch.manual_seed(0)
    assert torch.equal(w, torch.nn.Embedding(2000, 16).weight.detach())  # the same random init
    with torch.device("meta"):
        assert Embedding(2000, 16).weight.is_meta


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

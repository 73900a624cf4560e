"""Drafts with another vocabulary: the token maps, and exactness of speculative decoding with them."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from checkpoints import make_checkpoint, write_tokenizer
from conftest import real_folder
from specwhisper import Engine
from specwhisper.tokenizer import Tokenizer
from specwhisper.engine.vocab import VocabMap, padded_spellings, vocab_tables

MAX_NEW = 40


def tokenizer(folder, vocab_size):
    return Tokenizer.from_folder(folder, vocab_size)


def test_real_tiny_en_to_base_map():
    base = tokenizer(real_folder("base"), 51865)
    tiny_en = tokenizer(real_folder("tiny.en"), 51864)
    vmap = VocabMap.build(tiny_en, base)
    assert not vmap.identity and 0.5 < vmap.shared_text < 0.7  # GPT-2 vs multilingual BPE
    d2t = vmap.draft_to_target
    # special tokens map by name, although their ids differ
    assert d2t[tiny_en.eot] == base.eot == tiny_en.eot + 1
    assert d2t[tiny_en.no_timestamps] == base.no_timestamps
    # a plain English word: different ids, same string
    the_base, the_en = base.backend.token_to_id("Ġthe"), tiny_en.backend.token_to_id("Ġthe")
    assert the_base != the_en and d2t[the_en] == the_base and vmap.to_draft(the_base) == [the_en]
    # every target text token can be fed to the draft; those without a single-token twin are
    # spelled with several draft tokens whose strings concatenate to the target's string
    strings = {i: s for s, i in tiny_en.backend.get_vocab().items()}
    target_strings = {i: s for s, i in base.backend.get_vocab().items()}
    multi = 0
    for tid in range(0, base.eot, 97):
        spelled = vmap.to_draft(tid)
        assert "".join(strings[i] for i in spelled) == target_strings[tid]
        multi += len(spelled) > 1
    assert multi > 0
    # and the reverse map of a real sentence round-trips through the draft's tokens
    text = " The weather today will be mostly sunny, with a high of 72 degrees."
    ids = [i for i in base.backend.encode(text, add_special_tokens=False).ids]
    drafted = [d for i in ids for d in vmap.to_draft(i)]
    assert tiny_en.backend.decode(drafted) == text


def test_all_spellings_at_once_equal_one_at_a_time():
    """`VocabMap.all_to_draft` (the draft's tables at construction) spells every target id as
    `to_draft` does, and `padded_spellings` lays them out as zero-padded rows with their lengths."""
    base = tokenizer(real_folder("base"), 51865)
    tiny_en = tokenizer(real_folder("tiny.en"), 51864)
    together = VocabMap.build(tiny_en, base).all_to_draft(51866)  # one id past the tokenizer's
    alone = VocabMap.build(tiny_en, base)
    assert together == [alone.to_draft(t) if t < 51865 else [] for t in range(51866)]
    assert sum(len(sp) > 1 for sp in together) > 1000 and together[base.eot] == [tiny_en.eot]
    spellings = [[3, 1, 4], [], [1], [5, 9], []]
    padded, lengths = padded_spellings(spellings)
    assert padded.tolist() == [[3, 1, 4], [0, 0, 0], [1, 0, 0], [5, 9, 0], [0, 0, 0]]
    assert lengths.tolist() == [3, 0, 1, 2, 0]
    padded, lengths = padded_spellings([[], []])
    assert padded.tolist() == [[0], [0]] and lengths.tolist() == [0, 0]
    assert VocabMap.build(base, base).all_to_draft(3) == [[0], [1], [2]]


def test_v3_style_vocabulary_shifts_special_tokens(tmp_path):
    for size in (51865, 51866):
        (tmp_path / str(size)).mkdir()
        write_tokenizer(tmp_path / str(size), size)
    tiny, v3 = tokenizer(tmp_path / "51865", 51865), tokenizer(tmp_path / "51866", 51866)
    vmap = VocabMap.build(tiny, v3)
    d2t = vmap.draft_to_target
    assert torch.equal(d2t[: tiny.eot + 1], torch.arange(tiny.eot + 1))  # text + EOT: same ids
    assert d2t[tiny.languages["su"]] == v3.languages["su"]  # languages before <|yue|>: same
    assert d2t[tiny.task_ids["transcribe"]] == tiny.task_ids["transcribe"] + 1 == v3.task_ids["transcribe"]
    assert d2t[tiny.no_timestamps] == v3.no_timestamps == tiny.no_timestamps + 1
    assert vmap.to_draft(v3.languages["yue"]) == []  # the draft has no <|yue|>
    assert VocabMap.build(tiny, tiny).identity


def test_pairs_that_share_too_little_are_refused(tmp_path):
    for name, offset in (("a", 0), ("b", 10**6)):
        (tmp_path / name).mkdir()
        write_tokenizer(tmp_path / name, 51865, word_offset=offset)
    with pytest.raises(ValueError, match=r"draft D cannot serve target T: comparing the token strings.*only \d+\.\d% "):
        VocabMap.build(tokenizer(tmp_path / "b", 51865), tokenizer(tmp_path / "a", 51865), "D", "T")


@pytest.fixture(scope="module")
def v3_target(ckpt_dir):
    return ckpt_dir("v3-80", vocab_size=51866, n_mels=80, d_model=64, heads=4, seed=21)


@pytest.fixture(scope="module")
def v3_as_tiny(v3_target, tmp_path_factory):
    """The v3 target's own weights in a 51865 vocabulary (the <|yue|> row dropped): a draft
    that is always right once its ids are mapped."""
    folder = make_checkpoint(tmp_path_factory.mktemp("drop-yue") / "m", vocab_size=51865, n_mels=80,
                             d_model=64, heads=4, seed=0)
    state = load_file(v3_target / "model.safetensors")
    yue = tokenizer(v3_target, 51866).languages["yue"]
    emb = state["model.decoder.embed_tokens.weight"]
    state["model.decoder.embed_tokens.weight"] = torch.cat([emb[:yue], emb[yue + 1:]])
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def mels():
    torch.manual_seed(3)
    return torch.randn(3, 80, 3000)


@pytest.mark.parametrize("k", [1, 4, 7])
def test_shifted_special_tokens_draft_is_exact(k, v3_target, v3_as_tiny, ckpt_dir, mels):
    expected = [o.tokens for o in Engine(v3_target).transcribe(mels, language="en", max_new_tokens=MAX_NEW)]
    assert all(len(t) >= 20 for t in expected)
    spec = Engine(v3_target, v3_as_tiny)
    assert not spec.drafter.vocab.identity
    out = spec.transcribe(mels, language="en", max_new_tokens=MAX_NEW, num_draft_tokens=k)
    assert [o.tokens for o in out] == expected
    assert all(o.stats.acceptance_rate == 1.0 for o in out)  # same weights, mapped ids
    unrelated = ckpt_dir("tiny-unrelated", vocab_size=51865, n_mels=80, d_model=32, heads=2, seed=5)
    out = Engine(v3_target, unrelated).transcribe(mels, language="en", max_new_tokens=MAX_NEW, num_draft_tokens=k)
    assert [o.tokens for o in out] == expected


@pytest.mark.parametrize("k", [2, 5])
def test_english_only_draft_with_partly_shared_vocabulary_is_exact(k, ckpt_dir, mels):
    target = ckpt_dir("ml-target", vocab_size=51865, n_mels=80, d_model=64, heads=4, seed=31)
    draft = ckpt_dir("en-draft", vocab_size=51864, n_mels=80, d_model=48, heads=3, seed=32, word_offset=20000)
    expected = [o.tokens for o in Engine(target).transcribe(mels, language="en", max_new_tokens=MAX_NEW)]
    spec = Engine(target, draft)
    assert 0.25 < spec.drafter.vocab.shared_text < 0.7
    out = spec.transcribe(mels, language="en", max_new_tokens=MAX_NEW, num_draft_tokens=k)
    assert [o.tokens for o in out] == expected
    # an English-only draft cannot follow German: decoding falls back to the target alone
    de = spec.transcribe(mels[0], language="de", max_new_tokens=10, num_draft_tokens=k)
    assert de.tokens == Engine(target).transcribe(mels[0], language="de", max_new_tokens=10).tokens
    assert de.stats.drafted == 0


def test_english_only_draft_prompt_has_no_language_tokens(ckpt_dir):
    draft = ckpt_dir("en-draft", vocab_size=51864, n_mels=80, d_model=48, heads=3, seed=32, word_offset=20000)
    tok = tokenizer(draft, 51864)
    assert tok.prompt(None, "transcribe") == [tok.sot, tok.no_timestamps]
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["vocab_size"] == 51864


def test_sampling_with_a_mapped_draft_runs_and_is_reproducible(v3_target, v3_as_tiny, mels):
    """The unspellable-token path of speculative sampling (its exactness argument is in
    Engine._accept; the sampler itself is proven in test_sampling.py)."""
    spec = Engine(v3_target, v3_as_tiny)
    kw = dict(language="en", temperature=0.7, top_p=0.9, seed=5, max_new_tokens=25, num_draft_tokens=3)
    a, b = spec.transcribe(mels[0], **kw), spec.transcribe(mels[0], **kw)
    assert a.tokens == b.tokens and a.stats.drafted > 0
    assert a.stats.acceptance_rate > 0.5  # same weights behind the map: mostly accepted


def test_a_pairs_tables_are_kept_on_disk_and_read_back(ckpt_dir, tmp_path, monkeypatch):
    """`vocab_tables` keeps a pair's map on disk by the two tokenizer.json contents: read back it
    spells every target id as the built map does, with no strings compared; a kept file that is
    corrupt, another key's or out of range is built again; SPECWHISPER_VOCAB_DIR=off keeps none."""
    target = tokenizer(ckpt_dir("ml-target", vocab_size=51865, n_mels=80, d_model=64, heads=4, seed=31), 51865)
    draft = tokenizer(ckpt_dir("en-draft", vocab_size=51864, n_mels=80, d_model=48, heads=3, seed=32,
                               word_offset=20000), 51864)
    folder = tmp_path / "vocab"
    monkeypatch.setenv("SPECWHISPER_VOCAB_DIR", str(folder))
    built = VocabMap.build(draft, target)
    rows, lengths = padded_spellings(built.all_to_draft(51865))
    assert int((lengths > 1).sum()) > 100  # spellings of several draft tokens

    def same(vmap):
        assert not vmap.identity and vmap.shared_text == built.shared_text
        assert torch.equal(vmap.draft_to_target, built.draft_to_target)
        assert all(torch.equal(a, b) for a, b in zip(vmap.spelling_table(51865), (rows, lengths)))
        ids = [0, draft.eot, target.eot, target.no_timestamps, 51864] + list(range(1, 51865, 499))
        assert [vmap.to_draft(t) for t in ids] == [built.to_draft(t) for t in ids]

    same(vocab_tables(draft, target, 51865))
    kept = list(folder.iterdir())
    assert len(kept) == 1 and kept[0].suffix == ".safetensors"
    real_build = VocabMap.build
    monkeypatch.setattr(VocabMap, "build", staticmethod(lambda *a, **k: pytest.fail("built again")))
    read = vocab_tables(draft, target, 51865)
    assert read.target_strings is None  # read back: tables, no strings
    same(read)
    assert Engine(ckpt_dir("ml-target"), ckpt_dir("en-draft"), background=False).drafter.vocab.spellings is not None
    monkeypatch.setattr(VocabMap, "build", real_build)
    assert vocab_tables(draft, target, 51866).spellings[1].shape == (51866,)  # another n: another file
    assert len(list(folder.iterdir())) == 2

    kept[0].write_bytes(b"not a safetensors file")
    same(vocab_tables(draft, target, 51865))
    with safe_open(str(kept[0]), framework="pt") as f:  # written again, whole
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["spellings"][5, 0] = len(built.draft_to_target)  # a draft id past the draft's vocabulary
    save_file(tensors, str(kept[0]), metadata=metadata)
    calls = []
    monkeypatch.setattr(VocabMap, "build", staticmethod(lambda *a, **k: (calls.append(1), real_build(*a, **k))[1]))
    same(vocab_tables(draft, target, 51865))
    assert calls == [1]
    other = next(p for p in folder.iterdir() if p != kept[0])
    kept[0].write_bytes(other.read_bytes())  # another key's tables (51866 rows) under this key's name
    same(vocab_tables(draft, target, 51865))
    assert calls == [1, 1]
    same(vocab_tables(draft, target, 51865))  # written again: read back
    assert calls == [1, 1]

    monkeypatch.setenv("SPECWHISPER_VOCAB_DIR", "off")
    assert vocab_tables(draft, target, 51865).spellings is None and len(list(folder.iterdir())) == 2
    assert vocab_tables(target, target, 51865).identity

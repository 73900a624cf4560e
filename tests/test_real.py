"""Real pretrained weights (whisper base, tiny.en) on the bundled speech: specwhisper greedy ==
transformers greedy on the converted folder == CTranslate2 greedy on the original checkpoint,
token for token on identical features; and speculative decoding with real drafts changes nothing."""
from __future__ import annotations

import pytest
import torch

from conftest import real_folder
from specwhisper import Engine, load_audio, log_mel_spectrogram
from specwhisper.samples import references, sample_paths
from specwhisper.tools.fetch import cache_root

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def mels():
    return torch.stack([log_mel_spectrogram(load_audio(p), n_mels=80) for p in sample_paths()])


@pytest.fixture(scope="module")
def greedy(mels):
    """Target-only greedy tokens of each real model, computed once."""
    made = {}

    def get(name):
        if name not in made:
            made[name] = [o.tokens for o in Engine(real_folder(name)).transcribe(mels, language="en")]
        return made[name]

    return get


def transformers_tokens(folder, mels, multilingual):
    from transformers import WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    eot = model.generation_config.eos_token_id
    kwargs = dict(language="en", task="transcribe") if multilingual else {}
    with torch.no_grad():
        out = model.generate(mels, do_sample=False, num_beams=1, return_timestamps=False, **kwargs)
    return [[t for t in row if t != eot] for row in out.tolist()]


def ctranslate2_tokens(ct2_folder, mels, prompt):
    ctranslate2 = pytest.importorskip("ctranslate2")
    model = ctranslate2.models.Whisper(str(ct2_folder), device="cpu", compute_type="float32")
    features = ctranslate2.StorageView.from_array(mels.numpy())
    results = model.generate(features, [prompt] * len(mels), beam_size=1, max_length=448)
    return [r.sequences_ids[0] for r in results]


@pytest.mark.parametrize("name", ["base", "tiny.en"])
def test_greedy_parity_with_transformers_and_ctranslate2(name, mels, greedy):
    folder = real_folder(name)
    engine = Engine(folder)
    ours = greedy(name)
    tok = engine.target.tokenizer
    assert ours == transformers_tokens(folder, mels, tok.multilingual)
    assert ours == ctranslate2_tokens(cache_root() / f"{name}-ct2", mels, tok.prompt("en" if tok.multilingual else None, "transcribe"))
    assert all(len(t) >= 5 for t in ours)
    # one at a time gives the batch's answer
    assert engine.transcribe(mels[3], language="en").tokens == ours[3]


def test_real_transcripts_are_close_to_the_references(mels, greedy):
    from specwhisper.wer import wer

    tok = Engine(real_folder("base")).target.tokenizer
    texts = [tok.decode(t) for t in greedy("base")]
    refs = references()
    score = wer([refs[p.name] for p in sample_paths()], texts)
    assert score < 0.25, (score, texts)


@pytest.mark.parametrize("draft, k, head", [("tiny.en", 3, None), ("tiny.en", None, None), ("tiny.en", 3, 16384),
                                            ("base", 4, None)])
def test_speculative_with_real_drafts_is_exact(draft, k, head, mels, greedy):
    engine = Engine(real_folder("base"), real_folder(draft), draft_head_tokens=head)
    out = engine.transcribe(mels, language="en", num_draft_tokens=k)
    assert [o.tokens for o in out] == greedy("base")
    rate = sum(o.stats.accepted for o in out) / max(sum(o.stats.drafted for o in out), 1)
    if draft == "base":
        assert rate == 1.0
    else:
        assert rate > 0.3, rate

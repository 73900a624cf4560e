"""Long-form through the engine (runner + scheduler): equal to openai-whisper's `transcribe()` on
real base weights, and speculative long-form (tiny.en and self drafts) equal to target-only."""
from __future__ import annotations

import pytest
import torch

from conftest import real_folder
from specwhisper import Engine
from test_longform import assert_same
from whisper_ref import openai_transcribe


@pytest.mark.real
@pytest.mark.slow
def test_engine_longform_equals_openai_whisper_and_speculation_is_exact(recording):
    ref = openai_transcribe(real_folder("base"), recording, language="en")
    base, tiny = real_folder("base"), real_folder("tiny.en")
    plain = Engine(base).transcribe(recording, language="en")
    assert_same(plain, ref)
    assert plain.duration == pytest.approx(len(recording) / 16000, abs=0.01)
    for draft in (tiny, base):
        spec = Engine(base, draft).transcribe(recording, language="en", num_draft_tokens=4)
        assert_same(spec, ref)
        assert spec.stats.drafted > 0 and spec.stats.accepted > 0


@pytest.mark.real
@pytest.mark.slow
def test_engine_longform_initial_prompt_no_conditioning(recording):
    prompt = "Trains, museums and frogs."
    ref = openai_transcribe(real_folder("base"), recording, language="en", temperature=0.0,
                            condition_on_previous_text=False, initial_prompt=prompt)
    out = Engine(real_folder("base"), real_folder("base")).transcribe(
        recording, language="en", temperature=0.0, condition_on_previous_text=False, initial_prompt=prompt)
    assert_same(out, ref)


def test_fallback_is_triggered_and_reproducible(multilingual):
    """Noise on a random model fails the logprob check: windows are retried at higher temperatures
    (recorded per segment), and the same seed reproduces the transcript, with or without a draft."""
    torch.manual_seed(1)
    audio = (0.3 * torch.randn(16000 * 40)).numpy()
    kw = dict(language="en", temperature=(0.0, 0.5, 1.0), seed=3)
    a = Engine(multilingual).transcribe(audio, **kw)
    b = Engine(multilingual, multilingual).transcribe(audio, num_draft_tokens=3, **kw)
    assert any(s.temperature > 0 for s in a.segments)
    assert [(s.tokens, s.temperature, s.start, s.end) for s in a.segments] == \
        [(s.tokens, s.temperature, s.start, s.end) for s in b.segments]
    c = Engine(multilingual).transcribe(audio, **{**kw, "seed": 4})
    assert c.tokens != a.tokens


@pytest.mark.real
def test_timestamp_rows_through_the_screened_head_equal_the_full_logits(recording, monkeypatch):
    """Greedy long-form rows choose through the screened head's timestamp_argmax and get their
    log-probabilities when the window ends; without a screened head every row takes the full
    logits: the same segments, tokens and log-probabilities."""
    from specwhisper.model.head import ScreenedHead

    engine = Engine(real_folder("base"))
    calls = []
    real = ScreenedHead.timestamp_argmax
    monkeypatch.setattr(ScreenedHead, "timestamp_argmax", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fast = engine.transcribe(recording, language="en", temperature=0.0)
    assert len(calls) > 50  # the screened path decided this recording's tokens
    head, engine.target.head = engine.target.head, None
    try:
        slow = engine.transcribe(recording, language="en", temperature=0.0)
    finally:
        engine.target.head = head
    assert [(s.tokens, s.start, s.end, s.avg_logprob) for s in fast.segments] == \
        [(s.tokens, s.start, s.end, s.avg_logprob) for s in slow.segments]
    assert len(fast.segments) > 5


def test_long_form_max_new_tokens_is_checked_on_both_entries(multilingual):
    """`transcribe(timestamps=True)` and `transcribe_long` refuse a per-window cap outside 1..224
    (openai's sample_len) with the same message, and take one inside it."""
    from specwhisper.config import TranscribeOptions

    engine = Engine(multilingual)
    audio = torch.zeros(16000 * 2)
    for bad in (0, 225):
        with pytest.raises(ValueError, match="caps each long-form window.*at most 224"):
            engine.transcribe(audio, language="en", timestamps=True, max_new_tokens=bad)
        with pytest.raises(ValueError, match="caps each long-form window.*at most 224"):
            engine.transcribe_long(audio, TranscribeOptions(language="en"), max_new_tokens=bad)
    engine.transcribe_long(audio, TranscribeOptions(language="en"), max_new_tokens=4)

"""A draft with its own encoder and another mel front end (tiny's 80 bins drafting large-v3's 128):
it reads log-mels of its own, made from the same audio, window by window at the target's frames;
its proposals change only the speed, so every output is target-only's. Given the target's log-mel
instead of audio, the draft stands aside and says why."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specwhisper import Engine, load_audio, log_mel_spectrogram
from specwhisper.samples import sample_paths


@pytest.fixture(scope="module")
def audio():
    clips = [torch.from_numpy(np.asarray(load_audio(p))) for p in sample_paths()[:3]]
    pause = torch.zeros(16000)
    longform = torch.cat([clips[0], pause, clips[1], pause, clips[2]] * 3)  # > 30 s: two windows or more
    assert longform.numel() > 31 * 16000
    return clips[0], clips[1], longform


@pytest.fixture(scope="module")
def engines(v3, multilingual):
    return Engine(v3, background=False), Engine(v3, draft=multilingual, background=False)


def test_a_draft_with_other_mel_bins_drafts_from_the_audio(engines, audio):
    alone, drafted = engines
    assert drafted.drafter.own_mels == 80 and drafted.n_mels == 128
    short, other, longform = audio
    cases = [(short, dict(language="en", max_new_tokens=20)),
             (other, dict(language="en", max_new_tokens=20, temperature=0.8, seed=5)),
             (longform, dict(language="en", temperature=(0.0,), max_new_tokens=30))]
    for x, options in cases:
        expected = alone.transcribe(x, **options)
        got = drafted.transcribe(x, num_draft_tokens=3, **options)
        assert got.tokens == expected.tokens and len(expected.tokens) > 0
        assert [s.tokens for s in got.segments] == [s.tokens for s in expected.segments]
        assert got.stats.draft_skipped is None and got.stats.draft_passes > 0
    # several recordings at once: each its own draft mel
    got = drafted.transcribe([short, other], language="en", max_new_tokens=20, num_draft_tokens=2)
    assert [r.tokens for r in got] == [r.tokens for r in alone.transcribe([short, other], language="en",
                                                                          max_new_tokens=20)]


def test_a_draft_with_other_mel_bins_stands_aside_for_a_log_mel(engines, audio):
    alone, drafted = engines
    mel = log_mel_spectrogram(audio[0], n_mels=128)
    got = drafted.transcribe(mel, language="en", max_new_tokens=20, num_draft_tokens=3)
    assert got.tokens == alone.transcribe(mel, language="en", max_new_tokens=20).tokens
    assert got.stats.draft_passes == 0
    assert "80-bin" in got.stats.draft_skipped and "audio" in got.stats.draft_skipped
    with pytest.raises(ValueError, match="mel bins"):
        drafted.transcribe(log_mel_spectrogram(audio[0], n_mels=80), language="en")

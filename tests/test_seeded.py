"""Seeded sampling reproduces: the same seed gives the same tokens whatever k (fixed or adaptive),
whatever the batch it shares, and with or without a draft (same vocabulary or mapped).

The engine samples by the exponential race with counter-based noise keyed by (seed, position,
token id): draft and target race with the same noise, the draft proposes its winner, the target's
winner is emitted, so the draft changes only the speed, never the tokens."""
from __future__ import annotations

import pytest
import torch

from conftest import real_folder
from specwhisper import Engine
from test_speculative import perturbed

KW = dict(language="en", max_new_tokens=40)


@pytest.fixture(scope="module")
def target(ckpt_dir):
    return ckpt_dir("seed-target", vocab_size=51865, d_model=64, heads=4, seed=51, init_std=0.05)


@pytest.fixture(scope="module")
def noisy(target, tmp_path_factory):
    return perturbed(target, tmp_path_factory.mktemp("seeded") / "noisy", 0.05, seed=4)


@pytest.fixture(scope="module")
def mels():
    torch.manual_seed(6)
    return torch.randn(3, 80, 3000)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.6, 0.9)])
def test_same_seed_same_tokens_at_any_k(temperature, top_p, target, noisy, english, mels):
    plain = Engine(target).transcribe(mels[0], temperature=temperature, top_p=top_p, seed=11, **KW).tokens
    assert len(plain) >= 10
    spec = Engine(target, noisy)
    for k in [None, *range(1, 9)]:
        out = spec.transcribe(mels[0], temperature=temperature, top_p=top_p, seed=11, num_draft_tokens=k, **KW)
        assert out.tokens == plain, k
    assert out.stats.drafted > 0 and 0 < out.stats.acceptance_rate < 1
    mapped = Engine(target, english)  # another vocabulary, mapped by token string
    for k in (2, 5):
        assert mapped.transcribe(mels[0], temperature=temperature, top_p=top_p, seed=11,
                                 num_draft_tokens=k, **KW).tokens == plain


def test_same_seed_same_tokens_in_any_batch(target, noisy, mels):
    """A request's tokens do not depend on what shares its batch (greedy or sampled, any seed)."""
    alone = Engine(target).transcribe(mels[1], temperature=1.0, seed=5, **KW).tokens
    engine = Engine(target, noisy, max_batch=4, background=False)
    futures = [engine.submit(mels[0], temperature=0.7, seed=1, num_draft_tokens=2, **KW),
               engine.submit(mels[1], temperature=1.0, seed=5, num_draft_tokens=6, **KW),
               engine.submit(mels[2], **KW)]
    engine.step()
    futures.append(engine.submit(mels[1], temperature=1.0, seed=5, **KW))  # joins mid-decode
    engine.run_until(futures)
    assert futures[1].result().tokens == alone == futures[3].result().tokens


def test_batch_rows_take_seed_plus_row(target, mels):
    engine = Engine(target)
    batch = engine.transcribe(mels, temperature=1.0, seed=20, **KW)
    for i, row in enumerate(batch):
        assert row.tokens == engine.transcribe(mels[i], temperature=1.0, seed=20 + i, **KW).tokens


def test_different_seeds_differ(target, mels):
    engine = Engine(target)
    outs = {tuple(engine.transcribe(mels[0], temperature=1.0, seed=s, **KW).tokens) for s in range(6)}
    assert len(outs) >= 4


@pytest.mark.real
@pytest.mark.parametrize("temperature", [0.2, 1.0])
def test_real_pair_sampling(temperature):
    """base drafted by tiny.en (mapped vocabularies, the draft's logits cover its timestamp ids):
    sampling runs, and equals target-only sampling for the same seed, single and batched."""
    from specwhisper import load_audio, log_mel_spectrogram
    from specwhisper.samples import sample_paths

    base, tiny = real_folder("base"), real_folder("tiny.en")
    mels = torch.stack([log_mel_spectrogram(load_audio(p), n_mels=80) for p in sample_paths()[:2]])
    plain = Engine(base).transcribe(mels, temperature=temperature, seed=1, language="en")
    spec = Engine(base, tiny).transcribe(mels, temperature=temperature, seed=1, language="en", num_draft_tokens=3)
    assert [o.tokens for o in spec] == [o.tokens for o in plain]
    assert all(o.stats.drafted > 0 for o in spec)
    single = Engine(base, tiny).transcribe(mels[1], temperature=temperature, seed=2, language="en")
    assert single.tokens == plain[1].tokens

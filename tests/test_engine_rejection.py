"""Both acceptance rules through the engine sample exactly the target's distribution: two-sample
chi-square tests of the engine's output against target-only sampling, for `sampling="race"` and
`sampling="rejection"`, same-vocabulary and mapped (English-only) drafts, batched and one row at a
time, each with a power check (the same test rejects a deliberately wrong sampler).

False-alarm rate: every test compares at significance ALPHA = 1e-4 (test_engine_sampling.py);
the seeds are fixed, so a correct engine passes deterministically, and fails with probability
1e-4 over the choice of seeds."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import specwhisper.runner
from specwhisper import Engine
from test_engine_sampling import ALPHA, CALLS, ROWS, mel, pair, pairs, two_sample_pvalue  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def plain(pair, mel):
    """Target-only sampling: the reference counts."""
    return pairs(Engine(pair[0]), mel, seed0=10_000)[0]


@pytest.fixture(scope="module")
def drafts(pair, english):
    return {"same": pair[1], "mapped": english}


@pytest.mark.parametrize("rule", ["rejection", "race"])
@pytest.mark.parametrize("draft", ["same", "mapped"])
def test_batched_speculative_sampling_matches_target_only(pair, drafts, mel, plain, rule, draft):
    engine = Engine(pair[0], drafts[draft], sampling=rule)
    spec, stats = pairs(engine, mel, seed0=40_000, num_draft_tokens=2)
    drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
    assert drafted > 0 and accepted < drafted
    if draft == "same":
        assert accepted > 0
    assert two_sample_pvalue(plain, spec) > ALPHA


def test_one_row_at_a_time_rejection(pair, drafts, mel, plain):
    """max_batch=1 (a row never shares a pass), per-row parameters differing between calls."""
    engine = Engine(pair[0], drafts["same"], sampling="rejection", max_batch=1)
    spec, stats = pairs(engine, mel, seed0=50_000, num_draft_tokens=3)
    assert 0 < sum(s.accepted for s in stats) < sum(s.drafted for s in stats)
    assert two_sample_pvalue(plain, spec) > ALPHA


def test_mixed_rows_use_per_row_probabilities(pair, drafts, mel, plain):
    """Greedy rows and rows of two temperatures in one batch (no shared (temperature, top_p): the
    per-row float64 path); the counted rows still follow the target's distribution, greedy rows
    give the target's argmax."""
    engine = Engine(pair[0], drafts["same"], sampling="rejection", background=False)
    reference = Engine(pair[0]).transcribe(mel, language="en", max_new_tokens=3).tokens
    kw = dict(language="en", max_new_tokens=3, num_draft_tokens=2)
    counted, others, greedy = [], [], []
    for i in range(ROWS * CALLS):
        counted.append(engine.submit(mel, temperature=0.3, top_p=0.9, seed=60_000 + i, **kw))
        if i % 4 == 0:
            others.append(engine.submit(mel, temperature=0.7, seed=90_000 + i, **kw))
        if i % 64 == 0:
            greedy.append(engine.submit(mel, **kw))
    engine.run_until(counted + others + greedy)
    assert all(f.result().tokens == reference for f in greedy)
    counts = Counter(tuple(f.result().tokens[:2]) for f in counted)
    assert two_sample_pvalue(plain, counts) > ALPHA


def test_power_a_sampler_that_keeps_every_proposal_is_caught(pair, drafts, mel, plain, monkeypatch):
    """The same test rejects the engine when its rejection rule is broken to accept every usable
    proposal (the output then follows the draft's distribution)."""
    real = specwhisper.runner.accept_by_rejection

    def always_accept(target_logits, draft_logits, proposals, choice, *args):
        emitted, _ = real(target_logits, draft_logits, proposals, choice, *args)
        valid = (proposals >= 0).sum(dim=1)
        j = torch.arange(emitted.shape[1])
        padded = torch.cat([proposals.clamp(min=0), choice[:, -1:]], dim=1)
        return torch.where(j[None] < valid[:, None], padded, choice.gather(1, valid[:, None])), valid

    monkeypatch.setattr(specwhisper.runner, "accept_by_rejection", always_accept)
    engine = Engine(pair[0], drafts["same"], sampling="rejection")
    wrong, _ = pairs(engine, mel, seed0=70_000, num_draft_tokens=2)
    assert two_sample_pvalue(plain, wrong) < ALPHA


def test_rejection_is_reproducible_with_a_seed(pair, drafts, mel):
    engine = Engine(pair[0], drafts["same"], sampling="rejection")
    kw = dict(language="en", temperature=1.0, seed=5, max_new_tokens=20, num_draft_tokens=3)
    assert engine.transcribe(mel, **kw).tokens == engine.transcribe(mel, **kw).tokens


def test_sampling_option_is_checked(pair):
    with pytest.raises(ValueError, match="sampling"):
        Engine(pair[0], sampling="gumbel")

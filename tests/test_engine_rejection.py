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

import specwhisper.engine.runner
from specwhisper import Engine
from specwhisper.backends import cpu_ops
from specwhisper.model.head import Q4Head
from test_engine_sampling import ALPHA, ROWS, mel, pair, pairs, two_sample_pvalue  # noqa: F401 (fixtures)

CALLS = 4  # 512 samples per tested system (the target-only reference: 1024)


def sampled(engine, mel, seed0, calls=CALLS, **kw):
    """(counts of the first two tokens, stats) over `calls` batches of ROWS rows."""
    counts, stats = Counter(), []
    for call in range(calls):
        for o in engine.transcribe(mel.expand(ROWS, -1, -1), language="en", temperature=0.3, top_p=0.9,
                                   max_new_tokens=3, seed=seed0 + call * ROWS, **kw):
            counts[tuple(o.tokens[:2])] += 1
            stats.append(o.stats)
    return counts, stats


class Memo(torch.nn.Module):
    """An encoder that computes its output once for the one mel every row of these tests
    shares (the encoders are not what these tests check; they dominated their time)."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder, self.seen = encoder, None

    def forward(self, mel):
        if self.seen is None or not torch.equal(self.seen[0], mel[:1]):
            self.seen = (mel[:1].clone(), self.encoder(mel[:1]))
        assert all(torch.equal(m, self.seen[0][0]) for m in mel)
        return self.seen[1].expand(mel.shape[0], -1, -1)


def engine(target, draft=None, **kwargs) -> Engine:
    out = Engine(target, draft, **kwargs)
    out.target.model.encoder = Memo(out.target.model.encoder)
    if out.drafter is not None and not out.drafter.shared_encoder:
        out.drafter.draft.model.encoder = Memo(out.drafter.draft.model.encoder)
    return out


@pytest.fixture(scope="module")
def plain(pair, mel):
    """Target-only sampling: the reference counts."""
    return pairs(engine(pair[0]), mel, seed0=10_000)[0]


@pytest.fixture(scope="module")
def drafts(pair, english):
    return {"same": pair[1], "mapped": english}


@pytest.mark.parametrize("rule, draft", [("rejection", "same"), ("rejection", "mapped"), ("race", "mapped")])
def test_batched_speculative_sampling_matches_target_only(pair, drafts, mel, plain, rule, draft):
    """(race with a same-vocabulary draft: test_engine_sampling.py). The same-vocabulary draft is
    compact (64 features): it drafts from its 4-bit head's logits (`Q4Head.logits`), and under
    rejection sampling those are the distribution its proposals are drawn from and tested against."""
    tested = engine(pair[0], drafts[draft], sampling=rule)
    if draft == "same" and cpu_ops.available():
        assert isinstance(tested.drafter.head, Q4Head)
    spec, stats = sampled(tested, mel, seed0=40_000, num_draft_tokens=2)
    drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
    assert drafted > 0 and accepted < drafted
    if draft == "same":
        assert accepted > 0
    assert two_sample_pvalue(plain, spec) > ALPHA


def test_drafts_that_stop_at_a_small_race_lead_keep_the_target_distribution(pair, drafts, mel, plain, monkeypatch):
    """Adaptive rows under a cap of 3 whose draft stops after a proposal with a small race lead
    (`DraftSide.stop_margin`, `sampling.race_leads`): where the draft stops depends on its own
    proposals and noise alone, so the output still follows the target's distribution. (Under the
    race rule a seeded row's tokens do not depend on where the draft stops: tests/test_real_pairs.py.)"""
    from specwhisper.engine.drafting import DraftSide
    from specwhisper.engine.speculation import Speculation

    tested = engine(pair[0], drafts["same"], sampling="rejection")
    steps = []
    propose = DraftSide.propose

    def recorded(self, B, k, *args, **kwargs):
        steps.append((k, propose(self, B, k, *args, **kwargs)))
        return steps[-1][1]

    monkeypatch.setattr(DraftSide, "propose", recorded)
    monkeypatch.setattr(Speculation, "choose_k", lambda self, B: (3, None))
    # (the random test models' leads are small: a margin that some proposals pass and some do not)
    monkeypatch.setattr(tested.runner.draft_side, "STOP_MARGIN", 0.5)
    spec, stats = sampled(tested, mel, seed0=45_000)
    assert any(s < k for k, s in steps) and any(s == k for k, s in steps)
    assert 0 < sum(s.accepted for s in stats) < sum(s.drafted for s in stats)
    assert two_sample_pvalue(plain, spec) > ALPHA


def test_one_row_at_a_time_rejection(pair, drafts, mel, plain):
    """max_batch=1: a row never shares a pass (256 samples)."""
    one = engine(pair[0], drafts["same"], sampling="rejection", max_batch=1)
    spec, stats = sampled(one, mel, seed0=50_000, calls=2, num_draft_tokens=3)
    assert 0 < sum(s.accepted for s in stats) < sum(s.drafted for s in stats)
    assert two_sample_pvalue(plain, spec) > ALPHA


def test_mixed_rows_use_per_row_probabilities(pair, drafts, mel, plain):
    """Greedy rows and rows of two temperatures in one batch (no shared (temperature, top_p): the
    per-row float64 path); the counted rows still follow the target's distribution, greedy rows
    give the target's argmax."""
    mixed = engine(pair[0], drafts["same"], sampling="rejection", background=False)
    reference = Engine(pair[0]).transcribe(mel, language="en", max_new_tokens=3).tokens
    kw = dict(language="en", max_new_tokens=3, num_draft_tokens=2)
    counted, others, greedy = [], [], []
    for i in range(ROWS * CALLS):
        counted.append(mixed.submit(mel, temperature=0.3, top_p=0.9, seed=60_000 + i, **kw))
        if i % 4 == 0:
            others.append(mixed.submit(mel, temperature=0.7, seed=90_000 + i, **kw))
        if i % 64 == 0:
            greedy.append(mixed.submit(mel, **kw))
    mixed.run_until(counted + others + greedy)
    assert all(f.result().tokens == reference for f in greedy)
    counts = Counter(tuple(f.result().tokens[:2]) for f in counted)
    assert two_sample_pvalue(plain, counts) > ALPHA


def test_power_a_sampler_that_keeps_every_proposal_is_caught(pair, drafts, mel, plain, monkeypatch):
    """The same test rejects the engine when its rejection rule is broken to accept every usable
    proposal (the output then follows the draft's distribution)."""
    real = specwhisper.engine.runner.accept_by_rejection

    def always_accept(target_logits, draft_logits, proposals, choice, *args):
        emitted, _ = real(target_logits, draft_logits, proposals, choice, *args)
        valid = (proposals >= 0).sum(dim=1)
        j = torch.arange(emitted.shape[1])
        padded = torch.cat([proposals.clamp(min=0), choice[:, -1:]], dim=1)
        return torch.where(j[None] < valid[:, None], padded, choice.gather(1, valid[:, None])), valid

    monkeypatch.setattr(specwhisper.engine.runner, "accept_by_rejection", always_accept)
    wrong, _ = sampled(engine(pair[0], drafts["same"], sampling="rejection"), mel, seed0=70_000, num_draft_tokens=2)
    assert two_sample_pvalue(plain, wrong) < ALPHA


def test_rejection_is_reproducible_with_a_seed(pair, drafts, mel):
    seeded = Engine(pair[0], drafts["same"], sampling="rejection")
    kw = dict(language="en", temperature=1.0, seed=5, max_new_tokens=20, num_draft_tokens=3)
    assert seeded.transcribe(mel, **kw).tokens == seeded.transcribe(mel, **kw).tokens


def test_sampling_option_is_checked(pair):
    with pytest.raises(ValueError, match="sampling"):
        Engine(pair[0], sampling="gumbel")

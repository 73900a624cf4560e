"""Sampling through the engine: reproducible with a seed, and speculative sampling has the same
output distribution as target-only sampling (the exact sampler itself is proven against exact
distributions in test_sampling.py; here the engine's wiring is tested end to end)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chi2_contingency

from specwhisper import Engine
from test_speculative import perturbed

ROWS, CALLS = 128, 8  # 1024 samples per system
# Two-sample chi-square over (first, second) token pairs. The false-alarm rate is the chosen
# significance level, 1e-4 per test: with fixed seeds the outcome is deterministic, and a correct
# engine fails it with probability 1e-4 over the choice of seeds.
ALPHA = 1e-4


@pytest.fixture(scope="module")
def pair(ckpt_dir, tmp_path_factory):
    target = ckpt_dir("sampling-target", vocab_size=51865, d_model=64, heads=4, seed=41)
    draft = perturbed(target, tmp_path_factory.mktemp("samp") / "noisy", 0.1, seed=2)
    return target, draft


@pytest.fixture(scope="module")
def mel():
    torch.manual_seed(4)
    return torch.randn(80, 3000)


def pairs(engine, mel, seed0, calls=CALLS, **kw):
    batch = mel.expand(ROWS, -1, -1)
    counts, stats = Counter(), []
    for call in range(calls):
        for o in engine.transcribe(batch, language="en", temperature=0.3, top_p=0.9, max_new_tokens=3,
                                   seed=seed0 + call * ROWS, **kw):  # row i samples with seed + i
            counts[tuple(o.tokens[:2])] += 1
            stats.append(o.stats)
    return counts, stats


def two_sample_pvalue(a: Counter, b: Counter) -> float:
    keys = [key for key in set(a) | set(b) if a[key] + b[key] >= 10]
    rest = [sum(a[k] for k in a if k not in keys), sum(b[k] for k in b if k not in keys)]
    table = [[a[k] for k in keys] + [rest[0]], [b[k] for k in keys] + [rest[1]]]
    if rest == [0, 0]:
        table = [row[:-1] for row in table]
    assert len(table[0]) >= 4, "too few categories for a meaningful test"
    return chi2_contingency(table)[1]


def test_seeded_sampling_is_reproducible(pair, mel):
    target, draft = pair
    engine = Engine(target, draft)
    a = engine.transcribe(mel, language="en", temperature=0.8, top_p=0.9, seed=123, max_new_tokens=20, num_draft_tokens=3)
    b = engine.transcribe(mel, language="en", temperature=0.8, top_p=0.9, seed=123, max_new_tokens=20, num_draft_tokens=3)
    assert a.tokens == b.tokens
    outs = {tuple(engine.transcribe(mel, language="en", temperature=1.0, seed=s, max_new_tokens=20).tokens)
            for s in range(6)}
    assert len(outs) > 1


def test_self_draft_accepts_everything_when_sampling(pair, mel):
    target, _ = pair
    out = Engine(target, target).transcribe(mel, language="en", temperature=1.0, seed=7, max_new_tokens=30,
                                            num_draft_tokens=4)
    assert out.stats.drafted > 0 and out.stats.acceptance_rate == 1.0


def test_speculative_sampling_matches_target_only_distribution(pair, mel):
    target, draft = pair
    plain, _ = pairs(Engine(target), mel, seed0=10_000)
    spec, stats = pairs(Engine(target, draft), mel, seed0=20_000, num_draft_tokens=1)
    drafted = sum(s.drafted for s in stats)
    assert drafted > 0 and 0 < sum(s.accepted for s in stats) < drafted  # some accepted, some not
    assert two_sample_pvalue(plain, spec) > ALPHA
    # the test has power: a sampler that always keeps the draft's proposal is caught, on a quarter
    # of the samples already (p = 3e-33 here; power only grows with the sample size)
    greedy_draft, _ = pairs(Engine(draft), mel, seed0=30_000, calls=CALLS // 4)
    assert two_sample_pvalue(plain, greedy_draft) < ALPHA

"""The sampling reference (specwhisper/sampling.py): top-p semantics, exact cases, invariants,
counter-based noise and race sampling, and statistical proofs that race sampling and speculative
sampling (same vocabulary and mapped) emit tokens distributed exactly as the target's."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from specwhisper import sampling as S
from specwhisper.backends import ops


def _step_inputs(B, k, V, temperature=1.0, top_p=1.0, seed=0, spread=3.0, mismatch=0.7):
    """Random target/draft logits, drafts sampled from the processed draft distribution, noise."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(B, k + 1, V, generator=g) * spread
    draft = target[:, :k] + torch.randn(B, k, V, generator=g) * mismatch
    t = temperature if temperature > 0 else 1.0
    drafts = S.sample(draft, t, top_p, g)
    u = S.draw_uniforms((B, k), "cpu", g)
    noise = S.draw_exp_noise((B, V), "cpu", g)
    return target, draft, drafts, temperature, top_p, u, noise


# --- top-p semantics -----------------------------------------------------------------------------

def _exact_top_p_mask(logits, temperature, top_p):
    """The definition, by sorting the exact integer weights: keep w >= tau, tau the largest value
    whose kept mass is >= top_p * total (float64 compare, as the spec)."""
    w = S._weights(logits, temperature)
    keep = torch.zeros_like(w, dtype=torch.bool)
    for row in range(w.shape[0]):
        values = torch.unique(w[row]).flip(0)  # descending distinct weights
        target = w[row].sum() * S.f32(top_p)
        for tau in values:
            if tau > 0 and w[row][w[row] >= tau].sum() >= target:
                keep[row] = w[row] >= tau
                break
    return keep


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_matches_transformers_on_tie_free_rows(temperature, top_p):
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 300, generator=g) * 2.5  # continuous: no ties
    warped = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, logits))
    expected = torch.softmax(warped, -1)
    probs = S.processed_probs(logits, temperature, top_p)
    assert torch.equal(probs > 0, expected > 0)
    torch.testing.assert_close(probs, expected, rtol=2e-6, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_top_p_equals_the_definition(data):
    V = data.draw(st.integers(1, 24))
    levels = st.sampled_from([-math.inf, -3.0, -1.0, 0.0, 0.0, 0.5, 2.0, 2.0, 4.0])
    values = data.draw(st.lists(st.one_of(levels, st.floats(-8, 8, width=32)), min_size=V, max_size=V))
    if all(v == -math.inf for v in values):
        values[0] = 0.0
    logits = torch.tensor([values], dtype=torch.float32)
    temperature = data.draw(st.sampled_from([0.3, 1.0, 2.5]))
    top_p = data.draw(st.sampled_from([1e-9, 0.05, 0.3, 0.5, 0.8, 0.95, 1.0]))
    probs = S.processed_probs(logits, temperature, top_p)
    assert torch.equal(probs > 0, _exact_top_p_mask(logits, temperature, top_p))
    assert abs(probs.double().sum().item() - 1.0) < 1e-6


def test_top_p_keeps_all_ties_at_the_threshold():
    logits = torch.tensor([[2.0, 2.0, 2.0, 0.0, -1.0, -5.0]])
    probs = S.processed_probs(logits, 1.0, 0.01)  # one of the tied tokens alone would suffice
    assert (probs[0, :3] > 0).all() and (probs[0, 3:] == 0).all()
    torch.testing.assert_close(probs[0, :3], torch.full((3,), 1 / 3))


def test_top_p_one_keeps_every_nonzero_token_and_is_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 1000, generator=g) * 4  # spans ~ 40 nats at temperature 0.8
    logits[:, ::7] = -math.inf  # suppressed
    probs = S.processed_probs(logits, 0.8, 1.0)
    expected = torch.softmax(logits.double() / 0.8, -1)
    relative = expected / expected.amax(-1, keepdim=True)
    # Nonzero means a weight >= 1, i.e. at least 2^-37 of the likeliest token (documented).
    assert (probs[relative > 2.0 ** -36] > 0).all()
    assert (probs[relative < 2.0 ** -38] == 0).all()
    assert (probs[:, ::7] == 0).all()
    torch.testing.assert_close(probs.double(), expected, rtol=2e-6, atol=2.0 ** -36)
    assert (probs.double() - expected).abs().sum(-1).max() < 1e-7  # total variation


def test_tiny_top_p_keeps_only_the_argmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 500, generator=g)
    probs = S.processed_probs(logits, 1.0, 1e-9)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 500).float())


def test_suppressed_tokens_are_never_sampled():
    logits = torch.zeros(20_000, 12)
    logits[:, [0, 5, 11]] = -math.inf
    tokens = S.sample(logits, 1.3, 1.0, torch.Generator().manual_seed(3))
    assert not torch.isin(tokens, torch.tensor([0, 5, 11])).any()
    assert set(tokens.tolist()) == set(range(12)) - {0, 5, 11}


def test_temperature_zero_is_greedy():
    logits = torch.randn(5, 40)
    assert torch.equal(S.sample(logits, 0.0, 0.5), logits.argmax(-1))
    assert torch.equal(S.processed_probs(logits, 0.0, 1.0),
                       torch.nn.functional.one_hot(logits.argmax(-1), 40).float())


def test_exp_is_accurate():
    s = torch.linspace(-60, 0, 200_001)
    rel = (S._exp_f32(s).double() / torch.exp(s.double()) - 1).abs()
    assert rel.max() < 2.5 * 2.0 ** -24
    assert S._exp_f32(torch.tensor([0.0])).item() == 1.0


# --- greedy acceptance ---------------------------------------------------------------------------

def test_greedy_accept():
    V = 10
    target_tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 1, 2]])  # [B, k+1]
    logits = torch.nn.functional.one_hot(target_tokens, V).float()
    drafts = torch.tensor([[1, 2, 3], [5, 0, 7], [4, 0, 1]])
    tokens, n = S.greedy_accept(logits, drafts)
    assert n.tolist() == [4, 2, 1]
    assert tokens.tolist() == [[1, 2, 3, 4], [5, 6, -1, -1], [9, -1, -1, -1]]
    assert torch.equal(S.speculative_sample_noise(logits, logits[:, :3], drafts, 0.0, 1.0,
                                                  torch.ones(3, 3, dtype=torch.float64),
                                                  torch.ones(3, V))[0], tokens)


# --- exact cases of speculative sampling ---------------------------------------------------------

def test_one_hot_target_always_emits_its_token():
    B, k, V = 500, 4, 30
    target, draft, drafts, *_, u, noise = _step_inputs(B, k, V, seed=4)
    target = torch.full_like(target, -math.inf)
    target[..., 13] = 0.0
    tokens, n = S.speculative_sample_noise(target, draft, drafts, 1.0, 1.0, u, noise)
    emitted = torch.arange(k + 1) < n[:, None]
    assert (tokens[emitted] == 13).all() and (tokens[~emitted] == -1).all()


def test_draft_equal_to_target_is_always_accepted():
    B, k, V = 300, 5, 50
    target, _, _, *_, u, noise = _step_inputs(B, k, V, seed=5)
    for temperature, top_p in [(1.0, 1.0), (0.7, 0.8)]:
        drafts = S.sample(target[:, :k], temperature, top_p, torch.Generator().manual_seed(6))
        tokens, n = S.speculative_sample_noise(target, target[:, :k].clone(), drafts, temperature,
                                               top_p, u, noise)
        assert (n == k + 1).all()
        assert torch.equal(tokens[:, :k], drafts)


def test_draft_outside_target_top_p_is_always_rejected():
    B, k, V = 400, 3, 40
    target, draft, drafts, *_, u, noise = _step_inputs(B, k, V, seed=8)
    top_p = 0.3
    p = S.processed_probs(target, 1.0, top_p)
    # the first draft: the target's likeliest token outside its top-p set, the draft's favourite
    x = torch.where(p[:, 0] > 0, -math.inf, target[:, 0]).argmax(-1)
    draft[torch.arange(B), 0, x] = draft[:, 0].amax(-1) + 1.0
    drafts[:, 0] = x
    tokens, n = S.speculative_sample_noise(target, draft, drafts, 1.0, top_p, u, noise)
    assert (n == 1).all()
    assert (p[torch.arange(B), 0, tokens[:, 0]] > 0).all()
    assert (tokens[:, 1:] == -1).all()


def test_draft_the_draft_could_not_propose_is_rejected():
    B, k, V = 200, 2, 16
    target, draft, drafts, *_, u, noise = _step_inputs(B, k, V, seed=10)
    draft[torch.arange(B), 0, drafts[:, 0]] = -math.inf  # q(x) = 0 while p(x) > 0
    tokens, n = S.speculative_sample_noise(target, draft, drafts, 1.0, 1.0, u, noise)
    assert (n == 1).all()


def test_all_zero_residual_falls_back_to_p():
    B, k, V = 100, 2, 12
    target, _, _, *_, u, noise = _step_inputs(B, k, V, seed=11)
    target[:, :, 0] = -math.inf  # p(0) = q(0) = 0, and q == p: the residual is all zero
    drafts = torch.zeros(B, k, dtype=torch.int64)
    tokens, n = S.speculative_sample_noise(target, target[:, :k].clone(), drafts, 1.0, 1.0, u, noise)
    assert (n == 1).all()
    p = S._probs64(target[:, 0], 1.0, 1.0)
    assert torch.equal(tokens[:, 0], (p / noise.double()).argmax(-1))


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.6, 0.9), (1.4, 0.5)])
def test_invariants(temperature, top_p):
    B, k, V = 2000, 4, 25
    target, draft, drafts, *_, u, noise = _step_inputs(B, k, V, temperature, top_p, seed=12)
    tokens, n = S.speculative_sample_noise(target, draft, drafts, temperature, top_p, u, noise)
    assert ((n >= 1) & (n <= k + 1)).all()
    steps = torch.arange(k + 1)
    assert (tokens[steps >= n[:, None]] == -1).all()
    accepted = steps < (n - 1)[:, None]
    assert torch.equal(tokens[:, :k][accepted[:, :k]], drafts[accepted[:, :k]])
    p = S.processed_probs(target, temperature, top_p)
    emitted = steps < n[:, None]
    support = p.gather(-1, tokens.clamp_min(0)[..., None]).squeeze(-1) > 0
    assert support[emitted].all()  # nothing outside the target's top-p support
    assert 0 < (n - 1).float().mean() < k  # some accepted, some rejected


def test_speculative_sample_is_the_core_with_drawn_noise():
    B, k, V = 64, 3, 33
    target, draft, drafts, temperature, top_p, *_ = _step_inputs(B, k, V, 0.9, 0.8, seed=13)
    got = ops.speculative_sample(target, draft, drafts, 0.9, 0.8, torch.Generator().manual_seed(14))
    g = torch.Generator().manual_seed(14)
    u = S.draw_uniforms((B, k), "cpu", g)
    noise = S.draw_exp_noise((B, V), "cpu", g)
    expected = S.speculative_sample_noise(target, draft, drafts, 0.9, 0.8, u, noise)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_validation_errors():
    target, draft, drafts, _, _, u, noise = _step_inputs(2, 3, 10)
    call = S.speculative_sample_noise
    with pytest.raises(ValueError, match="draft_logits"):
        call(target, draft[:, :2], drafts, 1.0, 1.0, u, noise)
    with pytest.raises(ValueError, match="exp_noise"):
        call(target, draft, drafts, 1.0, 1.0, u, noise[:, :5])
    with pytest.raises(TypeError, match="uniforms"):
        call(target, draft, drafts, 1.0, 1.0, u.float(), noise)
    with pytest.raises(TypeError, match="draft_tokens"):
        call(target, draft, drafts.int(), 1.0, 1.0, u, noise)
    with pytest.raises(ValueError, match="temperature"):
        call(target, draft, drafts, -0.1, 1.0, u, noise)
    for bad_top_p in (0.0, 1.5, -1.0):
        with pytest.raises(ValueError, match="top_p"):
            call(target, draft, drafts, 1.0, bad_top_p, u, noise)
    for bad in (math.nan, math.inf, 0.0):
        u_bad = u.clone()
        u_bad[1, 2] = bad
        with pytest.raises(ValueError, match="uniforms"):
            call(target, draft, drafts, 1.0, 1.0, u_bad, noise)
    with pytest.raises(ValueError, match="draft_tokens"):
        call(target, draft, drafts + 10, 1.0, 1.0, u, noise)
    with pytest.raises(ValueError, match="top_p"):
        S.processed_probs(target, 1.0, 0.0)


# --- statistical proof ---------------------------------------------------------------------------
# N = 200,000 speculative steps per case, V = 16, k = 2, fixed seeds. The first emitted token must
# follow the processed target distribution p0, and the second, given that the first (a draft) was
# accepted as a, must follow p1(. | a). Each good-sampler check passes when the chi-square
# goodness-of-fit p-value is > 1e-4: a correct sampler fails one check with probability 1e-4 over
# the choice of seed, so the 8 checks below raise a false alarm with probability < 1e-3 (and, the
# seeds being fixed, the outcome is reproducible). Two broken samplers must score p < 1e-6.
# (`slow`: 3-12 s per case here, up to 40 s on a loaded 2-core machine.)

N_TRIALS, V_STAT, K_STAT = 200_000, 16, 2


def _chi2(observed: np.ndarray, probs: np.ndarray):
    """(statistic, degrees of freedom) of one multinomial sample; bins with expected count < 5
    are pooled. An outcome of probability 0 makes the statistic infinite."""
    n = observed.sum()
    if n == 0:
        return 0.0, 0
    if observed[probs == 0].sum() > 0:
        return math.inf, 1
    expected = probs * n
    small = (expected < 5) & (probs > 0)
    obs = list(observed[~small & (probs > 0)]) + ([observed[small].sum()] if small.any() else [])
    exp = list(expected[~small & (probs > 0)]) + ([expected[small].sum()] if small.any() else [])
    if len(exp) < 2:
        return 0.0, 0
    obs, exp = np.array(obs, dtype=np.float64), np.array(exp)
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def _stat_tables(seed):
    """Target logits for position 0 and for positions 1, 2 as functions of the previous token;
    a deliberately mismatched draft of the same shape."""
    g = torch.Generator().manual_seed(seed)
    V = V_STAT
    target = [torch.randn(V, generator=g), torch.randn(V, V, generator=g),
              torch.randn(V, V, generator=g)]
    draft = [t + torch.randn(t.shape, generator=g) * 1.0 for t in target[:2]]
    return target, draft


def _stat_step(seed, temperature, top_p, sampler):
    """Run N_TRIALS speculative steps (one per batch row) -> tokens, n, p0, p1 table."""
    (t0, t1, t2), (d0, d1) = _stat_tables(seed)
    g = torch.Generator().manual_seed(seed + 1)
    B = N_TRIALS
    x1 = S.sample(d0.expand(B, -1), temperature, top_p, g)  # drafts from the processed q
    x2 = S.sample(d1[x1], temperature, top_p, g)
    target_logits = torch.stack([t0.expand(B, -1), t1[x1], t2[x2]], 1)  # [B, 3, V]
    draft_logits = torch.stack([d0.expand(B, -1), d1[x1]], 1)  # [B, 2, V]
    drafts = torch.stack([x1, x2], 1)
    u = S.draw_uniforms((B, K_STAT), "cpu", g)
    noise = S.draw_exp_noise((B, V_STAT), "cpu", g)
    tokens, n = sampler(target_logits, draft_logits, drafts, temperature, top_p, u, noise)
    p0 = S.processed_probs(t0, temperature, top_p).double().numpy()
    p1 = S.processed_probs(t1, temperature, top_p).double().numpy()  # row a: p1(. | a)
    return tokens.numpy(), n.numpy(), p0, p1


def _sf(stat: float, dof: int) -> float:
    """Chi-square p-value; with no degree of freedom the only test is 'nothing impossible'."""
    return stats.chi2.sf(stat, dof) if dof > 0 else float(stat == 0)


def _p_values(tokens, n, p0, p1):
    """p-values of the first token vs p0 and of the second given an accepted first vs p1, the
    fraction of rows with two tokens, and the pooled degrees of freedom of both tests."""
    first_stat, first_dof = _chi2(np.bincount(tokens[:, 0], minlength=V_STAT), p0)
    stat, dof = 0.0, 0
    two = n >= 2
    for a in range(V_STAT):
        rows = two & (tokens[:, 0] == a)
        s, d = _chi2(np.bincount(tokens[rows, 1], minlength=V_STAT), p1[a])
        stat, dof = stat + s, dof + d
    return _sf(first_stat, first_dof), _sf(stat, dof), two.mean(), (first_dof, dof)


def _accept_everything(target_logits, draft_logits, drafts, temperature, top_p, u, noise):
    """Broken: accepts every draft (emits draft samples, i.e. q)."""
    p = S._probs64(target_logits[:, -1], temperature, top_p)
    bonus = (p / noise.double()).argmax(-1)
    tokens = torch.cat([drafts, bonus[:, None]], 1)
    return tokens, torch.full((drafts.shape[0],), drafts.shape[1] + 1)


def _resample_from_p(target_logits, draft_logits, drafts, temperature, top_p, u, noise):
    """Broken: at a rejection, resamples from p instead of max(0, p - q)."""
    tokens, n = S.speculative_sample_noise(target_logits, draft_logits, drafts, temperature, top_p,
                                           u, noise)
    k = drafts.shape[1]
    B = drafts.shape[0]
    p = S._probs64(target_logits, temperature, top_p)
    from_p = (p[torch.arange(B), n - 1] / noise.double()).argmax(-1)
    rejected = n <= k
    tokens[rejected, n[rejected] - 1] = from_p[rejected]
    return tokens, n


STAT_CASES = [(1.0, 1.0), (0.7, 0.9), (1.5, 0.8), (1.0, 0.5)]


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p", STAT_CASES)
def test_emitted_tokens_follow_the_target_distribution(temperature, top_p):
    tokens, n, p0, p1 = _stat_step(100, temperature, top_p, S.speculative_sample_noise)
    p_first, p_second, accepted, dofs = _p_values(tokens, n, p0, p1)
    print(f"T={temperature} top_p={top_p}: p(first)={p_first:.3g} p(second|first)={p_second:.3g} "
          f"dof={dofs} first accepted {accepted:.3f}")
    assert 0.1 < accepted < 0.9  # the draft is mismatched but useful
    assert min(dofs) >= 3  # the distributions tested are not trivial
    assert p_first > 1e-4 and p_second > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("broken", [_accept_everything, _resample_from_p])
def test_statistical_test_rejects_broken_samplers(broken):
    tokens, n, p0, p1 = _stat_step(100, 1.0, 1.0, broken)
    p_first, p_second, _, dofs = _p_values(tokens, n, p0, p1)
    print(f"{broken.__name__}: p(first)={p_first:.3g} p(second|first)={p_second:.3g} dof={dofs}")
    assert p_first < 1e-6


def test_sample_follows_processed_probs():
    logits = torch.randn(V_STAT, generator=torch.Generator().manual_seed(15))
    for temperature, top_p in [(1.0, 1.0), (0.8, 0.9)]:
        tokens = S.sample(logits.expand(N_TRIALS, -1), temperature, top_p,
                          torch.Generator().manual_seed(16))
        probs = S.processed_probs(logits, temperature, top_p).double().numpy()
        stat, dof = _chi2(np.bincount(tokens.numpy(), minlength=V_STAT), probs)
        print(f"sample T={temperature} top_p={top_p}: p={_sf(stat, dof):.3g} dof={dof}")
        assert dof >= 3 and _sf(stat, dof) > 1e-4


# --- counter-based noise -------------------------------------------------------------------------

def test_neg_log_is_accurate_positive_and_finite_on_every_input():
    b = torch.arange(2 ** 23, dtype=torch.int32)  # every value the hash can produce
    u = (b * 2 + 1).float() * S._TWO_M24
    noise = S._neg_log_f32(u)
    assert (noise > 0).all() and torch.isfinite(noise).all()
    rel = (noise.double() / -torch.log(u.double()) - 1).abs()
    assert rel.max() < 2.0 ** -23  # within about one fp32 ulp of -log(u)


def test_noise_is_keyed_by_seed_position_and_id():
    seed = torch.tensor([5, 5, 6, 5, -1, 2 ** 63 - 1, 5 + 2 ** 32])
    position = torch.tensor([3, 3, 3, 4, 3, 3, 3])
    ids = torch.arange(1000)
    noise = S.exp_noise(seed, position, ids)
    assert torch.equal(noise[0], noise[1])  # same key, same noise
    for other in range(2, 7):  # another seed (incl. one differing only in the high bits) or position
        assert (noise[other] != noise[0]).float().mean() > 0.99
    # a row does not depend on its batch, and a column only on its id
    assert torch.equal(S.exp_noise(seed[3:4], position[3:4], ids), noise[3:4])
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(S.exp_noise(seed, position, ids[perm]), noise[:, perm])
    assert (S.exp_noise(seed, position, ids + 2 ** 32) != noise).float().mean() > 0.99  # high bits


def test_noise_is_exponential_and_uncorrelated():
    # 1000 positions x 2000 ids of one seed. Kolmogorov-Smirnov against Exp(1), p > 1e-4, and
    # neighbouring positions / ids uncorrelated (|r| < 5 standard errors): together a false
    # alarm rate below 1e-4 for a correct hash (fixed seed: the outcome is reproducible).
    noise = S.exp_noise(torch.full((1000,), 7), torch.arange(1000), torch.arange(2000)).double()
    assert stats.kstest(noise.flatten().numpy(), "expon").pvalue > 1e-4
    n = noise.numel()
    for a, b in [(noise[1:], noise[:-1]), (noise[:, 1:], noise[:, :-1])]:
        r = np.corrcoef(a.flatten().numpy(), b.flatten().numpy())[0, 1]
        assert abs(r) < 5 / math.sqrt(n)


# --- race sampling -------------------------------------------------------------------------------

def _rows(N, temperature, top_p, seed=0, position0=0):
    return (torch.full((N,), temperature, dtype=torch.float32),
            torch.full((N,), top_p, dtype=torch.float32),
            torch.full((N,), seed, dtype=torch.int64), torch.arange(N) + position0)


def test_race_greedy_rows_are_the_argmax():
    g = torch.Generator().manual_seed(20)
    logits = torch.randint(-2, 3, (50, 30), generator=g).float()  # many ties
    t, tp, seed, pos = _rows(50, 1.0, 0.9)
    t[::2] = 0.0
    tokens = S.race_sample(logits, t, tp, seed, pos)
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))  # first index among ties
    # a sampled row's token does not depend on its neighbours being greedy
    assert torch.equal(tokens[1::2], S.race_sample(logits[1::2], t[1::2], tp[1::2], seed[1::2],
                                                   pos[1::2]))


def test_race_leads_say_how_far_the_winner_leads():
    """`race_leads`: raising the runner-up's logit by a little less than the winner's lead keeps
    the winner; by a little more, the runner-up wins (the noise is keyed by token: it stays with the
    column), at a temperature and greedy alike."""
    g = torch.Generator().manual_seed(23)
    N, V = 300, 50
    logits = torch.randn(N, V, generator=g) * 2
    t, tp, seed, pos = _rows(N, 0.6, 1.0)
    t[::3] = 0.0
    win = S.race_sample(logits, t, tp, seed, pos)
    leads = S.race_leads(logits, t, tp, seed, pos)
    rows = torch.arange(N)
    # the runner-up: the race's winner once the winner is out
    runner_up = S.race_sample(logits.index_put((rows, win), torch.tensor(-math.inf)), t, tp, seed, pos)
    assert (runner_up != win).all() and torch.isfinite(leads).all() and (leads > 0).all()
    checked = 0
    for r in range(N):
        if leads[r] < 0.05:  # (the weights' integer rounding blurs a near tie)
            continue
        for factor, winner in ((0.98, win[r]), (1.02, runner_up[r])):
            bumped = logits[r:r + 1].clone()
            bumped[0, runner_up[r]] += factor * leads[r]
            assert S.race_sample(bumped, t[r:r + 1], tp[r:r + 1], seed[r:r + 1], pos[r:r + 1]) == winner, (r, factor)
        checked += 1
    assert checked > 0.9 * N
    one_hot = torch.full((4, 9), -math.inf)
    one_hot[:, 4] = 0.0
    assert torch.isinf(S.race_leads(one_hot, *_rows(4, 1.0, 1.0))).all()  # nothing else could win


def test_race_respects_support():
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(4000, 20, generator=g) * 2
    logits[:, [0, 7]] = -math.inf
    for temperature, top_p in [(1.0, 1.0), (1.3, 0.6), (0.5, 1e-6)]:
        tokens = S.race_sample(logits, *_rows(4000, temperature, top_p, seed=3))
        p = S.processed_probs(logits, temperature, top_p)
        assert (p.gather(-1, tokens[:, None]) > 0).all()
    one_hot = torch.full((100, 9), -math.inf)
    one_hot[:, 4] = 0.0
    assert (S.race_sample(one_hot, *_rows(100, 2.0, 1.0)) == 4).all()


def test_race_is_reproducible_and_seeds_differ():
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(22))
    a = S.race_sample(logits, *_rows(64, 1.0, 1.0, seed=1))
    assert torch.equal(a, S.race_sample(logits, *_rows(64, 1.0, 1.0, seed=1)))
    b = S.race_sample(logits, *_rows(64, 1.0, 1.0, seed=2))
    assert (a != b).float().mean() > 0.5
    # a row's token depends only on (its logits, temperature, top_p, seed, position)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    t, tp, seed, pos = _rows(64, 1.0, 1.0, seed=1)
    assert torch.equal(S.race_sample(logits[perm], t, tp, seed, pos[perm]), a[perm])


def test_mapped_columns_race_like_the_target():
    """A draft whose vocabulary is the target's permuted (draft column j = target id perm[j]),
    keyed by target ids, picks the same token as the target under the same noise."""
    g = torch.Generator().manual_seed(23)
    target = torch.randn(300, 64, generator=g) * 2
    perm = torch.randperm(64, generator=g)
    rows = _rows(300, 0.8, 0.9, seed=9)
    picked = S.race_sample(target[:, perm], *rows, noise_ids=perm)
    assert torch.equal(perm[picked], S.race_sample(target, *rows))


def test_token_logprobs():
    g = torch.Generator().manual_seed(24)
    logits = torch.randn(6, 40, generator=g).half()
    logits[:, 3] = -math.inf
    tokens = torch.tensor([0, 1, 39, 5, 3, 7])
    got = S.token_logprobs(logits, tokens)
    expected = torch.log_softmax(logits.float(), -1)[torch.arange(6), tokens]  # openai-whisper
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert got[4] == -math.inf


def _speculative_race(target_fn, draft_fn, draft_ids, seed, start, length, k):
    """Decode `length` tokens with race sampling, drafting k per target pass; target_fn(prefix)
    and draft_fn(prefix) give one row of logits. The draft's columns are keyed by draft_ids."""
    out = []
    while len(out) < length:
        prefix, proposals = list(out), []
        for i in range(k):  # the draft proposes its race winner at each position
            pos = torch.tensor([start + len(prefix)])
            row = S.race_sample(draft_fn(prefix)[None], *_rows(1, 0.9, 0.95, seed, 0)[:3], pos,
                                noise_ids=draft_ids)
            proposals.append(int(draft_ids[row]))
            prefix.append(proposals[-1])
        for i in range(k + 1):  # the target's winners at the k + 1 positions of one pass
            pos = torch.tensor([start + len(out)])
            token = int(S.race_sample(target_fn(out)[None], *_rows(1, 0.9, 0.95, seed, 0)[:3], pos))
            out.append(token)
            if i == k or token != proposals[i]:
                break
    return out[:length]


@pytest.mark.parametrize("mapped", [False, True])
def test_speculative_race_output_equals_target_only(mapped):
    """The race coupling: for the same seed, the emitted tokens do not depend on k or the draft."""
    V = 40
    g = torch.Generator().manual_seed(25)
    table = torch.randn(V, V, generator=g) * 2.5  # next-token logits given the previous token
    noise_table = table + torch.randn(V, V, generator=g) * 0.8

    def target_fn(prefix):
        return table[prefix[-1] if prefix else 0]

    perm = torch.randperm(V, generator=g) if mapped else torch.arange(V)

    def draft_fn(prefix):  # the draft's own column order: draft column j is target id perm[j]
        return noise_table[prefix[-1] if prefix else 0][perm]

    for seed in (1, 2, 3):
        reference = _speculative_race(target_fn, draft_fn, perm, seed, 4, 30, k=0)
        for k in (1, 3, 8):
            assert _speculative_race(target_fn, draft_fn, perm, seed, 4, 30, k) == reference


# --- statistical proof: race sampling ------------------------------------------------------------
# One seed, N_TRIALS positions (one row each) of V_STAT tokens: the race winners must follow the
# processed distribution. Each check passes when the chi-square p-value is > 1e-4, so the 4
# good-sampler checks raise a false alarm with probability < 4e-4 over the choice of seed (fixed:
# the outcome is reproducible). Power: the same draws tested against a slightly wrong distribution
# (temperature off by 5%), and a sampler with wrong noise (E^1.15), must score p < 1e-6.

def _race_counts(temperature, top_p, seed=31, noise_power=1.0):
    logits = torch.randn(V_STAT, generator=torch.Generator().manual_seed(30))
    rows = _rows(N_TRIALS, temperature, top_p, seed=seed)
    if noise_power == 1.0:
        tokens = S.race_sample(logits.expand(N_TRIALS, -1), *rows)
    else:  # broken: the race on p / E^power
        noise = S.exp_noise(rows[2], rows[3], torch.arange(V_STAT)).double() ** noise_power
        tokens = (S._probs64(logits.expand(N_TRIALS, -1), temperature, top_p) / noise).argmax(-1)
    return logits, np.bincount(tokens.numpy(), minlength=V_STAT)


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p", STAT_CASES)
def test_race_follows_processed_probs(temperature, top_p):
    logits, counts = _race_counts(temperature, top_p)
    probs = S.processed_probs(logits, temperature, top_p).double().numpy()
    stat, dof = _chi2(counts, probs)
    print(f"race T={temperature} top_p={top_p}: p={_sf(stat, dof):.3g} dof={dof}")
    assert dof >= 3 and _sf(stat, dof) > 1e-4


@pytest.mark.slow
def test_race_statistical_test_has_power():
    logits, counts = _race_counts(1.0, 1.0)
    wrong = S.processed_probs(logits, 1.05, 1.0).double().numpy()
    assert _sf(*_chi2(counts, wrong)) < 1e-6
    _, broken = _race_counts(1.0, 1.0, noise_power=1.15)
    assert _sf(*_chi2(broken, S.processed_probs(logits, 1.0, 1.0).double().numpy())) < 1e-6


# --- mapped (cross-vocabulary) speculative sampling ----------------------------------------------
# Target vocabulary V_STAT; a draft vocabulary of V_DRAFT tokens of which MAPPED spell a target
# token (draft id d -> target id d2t[d]) and the rest cannot (-1); 3 target tokens have no draft
# spelling. The same two checks and false-alarm rate as the same-vocabulary proof above (4 cases x
# 2 checks at p > 1e-4: < 1e-3), and the broken sampler (accept everything) must score p < 1e-6.

V_DRAFT, MAPPED = 18, 13
MAPPED_CASES = [(1.0, 1.0), (0.7, 0.9), (1.5, 0.8), (1.2, 0.7)]


def _mapped_tables(seed):
    g = torch.Generator().manual_seed(seed)
    target_ids = torch.randperm(V_STAT, generator=g)[:MAPPED]
    d2t = torch.full((V_DRAFT,), -1, dtype=torch.int64)
    d2t[torch.randperm(V_DRAFT, generator=g)[:MAPPED]] = target_ids
    target = [torch.randn(V_STAT, generator=g), torch.randn(V_STAT + 1, V_STAT, generator=g),
              torch.randn(V_STAT + 1, V_STAT, generator=g)]  # row V_STAT: after an unspellable
    # The draft: the target's logits at the tokens it can spell, plus noise; others low.
    as_target = torch.where(d2t >= 0, d2t, V_STAT)
    padded = [torch.nn.functional.pad(t, (0, 1), value=-1.0) for t in target[:2]]
    draft = [padded[0][as_target], padded[1][as_target][:, as_target]]
    draft = [d + torch.randn(d.shape, generator=g) * 0.7 for d in draft]
    return target, draft, d2t


def _mapped_step(seed, temperature, top_p, sampler):
    (t0, t1, t2), (d0, d1), d2t = _mapped_tables(seed)
    g = torch.Generator().manual_seed(seed + 1)
    B, V = N_TRIALS, V_STAT
    rows = lambda n: (torch.full((n,), temperature), torch.full((n,), top_p))  # noqa: E731
    q0 = S.probs64(d0.expand(B, -1), *rows(B))  # the draft's exact processed probabilities
    x1 = S.sample(d0.expand(B, -1), temperature, top_p, g)  # draft ids
    q1 = S.probs64(d1[x1], *rows(B))
    x2 = S.sample(d1[x1], temperature, top_p, g)
    as_target = lambda x: torch.where(d2t[x] >= 0, d2t[x], V)  # noqa: E731
    y1, y2 = as_target(x1), as_target(x2)
    target_logits = torch.stack([t0.expand(B, -1), t1[y1], t2[y2.clamp_max(V - 1)]], 1)
    draft_probs = S.permute_probs(torch.stack([q0, q1], 1), d2t, V)  # [B, 2, V + 1]
    drafts = torch.stack([y1, y2], 1)
    u = S.draw_uniforms((B, K_STAT), "cpu", g)
    noise = S.draw_exp_noise((B, V + 1), "cpu", g)
    tokens, n = sampler(target_logits, draft_probs, drafts, temperature, top_p, u, noise)
    p0 = S.processed_probs(t0, temperature, top_p).double().numpy()
    p1 = S.processed_probs(t1[:V], temperature, top_p).double().numpy()
    return tokens.numpy(), n.numpy(), drafts.numpy(), p0, p1


def _accept_everything_mapped(target_logits, draft_probs, drafts, temperature, top_p, u, noise):
    return _accept_everything(target_logits, None, drafts, temperature, top_p, u, noise[:, :-1])


def test_permute_probs():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    d2t = torch.tensor([2, -1, 0, -1])
    out = S.permute_probs(probs, d2t, 3)
    torch.testing.assert_close(out, torch.tensor([[0.3, 0.0, 0.1, 0.6]], dtype=torch.float64))


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p", MAPPED_CASES)
def test_mapped_emitted_tokens_follow_the_target_distribution(temperature, top_p):
    tokens, n, drafts, p0, p1 = _mapped_step(200, temperature, top_p, S.speculative_sample_mapped)
    assert (tokens < V_STAT).all()  # never the unspellable column
    unspellable = drafts[:, 0] == V_STAT
    assert (n[unspellable] == 1).all()  # always rejected
    assert unspellable.any() or top_p < 1  # (the draft's top-p set may exclude them)
    p_first, p_second, accepted, dofs = _p_values(tokens, n, p0, p1)
    print(f"mapped T={temperature} top_p={top_p}: p(first)={p_first:.3g} "
          f"p(second|first)={p_second:.3g} dof={dofs} first accepted {accepted:.3f}")
    assert 0.1 < accepted < 0.9
    assert min(dofs) >= 3
    assert p_first > 1e-4 and p_second > 1e-4


@pytest.mark.slow
def test_mapped_statistical_test_rejects_a_broken_sampler():
    tokens, n, drafts, p0, p1 = _mapped_step(200, 1.0, 1.0, _accept_everything_mapped)
    tokens = np.where(tokens == V_STAT, 0, tokens)
    assert _p_values(tokens, n, p0, p1)[0] < 1e-6


def test_mapped_greedy_and_validation():
    target = torch.randn(3, 3, 10)
    drafts = target[:, :2].argmax(-1)
    drafts[1, 0] = 10  # unspellable: never matches
    u, noise = torch.ones(3, 2, dtype=torch.float64), torch.ones(3, 11)
    probs = torch.zeros(3, 2, 11, dtype=torch.float64)
    tokens, n = S.speculative_sample_mapped(target, probs, drafts, 0.0, 1.0, u, noise)
    assert n.tolist() == [3, 1, 3]
    with pytest.raises(ValueError, match="draft_probs"):
        S.speculative_sample_mapped(target, probs.float(), drafts, 1.0, 1.0, u, noise)

"""The graph-shaped path (`Engine(..., cuda_graphs=True)`): live rows padded with inert rows to a
power-of-two bucket, fixed shapes, each step's first use rehearsing a capture's warm-up and
rewind. On a CPU it runs eagerly, and must give the tokens and counts of the unpadded path, for
greedy, sampled, long-form and mapped-vocabulary drafts, with rows joining and leaving."""
from __future__ import annotations

import pytest
import torch

from specwhisper import Engine
from specwhisper.engine.runner import bucket_size
from test_speculative import perturbed

MAX_NEW = 16


@pytest.fixture(scope="module")
def target(ckpt_dir):
    return ckpt_dir("graphs-target", vocab_size=51865, d_model=64, heads=4, seed=31)


@pytest.fixture(scope="module")
def drafts(target, english, tmp_path_factory):
    return {"noisy": perturbed(target, tmp_path_factory.mktemp("graphs") / "noisy", 0.05, seed=5),
            "english": english}  # another vocabulary: proposals mapped by token string


@pytest.fixture(scope="module")
def mels():
    torch.manual_seed(6)
    return torch.randn(4, 80, 3000)


def run_staggered(engine, mels, **kwargs):
    """Request 0 alone for 3 iterations, then the others (more than the slots: some wait), each
    with its own budget, so rows leave at different times and the batch shrinks and regrows."""
    futures = [engine.submit(mels[0], language="en", max_new_tokens=MAX_NEW, **kwargs)]
    for _ in range(3):
        engine.step()
    futures += [engine.submit(m, language="en", max_new_tokens=MAX_NEW - 4 * i, **kwargs)
                for i, m in enumerate(mels[1:], start=1)]
    engine.run_until(futures)
    return [(f.result().tokens, f.result().stats.drafted, f.result().stats.accepted,
             f.result().stats.target_passes) for f in futures]


def test_bucket_size():
    assert [bucket_size(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


@pytest.mark.parametrize("draft", ["noisy", "english"])
@pytest.mark.parametrize("sampled", [False, True])
def test_padded_path_equals_unpadded(target, drafts, mels, draft, sampled):
    kwargs = dict(num_draft_tokens=3)
    if sampled:
        kwargs.update(temperature=0.8, top_p=0.95, seed=17)
    results, keys = [], None
    for graphs in (False, True):
        engine = Engine(target, drafts[draft], max_batch=3, background=False, cuda_graphs=graphs)
        results.append(run_staggered(engine, mels, **kwargs))
        if graphs:
            keys = engine.runner.graphs._seen
            assert engine.runner.state.tokens.shape[0] == 4  # 3 slots padded to a bucket of 4
    assert results[0] == results[1]
    assert all(r[1] > 0 for r in results[0])  # every row drafted
    if draft == "noisy":  # (the random English-only draft is almost never right)
        assert any(r[2] > 0 for r in results[0])
    buckets = {key[1] for key in keys}
    assert {1, 4} <= buckets  # one row alone, then 3 rows padded to 4
    assert {key[0] for key in keys} == {"draft", "verify"}


def test_adaptive_k_and_target_only_padded(target, drafts, mels):
    """Adaptive k (plain steps between drafting ones: catch-up before the padded draft) and no
    draft at all; greedy."""
    for draft in (drafts["noisy"], None):
        out = [Engine(target, draft, max_batch=3, background=False, cuda_graphs=g).transcribe(
            mels[:3], language="en", max_new_tokens=MAX_NEW) for g in (False, True)]
        assert [o.tokens for o in out[0]] == [o.tokens for o in out[1]]


def test_longform_padded(target, drafts):
    """Long-form windows (timestamp rules, temperature fallback, previous-text prompts) with a
    draft: the padded path gives the same segments."""
    torch.manual_seed(2)
    audio = (0.3 * torch.randn(16000 * 34)).numpy()
    kw = dict(language="en", temperature=(0.0, 1.0), seed=3, num_draft_tokens=2)
    a, b = (Engine(target, drafts["noisy"], background=False, cuda_graphs=g).transcribe(audio, **kw)
            for g in (False, True))
    assert len(a.segments) > 1 and any(s.temperature > 0 for s in a.segments)  # a retried window
    assert [(s.tokens, s.temperature, s.start, s.end, s.avg_logprob) for s in a.segments] == \
        [(s.tokens, s.temperature, s.start, s.end, s.avg_logprob) for s in b.segments]


def test_cuda_graphs_option_is_checked(target):
    with pytest.raises(TypeError, match="cuda_graphs"):
        Engine(target, cuda_graphs="yes")
    assert Engine(target).runner.graphs is None  # off on a CPU unless asked for

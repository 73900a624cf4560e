"""The engine core: continuous batching gives every request exactly the tokens it gets alone.

Requests join a running batch mid-decode and leave early (slots compacted); concurrent callers are
decoded together; drafts with their own limits stand aside; the static-shape path equals the
trimmed one; rows run to the end of the 448-position cache."""
from __future__ import annotations

import threading

import pytest
import torch

from specwhisper import Engine
from test_speculative import perturbed

MAX_NEW = 30


@pytest.fixture(scope="module")
def target(ckpt_dir):
    return ckpt_dir("sched-target", vocab_size=51865, d_model=64, heads=4, seed=21)


@pytest.fixture(scope="module")
def noisy(target, tmp_path_factory):
    return perturbed(target, tmp_path_factory.mktemp("sched") / "noisy", 0.05, seed=3)


@pytest.fixture(scope="module")
def mels():
    torch.manual_seed(5)
    return torch.randn(6, 80, 3000)


@pytest.fixture(scope="module")
def alone(target, mels):
    """Each request decoded alone, target only: the reference."""
    engine = Engine(target, max_batch=1)
    return [engine.transcribe(m, language="en", max_new_tokens=MAX_NEW + 7 * i).tokens for i, m in enumerate(mels)]


def staggered(engine, mels, joins_after: int, **kwargs):
    """Submit request 0, run `joins_after` iterations, then submit the rest; run to the end."""
    futures = [engine.submit(mels[0], language="en", max_new_tokens=MAX_NEW, **kwargs)]
    for _ in range(joins_after):
        engine.step()
    assert len(engine.scheduler.running) == 1 and not futures[0].done()
    futures += [engine.submit(m, language="en", max_new_tokens=MAX_NEW + 7 * i, **kwargs)
                for i, m in enumerate(mels[1:], start=1)]
    engine.run_until(futures)
    return [f.result().tokens for f in futures]


@pytest.mark.parametrize("draft", [None, "self", "noisy", "english"])
def test_join_mid_decode_and_leave_early(draft, target, noisy, english, mels, alone):
    """Request 0 runs alone for a while, five more join (one batch of 4 slots: two wait for a
    free slot), rows of different budgets leave at different times; every request gets its
    tokens from decoding alone."""
    folder = {None: None, "self": target, "noisy": noisy, "english": english}[draft]
    engine = Engine(target, folder, max_batch=4, background=False)
    kwargs = {} if draft is None else {"num_draft_tokens": 3}
    assert staggered(engine, mels, joins_after=5, **kwargs) == alone
    assert engine.peak_batch == 4


def test_adaptive_k_in_a_changing_batch(target, noisy, mels, alone):
    engine = Engine(target, noisy, max_batch=3, background=False)
    assert staggered(engine, mels, joins_after=2) == alone


def test_concurrent_callers_are_batched(target, noisy, mels, alone):
    """12 threads call transcribe at once: results equal sequential calls, and the engine
    decoded several of them together."""
    engine = Engine(target, noisy, max_batch=8)
    results = [None] * 12
    barrier = threading.Barrier(12)

    def call(i):
        barrier.wait()
        m = i % len(mels)
        results[i] = engine.transcribe(mels[m], language="en", max_new_tokens=MAX_NEW + 7 * m,
                                       num_draft_tokens=2).tokens

    threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == [alone[i % len(mels)] for i in range(12)]
    assert engine.peak_batch >= 2
    assert engine.host_syncs == engine.iterations  # one host read per iteration


def test_mixed_greedy_and_sampled_rows(target, mels, alone):
    """A greedy request's tokens do not depend on sampled neighbours, and a seeded sampled
    request's tokens do not depend on its neighbours either."""
    engine = Engine(target, target, max_batch=4, background=False)
    sampled_alone = engine.transcribe(mels[1], language="en", max_new_tokens=MAX_NEW, temperature=1.0,
                                      seed=7, num_draft_tokens=2).tokens
    futures = [engine.submit(mels[0], language="en", max_new_tokens=MAX_NEW, num_draft_tokens=3),
               engine.submit(mels[1], language="en", max_new_tokens=MAX_NEW, temperature=1.0, seed=7,
                             num_draft_tokens=4),
               engine.submit(mels[2], language="en", max_new_tokens=MAX_NEW + 14, temperature=0.7, seed=1)]
    engine.run_until(futures)
    assert futures[0].result().tokens == alone[0]
    assert futures[1].result().tokens == sampled_alone


def test_english_target_with_multilingual_draft(english, multilingual):
    """The draft gets its own prompt with the language passed explicitly (an English-only
    target has no language token to parse back)."""
    torch.manual_seed(2)
    mels = torch.randn(2, 80, 3000)
    plain = Engine(english).transcribe(mels, max_new_tokens=20)
    spec = Engine(english, multilingual).transcribe(mels, max_new_tokens=20, num_draft_tokens=3)
    assert [o.tokens for o in spec] == [o.tokens for o in plain]
    assert all(o.stats.draft_passes > 0 and o.stats.draft_skipped is None for o in spec)


def test_draft_stands_aside_for_what_it_cannot_do(multilingual, english):
    """An English-only draft cannot translate or follow German: the target decodes alone and the
    stats say why; the request is never refused because of the draft."""
    torch.manual_seed(3)
    mel = torch.randn(80, 3000)
    engine = Engine(multilingual, english)
    for kwargs in (dict(task="translate", language="en"), dict(language="de")):
        out = engine.transcribe(mel, max_new_tokens=12, num_draft_tokens=3, **kwargs)
        assert out.tokens == Engine(multilingual).transcribe(mel, max_new_tokens=12, **kwargs).tokens
        assert out.stats.draft_skipped and out.stats.drafted == 0 and out.stats.draft_passes == 0


def test_a_row_without_draft_beside_drafting_rows(multilingual, english):
    """One batch: a German row (the English-only draft stands aside) decoded beside English rows
    that draft, admitted together and one after the other: every row gets its target-only
    tokens, and only the English rows draft."""
    torch.manual_seed(4)
    mels = torch.randn(3, 80, 3000)
    plain = Engine(multilingual)
    langs = ["de", "en", "en"]
    alone = [plain.transcribe(m, language=lang, max_new_tokens=20).tokens for m, lang in zip(mels, langs)]
    engine = Engine(multilingual, english, background=False)
    futures = [engine.submit(m, language=lang, max_new_tokens=20, num_draft_tokens=3) for m, lang in zip(mels, langs)]
    engine.step()  # all three admitted together
    late = engine.submit(mels[1], language="en", max_new_tokens=20, num_draft_tokens=2)  # joins mid-run
    engine.run_until(futures + [late])
    outs = [f.result() for f in futures + [late]]
    assert [o.tokens for o in outs] == alone + [alone[1]]
    assert outs[0].stats.draft_skipped and outs[0].stats.draft_passes == 0
    assert all(o.stats.draft_passes > 0 and o.stats.draft_skipped is None for o in outs[1:])


def test_static_shapes_equal_trimmed(target, noisy, mels, alone):
    """Attention over the whole 449-slot cache with a mask == attention trimmed to the longest row."""
    engine = Engine(target, noisy, max_batch=4, background=False)
    engine.runner.trim = False
    assert staggered(engine, mels[:4], joins_after=3, num_draft_tokens=4) == alone[:4]


def test_rows_run_to_the_end_of_the_cache(target, noisy):
    """Rows that fill all 448 positions, drafted by a noisy draft at k = 8: exact, and the
    real cache slots hold what target-only decoding wrote (the scratch slot absorbs the rest)."""
    torch.manual_seed(9)
    mels = torch.randn(2, 80, 3000)
    plain = Engine(target, max_batch=2)
    spec = Engine(target, noisy, max_batch=2)
    kwargs = dict(language="en", max_new_tokens=444)
    a = plain.transcribe(mels, **kwargs)
    b = spec.transcribe(mels, num_draft_tokens=8, **kwargs)
    assert [o.tokens for o in a] == [o.tokens for o in b]
    ends = [len(o.tokens) + 4 for o in a]  # prompt + generated (EOT not counted)
    for row, end in enumerate(ends):
        # the last token is never fed; everything before it sits at its own position
        torch.testing.assert_close(spec.runner.cache.self_k[:, row, :, :end - 1],
                                   plain.runner.cache.self_k[:, row, :, :end - 1], atol=1e-4, rtol=1e-4)
    assert any(e == 448 for e in ends) or all(len(o.tokens) < 444 for o in a)


def test_cancel_frees_the_slot(target, mels):
    engine = Engine(target, max_batch=1, background=False)
    first = engine.submit(mels[0], language="en", max_new_tokens=200)
    engine.step()
    assert not first.cancel() and first.abandoned  # already decoding: abandoned, slot freed next
    second = engine.submit(mels[1], language="en", max_new_tokens=5)
    engine.run_until([second])
    assert len(second.result().tokens) <= 5
    with pytest.raises(Exception):
        first.result(timeout=0)


def test_a_cancelled_longform_request_is_never_admitted_again(target):
    """Cancelled between two of its windows (its next window queued), a long-form request is not
    admitted again: no encoder pass, no slot; its Future fails with CancelledError at once."""
    from concurrent.futures import CancelledError

    import numpy as np

    engine = Engine(target, background=False)
    audio = (0.1 * np.random.default_rng(0).standard_normal(16000 * 70)).astype(np.float32)  # 3 windows
    future = engine.submit(audio, language="en", temperature=0.0, max_new_tokens=4)
    encoded, encode = [], engine.runner.encode
    engine.runner.encode = lambda mel: (encoded.append(mel.shape[0]), encode(mel))[1]
    for _ in range(200):  # the first window decodes (4 tokens at most) and its successor queues
        engine.step()
        if encoded and not engine.scheduler.running and engine.scheduler.waiting:
            break
    assert encoded == [1] and engine.scheduler.waiting[0].window is not None and not future.done()
    assert not future.cancel()  # running: abandoned, not cancelled outright
    engine.step()
    assert encoded == [1] and not engine.scheduler.has_work()
    with pytest.raises(CancelledError):
        future.result(timeout=0)


def mixed_requests(engine, mels, prompt_words: str):
    """Six windows submitted at once, before any iteration: one-window greedy and sampled rows
    (prompts of 4 tokens), long-form rows with timestamps, greedy and sampled (3 tokens), one
    with an initial prompt (longer)."""
    return [engine.submit(mels[0], language="en", max_new_tokens=MAX_NEW),
            engine.submit(mels[1], language="en", max_new_tokens=MAX_NEW, temperature=0.8, seed=3),
            engine.submit(mels[2], language="en", timestamps=True, temperature=(0.0,), max_new_tokens=MAX_NEW),
            engine.submit(mels[3], language="en", max_new_tokens=MAX_NEW + 7),
            engine.submit(mels[4], language="en", timestamps=True, temperature=(0.0,), max_new_tokens=MAX_NEW,
                          initial_prompt=prompt_words),
            engine.submit(mels[5], language="en", timestamps=True, temperature=(0.6,), seed=11,
                          max_new_tokens=MAX_NEW)]


def outcome(result):
    """Everything a window's admission decides, bit for bit: tokens, log-probabilities, no-speech."""
    return result.tokens, [(s.tokens, s.avg_logprob, s.no_speech_prob, s.temperature) for s in result.segments]


@pytest.mark.parametrize("draft", [None, "noisy"])
def test_windows_admitted_together_get_the_bits_they_get_alone(draft, target, noisy, mels, admitted, monkeypatch):
    """Windows whose prompts are one length share one prefill (`Runner.admit`): greedy, sampled and
    long-form rows admitted together get the tokens, log-probabilities and no-speech probabilities
    they get admitted one at a time; a group whose admission raises is admitted again one window at
    a time."""
    from specwhisper.engine.runner import Runner

    folder = {None: None, "noisy": noisy}[draft]
    sizes, admit = admitted, Runner.admit
    got = {}
    for together in (False, True):
        monkeypatch.setattr(Runner, "admit_together", together)
        engine = Engine(target, folder, max_batch=8, background=False)
        assert engine.runner.admits_together() == together
        sizes.clear()
        futures = mixed_requests(engine, mels, "one two three four five")
        engine.run_until(futures)
        got[together] = [outcome(f.result()) for f in futures]
        # the first admission: one-window rows (4-token prompts) x 3, long-form rows x 2, the
        # initial prompt's alone
        assert sizes[:3] == ([3, 2, 1] if together else [1, 1, 1]), sizes
    assert got[True] == got[False]

    def group_fails(self, s, specs, *args):
        if len(specs) > 1:
            raise MemoryError("injected: a group too large")
        return admit(self, s, specs, *args)

    monkeypatch.setattr(Runner, "admit", group_fails)
    engine = Engine(target, folder, max_batch=8, background=False)
    futures = mixed_requests(engine, mels, "one two three four five")
    engine.run_until(futures)
    assert [outcome(f.result()) for f in futures] == got[False]


def test_rows_admitted_together_need_row_independent_ops(target, mels, alone, monkeypatch):
    """Where the decoder's rows are not computed independently of each other (torch's ops), windows
    are admitted one at a time, and `Runner.admit` refuses a group outright."""
    from specwhisper.engine.runner import Runner

    seen = []
    admit = Runner.admit

    def recorded(self, s, specs, *args):
        seen.append(specs)
        return admit(self, s, specs, *args)

    monkeypatch.setattr(Runner, "admit", recorded)
    engine = Engine(target, max_batch=4, background=False)
    monkeypatch.setattr(type(engine.runner.target.model.decoder), "rows_independent", lambda self: False)
    assert not engine.runner.admits_together()
    futures = [engine.submit(m, language="en", max_new_tokens=MAX_NEW + 7 * i) for i, m in enumerate(mels[:3])]
    engine.run_until(futures)
    assert [f.result().tokens for f in futures] == alone[:3]
    assert [len(specs) for specs in seen] == [1, 1, 1]
    features = engine.runner.encode_windows([mels[0]])[0]
    with pytest.raises(ValueError, match="one window at a time"):
        admit(engine.runner, 0, seen[0] + seen[1], [features, features], [None, None])

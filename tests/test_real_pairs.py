"""Every combination of the real fetched pairs decodes (or, only where the target itself cannot
serve the request, refuses with a clear ValueError), and the engine core's failure modes are
covered on real models: a row moved during compaction keeps its pending draft, and a request whose
admission raises ends with that exception while the engine goes on serving.

Targets and drafts are the real checkpoints (base: multilingual BPE, 51865 ids; tiny.en: GPT-2 BPE,
51864 ids, its timestamp tokens not spelled in tokenizer.json; base-2l: base's bundled distilled
draft, sharing its encoder): synthetic vocabularies alone have hidden construction crashes before."""
from __future__ import annotations

import itertools

import pytest
import torch

from conftest import real_folder
from specwhisper import Engine, load_audio, log_mel_spectrogram
from specwhisper.samples import sample_paths

pytestmark = pytest.mark.real

MAX_NEW = 6  # enough tokens to draft, verify and accept a few times, cheap on every CPU
OPTIONS = {
    "greedy": dict(language="en"),
    "sampled": dict(language="en", temperature=0.7, seed=3),
    "translate": dict(language="de", task="translate"),
    "detect": dict(language=None),
    "one-token": dict(language="en", max_new_tokens=1),
}


@pytest.fixture(scope="module")
def mels():
    return torch.stack([log_mel_spectrogram(load_audio(p), n_mels=80) for p in sample_paths()[:2]])


@pytest.fixture(scope="module")
def references():
    return {}  # (target, dtype, option) -> the target-only transcriptions of both windows


def other(name):
    return {"base": "tiny.en", "tiny.en": "base"}[name]


def memoize_encoder(encoder) -> None:
    """Each window's encoder output computed once per model: these tests decode the same two
    windows dozens of times, and what they check is decoding (the encoder is tested elsewhere)."""
    forward, outputs = encoder.forward, {}

    def cached(mel):
        key = (tuple(mel.shape), mel.dtype, hash(mel.float().cpu().numpy().tobytes()))
        if key not in outputs:
            outputs[key] = forward(mel)
        return outputs[key]

    encoder.forward = cached


@pytest.fixture(scope="module")
def engines():
    made = {}

    def get(target, draft, dtype):
        key = (target, draft, dtype)
        if key not in made:
            folder = real_folder(target)
            draft_folder = {None: None, "self": folder}.get(draft) or (real_folder(draft) if draft else None)
            engine = Engine(folder, draft=draft_folder, dtype=dtype, max_batch=2, background=False)
            if draft is not None and dtype == torch.float32:
                engine.warm_up()  # what follows decodes as an engine never warmed up does
            memoize_encoder(engine.target.model.encoder)
            if engine.drafter is not None:
                memoize_encoder(engine.drafter.draft.model.encoder)
            made[key] = engine
        return made[key]

    return get


@pytest.mark.parametrize("target,draft,dtype", [
    *((t, d, dt) for t, d, dt in itertools.product(["base", "tiny.en"], ["other", "self", None],
                                                   [torch.float32, torch.bfloat16])),
    *(("base", "base-2l", dt) for dt in (torch.float32, torch.bfloat16))])
def test_every_combination_decodes_or_refuses_clearly(target, draft, dtype, engines, mels, references):
    """Each option single and batched: the same tokens as the target alone (greedy; sampled with
    the same seed), or the target's own clear refusal (translation by an English-only target)."""
    draft_name = other(target) if draft == "other" else draft
    engine = engines(target, draft_name, dtype)
    alone = engines(target, None, dtype)
    english_only = target == "tiny.en"
    for name, opts in OPTIONS.items():
        opts = {"max_new_tokens": MAX_NEW, **opts}
        if english_only and name == "translate":
            with pytest.raises(ValueError, match="translat|English|language"):
                engine.transcribe(mels[0], **opts)
            continue
        single = engine.transcribe(mels[0], **opts)
        batched = engine.transcribe(mels, **opts)
        assert len(batched) == 2
        assert single.tokens == batched[0].tokens, (name, target, draft_name)  # batch invariance
        if draft_name is None:
            assert single.stats.drafted == 0
            continue
        reference = references.get((target, dtype, name))
        if reference is None:
            reference = references[target, dtype, name] = alone.transcribe(mels, **opts)
        assert [b.tokens for b in batched] == [r.tokens for r in reference], (name, target, draft_name)
        assert single.tokens == reference[0].tokens, (name, target, draft_name)


def test_english_only_target_with_multilingual_draft_maps_every_token():
    """tiny.en drafted by base: the English-only tokenizer.json lists 50364 tokens, the model has
    51864 (its timestamps are unspelled); every target id has a row in the draft tables, and the
    timestamp tokens map to base's own timestamps by string."""
    engine = Engine(real_folder("tiny.en"), draft=real_folder("base"), background=False)
    d = engine.drafter
    assert d.target_to_draft.shape[0] == engine.target.config.vocab_size == 51864
    t_ts, d_ts = engine.target.tokenizer.timestamp_begin, d.draft.tokenizer.timestamp_begin
    assert d.target_to_draft_len[t_ts] == 1 and int(d.target_to_draft[t_ts, 0]) == d_ts
    assert int(d.draft_to_target[d_ts + 1500]) == t_ts + 1500


def test_moved_row_keeps_its_pending_draft(mels):
    """base drafted by tiny.en with the adaptive k, which starts with a plain step: the short
    request finishes in that step, the long one is moved into its slot before its draft started.
    It must still draft (and decode exactly the target's tokens)."""
    target = real_folder("base")
    engine = Engine(target, draft=real_folder("tiny.en"), max_batch=2, background=False)
    # costs as on a machine where this draft pays (whether it pays on this CPU is not the question)
    engine.drafter.length.calibrate(plain_seconds=0.01, verify_ratio=[1.0] * 10, cost_ratio=0.1, setup_seconds=0.0)
    short = engine.submit(mels[0], language="en", max_new_tokens=2)
    long = engine.submit(mels[1], language="en", max_new_tokens=24)
    engine.step()  # admission, then the adaptive k's plain step: `short` ends, `long` moves to slot 0
    assert short.done() and len(engine.scheduler.running) == 1
    assert engine.runner.hosts[0].draft_pending is not None
    engine.run_until([long])
    assert long.result().stats.draft_passes > 0
    expected = Engine(target, background=False).transcribe(mels[1], language="en", max_new_tokens=24)
    assert long.result().tokens == expected.tokens


@pytest.mark.parametrize("stage", ["encode", "detect_language", "admit"])
def test_failed_admission_ends_its_requests_and_the_engine_serves_on(stage, mels, monkeypatch):
    """An admission step that raises (out of memory, a bad window) ends the requests it was for
    with that exception; a request already running is unaffected; the next request decodes."""
    engine = Engine(real_folder("base"), draft=real_folder("tiny.en"), max_batch=4, background=False)
    runner = engine.runner
    first = engine.submit(mels[0], language="en", max_new_tokens=MAX_NEW)
    engine.step()
    assert len(engine.scheduler.running) == 1
    real = getattr(runner, stage)

    def broken(*args, **kwargs):
        raise MemoryError(f"injected failure in {stage}")

    monkeypatch.setattr(runner, stage, broken)
    failing = [engine.submit(m, language=None if stage == "detect_language" else "en", max_new_tokens=MAX_NEW)
               for m in mels]
    for _ in range(100):  # bounded: a stranded request would make run_until spin forever
        if all(f.done() for f in [first] + failing):
            break
        engine.step()
    assert all(f.done() for f in [first] + failing)
    monkeypatch.undo()
    assert getattr(runner, stage) == real
    for f in failing:
        with pytest.raises(MemoryError, match=stage):
            f.result(timeout=0)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    alone = Engine(real_folder("base"), background=False)
    assert first.result().tokens == alone.transcribe(mels[0], language="en", max_new_tokens=MAX_NEW).tokens
    later = engine.submit(mels[1], language="en", max_new_tokens=MAX_NEW)
    engine.run_until([later])
    assert later.result().tokens == alone.transcribe(mels[1], language="en", max_new_tokens=MAX_NEW).tokens


@pytest.mark.parametrize("draft", ["base-2l", "tiny.en"])
def test_fused_greedy_draft_steps_propose_what_the_loop_proposes(draft, engines, mels, monkeypatch):
    """`cpu_ops.draft_propose` (the uncached tokens fed, k draft steps with the 2-bit (base-2l) or
    4-bit (tiny.en) head, the slot state updated, in one C++ call) against `DraftSide.propose`'s
    Python form: every iteration's proposals, draft steps and draft state equal, single and
    batched, k = 1, 3 and 4, adaptive rows under a cap of 5 that stop at a small lead
    (`DraftSide.stop_margin`; some iterations stop early), and an adaptive row beside one fixed at
    k = 5 (which never stops) (and so the same tokens, acceptance and draft passes)."""
    from specwhisper.backends import cpu_ops
    from specwhisper.engine.drafting import DraftSide
    from specwhisper.engine.speculation import Speculation

    engine = engines("base", draft, torch.float32)
    d = engine.drafter
    with torch.inference_mode():
        if not d.greedy_fused():
            pytest.skip("no C++ decode ops here: the loop is the only path")
    seen, calls = {True: [], False: []}, {True: 0, False: 0}
    propose, fused_op = DraftSide.propose, cpu_ops.draft_propose
    choose_k = Speculation.choose_k

    def recorded(self, B, k, *args, **kwargs):
        steps = propose(self, B, k, *args, **kwargs)
        st = self.state  # (raw's columns past the steps are stale from earlier iterations, never read)
        seen[d.fused_greedy].append([torch.tensor([k, steps])] + [t.clone() for t in (
            st.proposals[:B, :k], st.raw[:B, :steps], st.dcached[:B], st.dn[:B], st.draft_passes[:B])])
        return steps

    def counted(*args, **kwargs):
        calls[d.fused_greedy] += 1
        return fused_op(*args, **kwargs)

    monkeypatch.setattr(DraftSide, "propose", recorded)
    monkeypatch.setattr(cpu_ops, "draft_propose", counted)
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(d, "fused_greedy", fused)
        results[fused] = []
        for k in (1, 3, 4, None, "mixed"):
            # adaptive rows at a cap of 5 every iteration (the estimate's timing-led choices aside);
            # "mixed": a row fixed at k = 5 (it never stops) beside an adaptive one
            monkeypatch.setattr(Speculation, "choose_k", choose_k if k in (1, 3, 4) else lambda self, B: (5, None))
            if k == "mixed":
                mixed_from = len(seen[fused])
                futures = [engine.submit(m, language="en", num_draft_tokens=n, max_new_tokens=20)
                           for m, n in zip(mels, (5, None))]
                engine.run_until(futures)
                # then an adaptive row beside one in French: tiny.en (English-only) stands aside for
                # it, and that row, its draft off, does not keep the draft steps going
                aside_from = len(seen[fused])
                futures += [engine.submit(m, language=lang, max_new_tokens=20)
                            for m, lang in zip(mels, ("en", "fr"))]
                engine.run_until(futures[2:])
                out = [f.result() for f in futures]
            else:
                for x in (mels[0], mels):
                    out = engine.transcribe(x, language="en", num_draft_tokens=k, max_new_tokens=20)
                    out = out if isinstance(out, list) else [out]
            results[fused].append([(r.tokens, r.stats.accepted, r.stats.drafted, r.stats.draft_passes) for r in out])
    assert calls[True] == len(seen[True]) > 10 and calls[False] == 0
    assert len(seen[True]) == len(seen[False])
    bad = [(i, j, a[j].tolist(), b[j].tolist()) for i, (a, b) in enumerate(zip(seen[True], seen[False])) for j in range(len(a)) if not torch.equal(a[j], b[j])]
    assert not bad, bad[:4]
    assert results[True] == results[False]
    steps = [(int(x[0][0]), int(x[0][1])) for x in seen[True]]
    assert any(s < k for k, s in steps if k == 5) and all(s == k for k, s in steps if k < 5)  # only adaptive rows stop
    # beside an adaptive row, the fixed row keeps the draft going to its k
    mixed = [x for x in seen[True][mixed_from:aside_from] if x[1].shape[0] == 2]
    assert mixed and all(int(x[0][1]) == 5 for x in mixed)
    aside = [int(x[0][1]) for x in seen[True][aside_from:] if x[1].shape[0] == 2]
    if draft == "tiny.en":  # the French row's draft is off: the English row's stops end the steps
        assert results[True][-1][-1][2] == 0 and any(s < 5 for s in aside)


@pytest.mark.parametrize("draft", ["base-2l", "tiny.en"])
def test_sampled_adaptive_rows_stop_at_a_small_race_lead(draft, engines, mels, monkeypatch):
    """Sampled rows of an adaptive k stop drafting after a proposal whose race lead is small
    (`sampling.race_leads`, `DraftSide.stop_margin`): under a cap of 5 some iterations stop early
    (none with the margin at 0), and every row's tokens are target-only's, single and batched
    beside a greedy row (whose lead is then its logits' difference)."""
    from specwhisper.engine.drafting import DraftSide
    from specwhisper.engine.speculation import Speculation

    engine, alone = engines("base", draft, torch.float32), engines("base", None, torch.float32)
    steps = []
    propose = DraftSide.propose

    def recorded(self, B, k, *args, **kwargs):
        steps.append((k, propose(self, B, k, *args, **kwargs)))
        return steps[-1][1]

    sampled = dict(language="en", temperature=0.7, seed=3, max_new_tokens=16)
    want = alone.transcribe(mels, **sampled)
    greedy_want = alone.transcribe(mels[1], language="en", max_new_tokens=16)
    monkeypatch.setattr(DraftSide, "propose", recorded)
    monkeypatch.setattr(Speculation, "choose_k", lambda self, B: (5, None))  # the cap, whatever the estimate
    runs = {}
    for margin in (DraftSide.STOP_MARGIN, 0.0):
        monkeypatch.setattr(engine.runner.draft_side, "STOP_MARGIN", margin)
        steps.clear()
        assert engine.transcribe(mels[0], **sampled).tokens == want[0].tokens
        if margin:
            assert [r.tokens for r in engine.transcribe(mels, **sampled)] == [r.tokens for r in want]
            futures = [engine.submit(mels[0], **sampled), engine.submit(mels[1], language="en", max_new_tokens=16)]
            engine.run_until(futures)
            assert [f.result().tokens for f in futures] == [want[0].tokens, greedy_want.tokens]
        runs[margin] = list(steps)
    assert runs[0.0] and all(s == k for k, s in runs[0.0])
    assert any(s < k for k, s in runs[DraftSide.STOP_MARGIN])


@pytest.mark.parametrize("target,draft", [("base", None), ("base", "base-2l"), ("base", "tiny.en"), ("tiny.en", "base")])
def test_fused_greedy_verify_passes_keep_what_the_python_form_keeps(target, draft, engines, mels, monkeypatch):
    """`cpu_ops.verify_greedy` (plain greedy rows: the pass, the exact screened argmax and the
    bookkeeping in one C++ call) and `cpu_ops.accept_greedy` (rows under the timestamp rules, whose
    log-probabilities are wanted: the bookkeeping after their choice, the outputs kept) against
    `Runner.verify_step`'s Python form: after every pass the same tokens, counts, kept outputs and
    draft state, single and batched, plain steps and k = 1, 3 (tiny.en drafted by base: spellings
    of several draft tokens), and the same segments and log-probabilities."""
    from specwhisper.backends import cpu_ops
    from specwhisper.engine.runner import Runner

    engine = engines(target, draft, torch.float32)
    runner = engine.runner
    seen = {True: [], False: []}
    calls = {(op, fused): 0 for op in ("verify_greedy", "accept_greedy") for fused in (True, False)}
    verify = Runner.verify_step

    def recorded(self, B, k, modes, *args, **kwargs):
        out = verify(self, B, k, modes, *args, **kwargs)
        st = self.state
        n, P = st.n_tokens[:B].tolist(), st.prompt_len[:B].tolist()
        row = [st.tokens[b, :n[b]].clone() for b in range(B)]
        row += [t[:B].clone() for t in (st.n_tokens, st.done, st.target_passes, st.drafted, st.accepted_total,
                                         st.accepted_now)]
        if modes.keep_hidden:
            row += [st.hidden[b, P[b]:n[b]].clone() for b in range(B)]
        if self.draft_side is not None:
            dn = st.dn[:B].tolist()
            row += [st.dtokens[b, :dn[b]].clone() for b in range(B)] + [st.dn[:B].clone(), st.dcached[:B].clone()]
        seen[self.fused_greedy].append(row)
        return out

    def counted(name):
        op = getattr(cpu_ops, name)

        def run(*args, **kwargs):
            calls[name, runner.fused_greedy] += 1
            return op(*args, **kwargs)
        return run

    monkeypatch.setattr(Runner, "verify_step", recorded)
    for name in ("verify_greedy", "accept_greedy"):
        monkeypatch.setattr(cpu_ops, name, counted(name))
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(runner, "fused_greedy", fused)
        results[fused] = []
        for k in ((None,) if draft is None else (1, 3)):
            for x in (mels[0], mels):
                for opts in (dict(max_new_tokens=20), dict(max_new_tokens=40, timestamps=True, temperature=0.0)):
                    out = engine.transcribe(x, language="en", num_draft_tokens=k, **opts)
                    out = out if isinstance(out, list) else [out]
                    results[fused].append([(r.tokens, r.stats.accepted, r.stats.drafted, r.stats.target_passes,
                                            [(s.tokens, s.avg_logprob) for s in r.segments]) for r in out])
    if not cpu_ops.available():
        assert sum(calls.values()) == 0
        return
    assert calls["verify_greedy", True] > 10 and calls["accept_greedy", True] > 10
    assert calls["verify_greedy", True] + calls["accept_greedy", True] == len(seen[True])
    assert calls["verify_greedy", False] == calls["accept_greedy", False] == 0
    assert len(seen[True]) == len(seen[False])
    bad = [(i, j) for i, (a, b) in enumerate(zip(seen[True], seen[False]))
           for j, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]
    assert not bad, bad[:4]
    assert results[True] == results[False]


def test_an_engine_reads_weights_changed_in_place_from_its_next_window(mels):
    """An engine's iterations read the step's copies of the target's and the draft's weights as
    its windows' starts checked them (`Decoder.layer_params(check=False)`: no version counter read
    each iteration); a change in place reaches the next window: the copies are rebuilt, and its
    tokens are those of an engine that had the changed weights from the start."""
    folder, draft = real_folder("base"), real_folder("base-2l")
    changed, fresh = (Engine(folder, draft=draft, max_batch=2, background=False) for _ in range(2))
    opts = dict(language="en", max_new_tokens=MAX_NEW, num_draft_tokens=3)

    def change(engine):
        with torch.inference_mode(False), torch.no_grad():
            engine.target.model.decoder.layers[-1].fc2.weight.zero_()  # float16 values: a copied tensor
            engine.drafter.draft.model.decoder.layers[0].fc1.bias.mul_(0.5)

    before = changed.transcribe(mels[0], **opts).tokens
    dec, ddec = changed.target.model.decoder, changed.drafter.draft.model.decoder
    stale, dstale = dec.layer_params(False), ddec.layer_params(False)
    change(changed)
    assert dec.layer_params(False) is stale and ddec.layer_params(False) is dstale  # an iteration's read
    after = changed.transcribe(mels[0], **opts).tokens
    assert dec.layer_params(False) is not stale and ddec.layer_params(False) is not dstale
    per = len(stale) // len(dec.layers)
    assert not dec.layer_params(False)[per * (len(dec.layers) - 1) + 16].any()  # fc2's copy: zeros now
    change(fresh)
    assert after == fresh.transcribe(mels[0], **opts).tokens
    assert after != before  # the change matters to the tokens


def test_the_adaptive_k_times_the_passes_beside_its_k_on_a_real_pair(mels):
    """base drafted by base-2l with the adaptive k, held on (`pays`) so the test does not hang on
    this machine's speed: every EXPLORE-th speculative iteration drafts one more or one fewer
    token than the rule's best k, so at least two row counts of the engine's own verify passes
    are timed, and v(r) for r >= 2 is the line fitted to them (nondecreasing, in equal steps where
    above 1); the tokens are target-only's."""
    from specwhisper.engine.draft_length import DraftLength

    class On(DraftLength):
        def pays(self) -> bool:
            return True

    folder, draft = real_folder("base"), real_folder("base-2l")
    plain, engine = Engine(folder, background=False), Engine(folder, draft=draft, background=False)
    rule = engine.drafter.length = On(None)
    drafted, choices = [], []  # the caps of the speculative iterations; (best k, k chosen) per choice
    update, explore = rule.update, rule.explore

    def tracked(k, *args, **kwargs):
        if k:  # (the cap: the k chosen; a draft that stops where unsure runs fewer steps)
            drafted.append(kwargs.get("cap", k))
        return update(k, *args, **kwargs)

    def tracked_explore(k):
        choices.append((k, explore(k)))
        return choices[-1][1]

    rule.update, rule.explore = tracked, tracked_explore
    # rounds over the two windows until the rule has explored twice: where its timings make a long
    # k best (k = 6..8 on a slow-memory phase), a round has fewer speculative iterations
    for _ in range(6):
        for mel in mels:
            assert engine.transcribe(mel, language="en").tokens == plain.transcribe(mel, language="en").tokens
        if len(drafted) > 2 * rule.EXPLORE:
            break
    assert len(drafted) > rule.EXPLORE, drafted
    explored = {k for b, k in choices if abs(k - b) == 1}
    assert explored & set(drafted), (choices, drafted)  # explored, and an explored k ran
    timed = [r for r in range(2, len(rule.row_weight)) if rule.row_weight[r] > rule.LATELY]
    assert len(timed) >= 2, (timed, drafted)
    v = rule.verify_ratio[2:]
    assert all(b >= a >= 1.0 for a, b in zip(v, v[1:])), v
    steps = [b - a for a, b in zip(v, v[1:]) if a > 1.0]  # a line (where above 1: a pass never costs less than a step)
    assert not steps or max(steps) - min(steps) < 1e-9, v


@pytest.mark.parametrize("target,draft", [("base", "tiny.en"), ("tiny.en", "base"), ("base", "base-2l"), ("base", None)])
def test_windows_admitted_together_decode_as_admitted_alone(target, draft, engines, mels, admitted, monkeypatch):
    """Both windows of a batch share one prefill (`Runner.admit`, the C++ ops' rows independent):
    greedy and sampled, one window and long-form with timestamps, the tokens, log-probabilities
    and no-speech probabilities they get admitted one at a time."""
    from specwhisper.engine.runner import Runner

    engine = engines(target, draft, torch.float32)
    assert engine.runner.admits_together()
    sizes = admitted
    got = {}
    for together in (True, False):
        monkeypatch.setattr(Runner, "admit_together", together)
        sizes.clear()
        got[together] = [
            [(r.tokens, [(s.avg_logprob, s.no_speech_prob, s.temperature) for s in r.segments])
             for r in engine.transcribe(list(mels), max_new_tokens=MAX_NEW, **options)]
            for options in (dict(language="en"), dict(language="en", temperature=0.7, seed=3),
                            dict(language="en", timestamps=True, temperature=(0.0,)))]
        assert max(sizes) == (2 if together else 1)
    assert got[True] == got[False]
    assert all(r[0] for options in got[True] for r in options)

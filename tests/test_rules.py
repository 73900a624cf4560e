"""rules.apply_rules against openai-whisper's own LogitFilters (SuppressBlank, SuppressTokens,
ApplyTimestampRules), row by row, on random logits and random token histories."""
from __future__ import annotations

import pytest
import torch
pytest.importorskip("whisper")  # openai-whisper, the reference
from whisper.decoding import ApplyTimestampRules, SuppressBlank, SuppressTokens  # noqa: E402
from whisper.tokenizer import get_tokenizer  # noqa: E402

from specwhisper.backends import cpu_ops
from specwhisper.engine.rules import RuleTables, apply_rules, row_state, rule_mask, rule_mask_reference


_SUPPRESS = {}


def openai_suppress(tok) -> list[int]:
    if id(tok) in _SUPPRESS:
        return _SUPPRESS[id(tok)]
    extra = [tok.transcribe, tok.translate, tok.sot, tok.sot_prev, tok.sot_lm, tok.no_speech]
    return _SUPPRESS.setdefault(id(tok), sorted(set(tok.non_speech_tokens) | set(extra)))


@pytest.fixture(scope="module", params=["multilingual", "english"])
def setup(request):
    multilingual = request.param == "multilingual"
    tok = get_tokenizer(multilingual, num_languages=99, language="en", task="transcribe")
    V = 51865 if multilingual else 51864
    suppress = torch.zeros(V, dtype=torch.bool)
    suppress[openai_suppress(tok)] = True
    blank = torch.zeros(V, dtype=torch.bool)
    blank[tok.encode(" ") + [tok.eot]] = True
    tables = RuleTables(suppress, blank, tok.eot, tok.no_timestamps, tok.timestamp_begin, V)
    return tok, tables


def random_case(gen: torch.Generator, tok, V: int):
    """A token history (mixing text and timestamps, sometimes empty) and logits whose timestamp
    mass is sometimes above, sometimes below the best text token."""
    tb = tok.timestamp_begin
    n = int(torch.randint(0, 12, (), generator=gen)) if torch.rand((), generator=gen) > 0.15 else 0
    history = []
    for _ in range(n):
        if torch.rand((), generator=gen) < 0.4:
            history.append(tb + int(torch.randint(0, 1501, (), generator=gen)))
        else:
            history.append(int(torch.randint(0, tok.eot, (), generator=gen)))
    logits = torch.randn(V, generator=gen) * float(torch.rand((), generator=gen) * 4 + 0.1)
    logits[tb:] += float(torch.randn((), generator=gen) * 4)  # shift the timestamp mass
    max_initial = -1 if torch.rand((), generator=gen) < 0.3 else int(torch.randint(0, 60, (), generator=gen))
    return history, logits, max_initial


def openai_apply(tok, tables, prompt, history, logits, timestamps, max_initial):
    sample_begin = len(prompt)
    tokens = torch.tensor([prompt + history])
    out = logits.clone()[None]
    filters = [SuppressBlank(tok, sample_begin), SuppressTokens(openai_suppress(tok))]
    if timestamps:
        filters.append(ApplyTimestampRules(tok, sample_begin, None if max_initial < 0 else max_initial))
    for f in filters:
        f.apply(out, tokens)
    return out[0]


@pytest.mark.parametrize("timestamps_share", [1.0, 0.5])
def test_apply_rules_equals_openai(setup, timestamps_share):
    tok, tables = setup
    V, tb = tables.vocab_size, tables.timestamp_begin
    gen = torch.Generator().manual_seed(12)
    prompt = list(tok.sot_sequence)
    rows, expected = [], []
    for _ in range(250):
        history, logits, max_initial = random_case(gen, tok, V)
        timestamps = bool(torch.rand((), generator=gen) < timestamps_share)
        rows.append((history, logits, timestamps, max_initial))
        expected.append(openai_apply(tok, tables, prompt if timestamps else prompt + [tok.no_timestamps],
                                     history, logits, timestamps, max_initial))
    states = [row_state(h, tb) for h, *_ in rows]
    col = lambda i: torch.tensor([s[i] for s in states])  # noqa: E731
    logits = torch.stack([r[1] for r in rows])
    got = apply_rules(logits.clone(), tables, at_begin=col(0) == 0,
                      timestamps=torch.tensor([r[2] for r in rows]), n_sampled=col(0), last=col(1),
                      penultimate=col(2), last_timestamp=col(3),
                      max_initial_timestamp=torch.tensor([r[3] for r in rows]))
    expected = torch.stack(expected)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.equal(got, expected)
    # the cases exercised every branch of the timestamp rules
    forced = (torch.isinf(got[:, :tb]).all(dim=1) & ~torch.isinf(got[:, tb:]).all(dim=1)).sum()
    text_only = torch.isinf(got[:, tb:]).all(dim=1).sum()
    assert forced > 10 and text_only > 10 and (torch.isinf(got[:, :tb]).all(1) == False).sum() > 10  # noqa: E712


def test_rule_mask_by_column_ranges_equals_the_reference(setup):
    """`rule_mask` (built by column ranges, or by the C++ op) equals `rule_mask_reference` (one whole-vocabulary term
    per rule) on random states: every mix of begin / timestamps / pair states, timestamps at both
    ends of the range, no initial limit or one past the last timestamp."""
    _, tables = setup
    tb, V = tables.timestamp_begin, tables.vocab_size
    gen = torch.Generator().manual_seed(8)
    N = 600
    pick = lambda *values: torch.tensor(values)[torch.randint(0, len(values), (N,), generator=gen)]  # noqa: E731
    ts = lambda: torch.where(torch.rand(N, generator=gen) < 0.5, pick(tb, tb + 1, V - 2, V - 1),  # noqa: E731
                             torch.randint(tb, V, (N,), generator=gen))
    n_sampled = pick(0, 1, 2, 3, 40)
    last = torch.where(torch.rand(N, generator=gen) < 0.5, ts(), torch.randint(0, tables.eot + 1, (N,), generator=gen))
    penultimate = torch.where(torch.rand(N, generator=gen) < 0.5, ts(), torch.randint(0, tables.eot, (N,), generator=gen))
    last_timestamp = torch.where(torch.rand(N, generator=gen) < 0.3, torch.full((N,), -1), ts())
    state = (n_sampled == 0, torch.rand(N, generator=gen) < 0.7, n_sampled, last, penultimate, last_timestamp,
             pick(-1, 0, 1, 50, 1500, 1501))
    expected = rule_mask_reference(tables, *state)
    with cpu_ops.reference():  # the column ranges in PyTorch
        got = rule_mask(tables, *state)
    with torch.inference_mode():  # one C++ call, where the extension is built
        fast = rule_mask(tables, *state)
    assert torch.equal(got, expected) and torch.equal(fast, expected)
    assert 0 < int(got[:, tb:].all(dim=1).sum()) < N and 0 < int(got[:, :tables.eot].all(dim=1).sum()) < N


def test_rules_follow_a_decoded_sequence(setup):
    """Step through one sequence token by token, the state updated as a runner would."""
    tok, tables = setup
    tb = tables.timestamp_begin
    seq = [tb + 10, 400, 500, tb + 40, tb + 40, 600, tb + 90, tb + 95, 700, tb + 120]
    prompt = list(tok.sot_sequence)
    gen = torch.Generator().manual_seed(3)
    for i in range(len(seq) + 1):
        history = seq[:i]
        logits = torch.randn(tables.vocab_size, generator=gen)
        n, last, pen, last_ts = row_state(history, tb)
        t = lambda x: torch.tensor([x])  # noqa: E731
        got = apply_rules(logits.clone()[None], tables, t(n == 0), t(True), t(n), t(last), t(pen), t(last_ts), t(50))[0]
        assert torch.equal(got, openai_apply(tok, tables, prompt, history, logits, True, 50))


def test_rules_are_rowwise(setup):
    """A row's result does not depend on the other rows of the batch."""
    tok, tables = setup
    gen = torch.Generator().manual_seed(5)
    cases = [random_case(gen, tok, tables.vocab_size) for _ in range(16)]
    states = [row_state(h, tables.timestamp_begin) for h, _, _ in cases]

    def run(idx):
        c = lambda i: torch.tensor([states[j][i] for j in idx])  # noqa: E731
        logits = torch.stack([cases[j][1] for j in idx]).clone()
        return apply_rules(logits, tables, c(0) == 0, torch.ones(len(idx), dtype=torch.bool), c(0), c(1), c(2),
                           c(3), torch.tensor([cases[j][2] for j in idx]))

    whole = run(list(range(16)))
    for j in range(16):
        assert torch.equal(whole[j], run([j])[0])


@pytest.mark.real
def test_tables_from_real_tokenizers():
    """RuleTables.build on our tokenizer.json equals openai's sets (base, tiny.en)."""
    from conftest import real_folder
    from specwhisper.tokenizer import Tokenizer

    for name, multilingual, V in (("base", True, 51865), ("tiny.en", False, 51864)):
        ours = RuleTables.build(Tokenizer.from_folder(real_folder(name), V), V, "cpu")
        tok = get_tokenizer(multilingual, num_languages=99, language="en", task="transcribe")
        assert ours.suppress.nonzero().flatten().tolist() == openai_suppress(tok)
        assert ours.blank.nonzero().flatten().tolist() == sorted(tok.encode(" ") + [tok.eot])
        assert (ours.eot, ours.no_timestamps, ours.timestamp_begin) == (tok.eot, tok.no_timestamps, tok.timestamp_begin)


def test_rule_state_in_one_call_equals_the_tensor_ops(setup):
    """`choosing.rule_state` (one C++ call on a CPU) equals `rule_state_reference` on random slot
    histories mixing text and timestamps, pass positions from the first generated token to past
    the proposals, with and without proposals (-1: none from there on)."""
    from types import SimpleNamespace

    from specwhisper.engine.choosing import Rows, rule_state, rule_state_reference

    _, tables = setup
    tb, V = tables.timestamp_begin, tables.vocab_size
    gen = torch.Generator().manual_seed(5)
    S, L, B, T = 7, 48, 5, 4
    tokens = torch.where(torch.rand(S, L, generator=gen) < 0.4, torch.randint(tb, V, (S, L), generator=gen),
                         torch.randint(0, tables.eot, (S, L), generator=gen))
    prompt_len = torch.randint(1, 6, (S,), generator=gen)
    n_tokens = prompt_len + torch.randint(1, 30, (S,), generator=gen)
    state = SimpleNamespace(tokens=tokens, n_tokens=n_tokens, prompt_len=prompt_len,
                            timestamps=torch.rand(S, generator=gen) < 0.7,
                            max_initial_ts=torch.randint(-1, 60, (S,), generator=gen))
    slots = torch.randperm(S, generator=gen)[:B]
    for k in (0, 3):
        proposed = None if k == 0 else torch.where(torch.rand(B, k, generator=gen) < 0.2, -1,
                                                   torch.randint(0, V, (B, k), generator=gen))
        first = prompt_len[slots][:, None] + torch.arange(T)  # from the first generated token on
        last = n_tokens[slots][:, None] - 1 + torch.arange(T)  # a verify pass's positions
        for predicted in (first, last, torch.zeros(B, T, dtype=torch.long)):
            rows = Rows(state, slots, predicted, proposed)
            expected = rule_state_reference(rows, tables)
            with torch.inference_mode():
                fast = rule_state(rows, tables)
            assert len(fast) == 7 and all(torch.equal(a, b) for a, b in zip(fast, expected)), (k, predicted)
            if predicted is last:  # power: rows with and without a timestamp generated so far
                assert bool((expected[5] >= tb).any()) and bool((expected[5] == -1).any())

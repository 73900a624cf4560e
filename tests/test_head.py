"""The screened int8 head returns exactly the full-precision argmax."""
from __future__ import annotations

import pytest
import torch

from specwhisper.backends import cpu_ops
from specwhisper.model.head import ScreenedHead


@pytest.fixture(autouse=True)
def inference():
    """The C++ decode ops serve inference only (with gradients on, the PyTorch path runs)."""
    with torch.inference_mode():
        yield



@pytest.fixture(params=["avx512", "avx512-bw", "avx2", "avx2-madd", "scalar", "reference"], autouse=True)
def path(request):
    """Every test runs through the C++ op (when built) at each vector level (a level the CPU
    lacks runs the best it has; avx512-bw: AVX-512 without VNNI; avx2-madd: AVX2 without AVX-VNNI,
    where a CPU has it) and through the PyTorch reference."""
    if request.param != "reference" and cpu_ops._ops() is None:
        pytest.skip("C++ decode ops unavailable")
    if request.param == "reference":
        with cpu_ops.reference():
            yield request.param
    elif request.param in ("avx512-bw", "avx2-madd"):
        with cpu_ops.vector_level(2 if request.param == "avx512-bw" else 1), cpu_ops.without_vnni():
            yield request.param
    else:
        with cpu_ops.vector_level({"avx512": 2, "avx2": 1, "scalar": 0}[request.param]):
            yield request.param


def full_argmax(weight, hidden, banned):
    return cpu_ops.linear(hidden, weight, None, torch.float32).masked_fill(banned, -float("inf")).argmax(dim=-1)


def test_matches_full_precision_argmax_on_random_rows():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(51865, 64, generator=gen) * 0.5
    head = ScreenedHead(weight)
    hidden = torch.randn(200, 64, generator=gen) * 3
    banned = torch.zeros(51865, dtype=torch.bool)
    banned[torch.randint(0, 51865, (500,), generator=gen)] = True
    assert torch.equal(head.argmax(hidden, banned), full_argmax(weight, hidden, banned))
    assert torch.equal(head.argmax(hidden), full_argmax(weight, hidden, torch.zeros_like(banned)))
    per_row = torch.rand(200, 51865, generator=gen) < 0.5  # [N, V] bans
    assert torch.equal(head.argmax(hidden, per_row), full_argmax(weight, hidden, per_row))


@pytest.mark.parametrize("K", [64, 512])
def test_bound_is_rigorous(K):
    """|approx - exact| <= c_v * |h| + TINY on random rows, heavy-tailed weights included; and the
    bound is tight enough to matter (within 20x of the largest error seen)."""
    from specwhisper.model.head import TINY

    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(20000, K, generator=gen)
    weight[::7] *= torch.rand(K, generator=gen) ** 4 * 30  # rows with outliers: coarse int8 steps
    head = ScreenedHead(weight)
    hidden = torch.randn(16, K, generator=gen)
    hidden[::3] *= torch.rand(K, generator=gen) ** 6 * 50  # outliers: coarse 16-bit steps for the rest
    hidden[1, 0] = 1e4  # one huge feature: every other one rounds to a few 16-bit steps
    approx = head.approx(hidden)
    exact = cpu_ops.linear(hidden, weight, None, torch.float32)
    bound = hidden.norm(dim=1, keepdim=True) * head.bound + TINY
    err = (approx - exact).abs()
    assert (err <= bound).all()
    assert (bound / err.clamp(min=1e-30)).min() < 20


def test_products_at_the_int32_limit():
    """The 16-bit range R shrinks with K so that 127 · R · K < 2^31: at K = 4096 every product
    at its extreme (q = 127, p = R) sums to 2 147 352 576 without overflowing, and a wrong sign
    anywhere would change the argmax."""
    from specwhisper.model.head import q16_range

    K = 4096
    assert 127 * q16_range(K) * K < 2**31 <= 127 * (q16_range(K) + 1) * K
    weight = torch.full((16, K), 1.0)
    weight[3] = -1.0
    weight[9, : K // 2] = 0.5  # smaller, not the winner
    head = ScreenedHead(weight)
    hidden = torch.stack([torch.ones(K), -torch.ones(K)])
    expected = full_argmax(weight, hidden, torch.zeros(16, dtype=torch.bool))
    assert expected.tolist() == [0, 3]
    assert torch.equal(head.argmax(hidden), expected)


def test_rows_with_nan_or_zero_are_handled():
    """A zero row has every logit 0 (token 0 wins the tie); a row with a NaN keeps no candidate
    (token 0, like the old screen) and does not disturb the other rows."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(100, 64, generator=gen)
    head = ScreenedHead(weight)
    hidden = torch.randn(3, 64, generator=gen)
    hidden[0] = 0.0
    hidden[1, 5] = float("nan")
    out = head.argmax(hidden)
    assert out[0] == 0 and out[1] == 0
    assert out[2] == full_argmax(weight, hidden[2:], torch.zeros(100, dtype=torch.bool))[0]


def test_near_ties_that_int8_cannot_separate():
    """Rows whose logits differ far below int8 resolution: the screen keeps all of them as
    candidates and the full-precision recomputation picks the right one."""
    gen = torch.Generator().manual_seed(1)
    d = 32
    hidden = torch.randn(8, d, generator=gen)
    base = torch.randn(d, generator=gen)
    weight = torch.randn(1000, d, generator=gen) * 0.01
    for row in range(8):
        h = hidden[row] / hidden[row].norm()
        # token 10*row+1 beats 10*row by 1e-5 in logit: invisible in int8
        weight[10 * row] = base + 4 * h
        weight[10 * row + 1] = base + (4 + 1e-5) * h
    head = ScreenedHead(weight)
    expected = full_argmax(weight, hidden, torch.zeros(1000, dtype=torch.bool))
    assert torch.equal(head.argmax(hidden), expected)
    # and the int8 copy alone cannot separate any of the pairs: both stay candidates
    from specwhisper.model.head import TINY

    approx = head.approx(hidden)
    bound = hidden.norm(dim=1, keepdim=True) * head.bound + TINY
    r = torch.arange(8)
    assert ((approx[r, 10 * r + 1] - approx[r, 10 * r]).abs() < bound[r, 10 * r]).all()


def test_banned_winner_is_skipped():
    weight = torch.eye(4, 4)
    head = ScreenedHead(weight)
    hidden = torch.tensor([[0.1, 0.9, 0.5, 0.2]])
    banned = torch.tensor([False, True, False, False])
    assert head.argmax(hidden, banned).tolist() == [2]


def test_subset_head_is_the_argmax_over_its_tokens():
    """The pruned draft head screens its kept rows like the full head: the same argmax as the
    float32 logits over those tokens, bans included."""
    from specwhisper.model.head import SubsetHead

    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(3000, 64, generator=gen)
    keep = torch.cat([torch.arange(0, 1000), torch.tensor([2999])])
    head = SubsetHead(weight, keep)
    assert head.screened is not None
    hidden = torch.randn(40, 64, generator=gen)
    banned = torch.zeros(40, 3000, dtype=torch.bool)
    banned[::3, keep[:500]] = True
    for b in (None, banned, banned[0]):
        logits = hidden @ weight[keep].T
        if b is not None:
            logits = logits.masked_fill(b[..., keep], -float("inf"))
        assert torch.equal(head.argmax(hidden, b), keep[logits.argmax(dim=-1)])


@pytest.mark.parametrize("rows", range(1, 10))
def test_extreme_int8_products_and_every_row_grouping(rows):
    """Weights at the int8 extremes (q = ±127), integer logits with many exact ties, a
    vocabulary that is not a multiple of the block, all-zero rows, and 1..9 rows (every grouping
    of the C++ op's row tiles): the exact argmax, exact ties to the lowest id included."""
    gen = torch.Generator().manual_seed(20 + rows)
    V, K = 1003, 96
    weight = torch.randint(0, 2, (V, K), generator=gen).float() * 2 - 1
    weight[5] = 1.0
    weight[6] = -1.0
    weight[7] = 0.0
    head = ScreenedHead(weight)
    hidden = torch.randint(0, 2, (rows, K), generator=gen).float() * 2 - 1
    hidden[0] = 1.0  # token 5 (and its exact duplicates, if any) wins with K
    if rows > 2:
        hidden[2] = 0.0  # every logit 0: token 0
    if rows > 3:
        hidden[3] = torch.randn(K, generator=gen) * 1e-3
    expected = full_argmax(weight, hidden, torch.zeros(V, dtype=torch.bool))
    assert torch.equal(head.argmax(hidden), expected)
    assert expected[0] == 5


def timestamp_case(V=6000, n_ts=1501, d=64, rows=300, seed=0):
    """A random head whose last `n_ts` ids are timestamps, and rows in random rule states (first
    token, open and closed timestamp pairs, a last timestamp, an initial-timestamp limit), their
    hidden states scaled over a wide range so that the timestamp-forcing rule goes both ways."""
    from specwhisper.engine.rules import RuleTables, rule_mask

    gen = torch.Generator().manual_seed(seed)
    tb = V - n_ts
    eot = tb - 10
    weight = torch.randn(V, d, generator=gen) * 0.5
    weight[tb:] *= 0.6  # timestamps a little less likely one by one, so both outcomes occur
    suppress = torch.zeros(V, dtype=torch.bool)
    suppress[eot + 1:tb - 1] = True  # the special tokens
    blank = torch.zeros(V, dtype=torch.bool)
    blank[[5, eot]] = True
    tables = RuleTables(suppress, blank, eot, tb - 1, tb, V)
    r = lambda lo, hi: torch.randint(lo, hi, (rows,), generator=gen)
    n_sampled = r(0, 6)
    at_begin = n_sampled == 0
    last = torch.where(r(0, 2) == 1, r(tb, V), r(0, eot + 1))
    penultimate = torch.where(r(0, 2) == 1, r(tb, V), r(0, eot + 1))
    last_timestamp = torch.where(n_sampled > 0, r(tb, V), -1)
    max_initial = torch.where(r(0, 2) == 1, r(0, 100), -1)
    state = (at_begin, torch.ones(rows, dtype=torch.bool), n_sampled, last, penultimate, last_timestamp, max_initial)
    banned = rule_mask(tables, *state)
    scale = torch.logspace(-1, 1.3, rows)[:, None]
    hidden = torch.randn(rows, d, generator=gen) * scale
    return weight, tables, state, banned, hidden


def test_timestamp_argmax_is_the_ruled_argmax_of_the_full_logits():
    from specwhisper.engine.rules import apply_rules, forces_timestamp

    weight, tables, state, banned, hidden = timestamp_case()
    head = ScreenedHead(weight)
    tokens, undecided = head.timestamp_argmax(hidden, banned, tables.timestamp_begin)
    logits = cpu_ops.linear(hidden, weight, None, torch.float32)
    expected = apply_rules(logits.clone(), tables, *state).argmax(dim=-1)
    assert torch.equal(tokens[~undecided], expected[~undecided])
    assert int(undecided.sum()) <= 3  # a rounding guard, not a way out
    forced = forces_timestamp(logits.masked_fill(banned, -float("inf")), tables.timestamp_begin)
    # power: both outcomes of the forcing rule, text and timestamp tokens, first and later tokens
    assert 30 < int(forced.sum()) < 270
    tb = tables.timestamp_begin
    masked = logits.masked_fill(banned, -float("inf")).double()
    assert 30 < int((expected >= tb).sum()) < 270
    assert bool((forced & (masked.argmax(dim=1) < tb)).any())  # rows where the forcing rule decides
    # the undecided rows are exactly those within the margin of the rule's threshold
    gap = masked[:, tb:].logsumexp(dim=1) - masked[:, :tb].max(dim=1).values
    assert torch.equal(undecided, gap.abs() < 1e-3)


def test_timestamp_argmax_reads_exact_timestamp_logits_only_where_the_screen_cannot_decide(monkeypatch):
    """The screen's upper bounds decide most rows for the text token without the exact timestamp
    logits; the tokens and undecided rows are those of the exact comparison on every row (the
    PyTorch path, which has no screen bounds, reads the timestamp logits of every row)."""
    import specwhisper.model.head as head_module

    weight, tables, _, banned, hidden = timestamp_case(rows=300, seed=2)
    tb = tables.timestamp_begin
    banned[0] = True  # nothing allowed
    banned[1, :tb] = True  # only timestamps
    banned[2, tb:] = True  # only text
    head = ScreenedHead(weight)
    read = []  # rows whose exact timestamp logits were computed, per call

    def spy(x, w, *args, **kwargs):
        if w.shape[0] == len(weight) - tb:
            read.append(x.shape[0])
        return linear(x, w, *args, **kwargs)

    linear = head_module.cpu_ops.linear
    monkeypatch.setattr(head_module.cpu_ops, "linear", spy)
    tokens, undecided = head.timestamp_argmax(hidden, banned, tb)
    if cpu_ops.active(hidden):  # the C++ screen: its bounds decide some rows, not all
        assert len(read) == 1 and 30 < read[0] < 250, read
    else:
        assert read == [300]
    with cpu_ops.reference():
        every_row = head.timestamp_argmax(hidden, banned, tb)
    assert read[-1] == 300
    assert torch.equal(tokens, every_row[0]) and torch.equal(undecided, every_row[1])
    # the rows the bounds decide are among those the exact comparison gives text tokens, clear of the margin
    logits = cpu_ops.linear(hidden, weight, None, torch.float32).masked_fill(banned, -float("inf")).double()
    gap = logits[:, tb:].logsumexp(dim=1) - logits[:, :tb].max(dim=1).values
    assert int((gap < -1e-3).sum()) >= 300 - read[0]


def test_screened_split_matches_its_reference():
    """`ScreenedHead.split` (one C++ pass) against `split_reference`: the same argmax below the
    split and the same bits of its logit; the upper log-sum-exp from the split on within float64
    rounding of the reference's, and above the exact one. Splits inside and at the edges of the
    8-token blocks; rows with nothing allowed below or above the split, a zero row, a NaN row."""
    weight, tables, _, banned, hidden = timestamp_case(rows=64, seed=4)
    head = ScreenedHead(weight)
    V = len(weight)
    hidden[3] = 0.0
    hidden[4, 7] = float("nan")
    exact = cpu_ops.linear(hidden, weight, None, torch.float32).double()
    for split in (tables.timestamp_begin, 517, 8, 0, V):
        b = banned.clone()
        b[0, :split] = True
        b[1, split:] = True
        arg, best, lse = head.split(hidden, b, split)
        ref_arg, ref_best, ref_lse = head.split_reference(hidden, b, split, bounds=True)
        ok = torch.ones(len(hidden), dtype=torch.bool)
        ok[4] = False  # the NaN row: no argmax to compare, and no bound
        assert torch.equal(arg[ok], ref_arg[ok]) and torch.equal(best[ok], ref_best[ok]), split
        assert bool(lse[4].isnan()) == (split < V) and bool(ref_lse[4].isnan()) == (split < V)
        assert torch.allclose(lse[ok], ref_lse[ok], rtol=1e-12, atol=0, equal_nan=False) or split == V, split
        true_lse = exact.masked_fill(b, -float("inf"))[:, split:].logsumexp(dim=1)
        assert bool((lse[ok] >= true_lse[ok]).all()), split
        if 0 < split < V:
            assert best[0] == -float("inf") and lse[1] == -float("inf")


@pytest.mark.parametrize("rows", range(1, 10))
def test_screen_products_in_every_row_grouping(rows):
    """The C++ screen's integer products for 1..9 rows (every grouping of its row tiles: one or two
    rows alone, groups of up to 6 over each half of a block) are `approx`'s: the upper log-sum-exp
    `split` reads from them equals the reference's within float64 rounding, row by row. The
    argmax alone cannot show a wrong product (the exact recheck repairs it)."""
    weight, _, _, banned, hidden = timestamp_case(rows=rows, seed=30 + rows)
    head = ScreenedHead(weight)
    _, _, lse = head.split(hidden, banned, 8)
    _, _, ref_lse = head.split_reference(hidden, banned, 8, bounds=True)
    assert torch.allclose(lse, ref_lse, rtol=1e-12, atol=0)


def test_timestamp_argmax_margins_and_fully_banned_rows():
    weight, tables, _, banned, hidden = timestamp_case(rows=40, seed=1)
    head = ScreenedHead(weight)
    tb = tables.timestamp_begin
    _, undecided = head.timestamp_argmax(hidden, banned, tb, margin=float("inf"))
    both = ~banned[:, :tb].all(dim=1) & ~banned[:, tb:].all(dim=1)
    assert torch.equal(undecided, both)  # every row with a choice to make is sent to the full logits
    banned[0] = True  # nothing allowed: argmax over all -inf is 0
    banned[1, :tb] = True  # only timestamps
    banned[2, tb:] = True  # only text
    tokens, undecided = head.timestamp_argmax(hidden, banned, tb)
    logits = cpu_ops.linear(hidden, weight, None, torch.float32).masked_fill(banned, -float("inf"))
    assert int(tokens[0]) == 0 and not bool(undecided[0])
    assert int(tokens[1]) == int(logits[1].argmax()) >= tb and not bool(undecided[1])
    assert int(tokens[2]) == int(logits[2].argmax()) < tb and not bool(undecided[2])


@pytest.mark.skipif(not cpu_ops.available(), reason="C++ decode ops unavailable")
@pytest.mark.parametrize("V,K", [(1031, 72), (13, 16), (8, 512)])
def test_the_cpp_int8_copy_is_quantizes_packed_bits(V, K):
    """`ScreenedHead` quantizes and packs in one C++ pass (`cpu_ops.quantize_head`): the packed
    int8 copy, the scales and the bounds are `quantize`'s bits, padded into blocks of 8 rows, at
    the AVX2 and the scalar level (zero rows, a last partial block, rows of very different scales)."""
    from specwhisper.model.head import BLOCK, ScreenedHead, bound_coefficients, quantize

    gen = torch.Generator().manual_seed(V + K)
    weight = torch.randn(V, K, generator=gen) * torch.rand(V, 1, generator=gen) * 10 ** torch.randint(-3, 3, (V, 1), generator=gen)
    weight[[0, V // 2]] = 0.0
    q, s, c = quantize(weight)
    blocks = -(-V // BLOCK)
    padded = torch.zeros(blocks * BLOCK, K, dtype=torch.int8)
    padded[:V] = q
    expected = padded.view(blocks, BLOCK, K // 8, 8).transpose(1, 2)
    for level in (1, 0):
        with cpu_ops.vector_level(level):
            packed = torch.full((blocks, K // 8, BLOCK, 8), 7, dtype=torch.int8)
            scale, bound = torch.empty(V), torch.empty(V)
            cpu_ops.quantize_head(weight, packed, scale, bound, *bound_coefficients(K))
            assert torch.equal(packed, expected) and torch.equal(scale, s) and torch.equal(bound, c)
    head = ScreenedHead(weight)
    assert torch.equal(head.packed, expected) and torch.equal(head.scale, s) and torch.equal(head.bound, c)
    assert torch.equal(head.int8_weights(), q)


def test_quantize_in_row_blocks_gives_the_bits_of_one_pass():
    """`quantize` works `rows` at a time (its float64 temporaries in cache): every block size
    gives the int8 copy, scales and bounds of one pass over all rows, zero rows included."""
    from specwhisper.model.head import quantize

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(1031, 72, generator=gen) * torch.rand(1031, 1, generator=gen)
    weight[[0, 500, 1030]] = 0.0
    whole = quantize(weight, rows=len(weight))
    for rows in (1, 7, 256, 1030):
        blocked = quantize(weight, rows=rows)
        assert all(torch.equal(a, b) for a, b in zip(whole, blocked)), rows
    q, s, c = whole
    assert q.dtype == torch.int8 and s.shape == c.shape == (1031,)
    assert (q[[0, 500, 1030]] == 0).all() and int(q.abs().max()) == 127

"""The drafts' 4-bit and 2-bit heads (`Q4Head`, `Q2Head`): the C++ ops equal its PyTorch reference bit for bit at every
vector level (proposals and their leads over the next candidate), its packing is the documented layout, and its proposals are the exact argmax where
the rounding cannot hide it."""
from __future__ import annotations

import contextlib

import pytest
import torch

from specwhisper.backends import cpu_ops
from specwhisper.model.head import Q2Head, Q4Head, quantize_rows8

needs_ops = pytest.mark.skipif(cpu_ops._ops() is None, reason="C++ decode ops unavailable")
# vector levels (a level the CPU lacks runs the best it has): scalar, AVX2 (with AVX-VNNI where the
# CPU has it), AVX2 without it (maddubs), AVX-512
LEVELS = [0, 1, "1-madd", 2]


@contextlib.contextmanager
def at_level(level):
    with cpu_ops.vector_level(1 if level == "1-madd" else level), \
            (cpu_ops.without_vnni() if level == "1-madd" else contextlib.nullcontext()):
        yield


@pytest.fixture(autouse=True)
def inference():
    with torch.inference_mode():
        yield


def exact_argmax(weight, hidden, banned=None):
    logits = cpu_ops.linear(hidden, weight, None, torch.float32)
    return logits if banned is None else logits.masked_fill(banned, -float("inf"))


@needs_ops
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("V,K,N", [(8, 32, 1), (8, 64, 1), (77, 32, 3), (77, 64, 3), (1001, 64, 5), (1001, 128, 5),
                                   (5003, 384, 2), (4099, 512, 9)])
def test_op_equals_reference(level, V, K, N):
    """Approximations, candidate order (ties to the lower id) and the float32 recheck: the same
    proposals as the reference, with no banned tokens, a shared [V] mask and per-row [N, V] masks,
    at 1, 16 and more candidates than tokens; duplicate rows make exact ties; the 4-bit and (K a
    multiple of 64) the 2-bit copy."""
    gen = torch.Generator().manual_seed(V + K + N)
    weight = torch.randn(V, K, generator=gen) * torch.rand(V, 1, generator=gen)
    weight[5 % V] = weight[3 % V]
    weight[V - 1] = 0.0  # an all-zero row
    hidden = torch.randn(N, K, generator=gen) * 4
    hidden[0] = weight[3 % V] * 10  # the duplicated rows are the best: the lower id wins
    masks = [None, torch.rand(V, generator=gen) < 0.3, torch.rand(N, V, generator=gen) < 0.5]
    for kind in (Q4Head, Q2Head) if K % 64 == 0 else (Q4Head,):  # the 2-bit copy: chunks of 64
        for candidates in (1, 16, V + 3):
            head = kind(weight, candidates)
            for banned in masks:
                got_lead, want_lead = torch.full((N,), -1.0), torch.full((N,), -2.0)
                with at_level(level):
                    got = head.argmax(hidden, banned, got_lead)
                    # the reference with the op's exact logits (`gather_dot`): the same leads, bit for bit
                    assert torch.equal(head.argmax_reference(hidden, banned, want_lead), got)
                with cpu_ops.reference():
                    want = head.argmax(hidden, banned)
                assert torch.equal(got, want), (kind, candidates, banned is None)
                assert torch.equal(got, head.argmax(hidden, banned))  # the leads change nothing
                assert torch.equal(got_lead, want_lead), (kind, candidates, banned is None)
                if candidates == 1:
                    assert torch.isinf(got_lead).all()  # no other candidate: an infinite lead
        head = kind(weight, V + 3)  # every token rechecked: the exact argmax, leading the exact runner-up
        lead = torch.empty(N)
        assert torch.equal(head.argmax(hidden, None, lead), exact_argmax(weight, hidden).argmax(dim=-1))
        top2 = exact_argmax(weight, hidden).topk(2, dim=-1).values
        assert torch.equal(lead, top2[:, 0] - top2[:, 1])  # 0 where two rows tie (row 0, mostly)


def odd_rows_agree(head, level):
    """A head's op against its reference on hidden rows at ±127 (the largest maddubs sums), a zero
    hidden row, rows with a NaN or an infinity, every token banned in one row, and no rows at all."""
    V, K = head.weight.shape
    hidden = torch.stack([torch.full((K,), 5.0), torch.full((K,), -5.0), torch.zeros(K),
                          torch.full((K,), float("nan")), torch.randn(K), torch.randn(K)])
    hidden[5, 3] = float("inf")
    banned = torch.zeros(6, V, dtype=torch.bool)
    banned[4] = True
    got_lead, want_lead = torch.empty(6), torch.empty(6)
    with at_level(level):
        got = head.argmax(hidden, banned, got_lead)
        empty = head.argmax(hidden[:0], None, torch.empty(0))
        head.argmax_reference(hidden, banned, want_lead)  # with the op's exact logits
    with cpu_ops.reference():
        want = head.argmax(hidden, banned)
    assert torch.equal(got, want)
    assert torch.equal(got_lead.isnan(), want_lead.isnan())
    assert torch.equal(got_lead.nan_to_num(), want_lead.nan_to_num()) and got_lead[4] == float("inf")  # all banned
    assert got[4] == 0 and empty.shape == (0,)
    p = quantize_rows8(hidden)
    assert p[:2].abs().max() == 127 and (p[2:4] == 0).all() and (p[5] == 0).all()


@needs_ops
@pytest.mark.parametrize("level", LEVELS)
def test_extreme_products_and_odd_rows(level):
    """Weights at -7 and 7 against the odd rows (`odd_rows_agree`)."""
    V, K = 203, 512
    weight = torch.where(torch.arange(K) % 3 == 0, -1.0, 7 / 8).repeat(V, 1) * torch.linspace(0.5, 2, V)[:, None]
    weight[7, :] = -1.0
    odd_rows_agree(Q4Head(weight, 4), level)


@pytest.mark.parametrize("V", [13, 2 * 1024 + 13])  # one packing chunk, and three (1024 rows each)
def test_packing_is_the_documented_layout(V):
    """packed[block, chunk, row, byte]: q + 8 of feature 32·chunk + byte (low nibble) and of
    feature 32·chunk + 16 + byte (high nibble) of vocabulary row 8·block + row; padding rows
    hold q = 0; q = round(w / s) in -7..7 with s = max|w| / 7."""
    gen = torch.Generator().manual_seed(3)
    K = 64
    weight = torch.randn(V, K, generator=gen)
    weight[V // 2] = 0  # an all-zero row: q = 0
    head = Q4Head(weight)
    blocks = -(-V // 8)
    assert head.packed.shape == (blocks, K // 32, 8, 16) and head.packed.dtype == torch.uint8
    lo = (head.packed & 0x0F).long() - 8
    hi = (head.packed >> 4).long() - 8
    q = torch.cat([lo, hi], dim=-1).transpose(1, 2).reshape(blocks * 8, K)  # [rows, chunk * 32 + feature]
    scale = weight.abs().amax(1, keepdim=True) / 7
    want = (weight / torch.where(scale > 0, scale, 1.0)).round().clamp(-8, 7)
    assert torch.equal(q[:V].float(), want) and (q[V:] == 0).all() and (q[V // 2] == 0).all()
    assert torch.equal(head.int4_weights(), q[:V].to(torch.int8))  # what the references read
    assert q[:V].abs().max() == 7


def test_proposals_match_the_exact_argmax_on_clear_winners():
    """A hidden state near one token's embedding (a confident draft): the proposal is that token
    for all 200 rows, through the C++ op (when built) and the reference alike."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(51865, 64, generator=gen) * 0.5
    ids = torch.randint(0, 51865, (200,), generator=gen)
    hidden = weight[ids] * 3 + torch.randn(200, 64, generator=gen) * 0.3
    want = exact_argmax(weight, hidden).argmax(dim=-1)
    assert torch.equal(want, ids)  # the test's premise
    head = Q4Head(weight)
    assert torch.equal(head.argmax(hidden), want)
    with cpu_ops.reference():
        assert torch.equal(head.argmax(hidden[:20]), want[:20])


@needs_ops
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("V,K,N", [(8, 32, 1), (77, 32, 3), (1001, 64, 5), (5003, 384, 2)])
def test_logits_op_equals_reference(level, V, K, N):
    """A sampled draft's logits: every approximation and the exact logits of the best
    `candidates` (0, 1, 16, more than V), bit for bit against the reference at every level; a
    zero and a non-finite hidden row give zeros (then the exact values of their candidates)."""
    gen = torch.Generator().manual_seed(V * K + N)
    weight = torch.randn(V, K, generator=gen) * torch.rand(V, 1, generator=gen)
    weight[5 % V] = weight[3 % V]
    hidden = torch.randn(N, K, generator=gen) * 3
    if N > 2:
        hidden[1] = 0.0
        hidden[2, 0] = float("inf")
    for candidates in (0, 1, 16, V + 3):
        head = Q4Head(weight, max(candidates, 1))
        head.candidates = candidates  # 0: approximations only
        with at_level(level):
            got = head.logits(hidden)
            want = head.logits_reference(hidden)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), candidates
    exact = exact_argmax(weight, hidden[:1])
    assert torch.equal(got[:1], exact)  # every token rechecked: the exact float32 logits


def test_logits_keep_the_likely_winners_exact_and_the_shape():
    """[B, T, d] in, [B, T, V] out; the best 16 approximations carry their exact logits, so a
    confident row's top tokens (and its argmax) are the exact ones."""
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(4000, 64, generator=gen) * 0.5
    ids = torch.randint(0, 4000, (2, 3), generator=gen)
    hidden = weight[ids] * 3 + torch.randn(2, 3, 64, generator=gen) * 0.3
    out = Q4Head(weight).logits(hidden)
    assert out.shape == (2, 3, 4000)
    exact = exact_argmax(weight, hidden.reshape(6, 64)).view(2, 3, 4000)
    assert torch.equal(out.argmax(-1), ids)
    top = exact.topk(4, dim=-1).indices
    assert torch.equal(out.gather(-1, top), exact.gather(-1, top))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiples of 32"):
        Q4Head(torch.randn(10, 48))
    with pytest.raises(ValueError, match="candidates"):
        Q4Head(torch.randn(10, 32), candidates=0)


# ---------------------------------------------------------------- the 2-bit head (Q2Head)
@needs_ops
@pytest.mark.parametrize("level", LEVELS)
def test_q2_extreme_products_and_odd_rows(level):
    """Every 2-bit level against the odd rows (`odd_rows_agree`)."""
    V, K = 203, 512
    levels = torch.tensor([-1.5, -0.5, 0.5, 1.5])
    # a pattern whose sum does not cancel (exact logits far from rounding noise), and constant rows
    # at the outer levels
    weight = levels[torch.arange(K) % 3 + 1].repeat(V, 1) * torch.linspace(0.5, 2, V)[:, None]
    weight[7, :] = 1.5
    weight[8, :] = -1.5
    head = Q2Head(weight, 4)
    assert set(head.int2_weights().unique().tolist()) == {-3, -1, 1, 3}
    odd_rows_agree(head, level)


@pytest.mark.parametrize("V", [13, 2 * 1024 + 13])
def test_q2_packing_is_the_documented_layout(V):
    """packed[block, chunk, row, byte]: u = q + 1.5 of features 64·chunk + byte + 16·i in bit pairs
    2i..2i+1 of vocabulary row 8·block + row; q the nearest of ±0.5, ±1.5 to w / s, s the row's
    standard deviation (an all-zero row: s = 1); padding rows hold u = 0."""
    gen = torch.Generator().manual_seed(5)
    K = 128
    weight = torch.randn(V, K, generator=gen)
    weight[V // 2] = 0
    head = Q2Head(weight)
    blocks = -(-V // 8)
    assert head.packed.shape == (blocks, K // 64, 8, 16) and head.packed.dtype == torch.uint8
    u = torch.cat([(head.packed >> (2 * i)) & 3 for i in range(4)], dim=-1)  # [blocks, chunk, row, 64]
    u = u.transpose(1, 2).reshape(blocks * 8, K).long()
    s = weight.std(1, keepdim=True)
    s = torch.where(s > 0, s, 1.0)
    q = (u[:V].float() - 1.5) * s
    nearest = (weight[:, :, None] - torch.tensor([-1.5, -0.5, 0.5, 1.5]) * s[:, :, None]).abs().argmin(-1)
    r = weight / s
    tie = (r == r.round()) & (r.abs() <= 1)  # halfway between two levels (0, ±1): either
    assert ((u[:V] == nearest) | tie).all() and (u[V:] == 0).all()
    assert torch.equal(head.int2_weights(), (2 * u[:V] - 3).to(torch.int8))
    assert torch.allclose(head.scale, s[:, 0] / 2)
    # within half a step of every weight inside the levels' range, clamped to ±1.5 s outside it
    assert ((q - weight).abs() <= torch.maximum(s / 2, weight.abs() - 1.5 * s) * (1 + 1e-6)).all()


def test_q2_proposals_match_the_exact_argmax_on_clear_winners_and_sample_from_a_4_bit_copy():
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(51865, 64, generator=gen) * 0.5
    ids = torch.randint(0, 51865, (200,), generator=gen)
    hidden = weight[ids] * 3 + torch.randn(200, 64, generator=gen) * 0.3
    want = exact_argmax(weight, hidden).argmax(dim=-1)
    assert torch.equal(want, ids)
    head = Q2Head(weight)
    assert torch.equal(head.argmax(hidden), want)
    with cpu_ops.reference():
        assert torch.equal(head.argmax(hidden[:20]), want[:20])
    assert "q4" not in head.__dict__  # greedy proposals never build the 4-bit copy
    logits = head.logits(hidden[:3])
    assert isinstance(head.q4, Q4Head) and head.q4.packed.numel() == 2 * head.packed.numel()
    assert torch.equal(logits, Q4Head(weight).logits(hidden[:3]))


def test_q2_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiples of 64"):
        Q2Head(torch.randn(10, 96))
    with pytest.raises(ValueError, match="candidates"):
        Q2Head(torch.randn(10, 64), candidates=0)

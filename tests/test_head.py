"""The screened bfloat16 head returns exactly the full-precision argmax."""
from __future__ import annotations

import torch

from specwhisper.head import ScreenedHead


def full_argmax(weight, hidden, banned):
    return (hidden @ weight.T).masked_fill(banned, -float("inf")).argmax(dim=-1)


def test_matches_full_precision_argmax_on_random_rows():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(51865, 64, generator=gen) * 0.5
    head = ScreenedHead(weight)
    hidden = torch.randn(200, 64, generator=gen) * 3
    banned = torch.zeros(51865, dtype=torch.bool)
    banned[torch.randint(0, 51865, (500,), generator=gen)] = True
    assert torch.equal(head.argmax(hidden, banned), full_argmax(weight, hidden, banned))
    assert torch.equal(head.argmax(hidden), full_argmax(weight, hidden, torch.zeros_like(banned)))


def test_near_ties_that_bfloat16_cannot_separate():
    """Rows whose logits differ far below bfloat16 resolution: the screen keeps all of them as
    candidates and the full-precision recomputation picks the right one."""
    gen = torch.Generator().manual_seed(1)
    d = 32
    hidden = torch.randn(8, d, generator=gen)
    base = torch.randn(d, generator=gen)
    weight = torch.randn(1000, d, generator=gen) * 0.01
    for row in range(8):
        h = hidden[row] / hidden[row].norm()
        # token 10*row+1 beats 10*row by 1e-5 in logit: invisible in bf16
        weight[10 * row] = base + 4 * h
        weight[10 * row + 1] = base + (4 + 1e-5) * h
    head = ScreenedHead(weight)
    expected = full_argmax(weight, hidden, torch.zeros(1000, dtype=torch.bool))
    assert torch.equal(head.argmax(hidden), expected)
    # and bf16 alone gets at least one of them wrong
    approx = (hidden.bfloat16() @ weight.bfloat16().T).float().argmax(-1)
    assert not torch.equal(approx, expected)


def test_banned_winner_is_skipped():
    weight = torch.eye(4, 4)
    head = ScreenedHead(weight)
    hidden = torch.tensor([[0.1, 0.9, 0.5, 0.2]])
    banned = torch.tensor([False, True, False, False])
    assert head.argmax(hidden, banned).tolist() == [2]

"""Output heads for greedy decoding: the exact screened bfloat16 head, the pruned draft head.

`ScreenedHead`: the head is the widest matrix of the decoder (vocab × d_model: 51865 × 512 for
base) and greedy decoding needs only its argmax. A bfloat16 copy of the weights is read instead
(half the bytes) in one product for all rows, with the hidden states kept in float32; then a
rigorous bound on each approximate logit's distance to the exact one selects the *candidates*,
whose exact logits are recomputed from the float32 rows. Their argmax is the answer.

The bound. bfloat16 keeps 8 significant bits, so rounding w to w̃ has unit roundoff u = 2^-8:
w̃_i = w_i (1 + δ_i) (+ an underflow term below 2^-134), |δ_i| ≤ u. A float32 sum of K products
in any order errs by at most γ_K Σ|products|, γ_K = K·2^-24 / (1 − K·2^-24). With l the exact
float32-computed logit (the same summation order as l̃, see `cpu_ops.gather_dot`):

    |l̃_v − l_v| ≤ (u + γ_K(1 + u) + γ_K) Σ_i |w_vi h_i| + TINY ≤ SLACK_K · ‖w_v‖·‖h‖ + TINY

by Cauchy–Schwarz; SLACK_K carries a factor (1 + 2^-12) for the float32 rounding of the norms
and of the bound itself. Comparisons then need no margin: rounding is monotone, so
fl(l̃_v + b_v) ≥ l_v and fl(l̃_w − b_w) ≤ l_w. A token is a candidate when its upper bound reaches
the best lower bound over the row; the true argmax always is one.

In PyTorch (`argmax_reference`) the candidates are the top `MAX_CANDIDATES` upper bounds per row (checked: the next
upper bound must fall below the row's best lower bound, else that row falls back to the full
float32 head); the C++ op (`cpu_ops.screened_argmax`) screens each row in two passes and keeps
any number of candidates. Ties go to the lowest token id, like `torch.argmax` over the full logits.
"""
from __future__ import annotations

import torch

from . import cpu_ops

BF16_ROUNDOFF = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits)
FP32_ROUNDOFF = 2.0**-24
TINY = 2.0**-40  # bfloat16 underflow of the weights (< 2^-134 per |h_i|, for |h_i| < 2^83)
MAX_CANDIDATES = 16


def screen_slack(d: int) -> float:
    """SLACK_K above for K = d: bound on |l̃ − l| per unit of ‖w‖·‖h‖."""
    gamma = d * FP32_ROUNDOFF / (1 - d * FP32_ROUNDOFF)
    return (BF16_ROUNDOFF + gamma * (1 + BF16_ROUNDOFF) + gamma) * (1 + 2.0**-12)


class ScreenedHead:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight.contiguous()  # [V, d] float32 (the token embedding)
        self.low = weight.to(torch.bfloat16).contiguous()  # [V, d]
        self.row_norm = weight.float().norm(dim=1)  # [V]
        self.slack = screen_slack(weight.shape[1])

    def argmax(self, hidden: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, d] -> [N]: argmax over the vocabulary of the float32 logits hidden @ weight.T,
        skipping `banned` ([V] or [N, V] bool), ties to the lowest id."""
        if cpu_ops.active(hidden):  # the same algorithm in one C++ op (any number of candidates)
            return cpu_ops.screened_argmax(hidden, self.low, self.weight, self.row_norm, self.slack, TINY, banned)
        return self.argmax_reference(hidden, banned)

    def argmax_reference(self, hidden: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor:
        hidden = hidden.float()
        approx = cpu_ops.linear(hidden, self.low, None, torch.float32)  # [N, V]
        bound = (hidden.norm(dim=1, keepdim=True) * self.slack) * self.row_norm + TINY
        if banned is not None:
            approx.masked_fill_(banned, -float("inf"))
        floor = (approx - bound).amax(dim=1, keepdim=True)  # the best guaranteed logit per row
        upper = approx.add_(bound)  # [N, V] (approx is not needed any more)
        c = min(MAX_CANDIDATES + 1, upper.shape[1])
        top, ids = upper.topk(c, dim=1)  # [N, c], descending
        fits = top[:, -1] < floor[:, 0] if c == MAX_CANDIDATES + 1 else torch.ones_like(floor[:, 0], dtype=torch.bool)
        top, ids = top[:, :MAX_CANDIDATES], ids[:, :MAX_CANDIDATES]
        ids, order = ids.sort(dim=1)  # ascending ids: argmax's first maximum is the lowest id
        candidate = top.gather(1, order) >= floor
        exact = cpu_ops.gather_dot(hidden, self.weight, ids).masked_fill_(~candidate, -float("inf"))
        out = ids.gather(1, exact.argmax(dim=1, keepdim=True))[:, 0]
        if not bool(fits.all()):  # more candidates than fit: the full float32 head for those rows
            rows = (~fits).nonzero()[:, 0]
            logits = cpu_ops.linear(hidden[rows], self.weight, None, torch.float32)
            if banned is not None:
                logits.masked_fill_(banned if banned.ndim == 1 else banned[rows], -float("inf"))
            out[rows] = logits.argmax(dim=1)
        return out


class SubsetHead:
    """Greedy argmax over a subset of the vocabulary: a draft's pruned output head.

    A draft only proposes; the target verifies every proposal with its full head, so a draft
    that can only say the `keep` tokens stays exact and just proposes less often right."""

    def __init__(self, weight: torch.Tensor, keep: torch.Tensor):
        self.keep = keep  # [N] vocabulary ids kept, ascending
        self.weight = weight[keep].contiguous()  # [N, d]

    def argmax(self, hidden: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor:
        if cpu_ops.active(hidden):
            logits = cpu_ops.linear(hidden, self.weight, None, torch.float32)  # [rows, N]
        else:
            logits = hidden @ self.weight.T
        if banned is not None:
            logits.masked_fill_(banned[..., self.keep], -float("inf"))
        return self.keep[logits.argmax(dim=-1)]

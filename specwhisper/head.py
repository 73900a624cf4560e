"""Exact greedy argmax over Whisper's (tied) output head, screened in bfloat16.

The head is the widest matrix of the decoder (vocab × d_model: 51865 × 512 for base) and greedy
decoding needs only its argmax. A bfloat16 copy is read instead (half the bytes), with a rigorous
bound on how far each bfloat16 logit can be from the float32 one:

    |l̃_v − l_v| ≤ ‖w_v‖·‖h‖·2^-7 + |l̃_v|·2^-7

(bf16 rounding of w and h contributes ≤ 2·2^-9 relative to Σ|w_i h_i| ≤ ‖w_v‖·‖h‖, the fp32
accumulation d·2^-24 of the same, the bf16 rounding of the result 2^-9·|l|; both constants here are
twice that). Every token whose upper bound reaches the best lower bound is a *candidate*; the
candidates' logits are recomputed in the model's dtype from the full-precision rows, and their
argmax is the answer: the same token a full-precision head would give. Typically a handful of rows
are recomputed.
"""
from __future__ import annotations

import torch

SLACK = 2.0**-7


class ScreenedHead:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # [V, d] full precision (the token embedding)
        self.low = weight.to(torch.bfloat16)  # [V, d]
        self.row_norm = weight.float().norm(dim=1)  # [V]

    def argmax(self, hidden: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, d] -> argmax over vocab of hidden @ weight.T, skipping `banned` [V] bool."""
        low_hidden = hidden.to(torch.bfloat16)
        # one matrix-vector product per row: on CPU `mv` streams the bf16 matrix ~1.5x faster
        # than a 1-row GEMM (measured cold-cache, whisper-base head)
        approx = torch.stack([torch.mv(self.low, row) for row in low_hidden]).float()  # [N, V]
        bound = hidden.float().norm(dim=1, keepdim=True) * self.row_norm * SLACK + approx.abs() * SLACK
        if banned is not None:
            approx.masked_fill_(banned, -float("inf"))
        floor = (approx - bound).amax(dim=1, keepdim=True)  # the best guaranteed logit per row
        candidate = approx + bound >= floor  # [N, V]
        out = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        for row in range(hidden.shape[0]):
            ids = candidate[row].nonzero().squeeze(1)
            exact = hidden[row : row + 1] @ self.weight[ids].T  # [1, C]
            out[row] = ids[exact.argmax()]
        return out


class SubsetHead:
    """Greedy argmax over a subset of the vocabulary: a draft's pruned output head.

    A draft only proposes; the target verifies every proposal with its full head, so a draft
    that can only say the `keep` tokens stays exact and just proposes less often right."""

    def __init__(self, weight: torch.Tensor, keep: torch.Tensor):
        self.keep = keep  # [N] vocabulary ids kept, ascending
        self.weight = weight[keep].contiguous()  # [N, d]

    def argmax(self, hidden: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor:
        logits = hidden @ self.weight.T  # [rows, N]
        if banned is not None:
            logits.masked_fill_(banned[self.keep], -float("inf"))
        return self.keep[logits.argmax(dim=-1)]

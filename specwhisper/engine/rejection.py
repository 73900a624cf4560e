"""Rejection sampling as the engine's acceptance rule (`Engine(..., sampling="rejection")`).

Leviathan et al. 2023 (arXiv 2211.17192), Chen et al. 2023 (arXiv 2302.01318): the draft
proposed x_j ~ q_j; x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)); at the first
rejection the target emits a token of normalize(max(0, p_j - q_j)) (the *recovered* token). The
emitted tokens follow the target's processed distribution p exactly, whatever the draft.

The default mode ("race") instead keeps a proposal when it equals the target's own race winner
under the same counter-based noise: reproducible tokens whatever k, batch or draft. Rejection
sampling accepts a little more (Σ min(p, q) per position; bench/couplings.py) but its tokens
depend on the draft. Its noise is counter-based too, so steps stay graph-safe and a seed
reproduces a run of the same engine:
- a proposal is the draft's race winner under exp_noise(seed, position) (as in race mode): a
  sample of q, whose exact probabilities are kept (the draft's logits, or its probabilities in
  target ids for a draft with another vocabulary);
- the uniform of the acceptance test at position j: exp(-E) with E = exp_noise(seed ^
  UNIFORM_STREAM, j, [0]) (a U(0, 1) variable, never 0);
- the noise of the residual race: exp_noise(seed ^ RESAMPLE_STREAM, first proposal's position),
  a fresh row per iteration (each iteration starts at a later position);
- when every usable proposal of a row was accepted (all k, or fewer where the row's draft stopped
  early: an unspellable token, a smaller fixed k, the cache's end, or no draft at all), the next
  token is the target's own race winner there, a sample of p at a position no decision has used.
"""
from __future__ import annotations

import torch

from .. import sampling
from ..backends import ops

UNIFORM_STREAM = 0x2545F4914F6CDD1D  # seed ^ this: the acceptance tests' uniforms
RESAMPLE_STREAM = 0x1B873593CC9E2D51  # seed ^ this: the residual race's noise


def accept_by_rejection(target_logits: torch.Tensor, draft_logits: torch.Tensor, proposals: torch.Tensor,
                        choice: torch.Tensor, draft_to_target: torch.Tensor | None, temperature: torch.Tensor,
                        top_p: torch.Tensor, seed: torch.Tensor, index: torch.Tensor,
                        shared: tuple[float, float] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B, k+1] to emit and the number of accepted proposals [B] under rejection sampling.

    target_logits [B, k+1, V] float32 under Whisper's rules (-inf: suppressed); draft_logits
    [B, k, V_draft] the logits each proposal was raced from (its suppression applied);
    proposals [B, k] target ids, -1 from the first unusable one on; choice [B, k+1] the target's
    own race winners; draft_to_target [V_draft] int64 for a draft with another vocabulary (None:
    the same ids); temperature, top_p [B] float32 (rows with temperature 0 are not sampled here:
    the caller keeps their greedy choices); seed [B] int64; index [B] the pending token's index.
    `shared`: (temperature, top_p) every sampled row has, for the fused kernels
    (`ops.speculative_sample_noise`: Triton on a GPU, C++ on a CPU); None: per-row parameters,
    exact float64 probabilities (`ops.speculative_sample_probs`). No host sync."""
    B, k1, V = target_logits.shape
    k = k1 - 1
    device = target_logits.device
    j = torch.arange(k1, device=device)
    position = index[:, None] + 1 + j[None, :k]  # [B, k]
    zero = torch.zeros(1, dtype=torch.long, device=device)
    e = ops.exp_noise((seed ^ UNIFORM_STREAM)[:, None].expand(B, k).reshape(-1), position.reshape(-1), zero)
    uniforms = torch.exp(-e.double()).view(B, k)  # (0, 1): E > 0 and finite
    tokens = proposals.clamp(min=0)
    if draft_to_target is None and shared is not None:
        noise = ops.exp_noise(seed ^ RESAMPLE_STREAM, index + 1, torch.arange(V, device=device))
        out, n_emit = ops.speculative_sample_noise(target_logits, draft_logits, tokens, shared[0], shared[1],
                                                   uniforms, noise)
    else:
        rows = lambda t, n: t[:, None].expand(B, n).reshape(-1)  # noqa: E731  per-row parameter, each position
        p = sampling.probs64(target_logits.reshape(B * k1, V), rows(temperature, k1), rows(top_p, k1)).view(B, k1, V)
        Vd = draft_logits.shape[-1]
        q = sampling.probs64(draft_logits.reshape(B * k, Vd), rows(temperature, k), rows(top_p, k)).view(B, k, Vd)
        width = V
        if draft_to_target is not None:  # q in target ids; a column for what the target cannot spell
            q = sampling.permute_probs(q, draft_to_target, V)
            p = torch.nn.functional.pad(p, (0, 1))
            width = V + 1
        noise = ops.exp_noise(seed ^ RESAMPLE_STREAM, index + 1, torch.arange(width, device=device))
        out, n_emit = ops.speculative_sample_probs(p, q, tokens, uniforms, noise)
    valid = (proposals >= 0).sum(dim=1)  # [B] usable proposals (a prefix)
    n_acc = torch.minimum(n_emit - 1, valid)
    recovered = out.gather(1, n_acc[:, None])
    after_all = choice.gather(1, valid[:, None])  # every usable proposal accepted: the target's race
    last = torch.where((n_emit - 1 >= valid)[:, None], after_all, recovered)  # [B, 1]
    padded = torch.cat([tokens, tokens[:, :1]], dim=1)  # [B, k+1]
    emitted = torch.where(j[None] < n_acc[:, None], padded, torch.where(j[None] == n_acc[:, None], last, choice))
    return emitted, n_acc

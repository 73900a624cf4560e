"""The alignment pass of word timestamps: one teacher-forced target decoder pass over kept
windows' text tokens that returns the alignment heads' cross-attention logits and the text
tokens' probabilities (what openai's `find_alignment` reads through forward hooks).

It runs in plain PyTorch (the C++ decode step does not expose attention weights) over the
cross-attention K/V each window already has, with no self-attention cache: the whole sequence is
known, so every position attends causally within one pass. The windows of one iteration are
aligned in one call but each in its own pass, at its own length: a batch padded to its longest
window would change the GEMMs' row counts, and MKL's AVX2 kernels round a few rows differently
from many (word probabilities then differed in the 7th digit between a recording transcribed
alone and in a batch). The attention logits are computed as openai computes them,
(q * s) @ (k * s)^T with s = head_dim^-1/4.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .timing import AlignmentRequest


def attention_logits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, T, Dh], k [B, H, S, Dh] -> float32 logits [B, H, T, S], openai's way."""
    scale = q.shape[-1] ** -0.25
    qk = (q * scale) @ (k * scale).transpose(-1, -2)
    if mask is not None:
        qk = qk + mask
    return qk.float()


@torch.inference_mode()
def alignment_pass(decoder, requests: list[AlignmentRequest], cross_k: torch.Tensor, cross_v: torch.Tensor,
                   heads: list[tuple[int, int]], eot: int,
                   rows: list[int] | None = None) -> list[tuple[torch.Tensor, list[float]]]:
    """For each request (cache row `rows[b]`, default b, of cross_k / cross_v [n_layers, S, H,
    1500, Dh], read in place): the alignment heads' cross-attention logits [len(heads),
    len(tokens), 1500] (float32, on the CPU) and its text tokens' probabilities among the text
    tokens (ids below `eot`), as openai's pass gives. Each request's result is the same whichever
    requests share the call."""
    rows = range(len(requests)) if rows is None else rows
    return [window_alignment(decoder, r, cross_k[:, s:s + 1], cross_v[:, s:s + 1], heads, eot)
            for r, s in zip(requests, rows, strict=True)]


def window_alignment(decoder, r: AlignmentRequest, cross_k: torch.Tensor, cross_v: torch.Tensor,
                     heads: list[tuple[int, int]], eot: int) -> tuple[torch.Tensor, list[float]]:
    """One window's pass; cross_k / cross_v [n_layers, 1, H, 1500, Dh]."""
    device = decoder.embed_tokens.weight.device
    T = len(r.tokens)
    tokens = torch.tensor([r.tokens], device=device)
    x = decoder.embed_tokens(tokens) + decoder.embed_positions.weight[:T]
    causal = torch.full((T, T), -float("inf"), device=device, dtype=x.dtype).triu_(1)
    layers_with_heads = {layer for layer, _ in heads}
    logits_by_layer = {}
    for i, layer in enumerate(decoder.layers):
        sa, ca = layer.self_attn, layer.encoder_attn
        q, k, v = sa.project(layer.self_attn_layer_norm(x), ("q", "k", "v"))
        w = F.softmax(attention_logits(q, k, causal), dim=-1).to(q.dtype)
        x = x + sa.out_proj((w @ v).transpose(1, 2).flatten(2))
        q = ca.heads(ca.q_proj(layer.encoder_attn_layer_norm(x)))
        ck, cv = cross_k[i].to(q.dtype), cross_v[i].to(q.dtype)
        qk = attention_logits(q, ck)  # [1, H, T, 1500]
        if i in layers_with_heads:
            logits_by_layer[i] = qk
        w = F.softmax(qk, dim=-1).to(q.dtype)
        x = x + ca.out_proj((w @ cv).transpose(1, 2).flatten(2))
        x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
    x = decoder.layer_norm(x)
    weights = torch.stack([logits_by_layer[layer][0, head] for layer, head in heads]).cpu()  # [n, T, 1500]
    n = len(r.text_tokens)
    rows = x[0, r.n_prefix:r.n_prefix + n]  # each predicts the next text token
    logits = (rows @ decoder.embed_tokens.weight[:eot].T).float()
    probs = logits.softmax(dim=-1)[torch.arange(n, device=device), torch.tensor(r.text_tokens, device=device)]
    return weights, probs.tolist()

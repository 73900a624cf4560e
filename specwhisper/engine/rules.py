"""Whisper's logit rules as tensor ops over rows: openai-whisper's `SuppressBlank`,
`SuppressTokens` and `ApplyTimestampRules` (whisper/decoding.py), vectorized.

Every row carries its own decoding state as small integer tensors (how many tokens were sampled,
the last two of them, the last timestamp), so one call serves a batch of requests, every position
of a verify pass (each position given its proposed prefix) and a draft's proposals alike. No host
sync, no Python loop over rows, no data-dependent branch: the ops are graph-safe.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..backends import cpu_ops
from ..tokenizer import Tokenizer

NEG_INF = float("-inf")


@dataclass(frozen=True)
class RuleTables:
    """What the rules need from one model's vocabulary, built once per model."""

    suppress: torch.Tensor  # [V] bool: openai's suppress_tokens="-1" set, suppressed at every step
    blank: torch.Tensor  # [V] bool: " " and <|endoftext|>, suppressed at the first sampled position
    eot: int  # <|endoftext|>; ids below it are text tokens
    no_timestamps: int  # <|notimestamps|>, suppressed when timestamps are predicted
    timestamp_begin: int  # <|0.00|>; ids from here on are timestamps (0.02 s apart)
    vocab_size: int  # V, the width of the logits
    blank_ids: torch.Tensor = field(init=False, repr=False)  # [n] the ids `blank` marks
    timestamp_ids: torch.Tensor = field(init=False, repr=False)  # [V - timestamp_begin] the timestamps

    def __post_init__(self):
        object.__setattr__(self, "blank_ids", self.blank.nonzero()[:, 0])
        object.__setattr__(self, "timestamp_ids", torch.arange(self.timestamp_begin, self.vocab_size,
                                                               device=self.blank.device))

    @classmethod
    def build(cls, tokenizer: Tokenizer, vocab_size: int, device) -> RuleTables:
        suppress = torch.zeros(vocab_size, dtype=torch.bool)
        suppress[[t for t in tokenizer.openai_suppress_tokens() if t < vocab_size]] = True
        blank = torch.zeros(vocab_size, dtype=torch.bool)
        blank[tokenizer.encode(" ") + [tokenizer.eot]] = True
        return cls(suppress.to(device), blank.to(device), tokenizer.eot, tokenizer.no_timestamps,
                   tokenizer.timestamp_begin, vocab_size)


def apply_rules(logits: torch.Tensor, tables: RuleTables, at_begin: torch.Tensor, timestamps: torch.Tensor,
                n_sampled: torch.Tensor, last: torch.Tensor, penultimate: torch.Tensor,
                last_timestamp: torch.Tensor, max_initial_timestamp: torch.Tensor) -> torch.Tensor:
    """Mask `logits` [N, V] (float32, in place; also returned) with Whisper's rules, row by row:
    the `rule_mask` of the rows' states, then the rule that forces a timestamp when the
    timestamps' total probability beats every single text token (`forces_timestamp`). The
    arguments are `rule_mask`'s."""
    logits.masked_fill_(rule_mask(tables, at_begin, timestamps, n_sampled, last, penultimate, last_timestamp,
                                  max_initial_timestamp), NEG_INF)
    force = timestamps & forces_timestamp(logits, tables.timestamp_begin)
    logits[:, :tables.timestamp_begin].masked_fill_(force[:, None], NEG_INF)
    return logits


def forces_timestamp(logits: torch.Tensor, timestamp_begin: int) -> torch.Tensor:
    """[N] bool: the masked logits' timestamps have more total probability than any single
    token below `timestamp_begin` (openai's comparison, on float32 log-probabilities)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    timestamp_logprob = logprobs[:, timestamp_begin:].logsumexp(dim=-1)
    max_text_logprob = logprobs[:, :timestamp_begin].max(dim=-1).values
    return timestamp_logprob > max_text_logprob


def rule_mask(tables: RuleTables, at_begin: torch.Tensor, timestamps: torch.Tensor,
              n_sampled: torch.Tensor, last: torch.Tensor, penultimate: torch.Tensor,
              last_timestamp: torch.Tensor, max_initial_timestamp: torch.Tensor) -> torch.Tensor:
    """[N, V] bool: the tokens Whisper's rules exclude in each row's state, before the
    timestamp-forcing rule (which needs the logits). Every argument is [N]:

    at_begin bool: nothing sampled yet (SuppressBlank; timestamp rows must start with a timestamp).
    timestamps bool: the row predicts timestamps (ApplyTimestampRules); other rows get
        suppression only (their prompt ends with <|notimestamps|>).
    n_sampled int64: tokens sampled so far after the prompt.
    last, penultimate int64: the last two sampled tokens (read only when n_sampled allows:
        fewer than 2 sampled counts the penultimate as a timestamp, as openai does).
    last_timestamp int64: id of the last sampled timestamp token, -1 when none yet.
    max_initial_timestamp int64: highest timestamp index allowed first, -1 for no limit.

    Built by column ranges (text ids below EOT, the special ids up to <|0.00|>, the timestamps),
    each a per-row flag or, for the timestamps, a per-row interval: two passes over [N, V]
    instead of a dozen (`rule_mask_reference` is the same mask from whole-vocabulary terms). On a
    CPU one C++ call builds it (`cpu_ops.rule_mask`: a long-form step's ~15 small ops cost about
    0.4 ms in an engine's loop thread).
    """
    V, tb, eot = tables.vocab_size, tables.timestamp_begin, tables.eot
    if not eot < tables.no_timestamps < tb:
        return rule_mask_reference(tables, at_begin, timestamps, n_sampled, last, penultimate, last_timestamp,
                                   max_initial_timestamp)
    if cpu_ops.active(at_begin):
        return cpu_ops.rule_mask(at_begin, timestamps, n_sampled, last, penultimate, last_timestamp,
                                 max_initial_timestamp, tables.suppress, tables.blank_ids, eot, tables.no_timestamps, tb)
    last_was_ts = (n_sampled >= 1) & (last >= tb)  # [N]
    penultimate_was_ts = (n_sampled < 2) | (penultimate >= tb)
    open_pair = last_was_ts & ~penultimate_was_ts
    upper = torch.where(open_pair, last_timestamp, last_timestamp + 1)
    limit = torch.where(max_initial_timestamp >= 0, tb + max_initial_timestamp, V)
    stamps = tables.timestamp_ids
    mask = torch.empty(at_begin.shape[0], V, dtype=torch.bool, device=at_begin.device)
    mask[:, :eot] = (timestamps & (open_pair | at_begin))[:, None]  # text
    mask[:, eot:tb] = (timestamps & at_begin)[:, None]  # EOT and the other special tokens
    mask[:, tables.no_timestamps] = timestamps
    mask[:, tb:] = timestamps[:, None] & ((last_was_ts & penultimate_was_ts)[:, None] | (stamps < upper[:, None])
                                          | (at_begin[:, None] & (stamps > limit[:, None])))
    mask[:, tables.blank_ids] |= at_begin[:, None]
    return mask.logical_or_(tables.suppress)


def rule_mask_reference(tables: RuleTables, at_begin: torch.Tensor, timestamps: torch.Tensor,
                        n_sampled: torch.Tensor, last: torch.Tensor, penultimate: torch.Tensor,
                        last_timestamp: torch.Tensor, max_initial_timestamp: torch.Tensor) -> torch.Tensor:
    """`rule_mask` from terms over the whole vocabulary, one per rule (the spec it is tested against)."""
    V, tb = tables.vocab_size, tables.timestamp_begin
    ids = torch.arange(V, device=at_begin.device)  # [V]
    is_timestamp, is_text = ids >= tb, ids < tables.eot  # [V]

    last_was_ts = (n_sampled >= 1) & (last >= tb)  # [N]
    penultimate_was_ts = (n_sampled < 2) | (penultimate >= tb)
    open_pair = last_was_ts & ~penultimate_was_ts  # a segment's start timestamp: its end must follow
    # timestamps come in pairs: after a closed pair text (or EOT) follows, after an opening one a
    # timestamp or EOT; they never decrease, and a segment has nonzero length
    upper = torch.where(open_pair, last_timestamp, last_timestamp + 1)  # first allowed timestamp id
    mask = ((last_was_ts & penultimate_was_ts)[:, None] & is_timestamp) | (open_pair[:, None] & is_text)
    mask |= is_timestamp & (ids < upper[:, None])  # upper <= tb when no timestamp yet: a no-op
    mask |= ids == tables.no_timestamps
    # the first token is a timestamp no later than max_initial_timestamp
    limit = torch.where(max_initial_timestamp >= 0, tb + max_initial_timestamp, V)
    mask |= at_begin[:, None] & (~is_timestamp | (ids > limit[:, None]))
    return (mask & timestamps[:, None]) | (at_begin[:, None] & tables.blank) | tables.suppress


def row_state(tokens: list[int], timestamp_begin: int) -> tuple[int, int, int, int]:
    """(n_sampled, last, penultimate, last_timestamp) of one row's sampled tokens, on the host
    (for reference loops and tests; a runner updates these as tensors)."""
    n = len(tokens)
    last = tokens[-1] if n >= 1 else -1
    penultimate = tokens[-2] if n >= 2 else -1
    last_timestamp = next((t for t in reversed(tokens) if t >= timestamp_begin), -1)
    return n, last, penultimate, last_timestamp

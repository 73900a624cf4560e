"""Choosing tokens under Whisper's rules, one function for the target and the draft alike.

`choose_tokens`: a model's float32 logits from decoder hidden states, its banned tokens masked
(suppression), Whisper's timestamp rules for the rows that want them (each position given its own
prefix: the row's tokens, then the tokens proposed before that position), then each row's seeded
exponential race (`ops.race_sample`; its argmax at temperature 0). The runner's target path
(`Runner.choose`: admission and the verify pass) and its draft path (`Runner.draft_choose`: each
proposal) both call it; each keeps only what differs: the target's exact screened head for plain
greedy rows, the draft's screened greedy head when no row samples or follows rules, the rejection
mode's copy of the draft's logits. `choose_ruled_greedy` gives greedy rows under the timestamp
rules the same tokens without their full logits (the screened head's `timestamp_argmax`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..backends import cpu_ops, ops
from . import rules
from .slots import SlotState


class Modes(NamedTuple):
    """Which token-choosing paths an iteration needs (from the host's copy of the rows' options)."""

    any_plain: bool  # a plain-greedy row: the screened head
    any_full: bool  # a row that needs full logits (sampled; greedy timestamps without a screened head)
    any_timestamps: bool  # a row under the timestamp rules
    any_sampled: bool  # a row sampled at a temperature above 0
    any_ruled: bool  # a greedy row under the timestamp rules, through the screened head
    keep_hidden: bool  # a greedy row whose log-probabilities are wanted (`kept_logprob`)


@dataclass
class Rows:
    """The rows of one pass and what the rules and the race need to know about its positions:
    the slots' state (tokens, lengths, per-row options), which slot each row is, which token
    index each position predicts, and the tokens proposed after each row's own tokens (they
    precede the later positions of the pass)."""

    state: SlotState
    slots: torch.Tensor  # [B] the slot of each row
    predicted: torch.Tensor  # [B, T] index, in the row's target tokens, of the token position t predicts
    proposed: torch.Tensor | None = None  # [B, j] tokens at indices n_tokens.. (None: none)

    def subset(self, sel: torch.Tensor) -> Rows:
        """The rows `sel` [n] (indices into this pass's rows)."""
        return Rows(self.state, self.slots[sel], self.predicted[sel], None if self.proposed is None else self.proposed[sel])

    def banned_first(self, suppress: torch.Tensor, begin_suppress: torch.Tensor) -> torch.Tensor:
        """[B, T, V] bool: `suppress`, and `begin_suppress` where a position predicts its row's
        first generated token."""
        return suppress | (self.at_begin()[..., None] & begin_suppress)

    def at_begin(self) -> torch.Tensor:
        """[B, T] bool: the position predicts the row's first generated token."""
        return self.predicted == self.state.prompt_len[self.slots][:, None]


def choose_tokens(logits_fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                  banned: torch.Tensor, rows: Rows, tables: rules.RuleTables, timestamps: bool,
                  noise_ids: torch.Tensor | None = None,
                  leads: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B, T] from hidden [B, T, d] -> (choices [B, T], the logits [B, T, V] they were
    raced from). `logits_fn`: the model's head (hidden -> logits); `banned`: [V] or [B, T, V]
    bool; `timestamps`: apply the timestamp rules to the rows that want them (other rows are only
    suppressed); `noise_ids`: the race's noise per vocabulary column (None: the column's id; a
    draft with another vocabulary races its columns with their target ids' noise); `leads`:
    float32 [B * T], written with each choice's lead (`sampling.race_leads`)."""
    B, T, _ = hidden.shape
    logits = ruled_logits(logits_fn(hidden).float(), banned, rows, tables, timestamps)
    st, slots = rows.state, rows.slots
    flat = slots[:, None].expand(B, T).reshape(-1)
    choices = ops.race_sample(logits.reshape(B * T, -1), st.temperature[flat], st.top_p[flat], st.seed[flat],
                              rows.predicted.reshape(-1), noise_ids, leads)
    return choices.view(B, T), logits


def ruled_logits(raw: torch.Tensor, banned: torch.Tensor, rows: Rows, tables: rules.RuleTables,
                 timestamps: bool) -> torch.Tensor:
    """Float32 logits [B, T, V] -> the logits under Whisper's rules: `banned` masked, or for the
    rows that want them (`timestamps`) the timestamp rules, which do their own suppression."""
    logits = raw.masked_fill(banned, -float("inf"))
    if timestamps:
        ruled = timestamp_rules(raw, rows, tables)
        logits = torch.where(rows.state.timestamps[rows.slots][:, None, None], ruled, logits)
    return logits


def choose_ruled_greedy(head, logits_fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                        rows: Rows, tables: rules.RuleTables) -> torch.Tensor:
    """Greedy tokens [B, T] of rows under the timestamp rules, without their full logits: the
    screened head's `timestamp_argmax` (exact), the few positions it leaves undecided (a call
    closer than its margin) from their full logits. Equal to `choose_tokens` at temperature 0."""
    B, T, d = hidden.shape
    state = rule_state(rows, tables)
    flat_hidden = hidden.reshape(B * T, d)
    tokens, undecided = head.timestamp_argmax(flat_hidden, rules.rule_mask(tables, *state), tables.timestamp_begin)
    if bool(undecided.any()):
        u = undecided.nonzero()[:, 0]
        logits = rules.apply_rules(logits_fn(flat_hidden[u]).float(), tables, *(t[u] for t in state))
        tokens[u] = logits.argmax(dim=-1)
    return tokens.view(B, T)


def kept_logprob(state: SlotState, s: int, logits_fn: Callable[[torch.Tensor], torch.Tensor], dtype,
                 suppress: torch.Tensor, begin_suppress: torch.Tensor, tables: rules.RuleTables) -> float:
    """The sum of slot `s`'s generated tokens' log-probabilities (EOT included), from the decoder
    outputs kept as they were emitted (`SlotState.hidden`): the logits under Whisper's rules that a
    full row's choice would have used, in one product over the whole row. A greedy row's tokens
    never needed them (its choice is an argmax, through the screened head on a CPU), so its passes
    skip the full head; `suppress`/`begin_suppress` are the target's banned tokens as its passes
    masked them."""
    n, P = int(state.n_tokens[s]), int(state.prompt_len[s])
    if n <= P:
        return 0.0
    device = state.tokens.device
    rows = Rows(state, torch.tensor([s], device=device), torch.arange(P, n, device=device)[None])
    raw = logits_fn(state.hidden[s, P:n].to(dtype)).float()  # [n - P, V], this function's own
    # `ruled_logits` for this one row, in place: the timestamp rules (which do their own
    # suppression) for a row that wants them, else its banned tokens
    if bool(state.timestamps[s]):
        logits = rules.apply_rules(raw, tables, *rule_state(rows, tables))
    else:
        logits = raw.masked_fill_(rows.banned_first(suppress, begin_suppress)[0], -float("inf"))
    lp = torch.log_softmax(logits, dim=-1).gather(1, state.tokens[s, P:n][:, None])[:, 0]
    return float(lp.double().sum())


def timestamp_rules(logits: torch.Tensor, rows: Rows, tables: rules.RuleTables) -> torch.Tensor:
    """Whisper's timestamp rules at every position [B, T] of a pass, each position given its own
    prefix: the row's tokens, then the proposed tokens before it. Returns new logits [B, T, V]."""
    B, T, V = logits.shape
    ruled = rules.apply_rules(logits.reshape(B * T, V).clone(), tables, *rule_state(rows, tables))
    return ruled.view(B, T, V)


def rule_state(rows: Rows, tables: rules.RuleTables) -> tuple[torch.Tensor, ...]:
    """The rules' per-position state, flattened to [B * T] (`rules.rule_mask`'s arguments):
    at_begin, timestamps, n_sampled, last, penultimate, last_timestamp, max_initial_timestamp.
    On a CPU one C++ call (`cpu_ops.rule_state`: ~15 small tensor ops cost a long-form step about
    0.2 ms in an engine's loop thread); `rule_state_reference` elsewhere."""
    st = rows.state
    if cpu_ops.active(rows.predicted):
        proposed = rows.proposed if rows.proposed is not None else rows.predicted.new_empty(len(rows.slots), 0)
        return tuple(cpu_ops.rule_state(st.tokens, st.n_tokens, st.prompt_len, st.timestamps, st.max_initial_ts,
                                        rows.slots, rows.predicted, proposed, tables.timestamp_begin))
    return rule_state_reference(rows, tables)


def rule_state_reference(rows: Rows, tables: rules.RuleTables) -> tuple[torch.Tensor, ...]:
    """`rule_state` in tensor ops (any device, graph-safe)."""
    st, slots, predicted = rows.state, rows.slots, rows.predicted
    B, T = predicted.shape
    device = predicted.device
    seq = st.tokens[slots]  # [B, L] (a copy)
    if rows.proposed is not None and rows.proposed.shape[1]:
        k = rows.proposed.shape[1]
        at = st.n_tokens[slots][:, None] + torch.arange(k, device=device)
        seq.scatter_(1, at, rows.proposed.clamp(min=0))
    tb = tables.timestamp_begin
    start = st.prompt_len[slots][:, None]
    j = torch.arange(seq.shape[1], device=device)
    stamps = torch.where((seq >= tb) & (j[None] >= start), seq, -1).cummax(dim=1).values
    before = (predicted - 1).clamp(min=0)
    n_sampled = predicted - start
    last = seq.gather(1, before)
    penultimate = seq.gather(1, (predicted - 2).clamp(min=0))
    last_timestamp = torch.where(n_sampled > 0, stamps.gather(1, before), -1)
    flat_slots = slots[:, None].expand(B, T)
    return tuple(t.reshape(B * T) for t in (rows.at_begin(), st.timestamps[flat_slots], n_sampled, last,
                                             penultimate, last_timestamp, st.max_initial_ts[flat_slots]))

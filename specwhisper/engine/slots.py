"""Per-slot state of the runner, declared once: what a slot holds, and what admission, moving a
row (compaction), a graph's warm-up rewind and the output read do with each part of it.

`SlotState` holds the device tensors, each [S, ...] (S slots); the metadata of each field (`Slot`)
says its dtype and shape, which side owns it (target, draft, rejection sampling), its value in a
free slot and at admission, whether it is per-sequence state (moved with its row) or one
iteration's scratch, whether a step changes it, and which `SeqOutput` field reads it. `HostSlot`
is the host's record of a slot (its options, lengths as of the last read, a draft not started
yet), moved whole. The runner's step functions read the tensors as plain attributes
(`state.tokens`): the declarations cost nothing per step.
"""
# ruff: noqa: RUF009 (`per_slot` returns a dataclasses.field, which RUF009 cannot see)
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..constants import NO_LIMIT


@dataclass
class SeqSpec:
    """One sequence to decode in a slot: a window's prompt and per-row options."""

    prompt: list[int]  # full decoder prefix (previous text, then the start-of-transcript sequence)
    language: str | None  # language of the prompt (the draft builds its own prompt from it)
    task: str  # "transcribe" or "translate"
    max_new_tokens: int  # generated tokens incl. EOT
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0  # noise key of sampled rows (counter-based: tokens do not depend on k or batch)
    timestamps: bool = False  # apply the timestamp rules
    max_initial_timestamp: int = NO_LIMIT  # last allowed initial timestamp index
    num_draft_tokens: int | None = None  # fixed k for this row; None: adaptive
    use_draft: bool = True  # False: the draft stands aside for this row
    sot_index: int = 0  # index of <|startoftranscript|> in `prompt` (no-speech probability)
    need_logprobs: bool = False  # the sum of the generated tokens' log-probabilities (SeqOutput)

    @property
    def plain(self) -> bool:
        """Plain greedy: the exact (screened) greedy head, no full logits needed (a greedy row's
        log-probabilities are computed when it finishes, `Runner.greedy_logprob`)."""
        return self.temperature == 0 and not self.timestamps

    @property
    def ruled_greedy(self) -> bool:
        """Greedy under the timestamp rules (`choosing.choose_ruled_greedy` with a screened head)."""
        return self.temperature == 0 and self.timestamps


@dataclass
class SeqOutput:
    tokens: list[int]  # generated ids without EOT
    generated: int  # generated tokens including EOT
    sum_logprob: float  # sum of log-probabilities of the generated tokens incl. EOT
    no_speech_prob: float  # probability of no-speech at the start-of-transcript position
    drafted: int
    accepted: int
    target_passes: int
    draft_passes: int


@dataclass(frozen=True)
class Slot:
    """What the runner does with one per-slot tensor."""

    dtype: torch.dtype = torch.long
    shape: tuple[str, ...] = ()  # per-slot shape: "L" positions, "K" proposals, "V" draft vocabulary, "D" width
    side: str = "target"  # "target"; "draft": with a drafter; "rejection": with a drafter, rejection sampling
    free: Any = 0  # its value in a free slot (an inert row: done, one pending token, nothing appended)
    moves: bool = True  # per-sequence state, moved with its row (False: scratch of one iteration)
    step: bool = False  # a step changes it: saved and restored around a graph's warm-up calls
    admit: Callable[[Any, int], Any] | None = None  # (spec, prompt length) -> its value at admission
    output: str | None = None  # the SeqOutput field that reads it


def per_slot(**meta) -> Any:
    return field(default=None, metadata={"slot": Slot(**meta)})


def zero(spec, P):
    return 0


@dataclass
class SlotState:
    """The runner's per-slot device tensors (see the module docstring); a field a runner has no
    use for (the draft side without a drafter) is None. n_tokens: the pending token is
    tokens[n_tokens - 1], at position n_tokens - 1; the cache holds positions < n_tokens - 1."""

    # target side
    tokens: torch.Tensor = per_slot(shape=("L",), step=True)  # target ids: prompt, then generated
    n_tokens: torch.Tensor = per_slot(free=1, step=True, admit=lambda spec, P: P)
    prompt_len: torch.Tensor = per_slot(admit=lambda spec, P: P)
    budget: torch.Tensor = per_slot(admit=lambda spec, P: P + spec.max_new_tokens)  # the most n_tokens
    done: torch.Tensor = per_slot(dtype=torch.bool, free=True, step=True, admit=lambda spec, P: False)
    temperature: torch.Tensor = per_slot(dtype=torch.float32, admit=lambda spec, P: spec.temperature)
    top_p: torch.Tensor = per_slot(dtype=torch.float32, admit=lambda spec, P: spec.top_p)
    seed: torch.Tensor = per_slot(admit=lambda spec, P: spec.seed)
    row_k: torch.Tensor = per_slot(admit=lambda spec, P: spec.num_draft_tokens or 0)  # fixed k (0: adaptive)
    timestamps: torch.Tensor = per_slot(dtype=torch.bool, admit=lambda spec, P: spec.timestamps)
    max_initial_ts: torch.Tensor = per_slot(admit=lambda spec, P: spec.max_initial_timestamp)
    # decoder output that predicted the token at each index (greedy rows' log-probabilities)
    hidden: torch.Tensor = per_slot(dtype=torch.float32, shape=("L", "D"), step=True)
    sum_logprob: torch.Tensor = per_slot(dtype=torch.float64, step=True, admit=zero, output="sum_logprob")
    no_speech: torch.Tensor = per_slot(dtype=torch.float32, admit=zero, output="no_speech_prob")
    drafted: torch.Tensor = per_slot(step=True, admit=zero, output="drafted")
    accepted_total: torch.Tensor = per_slot(step=True, admit=zero, output="accepted")
    target_passes: torch.Tensor = per_slot(step=True, admit=lambda spec, P: 1, output="target_passes")  # the prefill
    draft_passes: torch.Tensor = per_slot(step=True, admit=zero, output="draft_passes")
    # accepted drafts in the last iteration (-1: none proposed)
    accepted_now: torch.Tensor = per_slot(step=True, admit=lambda spec, P: -1)
    # draft side
    dtokens: torch.Tensor = per_slot(shape=("L",), side="draft", step=True)  # draft ids
    dn: torch.Tensor = per_slot(side="draft", step=True, admit=zero)  # the draft's sequence length
    dcached: torch.Tensor = per_slot(side="draft", step=True, admit=zero)  # leading draft tokens in its cache
    # the row's draft has started (and may propose); it starts at the row's first drafting iteration
    draft_on: torch.Tensor = per_slot(dtype=torch.bool, side="draft", admit=lambda spec, P: False)
    raw: torch.Tensor = per_slot(shape=("K",), side="draft", moves=False, step=True)  # last proposals, draft ids
    # last proposals in target ids (-1: none), read by verify
    proposals: torch.Tensor = per_slot(shape=("K",), side="draft", moves=False, step=True)
    # the logits each proposal was raced from (its q), read by the rejection test
    draft_logits: torch.Tensor = per_slot(dtype=torch.float32, shape=("K", "V"), side="rejection", moves=False)

    @classmethod
    def allocate(cls, slots: int, sizes: dict[str, int], sides: set[str], device) -> SlotState:
        """`sizes`: the sizes named in the fields' shapes ("L", "K", "V", "D"); `sides`: the sides to
        allocate ("target" always)."""
        state = cls()
        for f in fields(cls):
            meta = f.metadata["slot"]
            if meta.side == "target" or meta.side in sides:
                shape = (slots, *(sizes[n] for n in meta.shape))
                setattr(state, f.name, torch.full(shape, meta.free, dtype=meta.dtype, device=device))
        return state

    def parts(self) -> list[tuple[torch.Tensor, Slot]]:
        """(tensor, metadata) of every allocated field."""
        out = []
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None:
                out.append((t, f.metadata["slot"]))
        return out

    def admit(self, s: int, spec, P: int) -> None:
        """Slot `s`'s values at admission (the prompt itself is written by the runner)."""
        for t, meta in self.parts():
            if meta.admit is not None:
                t[s] = meta.admit(spec, P)

    def move(self, src: int, dst: int) -> None:
        for t, meta in self.parts():
            if meta.moves:
                t[dst] = t[src]

    def step_tensors(self) -> list[torch.Tensor]:
        """The tensors a step changes (besides cache entries at positions it rewrites from these)."""
        return [t for t, meta in self.parts() if meta.step]

    def rewind(self) -> Callable[[], None]:
        """Save the step state -> a function restoring it (`StepGraphs.run`'s `rewind`)."""
        tensors = self.step_tensors()
        saved = [t.clone() for t in tensors]

        def restore() -> None:
            for t, s in zip(tensors, saved):
                t.copy_(s)
        return restore

    def outputs(self, s: int) -> dict[str, Any]:
        """The SeqOutput fields read from slot `s`'s tensors."""
        return {meta.output: t[s].item() for t, meta in self.parts() if meta.output is not None}


@dataclass
class HostSlot:
    """The host's record of one slot (moved whole with its row)."""

    spec: SeqSpec | None = None  # the sequence's options (mode decisions, adaptive k); None: free
    n: int = 0  # n_tokens as of the last `Runner.progress` read
    budget: int = 0  # the most n_tokens (known from the spec)
    draft_pending: tuple | None = None  # (spec, features, draft mel) of a row whose draft starts later

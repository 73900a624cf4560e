"""The scheduler: requests wait, are admitted into free runner slots between iterations, and leave
when finished (their slot freed, the running rows compacted so they stay a prefix).

A request is a *job* that yields windows to decode one after another (one window for audio of at
most 30 s; openai-whisper's seek loop for long audio) and records each window's output. Windows of
different requests share the running batch; each carries its own options (temperature, top_p,
seed, language, task, k), so greedy and sampled requests run together.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..results import Stats, Transcription
from .runner import Progress
from .slots import SeqOutput, SeqSpec


@dataclass
class Window:
    """One 30 s window a job wants decoded."""

    mel: torch.Tensor  # [n_mels, 3000]
    spec: Callable[[str | None], SeqSpec]  # the sequence to decode, given the (detected) language
    language: str | None  # None: detect it from this window (multilingual targets)
    features: torch.Tensor | None = None  # the target encoder's output, kept for retries
    draft_mel: torch.Tensor | None = None  # [draft's n_mels, 3000] for a draft with its own mel
    # front end (`Drafter.own_mels`), from the same audio; None: the target's mel serves


class Job(Protocol):
    def next_window(self) -> Window | None: ...
    def record(self, output: SeqOutput, language: str | None) -> None: ...
    def result(self) -> Transcription: ...


class RequestFuture(Future):
    """A Future whose `cancel()` also abandons a request already being decoded: the scheduler
    frees its slot at the next iteration (the future then raises CancelledError)."""

    abandoned = False

    def cancel(self) -> bool:
        if super().cancel():
            return True
        if not self.done():
            self.abandoned = True
        return False


@dataclass
class Request:
    job: Job
    future: RequestFuture
    window: Window | None = None
    started: float = 0.0
    stats: Stats = field(default_factory=Stats)
    tokens_out: int = 0  # generated tokens incl. EOT, all windows


class Scheduler:
    def __init__(self, runner, draft_skip: Callable[[str | None, str], str | None]):
        self.runner = runner
        self.draft_skip = draft_skip  # why the draft stands aside for (language, task), or None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # index = slot

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- admission
    def schedule(self) -> list[Request]:
        """Admit waiting windows into free slots (encoder, language, prefill) -> the admitted.

        A request whose admission raises (its job, the encoder, language detection, the prefill:
        out of memory, a bad window) ends with that exception and leaves no slot behind; the
        others are admitted as usual."""
        free = self.runner.max_batch - len(self.running)
        joining = []
        while self.waiting and len(joining) < free:
            req = self.waiting.popleft()
            if req.window is None:  # a new request
                if not req.future.set_running_or_notify_cancel():
                    continue  # cancelled while waiting
                req.started = time.perf_counter()
                if not self._try(req, lambda r: setattr(r, "window", r.job.next_window())):
                    continue
                if req.window is None:  # nothing to decode (silent audio): the result at once
                    self._finish(req)
                    continue
            elif self._abandon(req):  # cancelled between two of its windows: its next one never runs
                continue
            joining.append(req)
        joining = [r for r in joining if not self._abandon(r)]
        fresh = [r for r in joining if r.window.features is None]
        if fresh:
            # a window's features never depend on the windows encoded beside it (`encode_windows`)
            try:
                features = self.runner.encode_windows([r.window.mel for r in fresh])
            except Exception as exc:
                for r in fresh:
                    self._fail(r, exc)
                joining = [r for r in joining if r.window is not None]
            else:
                for r, f in zip(fresh, features):
                    r.window.features = f
                    if hasattr(r.job, "keep_features"):  # fallback retries reuse the encoder output
                        r.job.keep_features(f)
        detect = [r for r in joining if r.window.language is None and self.runner.target.tokenizer.multilingual]
        if detect:
            try:
                codes = self.runner.detect_language(torch.stack([r.window.features for r in detect]))
            except Exception as exc:
                for r in detect:
                    self._fail(r, exc)
                joining = [r for r in joining if r not in detect]
            else:
                for r, code in zip(detect, codes):
                    r.window.language = code
        specs: dict[int, SeqSpec] = {}
        joining = [r for r in joining if self._try(r, lambda r: specs.__setitem__(id(r), self._spec(r)))]
        # windows whose prompts are one length share one prefill where the runner's rows are
        # independent of each other (`Runner.admits_together`); a group whose admission raises is
        # admitted again one window at a time, so only the windows that fail alone fail
        groups: dict[int, list[Request]] = {}
        together = len(joining) > 1 and self.runner.admits_together()
        for r in joining:
            groups.setdefault(len(specs[id(r)].prompt) if together else id(r), []).append(r)
        admitted = []
        for group in groups.values():
            if len(group) > 1:
                try:
                    self._admit(group, [specs[id(r)] for r in group])
                except Exception:
                    pass
                else:
                    admitted += group
                    continue
            admitted += [r for r in group if self._try(r, lambda r: self._admit([r], [specs[id(r)]]))]
        return admitted

    def _spec(self, req: Request) -> SeqSpec:
        """The sequence `req`'s window decodes (the draft stood aside where it does not apply)."""
        spec = req.window.spec(req.window.language)
        drafter = self.runner.drafter
        reason = self.draft_skip(spec.language, spec.task) if drafter is not None else None
        if reason is None and drafter is not None and drafter.own_mels and req.window.draft_mel is None:
            reason = (f"the draft reads {drafter.own_mels}-bin log-mels and the request came as the target's "
                      "log-mel; give audio to draft it")
        if reason is not None:
            spec.use_draft = False
            req.stats.draft_skipped = reason
        return spec

    def _admit(self, group: list[Request], specs: list[SeqSpec]) -> None:
        """Fill the next free slots with `group`'s windows (prompts of one length)."""
        slot = len(self.running)
        self.runner.admit(slot, specs, [r.window.features for r in group],
                          [r.window.mel if r.window.draft_mel is None else r.window.draft_mel for r in group])
        self.running += group  # only once the slots are filled

    def _try(self, req: Request, admission_step) -> bool:
        """Run one admission step for `req` -> whether it succeeded (else the request failed)."""
        try:
            admission_step(req)
        except Exception as exc:
            self._fail(req, exc)
            return False
        return True

    @staticmethod
    def _fail(req: Request, exc: BaseException) -> None:
        req.window = None
        if not req.future.done():
            req.future.set_exception(exc)

    @staticmethod
    def _abandon(req: Request) -> bool:
        """Whether `req` was cancelled while being decoded (it then fails with CancelledError)."""
        if req.future.abandoned and not req.future.done():
            req.future.set_exception(CancelledError("request cancelled while decoding"))
        return req.future.abandoned

    # ---------------------------------------------------------------- leaving
    def postprocess(self, progress: Progress) -> None:
        """After an iteration: finished rows are recorded, the kept windows that want word
        timestamps get their alignment pass (one batch, over the cross K/V their slots still
        hold), then the finished rows leave (slots compacted)."""
        done = progress.done
        errors: dict[int, BaseException] = {}
        recorded = []
        for slot in range(len(self.running)):
            req = self.running[slot]
            if done[slot] and not req.future.abandoned:
                output = self.runner.output(slot)
                self._account(req, output)
                try:
                    req.job.record(output, req.window.language)
                    recorded.append(slot)
                except BaseException as exc:  # a job's own error ends that request only
                    errors[slot] = exc
        self._align(recorded, errors)
        for slot in sorted(range(len(self.running)), reverse=True):
            req = self.running[slot]
            if done[slot] or req.future.abandoned:
                self._leave(slot, finished=bool(done[slot]), error=errors.get(slot))

    def _align(self, slots: list[int], errors: dict[int, BaseException]) -> None:
        """The alignment pass of every window among `slots` whose job waits for one."""
        waiting = [(s, getattr(self.running[s].job, "alignment_request", None)) for s in slots]
        waiting = [(s, r) for s, r in waiting if r is not None]
        if not waiting:
            return
        try:
            outputs = self.runner.align([s for s, _ in waiting], [r for _, r in waiting])
        except BaseException as exc:  # the pass failed: those requests fail, the others go on
            errors.update({s: exc for s, _ in waiting})
            return
        for (slot, _), output in zip(waiting, outputs):
            try:
                self.running[slot].job.add_alignment(*output)
            except BaseException as exc:
                errors[slot] = exc

    def _leave(self, slot: int, finished: bool, error: BaseException | None = None) -> None:
        req = self.running[slot]
        last = len(self.running) - 1
        if finished and not req.future.abandoned:
            try:
                if error is not None:
                    raise error
                req.window = req.job.next_window()
            except BaseException as exc:  # a job's own error ends that request only
                req.window = None
                req.future.set_exception(exc)
            else:
                if req.window is not None:
                    self.waiting.appendleft(req)  # its next window goes first
                else:
                    self._finish(req)
        elif req.future.abandoned and not req.future.done():
            req.future.set_exception(CancelledError("request cancelled while decoding"))
        if slot != last:
            self.runner.move(last, slot)
            self.running[slot] = self.running[last]
        self.running.pop()

    def _finish(self, req: Request) -> None:
        """The job has no window left: its result (or its error) completes the future."""
        req.stats.seconds = time.perf_counter() - req.started
        try:
            result = req.job.result()
            result.stats = self._final_stats(req)
            req.future.set_result(result)
        except BaseException as exc:
            req.future.set_exception(exc)

    def fail_all(self, exc: BaseException) -> None:
        """An iteration raised: every running request fails with it; the slots are freed."""
        for req in self.running:
            if not req.future.done():
                req.future.set_exception(exc)
        self.running.clear()

    # ---------------------------------------------------------------- stats
    def _account(self, req: Request, out: SeqOutput) -> None:
        s = req.stats
        s.drafted += out.drafted
        s.accepted += out.accepted
        s.target_passes += out.target_passes
        s.draft_passes += out.draft_passes
        req.tokens_out += out.generated

    def _final_stats(self, req: Request) -> Stats:
        s = req.stats
        s.acceptance_rate = s.accepted / s.drafted if s.drafted else 1.0
        s.tokens_per_pass = req.tokens_out / max(s.target_passes, 1)
        return s

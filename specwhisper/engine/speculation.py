"""The speculation controller: each iteration's k, and the clocks and setup charges that feed the
adaptive k (`draft_length.DraftLength`), kept out of the engine's iteration.

`begin(B)` picks k (the largest a row asks for; adaptive rows follow the drafter's running
estimate) and starts the drafts of rows whose draft is still pending (the setup of a draft with its
own encoder is charged to speculation); `drafted()` marks the end of the draft step;
`end(progress)` reads the draft and verify times (the backend's clock: wall clock on a CPU, CUDA
events on a GPU, read after the iteration's one host read, so timing adds no sync) and updates the
estimate.
"""
from __future__ import annotations

import time

from ..backends import Backend
from ..constants import MAX_DRAFT_TOKENS
from .draft_length import DraftLength


class Speculation:
    """Per iteration: how many tokens to draft, and what the adaptive k learns from it."""

    def __init__(self, runner, drafter, backend: Backend):
        self.runner, self.drafter, self.backend = runner, drafter, backend
        self.k = 0  # this iteration's draft steps ...
        self.cap = 0  # ... and the k it asked for (the draft may stop before it, `drafted`)
        self.rule: DraftLength | None = None  # the adaptive estimate this iteration follows
        self.clock = None  # this iteration's (`Backend.clock`)

    def begin(self, B: int) -> int:
        """This iteration's k for the first B rows (0: a plain target step); starts pending drafts."""
        self.k, self.rule = self.choose_k(B)
        self.cap = self.k
        if self.k > 0:
            t0, first = time.perf_counter(), self.drafter.encodes == 0
            started = self.runner.start_drafts(B)
            if started and self.rule is not None and not self.drafter.shared_encoder and not first:
                # a draft's own encoder pass counts against speculation (a shared-encoder draft's
                # setup, its cross K/V and prompt, is small next to what it saves in a window).
                # Not a pass that packs the encoder's weights (oneDNN's int8 layout): tiny.en's first
                # took 365 ms where the next ones took 75-86 (AVX2-only Zen 3); the calibration
                # warms the encoder (`Drafter.warm`); a backend that does not calibrate starts cold
                self.backend.synchronize()
                self.rule.charge(time.perf_counter() - t0, started)
            # the draft catches up on the tokens of the plain steps before this iteration: a cost
            # of resuming, paid once per run of plain steps, not per draft step; timed into the
            # iteration it made a k = 1 probe after 16 plain steps look 3x too costly, and the
            # inflated draft cost kept speculation off for the rest of a recording
            self.runner.sync_draft(B)
        self.clock = self.backend.clock()
        return self.k

    def drafted(self, k: int) -> None:
        """The draft step has been issued (the verify step's time starts here), k draft steps run
        (fewer than asked where the draft stopped early: the estimate learns from what ran)."""
        self.k = k
        self.clock.mark()

    def end(self, progress) -> None:
        """After the iteration's host read (`Runner.progress`): feed the adaptive k."""
        self.clock.mark()
        if self.rule is not None:
            # the next decision may leave the setup out if every row goes on in a window whose
            # draft has started (a row that ends here makes room for a window yet to pay one)
            # how far into their windows the rows whose drafts would start are (`choose_k` checks
            # again once windows come in for the rows that end here)
            generated = self.runner.pending_generated(len(progress.done))
            self.rule.paid = not any(progress.done) and generated is None
            self.rule.generated = generated or 0.0
            draft_seconds, verify_seconds = self.clock.intervals()
            self.rule.update(self.k, progress.accepted, progress.done, draft_seconds=draft_seconds,
                             verify_seconds=verify_seconds, cap=self.cap)
            hosts = self.runner.hosts
            for s in (s for s, done in enumerate(progress.done) if done and hosts[s].spec.use_draft):
                self.rule.window_done(progress.n_tokens[s] - len(hosts[s].spec.prompt))

    def calibrate(self) -> None:
        """The adaptive k's pass costs (`Drafter.costs`) and a warm draft, where the backend
        calibrates and it has not yet: before the first adaptive decision, or `Engine.warm_up`."""
        rule = self.drafter.length if self.drafter is not None else None
        if rule is not None and not rule.calibrated and self.backend.calibrates:
            rule.calibrate(**self.drafter.costs(self.backend.device, self.runner.dtype))
            self.drafter.warm(self.backend.device, self.runner.dtype)  # so that every start is timed

    def choose_k(self, B: int) -> tuple[int, DraftLength | None]:
        """The largest k a row asks for (rows with a smaller fixed k propose fewer); adaptive rows
        follow the drafter's running estimate."""
        if self.drafter is None:
            return 0, None
        specs = [sp for sp in self.runner.specs(B) if sp.use_draft]
        if not specs:
            return 0, None
        adaptive = any(sp.num_draft_tokens is None for sp in specs)
        k = max((sp.num_draft_tokens or 0) for sp in specs)
        rule = self.drafter.length if adaptive else None
        if adaptive:
            self.calibrate()
            # a probe measures acceptance where a draft runs already: it does not pay a draft's
            # own encoder worth more than a probe interval of plain steps (tiny.en's float32
            # encoder on an AVX2 CPU: a probe per fresh window cost that window its setup)
            generated = self.runner.pending_generated(B)
            pending = generated is not None
            probe_needs_setup = (rule.probing() and not self.drafter.shared_encoder and not rule.setup_is_cheap()
                                 and pending)
            if pending and (rule.paid or rule.generated != generated):
                # decided for windows whose setup was spent, or for others than those whose drafts
                # start now (a window admitted since pays its own, over the tokens it has left)
                rule.paid, rule.generated = False, generated
                if rule.k > 0 and not rule.probing() and not rule.pays():
                    rule.k = 0
            k = max(k, 0 if probe_needs_setup else rule.k)
        room = max(h.budget - h.n for h in self.runner.hosts[:B]) - 1
        return max(0, min(k, MAX_DRAFT_TOKENS, room)), rule

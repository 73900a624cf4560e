"""The adaptive number of draft tokens: `DraftLength`, which the speculation controller
(speculation.py) asks for each iteration's k, from the draft's and the target's measured pass
costs (`Drafter.costs`, draft.py) and the acceptance observed per proposal position."""
from __future__ import annotations

from ..constants import MAX_ADAPTIVE_K as MAX_K


def fit_line(points) -> tuple[float, float]:
    """(a, b) of y ≈ a + b·x by weighted least squares over (x, weight, y), b >= 0 (a flat line
    through the weighted mean where the fit slopes down, or where every x is the same)."""
    total = sum(w for _, w, _ in points)
    mx = sum(w * x for x, w, _ in points) / total
    my = sum(w * y for _, w, y in points) / total
    sxx = sum(w * (x - mx) ** 2 for x, w, _ in points)
    b = max(sum(w * (x - mx) * (y - my) for x, w, y in points) / sxx, 0.0) if sxx > 0 else 0.0
    return my - b * mx, b


class DraftLength:
    """How many tokens to draft next.

    Fixed when the user gives `num_draft_tokens`. Otherwise adaptive. In units of one plain pass
    (a one-row target step), an iteration drafting k tokens costs k·c + v(k+1) and emits
    E(k) = 1 + Σ_{j≤k} p_1···p_j tokens on average, where
    - c = (draft step time) / (plain pass time), and v(r) = (target pass over r rows) / (plain
      pass): both measured once on scratch caches before the first decision (`calibrate`: on a
      CPU each verify row adds arithmetic, v(5) ≈ 1.1-1.7 by machine; the draft step of a small model costs
      far more than its bytes suggest), then kept up to date from the timed iterations: every
      EXPLORE-th speculative iteration drafts k ± 1, so the passes next to the one in use are
      timed too, and v(r) for r >= 2 is the line fitted to them (`_new_verify_ratio`);
    - a draft that may stop before k (`DraftSide.stop_margin`: an adaptive row stops after a
      proposal it is unsure of) makes proposal j with probability g_1···g_(j-1), g_j how often it
      went on past j (counted; prior: it goes on): an iteration then costs the expected draft steps
      and the verify passes over the rows it made, and a stop counts as a proposal not kept in p_j
      (without stops both reduce to the above);
    - p_j is the acceptance of proposal j given the j - 1 before it were accepted, counted over
      recent iterations that reached j (exponentially weighted, with the pooled rate
      α = accepted / (accepted + rejections) as a prior): the rate depends on the position (base's
      distilled draft: p_1..p_4 ≈ 0.74, 0.72, 0.62, 0.48), one geometric rate overvalues long drafts;
    - a draft with its own encoder pays a setup per window (that encoder pass, `charge`), spread
      over the tokens its window has yet to generate: s = setup / max(W − g, W / 8), W the running
      number of tokens per window, g those its window has generated (`generated`, set by the
      engine), the setup in plain passes too (timed beside one, so a busy spell does not shift
      the balance; followed as every running cost, but two starts in a row timed beyond twice the
      estimate set it to the lower of them: a changed cost, not a busy moment). Once
      every live row's draft has started (`paid`: the setup of their windows is spent), s is 0:
      whether to go on drafting in those windows depends only on what the drafting costs from
      there on.
    The gain of k is 1 / ((k·c + v(k+1)) / E(k) + s); k in 1..8 maximizes it. Speculation runs
    while the best gain exceeds MARGIN and, once both are measured (speculation over at least
    MEASURED_TOKENS tokens), the speculative iterations' emitted tokens per second (setup
    included) beat the plain steps' by MARGIN too; switching back on a draft whose start is not
    cheap, once it has drafted, takes START_MARGIN instead (hysteresis: an estimate near MARGIN
    must not pay an encoder pass to switch on, then off). A plain step is timed only on warm
    caches: right after a speculative iteration the target's weights are out of the caches (the
    draft's steps ran in between), and a window's first COLD_STEPS steps follow its encoder pass
    (an engine's first, the calibration's passes too), so such a step, slower than plain decoding,
    is not counted and another plain step follows it. Two plain steps every 32 speculative
    iterations keep the plain rate fresh (every 128 while the measured speculative rate beats it
    by CLEAR, a verdict the next window's first iterations keep); a window's end leaves the
    measured speculative rate little weight (NEW_WINDOW_TOKENS), so each window starts from the
    model and is measured anew; while speculation is off, a k = 1 probe keeps the acceptance fresh
    and its own rate stands for the measured one (the stretch that switched speculation off no
    longer decides), after 16 plain steps and then, while probes keep losing, after twice as many
    each time up to PROBE_MAX, but only where a draft that is always right would pay (at the lower
    of the measured and calibrated verify costs, `always_right_gain`; so a self draft, or one
    whose setup outweighs any saving, never drafts), and, when a draft's start costs
    more than CHEAP_SETUP plain passes (its own encoder), only in windows whose draft runs already
    (the engine does not let a probe pay that encoder). The first iterations are plain steps
    (COLD_STEPS untimed, then one timed); an engine's first TRIAL speculative iterations are a
    trial of any draft that would pay were it always right, whatever its start costs, so that
    measurements, not the calibration alone, decide; a draft whose start is not cheap, once
    switched off, gets another trial at a window's start after RETRIAL windows off (then twice as
    many, up to RETRIAL_MAX; RETRIAL again once a window ends drafting, past its trial), so that its
    costs are measured again. The estimates live in the engine's drafter,
    so they carry over between calls.
    """

    REFRESH = 16  # plain steps between speculative probes ...
    # ... doubled after each lost probe up to this many: a k = 1 probe that keeps none of its
    # proposal loses by chance (an acceptance of 0.85: one probe in 7), and a draft worth 1.27x
    # kept off by a few such probes in a row waited thousands of plain steps for the next one
    # (simulated; at most 1% of a useless draft's time goes to probes every 64 plain steps)
    PROBE_MAX = 64
    # a draft start costing at most this many plain passes is cheap (`setup_is_cheap`): a shared
    # encoder draft's (base's distilled: its cross K/V copied, a 4-token prompt pass, ≈ 0.6), not
    # one with its own encoder (tiny.en's, int8 and block-local, held to AVX2: 14-16). At 16,
    # tiny.en's local encoder counted as cheap, got free probes (each paying that encoder), and
    # drafted short windows at 0.91x of target-only (bench/cpu.py) where k = 3 was worth 1.03x
    CHEAP_SETUP = 4.0
    # speculative iterations between plain-step refreshes (two plain steps, the first untimed: as
    # many plain steps a drafted token as one step every 16 iterations) ...
    REFRESH_SPEC = 32
    # ... and CLEAR_SPREAD times as many while the measured speculative rate beats the plain one by
    # CLEAR: a refresh only guards a decision near the margin. base's distilled draft (1.5x decode)
    # spent 23 of its 375 iterations on plain steps, 2% of its decoding time
    CLEAR, CLEAR_SPREAD = 1.3, 4
    DECAY = 0.9  # weight of the past in every running estimate (but the acceptance counts)
    RUN_DECAY = 0.97  # ... in the acceptance counts, per position and pooled (sparser: slower to forget)
    # weight of the pooled acceptance rate in each per-position estimate; the pooled rate decays as
    # the counts it anchors (RUN_DECAY). At weight 2, decayed as the timings (DECAY: ten
    # iterations), the sparse counts of late positions and a pooled rate of the last few proposals
    # moved k from iteration to iteration: replayed (`bench/replay.py`: base's distilled draft, 14
    # bench windows and the demo recording's long-form windows, the engine's measured costs of two
    # memory phases, timings noise-free, noisy, and noisy with slow phases) the adaptive k reached
    # 0.938 and 0.917 of the best fixed k's speed on average, 0.953 and 0.933 with these
    PRIOR = 8.0
    MARGIN = 1.05  # speculation must promise, and measure, this much faster than plain steps
    # ... and this much to switch back on a draft whose start is not cheap (its own encoder pass
    # every window) once it has run: held to AVX2, tiny.en's estimate hovered about MARGIN
    # (0.92-1.04 as the plain pass's timing moved on a busy machine), switched on in a fresh
    # window, paid its encoder (200 ms) and switched off again a few iterations later: 0.83x of
    # target-only on the demo recording in one round. Where it pays (AVX-512: 1.3-1.45 once on)
    # this changes nothing
    START_MARGIN = 1.15
    # the measured speculative rate decides from this many (decayed) tokens on; before, the model
    # does. One first iteration that kept 1 of 3 proposals on cold caches (10 ms a token against 9
    # for plain steps, held to AVX2) switched a draft off before its rate was known, and the lone
    # k = 1 probes that followed could not outweigh it
    MEASURED_TOKENS = 8.0
    # the weight a window's end leaves the measured speculative rate (`window_done`). The rate of a
    # window's last iterations carried over to the next windows and calls: base's distilled draft
    # held to AVX2 was switched off by a hard stretch at the end of the demo recording, and the
    # next call, whose model estimate said 1.16x, decoded all 379 tokens with it off (two k = 1
    # probes could not move the stale rate): 1.00x there, against 1.08-1.10x for calls that drafted
    NEW_WINDOW_TOKENS = MEASURED_TOKENS / 2
    # a draft that would pay if always right gets this many speculative iterations before the
    # model may switch it off: base's long-form distilled draft held to AVX2 missed its first
    # proposals of the demo recording (0 of 2), the model's estimate fell below MARGIN after that
    # one iteration, and probes then kept it off for most of the recording (0.97x; 1.10x at k = 2).
    # A draft whose start is not cheap (its own encoder) gets the trial too, wherever one that is
    # always right would pay at all (gain > 1, not MARGIN): the calibration that alone decided
    # whether it ever drafted times a whole 30 s window's encoder pass and isolated passes, and with
    # the prior acceptance (0.8; tiny.en's per proposal ≈ 0.9) it read tiny.en at 0.88-0.94 where
    # k = 3 decoded 1.12-1.40x faster (bench/cpu.py, natively); never drafting, the estimate was
    # never corrected. tiny.en drafting base on bench windows, alternated in one process against the
    # rule without it (decode, paired with target-only): held to AVX2 0.988x (drafting 109 of 623
    # iterations) -> 1.119x (fixed k = 3: 1.159x); natively, where the calibration let both draft,
    # 1.328x / 1.301x (k = 3: 1.355x). One trial an engine: its first TRIAL speculative iterations
    TRIAL = 4
    # ... and a draft whose start is not cheap, switched off, gets another trial of TRIAL iterations
    # at a window's start after RETRIAL windows, then twice as many each time up to RETRIAL_MAX
    # (while one that is always right would pay, `always_right_gain`). Switched off, such a draft
    # never drafted again (probes do not pay its encoder), so the costs and acceptance its last
    # window measured decided for the engine's life: tiny.en drafting base, whose first window ran on
    # cold caches (the measured acceptance low, the setup the calibration's whole 30 s window), was
    # switched off at its second window's start and decoded the next 24 bench windows at 1.00x of
    # target-only where k = 3 decoded 1.14x faster (AVX2-only Zen 3). A retrial that loses costs
    # about one window's setup: at most a window's worth in RETRIAL_MAX of plain steps
    RETRIAL, RETRIAL_MAX = 4, 32
    # a window's first iterations follow its encoder pass, which has evicted the decoder's weights
    # from the caches: plain steps there are not timed. base on bench/cpu.py's windows (2 threads of
    # a Zen 4 EPYC, ms a step, from the first on): an engine's first window, right after the
    # calibration's passes, 7.38, 3.70, 3.64, then 3.1; later windows 3.47-3.80, 3.14-3.66,
    # 3.09-3.35, then 3.1. The first timed plain pass replaces the calibrated one and, while a
    # draft runs, stays the unit of every cost for long (a refresh every 32-128 iterations): timed
    # at an engine's first step it was 3.72 ms (4.01 in another run) for 12 windows whose plain
    # steps took 3.0 (2.5), so verify rows and tiny.en's draft steps read 20-40% cheaper
    COLD_STEPS = 3
    # how far the first timed plain pass may move the calibrated one (`_new_plain_pass`): rows
    # that need full logits pass about twice as slowly as the calibration's screened head
    FIRST_PLAIN_SPAN = 4.0
    # extra verify cost v(r) - 1 below which a pass's rows count as free (`_new_verify_ratio`)
    FLAT = 0.02
    # while on, every EXPLORE-th speculative iteration drafts one more token than the best k, or one
    # fewer (alternately), so the verify passes next to the one in use are timed in this engine
    # (`_new_verify_ratio`) and the acceptance one position further is counted
    EXPLORE = 8
    # decayed count of timings below which a row count no longer counts as timed lately (one timing
    # 100 iterations ago: 0.97^100 = 0.05)
    LATELY = 0.05

    def __init__(self, fixed: int | None):
        self.fixed = fixed
        self.accepted, self.trials = 4.0, 5.0  # prior α = 0.8, weight of ~5 tokens
        self.cost_ratio = 0.3  # c: draft step / plain pass (prior until `calibrate`)
        self.verify_ratio = [1.0] * (MAX_K + 2)  # v(r), index r = rows (prior: flat, as on a GPU)
        self.calibrated_line = (0.0, 0.0)  # (a, b) of the line fitted to v(r) - 1 as calibrated (flat prior)
        self.calibrated_verify = None  # v(r) as calibrated (`always_right_gain`)
        self.row_sum = [0.0] * (MAX_K + 2)  # decayed sums of the timings of passes over r rows ...
        self.row_weight = [0.0] * (MAX_K + 2)  # ... and their decayed counts
        self.setup = 0.0  # running plain passes' worth of a row's draft start in a window
        self.setup_timed = False  # `charge` has timed a start (not only the calibration)
        # the last start's seconds a row where they were beyond the clip above the estimate (seconds:
        # a new plain pass rescales the costs kept in plain passes, not this)
        self.setup_above = None
        # running tokens per finished window (prior: ≈ 25 s of speech), the first finished window's
        # count at once (`window_done`)
        self.window_tokens = 64.0
        self.windows_seen = False
        # tokens already generated in the windows whose drafts would start next (their mean; set by
        # the engine, `Speculation`): a setup paid late in a window serves only its last tokens.
        # Spread over a whole window, tiny.en's encoder pass (19 plain passes, AVX2-only EPYC)
        # looked worth paying 62 iterations into a 66-iteration window: 0.81x of target-only there
        self.generated = 0.0
        self.calibrated = False
        # every live row's draft has started (its window's setup is spent): set by the engine
        # (`Speculation`) before each decision. Left in, the setup share kept tiny.en off for the
        # rest of a window it had paid its encoder for, after two slow first iterations there
        # (a window of 62 plain steps and one probe; the next windows drafted at 1.2-1.5x)
        self.paid = False
        self.plain_timed = False  # plain_pass comes from an iteration (not only the calibration)
        self.cost_floor = 0.0  # least c (1.0 for a draft as large as the target)
        self.plain_pass = None  # running seconds of one plain pass (k = 0)
        self.spec = None  # running (tokens, seconds) of speculative iterations
        self.plain = None  # running (tokens, seconds) of plain target steps
        self.spec_iters = 0
        self.trial_end = self.TRIAL  # `pays` runs the trial's rule up to this many speculative iterations
        self.off_windows = 0  # windows finished off since the last trial (RETRIAL) ...
        self.retrial_every = self.RETRIAL  # ... and how many start the next one
        self.since_refresh = 0  # speculative iterations since the last plain-step refresh
        self.on = False  # speculation is switched on (refresh plain steps and all)
        self.cleared = False  # the last verdict of `clear` from a measured speculative rate
        self.cold = False  # the last iteration drafted: the next plain step runs on cold caches
        self.window_steps = 0  # iterations since a window started (`window_done`; COLD_STEPS)
        self.probe_every = self.until_probe = self.REFRESH  # plain steps between probes (backs off)
        # adaptive: a timed plain step first (after the untimed cold ones), so that from the first
        # speculative iteration on the two measured rates decide (the model alone kept a self
        # draft on for a window and a half)
        self.k = fixed if fixed is not None else 0
        self.reach = [0.0] * (MAX_K + 1)  # running count of proposals j reached (the j - 1 before accepted)
        self.hit = [0.0] * (MAX_K + 1)  # ... and of those accepted
        # running count of iterations whose draft made proposal j below the cap, and of those that
        # went on to j + 1 (a draft that stops at a small lead, `DraftSide.stop_margin`)
        self.made = [0.0] * (MAX_K + 1)
        self.went_on = [0.0] * (MAX_K + 1)

    def calibrate(self, plain_seconds: float, verify_ratio: list[float], cost_ratio: float,
                  setup_seconds: float) -> None:
        """Start from measured pass costs (`Drafter.measure_costs`) instead of the priors."""
        self.plain_pass = plain_seconds if self.plain_pass is None else self.plain_pass
        self.verify_ratio = list(verify_ratio)
        self.calibrated_verify = list(verify_ratio)
        self.calibrated_line = fit_line([(r - 2, 1.0, v - 1.0) for r, v in enumerate(verify_ratio) if r >= 2])
        self.cost_ratio = cost_ratio
        self.cost_floor = 1.0 if cost_ratio >= 1.0 else 0.0
        self.setup = max(self.setup, setup_seconds / plain_seconds)
        self.calibrated = True

    def setup_share(self, start: bool = False) -> float:
        """s: a window's draft setup per token it has yet to emit, in plain passes (0 once `paid`;
        `start`: at a window's start, for a window yet to begin)."""
        if start:
            return self.setup / self.window_tokens
        if self.paid:
            return 0.0
        return self.setup / max(self.window_tokens - self.generated, self.window_tokens / 8)

    def best(self, always_right: bool = False, verify: list[float] | None = None,
             start: bool = False) -> tuple[int, float]:
        """(k, gain) of the best k (`always_right`: were every proposal accepted; `verify`: these
        verify costs v(r) instead of the running estimate; `start`: in a window yet to begin)."""
        gain, k = max(self.gains(always_right, verify, start))
        return k, gain

    def gains(self, always_right: bool = False, verify: list[float] | None = None,
              start: bool = False) -> list[tuple[float, int]]:
        """[(gain, k)] for k = 1..MAX_K (`best`'s arguments)."""
        verify = self.verify_ratio if verify is None else verify
        alpha = min(self.accepted / self.trials, 0.999)
        expected, survive, gains, s = 1.0, 1.0, [], self.setup_share(start)
        # a draft that may stop early (`DraftSide.stop_margin`) makes proposal j with probability
        # `reached` (g_j: how often it went on past j); at the cap k the iteration costs its expected
        # draft steps and the verify pass over the rows it made (without stops: k·c + v(k+1))
        reached, steps, stopped_cost = 1.0, 0.0, 0.0
        for k in range(1, MAX_K + 1):
            if not always_right:
                survive *= (self.hit[k] + self.PRIOR * alpha) / (self.reach[k] + self.PRIOR)
            # proposal j kept (a stop counts as a proposal not kept, `update`); always right: made
            expected += reached if always_right else survive
            steps += reached
            cost = steps * self.cost_ratio + stopped_cost + reached * verify[k + 1]
            gains.append((1.0 / (cost / expected + s), k))
            go_on = (self.went_on[k] + self.PRIOR) / (self.made[k] + self.PRIOR)  # prior: it goes on
            stopped_cost += reached * (1.0 - go_on) * verify[k + 1]
            reached *= go_on
        return gains

    def always_right_gain(self, start: bool = False) -> float:
        """The gain of the best k were every proposal accepted, at the lower of each row count's
        measured and calibrated verify cost: whether a draft may pay at all (its trial, and probes
        while it is off). At the measured costs alone, one verify pass timed slow against a plain
        pass timed fast wrote a good draft off for good: with a single row count timed, its extra
        cost scales the whole line (`_new_verify_ratio`), no draft that is always right paid at
        those costs, so no probe ever timed a pass again. Replayed on base's distilled draft (its
        teacher-forced agreement on 14 bench windows, 3 passes an engine, costs and timing noise as
        measured in the engine on a Zen 4 EPYC: CV 0.12 a pass and slow phases of 0.15), 7 engines
        of 400 decoded at 0.94-0.98x of plain steps where the rest ran 1.24x or faster; none since."""
        lower = None if self.calibrated_verify is None else \
            [min(m, c) for m, c in zip(self.verify_ratio, self.calibrated_verify)]
        return self.best(always_right=True, verify=lower, start=start)[1]

    def _track(self, current, tokens: float, seconds: float):
        t, s = current if current is not None else (0.0, 0.0)
        return self.DECAY * t + tokens, self.DECAY * s + seconds

    @staticmethod
    def _within(sample: float, estimate: float, span: float = 2.0) -> float:
        """`sample` clipped to within `span` times `estimate`, either way."""
        return min(max(sample, estimate / span), estimate * span)

    def _follow(self, estimate: float, sample: float) -> float:
        """A running estimate moved toward `sample`, clipped to within 2x of the estimate (a busy
        moment of a shared machine must not switch speculation at once)."""
        sample = self._within(sample, estimate)
        return self.DECAY * estimate + (1 - self.DECAY) * sample

    def _new_plain_pass(self, seconds: float) -> None:
        """A plain pass timed in an iteration. The first replaces the calibration's (clipped to
        within FIRST_PLAIN_SPAN of it), which timed the plain greedy path (screened head): rows
        that need full logits (long-form: timestamp rules, log-probabilities) pass about twice as
        slowly on a CPU. Costs kept in plain passes (the draft step c, its setup) keep their
        seconds: they are rescaled with the unit."""
        if self.plain_pass is None:
            new = seconds
        elif not self.plain_timed:
            # within FIRST_PLAIN_SPAN of the calibrated pass: a stalled first timed step would
            # otherwise set the unit of every cost for long (on a CI machine, unclipped, one made a
            # test draft's encoder of 100 passes read cheap enough to probe, CHEAP_SETUP)
            new = self._within(seconds, self.plain_pass, self.FIRST_PLAIN_SPAN)
        else:
            new = self._follow(self.plain_pass, seconds)
        if self.plain_pass:
            # a draft as large as the target (calibrated at c >= 1) stays no cheaper than a pass
            self.cost_ratio = max(self.cost_ratio * self.plain_pass / new, self.cost_floor)
            self.setup *= self.plain_pass / new
        self.plain_pass, self.plain_timed = new, True

    def _new_verify_ratio(self, rows: int, sample: float) -> None:
        """A pass over `rows` rows timed at `sample` plain passes. v(r) for r >= 2 is a line,
        1 + a + b·(r - 2), fitted (weighted least squares, b >= 0) to the running mean timing of
        each row count timed lately (counts decayed by RUN_DECAY an iteration): the first extra
        row costs a jump (another code path than the plain step's; the engine's multi-row pass
        with its acceptance: 1.39 plain passes for 3 rows on a Zen 4 EPYC where the calibration's
        isolated passes read 1.11), each further one its arithmetic. Exploring iterations
        (`explore`) time the row counts beside the one in use, so the line rests on two or three
        of them; a single value per row count, extrapolated, kept the calibration's shape (1.11,
        1.24, 1.52 for 3..5 rows, timed in a slow-memory phase, where the engine's passes read
        1.39, 1.37, 1.48) and held base's distilled draft at k = 2 where k = 3 and 4 decoded
        1.16x and 1.19x faster a token. Timed at one row count only, the others keep the
        calibration's line, scaled to it (what a pass's extra rows cost moves with the machine's
        memory phase: v(5) read 2.0 in one minute and 1.3 in another), or, where the calibration
        is flat (a GPU), stay as they are."""
        sample = self._within(sample, self.verify_ratio[rows])
        self.row_sum = [self.RUN_DECAY * x for x in self.row_sum]
        self.row_weight = [self.RUN_DECAY * w for w in self.row_weight]
        self.row_sum[rows] += sample
        self.row_weight[rows] += 1.0
        timed = [(r, self.row_weight[r], self.row_sum[r] / self.row_weight[r] - 1.0)
                 for r in range(2, MAX_K + 2) if self.row_weight[r] > self.LATELY]
        if len(timed) >= 2:
            a, b = fit_line([(r - 2, w, y) for r, w, y in timed])
            self.verify_ratio[2:] = [1.0 + max(a + b * (r - 2), 0.0) for r in range(2, MAX_K + 2)]
            return
        r0, _, y0 = timed[0]  # rows itself
        a, b = self.calibrated_line
        calibrated = a + b * (r0 - 2)
        self.verify_ratio[r0] = 1.0 + y0
        if calibrated > self.FLAT and y0 > self.FLAT:
            scale = y0 / calibrated
            self.verify_ratio[2:] = [1.0 + max(a + b * (r - 2), 0.0) * scale for r in range(2, MAX_K + 2)]

    def charge(self, seconds: float, rows: int = 1) -> None:
        """A draft setup of `seconds` for `rows` windows (their drafts started)."""
        if self.fixed is None and self.plain_pass:
            per_row = seconds / max(rows, 1) / self.plain_pass
            # the calibration timed a whole 30 s window's pass, the most a start costs (a draft
            # encodes its window's audio only, `Drafter.encode`): the first start timed replaces it
            # where lower. Followed at DECAY a window instead, tiny.en's setup read 118 ms for ten
            # windows whose starts took 75-86 (bench windows of 23-25 s, AVX2-only Zen 3), which
            # kept it off at a window's start where k = 3 decoded 1.14x faster
            first_lower = not self.setup_timed and per_row < self.setup
            above = self.setup > 0 and self._within(per_row, self.setup) < per_row  # clipped by `_follow`
            if not self.setup or first_lower:
                self.setup = per_row
            elif above and self.setup_above is not None:
                # a second start in a row beyond the clip: the cost has changed, not a busy moment,
                # so the estimate takes the lower of the two. Followed a tenth of the way a window,
                # a calibration read back under another kernel hold (tiny.en's bfloat16 encoder:
                # 34 ms natively, 730 ms with oneDNN held to AVX2) had crept up 10% a window and
                # kept the draft on for 10 windows at 0.51-0.55x of target-only
                self.setup, above = min(per_row, self.setup_above / self.plain_pass), False
            else:
                self.setup = self._follow(self.setup, per_row)
            self.setup_above = seconds / max(rows, 1) if above else None
            self.setup_timed = True

    def window_done(self, tokens: int) -> None:
        """A window finished with `tokens` generated tokens (spreads the setup). The measured
        speculative rate keeps its value but drops to NEW_WINDOW_TOKENS of weight: the next
        window's first decisions are the model's (its acceptance and costs are current), and its
        own iterations are measured before the rate decides again."""
        self.window_steps = 0  # the next window's first steps follow its encoder pass (COLD_STEPS)
        if self.fixed is None and tokens > 0:
            # the first window replaces the prior, as the first timed start replaces the calibrated
            # setup (`charge`): followed at DECAY from 64, bench windows of 76 tokens read 65 after
            # the first, 68 after the fourth, so a draft's setup looked spread over a sixth fewer
            # tokens than it was, enough to switch tiny.en off after an engine's first window where
            # k = 3 decoded 1.22x faster (`python bench/replay.py --draft tiny.en --noise 0 --phase 0`)
            self.window_tokens = self.DECAY * self.window_tokens + (1 - self.DECAY) * tokens \
                if self.windows_seen else float(tokens)
            self.windows_seen = True
            if self.spec is not None and self.spec[0] > self.NEW_WINDOW_TOKENS:
                scale = self.NEW_WINDOW_TOKENS / self.spec[0]
                self.spec = (self.spec[0] * scale, self.spec[1] * scale)
            if self.on or self.setup_is_cheap() or self.spec_iters < self.trial_end:
                self.off_windows = 0
                if self.on and self.spec_iters >= self.trial_end:
                    # a window that ended drafting, past any trial: the draft paid again, so the
                    # retrials' back-off starts over. Kept doubled, a draft that a retrial had
                    # switched back on for 9 bench windows, then off in a slow spell, waited 8
                    # windows for the next (tiny.en drafting base, AVX2-only Zen 3)
                    self.retrial_every = self.RETRIAL
            else:
                self.off_windows += 1
                # (whether it could pay in the next window: the share of the setup at its start,
                # not at the end of this one)
                if self.off_windows >= self.retrial_every and self.always_right_gain(start=True) > 1.0:
                    self.trial_end, self.off_windows = self.spec_iters + self.TRIAL, 0
                    self.retrial_every = min(2 * self.retrial_every, self.RETRIAL_MAX)

    def probing(self) -> bool:
        """Whether the next iteration is a k = 1 probe while speculation is off (not a k = 1 the
        model chose with speculation on, after a countdown to a probe: such a choice, taken for a
        probe, never started a draft with its own encoder, `Speculation.choose_k`)."""
        return self.fixed is None and not self.on and self.k == 1 and self.until_probe <= 0

    def setup_is_cheap(self) -> bool:
        """Whether a draft's setup costs at most CHEAP_SETUP plain passes (a probe may pay it)."""
        return self.setup <= self.CHEAP_SETUP

    def pays(self) -> bool:
        if self.spec_iters < self.trial_end:  # the trial (TRIAL, RETRIAL)
            return self.always_right_gain() > (self.MARGIN if self.setup_is_cheap() else 1.0)
        # hysteresis against switching back and forth; before any speculative iteration the
        # acceptance is a prior (0.8: tiny.en's 0.89 measured on AVX-512 looked 0.92-1.05 from it)
        restart = not self.on and self.spec is not None and not self.setup_is_cheap() and not self.paid
        margin = self.START_MARGIN if restart else self.MARGIN
        if self.best()[1] <= margin:
            return False
        if self.spec is None or self.plain is None or self.spec[0] < self.MEASURED_TOKENS:
            return True
        spec_time = self.spec[1] / self.spec[0] + self.setup_share() * (self.plain_pass or 0.0)
        return self.plain[1] / self.plain[0] > margin * spec_time

    def clear(self) -> bool:
        """Whether the measured speculative rate beats the plain steps' by CLEAR. While a window's
        own rate is still under MEASURED_TOKENS (`window_done` leaves the last one little weight),
        the verdict measured before it. Read as not clear, every window start brought a clear
        draft's refresh forward from 128 speculative iterations to 32, so refreshes fell on
        windows' first tokens, whose plain steps are the slowest (timestamps: base on the demo
        recording, tokens 0-3 of a window 4.09 ms against 3.67 from token 24 on), and their
        timings overstated the plain pass (4.3-4.6 against 3.5-3.7 ms), which understated what
        verify rows cost."""
        if self.spec is None or self.plain is None:
            return False
        if self.spec[0] >= self.MEASURED_TOKENS:
            self.cleared = self.plain[1] / self.plain[0] > self.CLEAR * self.spec[1] / self.spec[0]
        return self.cleared

    def explore(self, k: int) -> int:
        """The next speculative iteration's k given the best one: one more or one fewer in every
        EXPLORE-th iteration (alternately; the other way at 1 and MAX_K), else k itself."""
        if self.spec_iters % self.EXPLORE != self.EXPLORE // 2:
            return k
        step = 1 if (self.spec_iters // self.EXPLORE) % 2 == 0 else -1
        return k + step if 1 <= k + step <= MAX_K else k - step

    def update(self, k: int, accepted: list[int], done, draft_seconds: float, verify_seconds: float,
               cap: int | None = None):
        """After an iteration of k draft steps (0: a plain step) under a cap of `cap` (default k;
        more where the draft stopped early): the rows' accepted proposals, and the draft's and the
        verify pass's seconds."""
        cap = k if cap is None else cap
        if self.fixed is not None or cap > MAX_K:  # (a larger fixed k of another row led this one)
            return
        rows = [a for a in accepted if a >= 0]
        tokens, seconds = sum(a + 1 for a in rows), draft_seconds + verify_seconds
        self.window_steps += 1
        if k == 0:
            if self.cold or self.window_steps <= self.COLD_STEPS:
                # the draft's steps have just pushed the target's weights out of the caches; a plain
                # step right after them is not what plain decoding costs (base held to AVX2: 6.8
                # against 6.3 ms, which kept tiny.en drafting at 0.94x): time the next one instead.
                # Nor a window's first steps (COLD_STEPS)
                self.cold = False
                self.k = 0
                return
            self.plain = self._track(self.plain, tokens, seconds)
            if verify_seconds > 0:
                self._new_plain_pass(verify_seconds)
            self.on = self.pays()
            if self.on:
                self.k = self.best()[0]
            elif self.always_right_gain() > self.MARGIN:
                self.until_probe -= 1
                self.k = 1 if self.until_probe <= 0 else 0
            else:
                self.k = 0  # not even a draft that is always right would pay: no probes
            return
        probing = self.probing()
        self.cold = True
        # an engine's first speculative iteration is not timed: its first use of the draft's and
        # the slot's buffers ran at 2.0x a warm iteration (36.8 ms at k = 4, tiny.en drafting base
        # on an AVX2-only Zen 3, where later windows' first iterations ran 0.84-1.29x), and timed,
        # that one pass scaled the whole verify line 3x (v(5) 1.69 -> 3.05): k fell to 1 and the
        # draft was off from the end of the engine's first window until a retrial
        first = self.spec_iters == 0
        if not first:
            # a probe's own rate decides, at the weight of a measured one (not the stretch that
            # switched speculation off, nor the model alone: its acceptance by position is that stretch's)
            self.spec = (self.MEASURED_TOKENS, seconds * self.MEASURED_TOKENS / tokens) if probing and tokens \
                else self._track(self.spec, tokens, seconds)
        self.spec_iters += 1
        succ = sum(rows) / max(len(rows), 1)
        fail = sum(1 for a in rows if a < k) / max(len(rows), 1)
        self.accepted = self.RUN_DECAY * self.accepted + succ
        self.trials = self.RUN_DECAY * self.trials + succ + fail
        self.reach = [self.RUN_DECAY * r for r in self.reach]
        self.hit = [self.RUN_DECAY * h for h in self.hit]
        self.made = [self.RUN_DECAY * m for m in self.made]
        self.went_on = [self.RUN_DECAY * g for g in self.went_on]
        for a in rows:
            for j in range(1, min(a + 1, k) + 1):
                self.reach[j] += 1 / len(rows)
                self.hit[j] += (a >= j) / len(rows)
            if a == k < cap:  # every proposal kept, the draft stopped: the next one counts as not kept
                self.reach[k + 1] += 1 / len(rows)
        for j in range(1, min(k + 1, cap)):  # (the draft's steps: the batch's longest row's)
            self.made[j] += 1
            self.went_on[j] += j < k
        if verify_seconds > 0 and self.plain_pass and not first:
            self._new_verify_ratio(k + 1, verify_seconds / self.plain_pass)
            self.cost_ratio = self._follow(self.cost_ratio, draft_seconds / k / self.plain_pass)
        self.since_refresh += 1
        self.on = self.pays()
        if self.on:
            self.probe_every = self.until_probe = self.REFRESH
            refresh = self.since_refresh >= self.REFRESH_SPEC * (self.CLEAR_SPREAD if self.clear() else 1)
            self.since_refresh = 0 if refresh else self.since_refresh
            self.k = 0 if refresh else self.explore(self.best()[0])
        else:
            if probing:  # a lost probe: wait twice as long before the next one
                self.probe_every = min(2 * self.probe_every, self.PROBE_MAX)
            self.until_probe = self.probe_every
            self.k = 0

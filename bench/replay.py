"""Replay the adaptive k on a draft's teacher-forced agreement, without timing noise deciding.

Question answered: how close does the adaptive controller (`engine.draft.DraftLength`) come to the
best fixed k for a shared-encoder draft, and how often does timing noise lead it astray? Timed runs
move ±15% between minutes on a shared machine, more than the differences between controller rules.
Here acceptance is exact and the timings are a model: greedy speculation from position t keeps
min(k, L(t)) proposals, where L(t) is the run of positions from t at which the draft's argmax under
teacher forcing equals the target's token (the draft's inputs are the target's prefix until its
first miss), so one teacher-forced pass per window gives every k's outcome. The costs come from the
engine: a plain step, and per fixed k the draft steps and the verify pass, each timed inside the
engine on the same windows (or `--costs FILE`, JSON of such a run). Each replayed engine then gets
per-pass timing noise (`--noise`, a coefficient of variation) and slow phases shared by every pass
(`--phase`, an AR(1) in log time over the modelled time), and the controller decides from those noisy
timings as in the engine (the rule's own code, driven as `engine.speculation` drives it for one row);
its speed is against plain steps in the same phases.

A draft with its own encoder (tiny.en drafting base) pays a setup, its encoder pass, in each window
where it starts (timed in the engine, `Drafter.encode`), and a probe never pays it, as in the engine.
Its agreement comes from the engine's own (compact) draft instead of teacher forcing: iterations at
the largest k give L(t) at every position but the bonus ones after a fully kept run (those drawn at
the measured agreement rate). `--split` gives the draft's side (its steps and its setup: arithmetic)
slow phases of its own, apart from the target's (memory): other work on a shared machine slows
the two unequally.

    python bench/replay.py --draft base-2l --windows 14 --engines 200
    python bench/replay.py --draft ~/drafts/mine --costs costs.json --noise 0.08 --phase 0
    python bench/replay.py --draft tiny.en --windows 8 --engines 40 --split 1
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specwhisper.engine.draft_length import MAX_K, DraftLength  # noqa: E402

KS = range(1, MAX_K + 1)


def agreement_runs(target, draft, audios) -> list[list[bool]]:
    """Per window: whether the draft's argmax equals the target's greedy token at each position
    after the prompt (EOT last), under teacher forcing on the target's tokens."""
    from specwhisper import Engine
    from specwhisper.tools import distill

    engine = Engine(target, background=False)
    decoder = distill.init_draft_decoder(engine.target.model, 2)
    try:
        distill.load_draft_decoder(decoder, Path(draft))
    except ValueError as e:
        raise SystemExit(f"{draft}: not a 2-layer draft sharing the target's encoder ({e}); "
                         "replay needs a `specwhisper distill` draft") from None
    tok, captured = engine.target.tokenizer, []
    hook = engine.target.model.encoder.register_forward_hook(lambda m, a, out: captured.append(out))
    runs = []
    with torch.inference_mode():
        for audio in audios:
            captured.clear()
            result = engine.transcribe(audio, language="en")
            k, v = distill.cross_kv(decoder, captured[0][:1].float())
            seq = tok.prompt("en", "transcribe") + list(result.tokens) + [tok.eot]
            hidden = distill.teacher_forced_hidden(decoder, k, v, torch.tensor([seq[:-1]]))
            p = len(seq) - len(result.tokens) - 2
            logits = decoder.logits(hidden[0, p:]).float().masked_fill(engine.target.suppress, -float("inf"))
            runs.append((logits.argmax(-1) == torch.tensor(seq[p + 1:])).tolist())
    hook.remove()
    return runs


@contextlib.contextmanager
def each_iteration(record):
    """Within the block, `record(speculation, progress)` after every engine iteration (at the end
    of `Speculation.end`: its clock read, its k the iteration's)."""
    from specwhisper.engine import speculation

    original = speculation.Speculation.end

    def end(self, progress):
        original(self, progress)
        record(self, progress)

    speculation.Speculation.end = end
    try:
        yield
    finally:
        speculation.Speculation.end = original


def shares_encoder(target, draft) -> bool:
    """Whether the draft runs on the target's encoder output (as the engine pairs them)."""
    from specwhisper import Engine

    return Engine(target, draft, background=False).drafter.shared_encoder


def engine_runs(target, draft, audios, seed: int = 0) -> list[list[bool]]:
    """Per window, as `agreement_runs`, for a draft with its own encoder: read off the engine's
    iterations at k = MAX_K (its compact draft, as it drafts). An iteration from position t that
    keeps a < k proposals says the draft agrees at t..t+a-1 and not at t+a; one that keeps all k
    leaves its bonus position t+k unknown, drawn at the agreement measured elsewhere (seeded), as is
    position 0 (the prompt pass's token, never drafted)."""
    from specwhisper import Engine

    iterations, engine, runs = [], Engine(target, draft, background=False), []
    with each_iteration(lambda spec, progress: iterations.append((spec.k, progress.accepted[0], progress.done[0]))):
        for audio in audios:
            iterations.clear()
            tokens = len(engine.transcribe(audio, language="en", num_draft_tokens=MAX_K).tokens)
            match = [None]  # the prompt pass's token
            for k, kept, done in iterations:
                if k == 0:
                    raise RuntimeError("a fixed-k engine stepped without drafting")
                match += [True] * kept + [kept >= k and None]
                if done:
                    break
            runs.append(match[:tokens + 1])  # every token, then EOT (a last pass may keep past it)
    known = [x for run in runs for x in run[1:] if x is not None]
    rate, rnd = sum(known) / max(len(known), 1), random.Random(seed)
    return [[rnd.random() < rate if x is None else x for x in run] for run in runs]


def measure_costs(target, draft, audios, rounds: int) -> dict:
    """Seconds of a plain step, and per fixed k of the draft steps (per token) and the verify pass,
    timed inside the engine (`Speculation.end`'s clock) over `rounds` passes of the windows; for a
    draft with its own encoder also its setup, the median encoder pass of a window (`setup`, in
    plain steps; 0 for a draft that shares the target's)."""
    from specwhisper import Engine

    timed: dict = {}

    def record(spec, progress):
        draft_s, *_, verify_s = spec.clock.intervals()
        timed.setdefault(spec.k, []).append((draft_s, verify_s))

    plain = Engine(target, background=False)
    fixed = {k: Engine(target, draft, background=False) for k in KS}
    with each_iteration(record):
        for r in range(rounds + 1):  # the first round warms up
            if r == 1:
                timed.clear()
            for audio in audios:
                plain.transcribe(audio, language="en")
                for k, engine in fixed.items():
                    engine.transcribe(audio, language="en", num_draft_tokens=k)
    step = statistics.median(v for _, v in timed[0])
    setup = 0.0
    drafter = fixed[KS[0]].drafter
    if not drafter.shared_encoder:
        from specwhisper import log_mel_spectrogram

        mels, passes = [log_mel_spectrogram(a) for a in audios], []
        with torch.inference_mode():
            for _ in range(max(rounds, 2)):
                for mel in mels:
                    t0 = time.perf_counter()
                    drafter.encode(mel)
                    passes.append(time.perf_counter() - t0)
        setup = statistics.median(passes) / step
    return {"plain_s": step, "setup": setup,
            "c": [statistics.mean(d for d, _ in timed[k]) / k / step for k in KS],
            "v": [statistics.mean(v for _, v in timed[k]) / step for k in KS]}  # v[k - 1]: k + 1 rows


def run_length(match: list[bool], t: int) -> int:
    n = 0
    while t + n < len(match) and match[t + n]:
        n += 1
    return n


class Phases:
    """Slow phases shared by every pass, as a function of the modelled time (in plain steps): an
    AR(1) in log time advanced once per plain step's worth of time (`rho`), so every rule replayed
    with one seed meets the same phases at the same moments, and so does plain decoding (the
    speeds `replay` reports are against plain steps in the same phases). `split` mixes in the
    draft side's own phase. Drawn per pass instead (the phase a function of how many passes ran),
    rules that ran different passes met different phases, and a speed against unphased plain steps
    read the phases themselves: a mean slowdown of exp(phase² / 2), 4.6% at 0.3, in every rule."""

    def __init__(self, seed: int, phase: float, rho: float, split: float):
        self.rnd, self.phase, self.rho, self.split = random.Random(f"phases {seed}"), phase, rho, split
        self.state, self.t = [0.0, 0.0], 0.0

    def at(self, t: float) -> tuple[float, float]:
        """(the target's factor, the draft side's own factor) at time t (non-decreasing)."""
        while self.phase and self.t < t:
            for i in (0, 1):
                self.state[i] = self.rho * self.state[i] + math.sqrt(1 - self.rho ** 2) * self.rnd.gauss(0.0, self.phase)
            self.t += 1.0
        own = math.exp(self.split * (self.state[1] - self.state[0])) if self.split else 1.0
        return math.exp(self.state[0]), own


def replay(runs, costs: dict, k: int | None, rounds: int = 3, seed: int = 0, noise: float = 0.0,
           phase: float = 0.0, rho: float = 0.98, rule_class=DraftLength,
           split: float = 0.0) -> tuple[float, list[int]]:
    """Decode `runs` (`agreement_runs`) `rounds` times with fixed `k` or the adaptive rule (k None)
    -> (speed against plain steps in the same phases, iterations at each k). The first token of a
    window comes from the prompt pass, as in the engine; a draft never proposes past the window's
    last token. A draft with a setup (`costs["setup"]` plain steps: its own encoder) pays it in
    each window where it starts, charged to the rule, and a probe does not start it.
    split: the share of the draft side's slow phase that is its own (0: one phase for all)."""
    speed, hist = _replay(runs, costs, k, rounds, seed, noise, Phases(seed, phase, rho, split), rule_class)
    if phase:
        speed /= _replay(runs, costs, 0, rounds, seed, noise, Phases(seed, phase, rho, split), rule_class)[0]
    return speed, hist


def _replay(runs, costs: dict, k: int | None, rounds: int, seed: int, noise: float, phases: Phases,
            rule_class) -> tuple[float, list[int]]:
    """`replay` in `phases` -> (tokens per plain step's time, iterations at each k)."""
    rnd = random.Random(seed)
    c = lambda j: costs["c"][j - 1]  # noqa: E731
    v = lambda j: costs["v"][j - 1]  # noqa: E731  (a pass over j + 1 rows)
    setup = costs.get("setup", 0.0)
    rule = rule_class(k)
    if k is None:  # the calibration's isolated passes: here the engine's own, 5% slower a step;
        # a setup timed over a whole 30 s window (the bench windows are ≈ 23 s)
        rule.calibrate(plain_seconds=1.05, verify_ratio=[1.0, 1.0] + [v(j) for j in KS],
                       cost_ratio=c(3), setup_seconds=setup * 1.3 if setup else 0.6)
    seconds = tokens = 0.0
    hist = [0] * (MAX_K + 1)
    for _ in range(rounds):
        for match in runs:
            t, started = 1, False
            while t < len(match):
                j = k if k is not None else rule.k
                if k is None and not started:
                    if rule.paid or rule.generated != t:
                        rule.paid, rule.generated = False, t  # as `Speculation.choose_k` for a pending draft
                        if rule.k > 0 and not rule.probing() and not rule.pays():
                            rule.k = 0
                    j = 0 if setup and rule.probing() and not rule.setup_is_cheap() else rule.k
                j = max(0, min(j, len(match) - t))
                hist[j] += 1
                phase, own = phases.at(seconds)
                f = phase * math.exp(rnd.gauss(0.0, noise))
                if j:
                    kept = min(j, run_length(match, t))
                    if setup and not started:  # (the calibration warms the encoder: every start is timed)
                        start = setup * f * own
                        seconds += start
                        if k is None:
                            rule.charge(start)
                    started = True
                    draft_s, verify_s = j * c(j) * f * own * math.exp(rnd.gauss(0.0, noise)), v(j) * f
                else:
                    kept, draft_s, verify_s = 0, 0.0, f
                t += kept + 1
                seconds += draft_s + verify_s
                if k is None:
                    done = t >= len(match)
                    rule.paid, rule.generated = not done and started, 0.0 if started else t
                    rule.update(j, [kept], [done], draft_s, verify_s)
                    if done:
                        rule.window_done(len(match))
            tokens += len(match) - 1
    return tokens / seconds, hist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="base")
    p.add_argument("--draft", default="base-2l",
                   help="`base-2l`, a distill folder, or a draft with its own encoder (`tiny.en`)")
    p.add_argument("--windows", type=int, default=14)
    p.add_argument("--costs", help="JSON of measured costs (as written to --out) instead of timing them")
    p.add_argument("--rounds", type=int, default=2, help="timed passes over the windows per fixed k")
    p.add_argument("--engines", type=int, default=100, help="replayed engines (seeds) for the adaptive k")
    p.add_argument("--noise", type=float, default=0.12, help="per-pass timing noise (CV)")
    p.add_argument("--phase", type=float, default=0.15, help="slow phases' spread (log time)")
    p.add_argument("--split", type=float, default=0.0,
                   help="share of the draft side's slow phases that is its own (0: shared with the target's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="write the measured costs here (JSON)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from bench.cpu import synthesize_windows
    from specwhisper.tools.cli import model_folder

    target, draft = model_folder(args.target), model_folder(args.draft)
    with tempfile.TemporaryDirectory() as tmp:
        audios = [torch.from_numpy(a) for a, _ in synthesize_windows(args.windows, Path(tmp))]
    own = not shares_encoder(target, draft)
    runs = engine_runs(target, draft, audios) if own else agreement_runs(target, draft, audios)
    costs = json.loads(Path(args.costs).read_text()) if args.costs else measure_costs(target, draft, audios, args.rounds)
    if args.out:
        Path(args.out).write_text(json.dumps(costs, indent=1))
    positions = sum(map(len, runs))
    print(f"{len(runs)} windows, {positions} positions, agreement {sum(map(sum, runs)) / positions:.3f}; "
          f"plain step {1e3 * costs['plain_s']:.2f} ms" +
          (f"; the draft's setup {costs.get('setup', 0.0):.1f} plain steps a window" if own else ""))
    print("| k | c (draft step / plain) | v (verify / plain) | tokens a pass | speed vs plain steps |\n|---|---|---|---|---|")
    fixed = {}
    for k in KS:
        fixed[k], hist = replay(runs, costs, k, rounds=1)
        passes = sum(hist)
        print(f"| {k} | {costs['c'][k - 1]:.3f} | {costs['v'][k - 1]:.3f} | "
              f"{(positions - len(runs)) / passes:.3f} | {fixed[k]:.3f} |")
    best = max(fixed, key=fixed.get)
    speeds, hists = [], [0] * (MAX_K + 1)
    for s in range(args.engines):
        speed, hist = replay(runs, costs, None, seed=s, noise=args.noise, phase=args.phase, split=args.split)
        speeds.append(speed)
        hists = [a + b for a, b in zip(hists, hist)]
    print(f"adaptive k, {args.engines} engines (noise {args.noise}, phases {args.phase}, split {args.split}): "
          f"iterations at k = 0..{MAX_K}: {', '.join(f'{100 * h / sum(hists):.0f}%' for h in hists)}")
    print(f"adaptive k, {args.engines} engines (noise {args.noise}, phases {args.phase}): mean "
          f"{statistics.mean(speeds):.3f} ({statistics.mean(speeds) / fixed[best]:.3f} of k = {best}), "
          f"worst {min(speeds):.3f}, below 1.0: {sum(s < 1.0 for s in speeds)}")


if __name__ == "__main__":
    main()

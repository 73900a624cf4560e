"""Does a draft that stops where it is unsure decode faster than one that drafts its whole k?

Question answered: with the adaptive k, what does the draft's stopping rule (`DraftSide.STOP_MARGIN`:
an adaptive row stops drafting after a proposal that leads the draft's next candidate by less than
the margin) do to decoding, judged without the timing noise of a shared machine? For each margin
(0: the rule off) a fresh engine decodes the same windows (bench/cpu.py's flite windows and the
bundled demo recording's first windows) for `--rounds` passes; every iteration's draft steps are
recorded, and the decode is priced at one set of pass costs (a draft step, a verify pass over r
rows and a plain step, timed inside those engines, medians per row count), so two rules compare
on what they ran, not on the minute they ran in. The timed decode (the draft, the verify passes
and the draft's own encoder: the engine's iteration time) is printed beside it. Tokens are checked
against target-only's.

    python bench/stops.py --draft base-2l                 # margins 0 and 2, twice each, alternated
    python bench/stops.py --draft tiny.en --margins 0 1 2 3 --repeat 1
    python bench/stops.py --draft base-2l --fixed 3 4     # beside fixed k (no stops)
    python bench/stops.py --draft base-2l --temperature 0.5 --fixed 3   # sampled rows (their race's leads)
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="base")
    p.add_argument("--draft", default="base-2l")
    p.add_argument("--margins", type=float, nargs="+", default=[0.0, 2.0])
    p.add_argument("--fixed", type=int, nargs="*", default=[], help="also fixed num_draft_tokens values (no stops)")
    p.add_argument("--repeat", type=int, default=2, help="engines per margin (alternated)")
    p.add_argument("--windows", type=int, default=3, help="flite windows (plus 3 of the demo recording)")
    p.add_argument("--rounds", type=int, default=2, help="passes over the windows per engine")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0, help="sampled rows at this temperature (seeded)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from bench.cpu import cpu_model, synthesize_windows
    from specwhisper import Engine, load_audio
    from specwhisper.engine.speculation import Speculation
    from specwhisper.samples import SAMPLES_DIR
    from specwhisper.tools.cli import model_folder

    target, draft = model_folder(args.target), model_folder(args.draft)
    with tempfile.TemporaryDirectory() as tmp:
        audios = [torch.from_numpy(a) for a, _ in synthesize_windows(args.windows, Path(tmp))]
    demo = torch.from_numpy(load_audio(SAMPLES_DIR / "demo.flac"))
    audios += [demo[i * 400_000:(i + 1) * 400_000] for i in range(3)]  # 25 s windows
    print(cpu_model())
    # sampled rows reproduce across drafts and k (the race's noise is keyed by seed, position, token)
    sampled = dict(temperature=args.temperature, seed=args.seed) if args.temperature > 0 else {}
    reference = [Engine(target, background=False).transcribe(a, language="en", **sampled).tokens for a in audios]

    passes = collections.defaultdict(list)  # (draft steps, 0 draft / 1 verify) -> seconds
    current: list[int] = []
    begin, end = Speculation.begin, Speculation.end

    def timed_begin(self, B):
        self._started = time.perf_counter()
        return begin(self, B)

    def timed_end(self, progress):
        end(self, progress)
        draft_s, verify_s = self.clock.intervals()
        current.append(self.k)
        passes[(self.k, 1)].append(verify_s)
        if self.k:
            passes[(self.k, 0)].append(draft_s)
        self._seconds = getattr(self, "_seconds", 0.0) + time.perf_counter() - self._started

    Speculation.begin, Speculation.end = timed_begin, timed_end
    runs = []
    rules = [(f"adaptive, margin {m:g}", m, None) for m in args.margins] + [(f"k = {k}", 0.0, k) for k in args.fixed]
    for _ in range(args.repeat):
        for name, margin, k in rules:
            engine = Engine(target, draft=draft, background=False)
            engine.runner.draft_side.STOP_MARGIN = margin
            current.clear()
            tokens = 0
            for _ in range(args.rounds):
                for audio, want in zip(audios, reference):
                    got = engine.transcribe(audio, language="en", num_draft_tokens=k, **sampled).tokens
                    if got != want:
                        raise SystemExit(f"{name}: tokens differ from target-only's")
                    tokens += len(got)
            runs.append((name, list(current), tokens, engine.speculation._seconds))
    cost = {key: statistics.median(v) for key, v in passes.items()}
    plain = cost[(0, 1)]

    def price(k: int) -> float:
        if k == 0:
            return plain
        return cost[(k, 0)] + cost[(k, 1)]

    print(f"{args.draft} drafting {args.target}, {len(audios)} windows x {args.rounds} rounds; plain step "
          f"{1e3 * plain:.2f} ms; an iteration of k draft steps (draft + verify, ms): " +
          ", ".join(f"{k}: {1e3 * price(k):.1f}" for k in sorted({k for k, _ in cost}) if k))
    print("| rule | iterations | draft steps | tokens | priced ms / token | x plain steps | timed ms / token |")
    print("|---|---|---|---|---|---|---|")
    for name, ks, tokens, seconds in runs:
        priced = sum(price(k) for k in ks) / tokens
        print(f"| {name} | {len(ks)} | {sum(ks)} | {tokens} | {1e3 * priced:.3f} | {plain / priced:.3f} | "
              f"{1e3 * seconds / tokens:.3f} |")


if __name__ == "__main__":
    main()

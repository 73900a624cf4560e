"""Drafts side by side on short-form windows: target-only and each draft (adaptive k unless --k),
whole calls (encoder included), interleaved rounds in one process, the best round of each.

Question answered: does a draft pay on bench/cpu.py's full speech windows, and how does it compare
with another draft measured beside it (e.g. two `specwhisper distill` drafts)? Tokens must be
identical to target-only in every row.

    python bench/drafts.py --drafts ~/drafts/base-2l ~/drafts/base-2l-lf tiny.en
    python bench/drafts.py --drafts tiny.en --k 3 --windows 4 --rounds 3 --vector-level 1
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from cpu import AVX2_ENVIRONMENT, cpu_model, synthesize_windows  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="base", help="HF folder or a fetched name")
    p.add_argument("--drafts", nargs="+", required=True, help="draft folders or fetched names")
    p.add_argument("--k", type=int, default=None, help="draft tokens per verify pass (default: adaptive)")
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vector-level", type=int, choices=[1], default=None,
                   help="1: hold every kernel to AVX2 (as bench/cpu.py --vector-level 1)")
    args = p.parse_args()
    if args.vector_level == 1 and os.environ.get("SPECWHISPER_VECTOR_LEVEL") != "1":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ENVIRONMENT})  # read at load

    import torch

    from specwhisper import Engine, log_mel_spectrogram
    from specwhisper.tools.fetch import NAMES, fetch

    def folder(spec: str) -> Path:
        return fetch(spec) if spec in NAMES else Path(spec).expanduser()

    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}; {args.threads} threads"
          + ("; held to AVX2" if os.environ.get("SPECWHISPER_VECTOR_LEVEL") == "1" else ""))
    windows = synthesize_windows(args.windows, Path(tempfile.mkdtemp()))
    mels = [log_mel_spectrogram(audio) for audio, _ in windows]
    target = folder(args.target)
    engines = {"target-only": Engine(target)} | {d: Engine(target, folder(d)) for d in args.drafts}
    for engine in engines.values():  # builds the C++ ops, calibrates the adaptive k
        engine.transcribe(mels[0], language="en", num_draft_tokens=args.k)
    seconds = {name: [] for name in engines}
    outputs = {}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            outputs[name] = [engine.transcribe(m, language="en", num_draft_tokens=args.k) for m in mels]
            seconds[name].append(time.perf_counter() - t0)
    plain = min(seconds["target-only"])
    want = [o.tokens for o in outputs["target-only"]]
    print(f"{len(mels)} windows, {args.rounds} interleaved rounds, best round; k = {args.k or 'adaptive'}")
    print(f"{'system':40s} {'seconds':>8s} {'speed':>7s}  acceptance  drafted  identical")
    for name, outs in outputs.items():
        drafted = sum(o.stats.drafted for o in outs)
        accepted = sum(o.stats.accepted for o in outs)
        acceptance = f"{accepted / drafted:.2f}" if drafted else "-"
        same = [o.tokens for o in outs] == want
        print(f"{name[-40:]:40s} {min(seconds[name]):8.2f} {plain / min(seconds[name]):6.2f}x  {acceptance:>10s}"
              f"  {drafted:7d}  {'yes' if same else 'NO'}")
        if not same:
            raise SystemExit(f"{name}: tokens differ from target-only")


if __name__ == "__main__":
    main()

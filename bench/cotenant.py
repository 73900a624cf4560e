"""What does one busy process beside the engine cost, at 1 and 2 threads?

Every parallel section of a decode step waits for its slowest thread; when another process keeps
a core busy, the OS parks one of the engine's threads behind it and the section waits for a
scheduler time slice. This times base target-only on `bench/cpu.py`'s synthesized windows (one
batched call, language given, `background=False`), with 0 and `--busy` busy processes (`while True:
pass`) at each thread count, in `--rounds` rounds (each round every cell once, the busy processes
started and stopped around the loaded cells), and prints a markdown table (median and range over
the rounds) with the CPU's model and flags.

    python bench/cotenant.py                    # 2 windows, 1 busy process, threads 2 and 1, 3 rounds
    python bench/cotenant.py --busy 2 --threads 4 2 1 --out bench/results
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu import cpu_model, synthesize_windows  # noqa: E402

from specwhisper import Engine, log_mel_spectrogram  # noqa: E402
from specwhisper.tools.fetch import fetch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--busy", type=int, default=1, help="busy processes in the loaded runs")
    p.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, help="folder for cotenant.json and cotenant.md")
    args = p.parse_args()
    folder = Path("/tmp/specwhisper-cotenant")
    folder.mkdir(exist_ok=True)
    mels = [log_mel_spectrogram(torch.from_numpy(audio), 80) for audio, _ in synthesize_windows(args.windows, folder)]
    engine = Engine(fetch("base"), background=False)
    threads0 = torch.get_num_threads()

    def call(threads: int) -> float:
        torch.set_num_threads(threads)
        start = time.perf_counter()
        engine.transcribe(mels, language="en")
        return time.perf_counter() - start

    call(max(args.threads))  # warm up: the decode ops' build, the caches, the workers
    seconds: dict = {}
    for _ in range(args.rounds):
        for busy in (0, args.busy):
            procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
            try:
                time.sleep(0.3)
                for threads in args.threads:
                    seconds.setdefault((busy, threads), []).append(call(threads))
            finally:
                for proc in procs:
                    proc.kill()
                    proc.wait()
    torch.set_num_threads(threads0)
    lines = [f"# A busy process beside the engine: base target-only, {len(mels)} windows, {args.rounds} rounds", "",
             f"CPU: {cpu_model()}", "", "| busy processes | threads | seconds (median) | range |", "|---|---|---|---|"]
    lines += [f"| {busy} | {threads} | {statistics.median(t):.2f} | {min(t):.2f}–{max(t):.2f} |"
              for (busy, threads), t in seconds.items()]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        rows = [dict(busy=b, threads=t, seconds=v) for (b, t), v in seconds.items()]
        (args.out / "cotenant.json").write_text(json.dumps(dict(machine=cpu_model(), rows=rows), indent=1))
        (args.out / "cotenant.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

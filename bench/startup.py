"""What a fresh process pays before and around its first transcription, phase by phase.

Question answered: of a one-file CLI call (`specwhisper transcribe`), how much is importing,
building the Engine, the first call's one-time work (the C++ ops, packed encoder weights, the
screened head, a draft's cost calibration) and the transcription itself? Each round starts fresh
processes (target-only, then with each draft), so nothing is warm but the OS file cache; phases
are medians over the rounds. The CLI's own wall time on the same audio is timed beside them. A
draft runs twice: with its pass costs kept from an earlier process (`Drafter.costs`, an untimed
process fills them first) and measured in the process (`SPECWHISPER_COSTS_DIR=off`).

    python bench/startup.py                          # base, base + base-2l, 30 s of the demo recording
    python bench/startup.py --rounds 5 --draft base-2l tiny.en --seconds 60
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import specwhisper
from specwhisper import Engine, load_audio
t1 = time.perf_counter()
target, draft, audio_path = sys.argv[1], sys.argv[2] or None, sys.argv[3]
engine = Engine(target, draft)
t2 = time.perf_counter()
audio = load_audio(audio_path)
t3 = time.perf_counter()
out = engine.submit(audio, language="en", timestamps=True).result()
t4 = time.perf_counter()
engine.submit(audio, language="en", timestamps=True).result()
t5 = time.perf_counter()
print(json.dumps(dict(imports=t1 - t0, engine=t2 - t1, first_call=t4 - t3, second_call=t5 - t4,
                      tokens=len(out.tokens))))
"""


def main() -> None:
    import wave

    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu import cpu_model  # bench/cpu.py: the model name and the vector extensions

    from specwhisper.audio import SAMPLE_RATE, load_audio
    from specwhisper.samples import demo_recording
    from specwhisper.tools.fetch import fetch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="base")
    ap.add_argument("--draft", nargs="*", default=["base-2l"], help="drafts (fetched names or folders)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30.0, help="the first S seconds of the demo recording")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp())
    clip = tmp / "clip.wav"
    audio = load_audio(demo_recording()[0])[: int(args.seconds * SAMPLE_RATE)]
    with wave.open(str(clip), "wb") as f:  # 16-bit mono, as the CLI reads any file
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(SAMPLE_RATE)
        f.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    target = str(fetch(args.target))
    systems = [("target-only", "", {})]
    for d in args.draft:
        folder = str(fetch(d))
        # the kept costs, from one untimed process
        subprocess.run([sys.executable, "-c", PROBE, target, folder, str(clip)], capture_output=True, check=True)
        systems += [(f"+ {d}", folder, {}), (f"+ {d}, costs measured", folder, {"SPECWHISPER_COSTS_DIR": "off"})]
    print(f"CPU: {cpu_model()}; {args.seconds:.0f} s of the demo recording; {args.rounds} rounds", flush=True)
    phases = {name: [] for name, _, _ in systems}
    cli = {name: [] for name, _, _ in systems}
    for r in range(args.rounds):
        for name, draft, env in systems:
            env = dict(os.environ, **env)
            done = subprocess.run([sys.executable, "-c", PROBE, target, draft, str(clip)],
                                  capture_output=True, text=True, check=True, env=env)
            phases[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            command = [sys.executable, "-m", "specwhisper.tools.cli", "transcribe", "--target", target,
                       "--language", "en", "--quiet", "--output-format", "txt", "--output-dir", str(tmp / "out"),
                       str(clip)] + (["--draft", draft] if draft else [])
            start = time.perf_counter()
            subprocess.run(command, capture_output=True, check=True, env=env)
            cli[name].append(time.perf_counter() - start)
            print(f"round {r}: {name}: {phases[name][-1]} cli {cli[name][-1]:.2f} s", flush=True)
    keys = ("imports", "engine", "first_call", "second_call")
    print("\n| system | import | Engine() | first call | second call | first - second | CLI wall |")
    print("|---|---|---|---|---|---|---|")
    for name, _, _ in systems:
        med = {k: statistics.median(p[k] for p in phases[name]) for k in keys}
        print(f"| {name} | {med['imports']:.2f} s | {med['engine']:.2f} s | {med['first_call']:.2f} s | "
              f"{med['second_call']:.2f} s | {med['first_call'] - med['second_call']:.2f} s | "
              f"{statistics.median(cli[name]):.2f} s |")


if __name__ == "__main__":
    main()

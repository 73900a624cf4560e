"""Long-form transcription speed and accuracy, side by side in one run: specwhisper target-only,
specwhisper speculative (draft tiny.en) and openai-whisper's `transcribe()`, same weights, same
2-5 minute synthesized recording (flite sentences in several voices, with pauses), CPU; and the
cost of word timestamps as a share of a target-only long-form call.

Question answered: how many seconds of audio does each system transcribe per wall-clock second
(RTFx = audio s / wall s, higher is faster), and at what WER against the script read aloud?
Every system runs openai's long-form algorithm (30 s windows, timestamps, fallback temperatures
0, 0.2, ... 1, previous-text conditioning), one timed run each after a short warm-up.

    python bench/longform.py                  # base + tiny.en, 180 s recording, bench/results
    python bench/longform.py --seconds 300 --threads 2 --out bench/results
    python bench/longform.py --seconds 120 --systems target,words   # word timestamps' share only
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout; whisper_ref (openai loader, flite recordings)

from whisper_ref import flite_recording, openai_whisper  # noqa: E402

from specwhisper import Engine  # noqa: E402
from specwhisper.config import TranscribeOptions  # noqa: E402
from specwhisper.tools.fetch import NAMES, fetch  # noqa: E402
from specwhisper.wer import wer  # noqa: E402


def model_dir(spec: str) -> Path:
    return fetch(spec) if spec in NAMES else Path(spec).expanduser()


def run_specwhisper(engine: Engine, audio, seed: int) -> dict:
    out = engine.transcribe_long(audio, TranscribeOptions(language="en"), seed=seed)
    return dict(text=out.text, segments=len(out.segments),
                temperatures=sorted({s.temperature for s in out.segments}))


def run_specwhisper_words(engine: Engine, audio, seed: int) -> dict:
    """Word timestamps on: the time spent on them (the batched alignment passes, DTW and word
    splitting: the scheduler's `_align`) is measured inside the call."""
    align, spent = engine.scheduler._align, [0.0]

    def timed(*args):
        start = time.perf_counter()
        align(*args)
        spent[0] += time.perf_counter() - start

    engine.scheduler._align = timed
    try:
        start = time.perf_counter()
        out = engine.transcribe_long(audio, TranscribeOptions(language="en", word_timestamps=True), seed=seed)
        wall = time.perf_counter() - start
    finally:
        engine.scheduler._align = align
    return dict(text=out.text, segments=len(out.segments), temperatures=sorted({s.temperature for s in out.segments}),
                words=sum(len(s.words) for s in out.segments), word_seconds=spent[0], word_share=spent[0] / wall)


def run_openai(model, audio, seed: int) -> dict:
    import whisper

    torch.manual_seed(seed)  # openai samples fallback windows from torch's global generator
    out = whisper.transcribe(model, audio, language="en", fp16=False)
    return dict(text=out["text"], segments=len(out["segments"]),
                temperatures=sorted({s["temperature"] for s in out["segments"]}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="base")
    p.add_argument("--draft", default="tiny.en")
    p.add_argument("--seconds", type=float, default=180.0, help="length of the synthesized recording (120-300)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--systems", default="target,draft,words,openai",
                   help="comma list of target (target-only), draft (speculative), words (target-only with "
                        "word timestamps: their share of the call), openai")
    args = p.parse_args(argv)
    chosen = set(args.systems.split(","))
    torch.set_num_threads(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    audio, script = flite_recording(out_dir / "longform-audio", args.seconds, seed=args.seed)
    seconds = len(audio) / 16000
    target = model_dir(args.target)
    target_only = Engine(target) if chosen & {"target", "words"} else None
    systems = {name: system for key, name, system in (
        ("target", "specwhisper target-only", lambda: (target_only, run_specwhisper)),
        ("words", "specwhisper target-only, word timestamps", lambda: (target_only, run_specwhisper_words)),
        ("draft", f"specwhisper speculative ({args.draft})",
         lambda: (Engine(target, model_dir(args.draft)), run_specwhisper)),
        ("openai", "openai-whisper", lambda: (openai_whisper(target), run_openai))) if key in chosen}
    systems = {name: make() for name, make in systems.items()}
    warm = audio[: 16000 * 5]
    rows = []
    for name, (system, run) in systems.items():
        run(system, warm, args.seed)  # warm-up: first-call allocations, lazy imports
        start = time.perf_counter()
        result = run(system, audio, args.seed)
        wall = time.perf_counter() - start
        row = dict(system=name, wall_s=wall, rtfx=seconds / wall, wer=wer([script], [result["text"]]), **result)
        rows.append(row)
        words = (f", word timestamps {row['word_seconds']:.2f} s = {row['word_share']:.1%} of the call "
                 f"({row['words']} words)" if "words" in row else "")
        print(f"{name}: {wall:.1f} s wall, RTFx {row['rtfx']:.2f}, WER {row['wer']:.1%}, "
              f"{row['segments']} segments, temperatures {row['temperatures']}{words}", flush=True)

    report = dict(question="long-form RTFx (audio s / wall s) and WER, one run each", audio_seconds=seconds,
                  target=str(target), draft=args.draft, threads=args.threads, torch=torch.__version__,
                  machine=platform.processor() or platform.machine(), rows=rows,
                  note="Engine.transcribe_long decodes windows with the reference window decoder until "
                       "the runner is wired in; until then the speculative row does not use its draft.")
    (out_dir / "longform-cpu.json").write_text(json.dumps(report, indent=1))
    lines = [f"# Long-form transcription, {seconds:.0f} s synthesized recording, CPU ({args.threads} threads)", "",
             "| system | wall s | RTFx | WER | segments | temperatures used |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['system']} | {r['wall_s']:.1f} | {r['rtfx']:.2f} | {r['wer']:.1%} | {r['segments']} | "
              f"{', '.join(map(str, r['temperatures']))} |" for r in rows]
    lines += [f"\nWord timestamps: {r['word_seconds']:.2f} s of the {r['wall_s']:.1f} s call "
              f"({r['word_share']:.1%}; {r['words']} words)" for r in rows if "words" in r]
    (out_dir / "longform-cpu.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out_dir / 'longform-cpu.json'} and {out_dir / 'longform-cpu.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Randomized requests on the real checkpoints, every engine against its target alone.

Each case draws 1-5 requests (slices of the bundled demo recording from 0.3 s to its whole 104 s,
silence, noise; as a waveform, a tensor, WAV bytes, a FLAC path or a log-mel) with random options
(language, translate, temperature and fallback tuples, top_p, seed, num_draft_tokens,
max_new_tokens, initial_prompt, condition_on_previous_text, timestamps, word timestamps and the
hallucination threshold), submits them together to every engine of the draw's target (base: drafted
by base-2l, tiny.en, itself, base-2l on the graph-shaped path, base-2l in float32, base-2l with
rejection sampling, tiny.en with a pruned head; tiny.en: drafted by base, itself, base-2l, base
with rejection sampling) and checks that each engine's transcriptions equal the target-only
engine's where they must: greedy and seeded race sampling always (text, tokens, segments, word
timings), rejection sampling at temperature 0; that an error is the same ValueError; and that
nothing else raises.

    python tests/fuzz_real.py --seconds 1800 --seed 4      # a long run; the log names every case
`tests/test_fuzz_real.py` runs a few fixed cases in the suite.
"""
from __future__ import annotations

import argparse
import io
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from specwhisper import Engine, load_audio, log_mel_spectrogram
from specwhisper.samples import demo_recording

SR = 16000


def engines(base, tiny, b2l, small: bool = False, background: bool = True) -> dict[str, list[tuple[str, Engine]]]:
    """{target: [(name, engine), ...]}, the target alone first; `small`: a few pairs only;
    `background`: False runs each case's iterations in the calling thread (`Engine.run_until`)."""
    def make(target, draft=None, **kwargs):
        return Engine(target, draft, background=background, **kwargs)

    pairs = {"base": [("base", make(base)), ("base+base-2l", make(base, b2l)), ("base+tiny.en", make(base, tiny))],
             "tiny.en": [("tiny.en", make(tiny)), ("tiny.en+base", make(tiny, base))]}
    if not small:
        pairs["base"] += [("base+self", make(base, base)),
                          ("base+base-2l graph path", make(base, b2l, cuda_graphs=True)),
                          ("base+base-2l float32", make(base, b2l, compact_draft=False, max_batch=3)),
                          ("base+base-2l rejection", make(base, b2l, sampling="rejection", max_batch=2)),
                          ("base+tiny.en pruned head", make(base, tiny, draft_head_tokens=4096))]
        pairs["tiny.en"] += [("tiny.en+self", make(tiny, tiny)), ("tiny.en+base-2l", make(tiny, b2l)),
                             ("tiny.en+base rejection", make(tiny, base, sampling="rejection"))]
    return pairs


def draw_audio(rng: random.Random, demo: np.ndarray) -> tuple[np.ndarray, str]:
    r = rng.random()
    if r < 0.06:
        return np.zeros(int(SR * rng.choice([0.05, 1.0, 31.0])), np.float32), "silence"
    if r < 0.1:
        noise = np.random.RandomState(rng.randrange(99)).randn(int(SR * rng.uniform(0.2, 40)))
        return (0.1 * noise).astype(np.float32), "noise"
    seconds = rng.choice([rng.uniform(0.3, 8), rng.uniform(5, 30), rng.uniform(29, 35), rng.uniform(30, 104)])
    start = rng.uniform(0, max(0.0, len(demo) / SR - seconds))
    return demo[int(start * SR):int((start + seconds) * SR)].copy(), f"demo[{start:.1f} s +{seconds:.1f} s]"


def as_input(x: np.ndarray, kind: str, folder: Path):
    if kind == "tensor":
        return torch.from_numpy(x)
    if kind in ("bytes", "path"):  # 16-bit files: every engine reads the same one
        x = np.clip(x, -1, 1)
        if kind == "bytes":
            buffer = io.BytesIO()
            sf.write(buffer, x, SR, format="WAV", subtype="PCM_16")
            return buffer.getvalue()
        path = tempfile.NamedTemporaryFile(suffix=".flac", dir=folder, delete=False).name
        sf.write(path, x, SR)
        return path
    if kind == "mel":
        return log_mel_spectrogram(torch.from_numpy(x), 80, whole=len(x) > 30 * SR)
    return x


def draw_options(rng: random.Random, target: str) -> dict:
    o = {}
    if rng.random() < 0.3:
        o["language"] = rng.choice(["en", "en", "de", "fr"] if target == "base" else ["en"])
    if target == "base" and rng.random() < 0.12:
        o["task"] = "translate"
    t = rng.choice([None, None, 0.0, 0.0, 0.3, 1.0, (0.0, 0.4, 0.8)])
    if t is not None:
        o["temperature"] = t
    if t not in (None, 0.0) and rng.random() < 0.3:
        o["top_p"] = rng.choice([0.9, 0.5])
    if rng.random() < 0.9:
        o["seed"] = rng.randrange(1000)
    if rng.random() < 0.4:
        o["num_draft_tokens"] = rng.choice([1, 2, 3, 5, 8])
    if rng.random() < 0.2:
        o["max_new_tokens"] = rng.choice([1, 5, 40, 224])
    if rng.random() < 0.15:
        o["initial_prompt"] = rng.choice(["Hello there.", "The weather report, read by four voices."])
    if rng.random() < 0.15:
        o["condition_on_previous_text"] = False
    if rng.random() < 0.3:
        o["timestamps"] = rng.choice([True, False])
    if rng.random() < 0.25:
        o["word_timestamps"] = True
        if rng.random() < 0.4:
            o["hallucination_silence_threshold"] = rng.choice([0.5, 2.0])
    return o


def summary(tr) -> dict:
    """What must be equal: text, tokens, language, duration and every segment as openai's dict
    (`Segment.to_dict`: timing, text, tokens, temperature, scores, words), to the bit."""
    return dict(text=tr.text, tokens=list(tr.tokens), language=tr.language, duration=tr.duration,
                segments=[s.to_dict() for s in tr.segments])


def run(engine: Engine, requests) -> list[tuple]:
    """Submit every request, then collect: ("ok", summary) or ("error", type, message)."""
    futures = []
    for x, options in requests:
        try:
            futures.append(engine.submit(x, **options))
        except Exception as e:  # noqa: BLE001 - compared across engines
            futures.append(e)
    if not engine.background:
        engine.run_until([f for f in futures if not isinstance(f, Exception)])
    out = []
    for f in futures:
        if isinstance(f, Exception):
            out.append(("error", type(f).__name__, str(f)[:200]))
            continue
        try:
            out.append(("ok", summary(f.result(timeout=600))))
        except Exception as e:  # noqa: BLE001
            out.append(("error", type(e).__name__, str(e)[:200], "".join(traceback.format_exception(e))[-800:]))
    return out


def must_equal(name: str, options: dict) -> bool:
    """Whether `name`'s output must equal the target alone's for a request with `options`."""
    t = options.get("temperature")
    if "rejection" in name:  # its sampled tokens depend on the draft
        return t == 0.0
    return t == 0.0 or "seed" in options


def check_case(rng: random.Random, pairs, demo: np.ndarray, folder: Path) -> tuple[list[str], list[tuple]]:
    """One random case -> (problems found, the case's (description, options) per request)."""
    target = rng.choice(["base", "base", "tiny.en"])
    requests, described = [], []
    for _ in range(rng.choice([1, 1, 2, 3, 5])):
        x, desc = draw_audio(rng, demo)
        kind = rng.choice(["wave", "wave", "tensor", "bytes", "path", "mel"])
        options = draw_options(rng, target)
        requests.append((as_input(x, kind, folder), options))
        described.append((f"{desc} as {kind}", options))
    problems, reference = [], None
    for name, engine in pairs[target]:
        results = run(engine, requests)
        for (desc, options), r in zip(described, results):
            if r[0] == "error" and r[1] != "ValueError":
                problems.append(f"{name}: {desc} {options} raised {r[1:]}")
        if reference is None:
            reference = results
            continue
        for (desc, options), a, b in zip(described, reference, results):
            if a[0] != b[0] or (a[0] == "error" and a[1] != b[1]) or (a[0] == "ok" and must_equal(name, options)
                                                                      and a[1] != b[1]):
                problems.append(f"{name}: {desc} {options}\n  alone: {str(a)[:1500]}\n  {name}: {str(b)[:1500]}")
    return problems, described


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=600, help="run cases until this much time has passed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", type=Path, default=None, help="log file (default: fuzz_real_SEED.log here)")
    args = p.parse_args()
    from specwhisper.tools.fetch import fetch

    rng = random.Random(args.seed)
    pairs = engines(str(fetch("base")), str(fetch("tiny.en")), str(fetch("base-2l")))
    demo = np.asarray(load_audio(str(demo_recording()[0])), np.float32)
    end, cases, bad = time.time() + args.seconds, 0, 0
    with open(args.log or f"fuzz_real_{args.seed}.log", "w") as log, tempfile.TemporaryDirectory() as folder:
        while time.time() < end:
            cases += 1
            problems, described = check_case(rng, pairs, demo, Path(folder))
            bad += len(problems)
            for problem in problems:
                print(f"PROBLEM case {cases}: {problem}", file=log, flush=True)
            print(f"case {cases}: {len(problems)} problems; {described}", file=log, flush=True)
        print(f"{cases} cases, {bad} problems", file=log, flush=True)
    print(f"{cases} cases, {bad} problems (log: {log.name})")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

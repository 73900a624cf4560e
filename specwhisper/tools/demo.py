"""`specwhisper demo`: the main job, measured and printed as it is.

Transcribes the bundled ≈ 2 minute recording (samples/demo.flac: four flite voices taking turns)
with openai-whisper's long-form algorithm, target-only and speculative with each draft (by default
base's bundled distilled draft base-2l, which shares base's encoder, and tiny.en, which runs its
own; the draft's length adapts, and the controller switches drafting off where it does not pay),
and with CTranslate2 int8 (the CPU default of faster-whisper) in its own process when `ctranslate2`
is installed. Prints the CPU's vector level, each system's wall time, real-time factor and WER,
and whether each draft's speculative tokens are identical to target-only's.
"""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLE_RATE, FRAMES_PER_SECOND = 16000, 100


@dataclass
class Run:
    system: str
    seconds: float
    text: str
    tokens: list[int] | None = None
    note: str = ""
    speedup: float | None = None  # vs target-only, paired by round (None: seconds over target-only's)


def vector_level() -> str:
    """The CPU's widest vector extensions (from /proc/cpuinfo) and the level torch's kernels use."""
    import torch

    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    levels = [name for name, flag in (("avx2", "avx2"), ("avx512", "avx512f"), ("avx512-bf16", "avx512_bf16"),
                                      ("amx", "amx_tile")) if flag in flags]
    from ..backends import cpu_ops

    holds = cpu_ops.kernel_holds()
    if os.environ.get("CT2_FORCE_CPU_ISA"):  # the demo's CTranslate2 worker inherits it
        holds["CT2_FORCE_CPU_ISA"] = os.environ["CT2_FORCE_CPU_ISA"]
    held = [f"{name}={value}" for name, value in holds.items()]

    ops = ("decode ops: " + ("scalar", "AVX2", "AVX-512")[min(cpu_ops._ops().vector_level(), 2)] + ", "
           if cpu_ops.available() else "decode ops: off (PyTorch ops), ")
    return (f"{' + '.join(levels) or 'unknown'} ({ops}torch kernels: {torch.backends.cpu.get_cpu_capability()}"
            + (f"; held by {', '.join(held)}" if held else "") + ")")


def status(text: str, progress: bool = False) -> None:
    """A status line on stderr, rewritten in place on a terminal. Elsewhere (a log file, a pipe)
    plain lines without escape codes: the phases only, not each window's `progress`."""
    if sys.stderr.isatty():
        print(f"\r\033[K{text}", end="", file=sys.stderr, flush=True)
    elif text and not progress:
        print(text.strip(), file=sys.stderr, flush=True)


def transcribe(engine, mel, label: str, duration: float, **kwargs):
    """Long-form transcription of the whole-recording log-mel, with a progress line."""
    def progress(seek: int, frames: int) -> None:
        status(f"  {label}: {min(seek, frames) / FRAMES_PER_SECOND:5.1f} / {duration:.1f} s of audio", progress=True)

    start = time.perf_counter()
    out = engine.submit(mel, language="en", timestamps=True, seed=0, progress=progress, **kwargs).result()
    seconds = time.perf_counter() - start
    status("")
    return out, seconds


def ctranslate2_run(name: str, mel: np.ndarray, tokenizer, threads: int, compute_type: str) -> Run:
    """CTranslate2 on the original checkpoint of `name`, in its own process (`ct2_longform`)."""
    from .fetch import ct2_dir

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mel.npy"
        np.save(path, mel)
        cmd = [sys.executable, "-m", "specwhisper.tools.ct2_longform", str(ct2_dir(name)), str(path), str(threads),
               compute_type, json.dumps(tokenizer.sot_sequence("en", "transcribe")),
               str(tokenizer.timestamp_begin), str(tokenizer.eot)]
        env = dict(os.environ)
        if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2":
            env.setdefault("CT2_FORCE_CPU_ISA", "AVX2")  # hold CTranslate2's own kernels to AVX2 as well
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"CTranslate2 worker failed: {done.stderr.strip()[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return Run(f"CTranslate2 {compute_type}", result["seconds"], tokenizer.decode(result["tokens"]),
               note=f"greedy, {result['windows']} windows, no previous-text prompt or fallback")


def run_demo(target: str, drafts: list[str], target_name: str, k: int | None, threads: int,
             seconds: float | None, ct2: bool, repeats: int = 1, draft_names: list[str] | None = None) -> int:
    """Target-only and speculative with each of `drafts` (folders; `draft_names` label them),
    timed in interleaved rounds; returns 1 unless every draft's tokens equal target-only's."""
    import torch

    from .. import Engine, load_audio, log_mel_spectrogram
    from ..backends import cpu_ops
    from ..samples import demo_recording
    from ..wer import wer
    from .fetch import MODELS

    torch.set_num_threads(threads)
    names = draft_names or [Path(d).name for d in drafts]
    path, reference = demo_recording()
    audio = load_audio(path)
    if seconds is not None:
        audio = audio[: int(seconds * SAMPLE_RATE)]
    duration = len(audio) / SAMPLE_RATE
    print(f"CPU: {cpu_ops.cpu_model()}, {threads} threads; vector level: {vector_level()}; huge pages: {cpu_ops.huge_pages()}")
    print(f"Recording: {path.name}, {duration:.1f} s, four voices (reference transcript beside it)")

    status("loading models ...")
    plain = Engine(target)
    specs = [Engine(target, draft) for draft in drafts]
    mel = log_mel_spectrogram(audio, n_mels=plain.n_mels, whole=True)  # [n_mels, frames]: the whole recording
    status("warming up (the first run builds the C++ decode ops) ...")
    warm = mel[:, :1000]
    plain.transcribe(warm, language="en")
    for spec in specs:
        spec.transcribe(warm, language="en", num_draft_tokens=k)
    status("")

    print("Transcribing (openai-whisper's long-form algorithm, greedy with temperature fallback, seed 0)"
          + (f", {repeats} interleaved rounds, medians; 'vs target-only' pairs each round's calls:"
             if repeats > 1 else ":"))
    width = max(len("target-only"), *(len(f"+ {n}") for n in names))
    plain_times, spec_times = [], [[] for _ in specs]
    outs = [None] * len(specs)
    # interleaved: a busy spell of the machine hits every system alike; every other round in
    # reverse, so target-only is not always the first call of a round
    systems = [(None, "target-only")] + list(enumerate(f"+ {n}" for n in names))
    for r in range(repeats):
        for i, label in (systems if r % 2 == 0 else systems[::-1]):
            if i is None:
                a, t = transcribe(plain, mel, label, duration)
                plain_times.append(t)
            else:
                outs[i], t = transcribe(specs[i], mel, label, duration, num_draft_tokens=k)
                spec_times[i].append(t)
            print(f"  {label:{width}s} {t:6.1f} s")
    t_plain = statistics.median(plain_times)
    runs = [Run(f"target-only ({target_name})", t_plain, a.text, a.tokens)]
    for b, name, times in zip(outs, names, spec_times):
        # speedup: the median over rounds of target-only's call over this one's in the same round
        # (calls seconds apart), steadier than a ratio of medians where the machine's speed drifts
        paired = statistics.median(p / t for p, t in zip(plain_times, times))
        runs.append(Run(f"speculative (+ {name}, k={'adaptive' if k is None else k})", statistics.median(times),
                        b.text, b.tokens, note=speculation_note(b.stats), speedup=paired))
    if ct2 and importlib.util.find_spec("ctranslate2") is not None and target_name in MODELS:
        status("  CTranslate2 int8 (own process) ...")
        try:
            runs.append(ctranslate2_run(target_name, mel.numpy(), plain.target.tokenizer, threads, "int8"))
            print(f"  {'CTranslate2':{width}s} {runs[-1].seconds:6.1f} s")
        except (RuntimeError, OSError, ValueError) as exc:
            print(f"  CTranslate2 int8 skipped: {exc}")
        status("")
    elif ct2:
        print("  (CTranslate2 int8 not run: `pip install ctranslate2` and a fetched model name as --target)")

    reference_text = reference if seconds is None else None
    fastest = min(runs[1:len(specs) + 1], key=lambda r: r.seconds)
    print(f"\nTranscript ({fastest.system}):\n  {fastest.text}\n")
    print(f"{'system':44s} {'seconds':>8s} {'x real time':>12s} {'vs target-only':>15s} {'WER':>7s}")
    for run in runs:
        score = f"{wer([reference_text], [run.text]):.1%}" if reference_text else "-"
        print(f"{run.system:44s} {run.seconds:8.1f} {duration / run.seconds:12.1f} "
              f"{run.speedup or t_plain / run.seconds:14.2f}x {score:>7s}" + (f"   {run.note}" if run.note else ""))
    same = [b.tokens == a.tokens for b in outs]
    print()
    for name, ok in zip(names, same):
        print(f"Speculative tokens (+ {name}) identical to target-only: {'yes' if ok else 'NO'} "
              f"({len(a.tokens)} tokens)" + ("" if reference_text else "; WER needs the whole recording"))
    return 0 if all(same) else 1


def speculation_note(stats) -> str:
    if stats.draft_skipped:
        return f"draft stood aside: {stats.draft_skipped}"
    if stats.drafted == 0:
        return "drafting stayed off: the adaptive controller measured that it does not pay on this CPU"
    return (f"acceptance {stats.acceptance_rate:.2f}, {stats.tokens_per_pass:.2f} tokens per target pass, "
            f"{stats.drafted} drafted")

"""Continuous batching: 16 requests submitted concurrently vs the same 16 one at a time.

Question: how much throughput does one engine gain from decoding concurrent requests together,
with and without a draft, on full speech windows? Reports, in one run: tokens/s and requests/s of
each mode, their ratio, identical tokens, host syncs per iteration, and the cost of one decode
iteration at batch 1, 2, 4, 8 (the weights are read once per iteration whatever the batch).

    python bench/throughput.py                       # base; drafts none, tiny.en, self
    python bench/throughput.py --requests 8 --drafts none
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from specwhisper import Engine, load_audio  # noqa: E402
from specwhisper.samples import sample_paths  # noqa: E402
from specwhisper.tools.cli import model_folder  # noqa: E402


def speech_windows(n: int, seconds: float = 25.0) -> list[np.ndarray]:
    """n windows of about `seconds` of speech: the bundled flite sentences, concatenated with
    0.3 s pauses, each window starting at another sentence."""
    clips = [load_audio(p) for p in sample_paths() if "flite" in p.name]
    pause = np.zeros(4800, dtype=np.float32)
    windows = []
    for i in range(n):
        parts, total, j = [], 0, i
        while total + len(clips[j % len(clips)]) + len(pause) <= seconds * 16000:
            parts += [clips[j % len(clips)], pause]
            total += len(clips[j % len(clips)]) + len(pause)
            j += 1
        windows.append(np.concatenate(parts))
    return windows


def run_mode(engine, audio, concurrent: bool):
    t0 = time.perf_counter()
    if concurrent:
        futures = [engine.submit(a, language="en") for a in audio]
        results = [f.result() for f in futures]
    else:
        results = [engine.transcribe(a, language="en") for a in audio]
    return results, time.perf_counter() - t0


def step_costs(engine, audio, batches=(1, 2, 4, 8), steps: int = 6) -> dict:
    """Seconds per decode iteration (k = 0) with `b` rows running, none joining or leaving."""
    costs = {}
    for b in batches:
        if b > engine.runner.max_batch:
            continue
        eng = Engine(engine.target.path, max_batch=b, background=False)
        futures = [eng.submit(a, language="en") for a in audio[:b]]
        eng.step()  # admission (encoder + prefill) of all b rows
        eng.step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
        for f in futures:
            f.cancel()
        eng.step()
        costs[b] = float(np.median(times))
    return costs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="base")
    p.add_argument("--drafts", nargs="+", default=["none", "tiny.en", "self"])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    from cpu import cpu_model  # bench/cpu.py (bench/ is on the path): the CPU's model and vector extensions

    print(f"CPU: {cpu_model()}", flush=True)
    torch.set_num_threads(args.threads)
    target = model_folder(args.target)
    audio = speech_windows(args.requests)
    rows, reference = [], None
    for name in args.drafts:
        draft = None if name == "none" else target if name == "self" else model_folder(name)
        engine = Engine(target, draft, max_batch=args.max_batch)
        engine.transcribe(audio[0][:16000 * 3], language="en")  # warm-up
        seq, t_seq = run_mode(engine, audio, concurrent=False)
        syncs0, iters0 = engine.host_syncs, engine.iterations
        conc, t_conc = run_mode(engine, audio, concurrent=True)
        tokens = sum(len(r.tokens) + 1 for r in conc)
        same = [a.tokens for a in seq] == [b.tokens for b in conc]
        if reference is None:
            reference = [a.tokens for a in seq]
        rows.append(dict(draft=name, requests=len(audio), tokens=tokens, sequential_s=t_seq, concurrent_s=t_conc,
                         sequential_tok_s=tokens / t_seq, concurrent_tok_s=tokens / t_conc,
                         sequential_req_s=len(audio) / t_seq, concurrent_req_s=len(audio) / t_conc,
                         speedup=t_seq / t_conc, identical_to_sequential=same,
                         identical_to_target_only=[a.tokens for a in conc] == reference,
                         peak_batch=engine.peak_batch,
                         host_syncs_per_iteration=(engine.host_syncs - syncs0) / max(engine.iterations - iters0, 1),
                         acceptance=float(np.mean([r.stats.acceptance_rate for r in conc]))))
        print(json.dumps(rows[-1]), flush=True)
    costs = step_costs(Engine(target, max_batch=args.max_batch), audio)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "throughput.json").write_text(json.dumps(dict(rows=rows, step_seconds=costs), indent=2))
    lines = ["| draft | sequential tok/s | concurrent tok/s | speedup | req/s seq → conc | identical | "
             "syncs/iter | acceptance |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['draft']} | {r['sequential_tok_s']:.1f} | {r['concurrent_tok_s']:.1f} | "
                     f"{r['speedup']:.2f}× | {r['sequential_req_s']:.3f} → {r['concurrent_req_s']:.3f} | "
                     f"{r['identical_to_sequential'] and r['identical_to_target_only']} | "
                     f"{r['host_syncs_per_iteration']:.2f} | {r['acceptance']:.2f} |")
    lines += ["", "| rows | decode iteration (ms) | vs 1 row |", "|---|---|---|"]
    for b, c in costs.items():
        lines.append(f"| {b} | {1000 * c:.1f} | {c / costs[min(costs)]:.2f}× |")
    table = "\n".join(lines)
    (args.out / "throughput.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode-only speed on CPU, side by side in one process: CTranslate2 float32 greedy `generate` on
precomputed encoder output vs specwhisper with the target's encoder output precomputed (target-only,
and speculative with tiny.en / itself as draft; a draft's own encoder is part of its cost).

Question answered: is specwhisper's decode loop (cross K/V, prefill, steps) at least as fast as
CTranslate2's on the same weights and features? Unlike bench/e2e.py, nothing is subtracted: the
encoder is simply not run inside the timed region, for either system.

    python bench/decode_only.py [--rounds 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from specwhisper import Engine, load_audio, log_mel_spectrogram
from specwhisper.samples import sample_paths
from specwhisper.tools.fetch import ct2_dir, fetch


class Precomputed(torch.nn.Module):
    """Stands in for the target encoder: returns the features computed before timing."""

    def __init__(self, features):
        super().__init__()
        self.features, self.index = features, 0

    def forward(self, mel):
        return self.features[self.index]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--k", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu import cpu_model  # bench/cpu.py: the CPU's model and vector extensions

    print(f"CPU: {cpu_model()}", flush=True)
    import ctranslate2

    base = fetch("base")
    mels = [log_mel_spectrogram(load_audio(path)) for path in sample_paths()]
    ct = ctranslate2.models.Whisper(str(ct2_dir("base")), device="cpu", compute_type="float32",
                                    intra_threads=args.threads)
    systems = {"specwhisper target-only": Engine(base), "specwhisper tiny.en draft": Engine(base, fetch("tiny.en")),
               "specwhisper tiny.en draft, head 16k": Engine(base, fetch("tiny.en"), draft_head_tokens=16384),
               "specwhisper self draft": Engine(base, base)}
    with torch.inference_mode():
        features = [systems["specwhisper target-only"].target.model.encoder(m[None]) for m in mels]
    stand_in = Precomputed(features)
    for engine in systems.values():
        engine.target.model.encoder = stand_in
    prompt = systems["specwhisper target-only"].target.tokenizer.prompt("en", "transcribe")
    ct_features = [ct.encode(ctranslate2.StorageView.from_array(m[None].numpy()), to_cpu=True) for m in mels]

    def run_ct2(i):
        return [t for t in ct.generate(ct_features[i], [prompt], beam_size=1)[0].sequences_ids[0]], None

    def runner(engine):
        def run(i):
            stand_in.index = i
            out = engine.transcribe(mels[i], language="en", num_draft_tokens=None if engine.drafter is None else args.k)
            return out.tokens, out.stats
        return run

    runs = {"ctranslate2 float32": run_ct2, **{name: runner(e) for name, e in systems.items()}}
    reference = [run_ct2(i)[0] for i in range(len(mels))]
    for run in runs.values():
        run(0)  # warm-up (and the C++/BLAS first-call costs)
    totals = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():  # interleaved, so load changes hit every system alike
            start, tokens, same, acc = time.perf_counter(), 0, 0, []
            for i in range(len(mels)):
                out, stats = run(i)
                tokens += len(out) + 1  # + EOT
                same += out == reference[i]
                if stats is not None and stats.drafted:
                    acc.append((stats.accepted, stats.drafted, stats.tokens_per_pass))
            totals[name].append((time.perf_counter() - start, tokens, same, acc))
    print(f"| system | decode tok/s (median of {args.rounds}) | ratio vs CTranslate2 | identical to CT2 | acceptance | tokens/target pass |")
    print("|---|---|---|---|---|---|")
    ct_rate = sorted(n / t for t, n, _, _ in totals["ctranslate2 float32"])[args.rounds // 2]
    for name, rows in totals.items():
        rate = sorted(n / t for t, n, _, _ in rows)[args.rounds // 2]
        acc = rows[-1][3]
        accept = f"{sum(a for a, _, _ in acc) / sum(d for _, d, _ in acc):.3f}" if acc else "n/a"
        per_pass = f"{sum(tp for _, _, tp in acc) / len(acc):.2f}" if acc else "n/a"
        print(f"| {name} | {rate:.1f} | {rate / ct_rate:.2f}x | {rows[-1][2]}/{len(mels)} | {accept} | {per_pass} |")


if __name__ == "__main__":
    main()

"""transformers `WhisperForConditionalGeneration.generate` per token on bench/gpu_models.py's
large-v3 folder: eager, or with a static cache + torch.compile (`--compile`). bench/gpu.py runs it
as a time-boxed child process, so a compile that hangs or fails leaves its results alone.

    python bench/gpu_hf.py --models DIR [--device cuda] [--dtype float16] [--compile] [--quick]

Prints one line `HF_RESULT {json}`. Per token = (t(N) - t(N/2)) / (N - N/2): the encoder and the
prefill cancel out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu import Clock  # noqa: E402


def hf_child(args) -> None:
    from transformers import WhisperForConditionalGeneration

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    folder = Path(args.models) / "large-v3"
    model = WhisperForConditionalGeneration.from_pretrained(folder, dtype=dtype).to(device).eval()
    clock = Clock(device, args.quick)
    if args.compile:
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    N = args.max_new_tokens
    out = dict(mode="static cache + torch.compile" if args.compile else "eager", rows={})
    for batch in args.batch:
        mel = torch.randn(batch, model.config.num_mel_bins, 3000, generator=torch.Generator().manual_seed(batch))
        mel = mel.to(device, dtype)

        def generate(n):
            with torch.inference_mode():
                return model.generate(input_features=mel, max_new_tokens=n, language="en", task="transcribe",
                                      do_sample=False, num_beams=1)
        start = time.perf_counter()
        generate(N), generate(N // 2)  # warm-up (compiles both cache lengths when compiling)
        warm = time.perf_counter() - start
        spans = {}
        for n in (N, N // 2):
            times = []
            for _ in range(1 if args.quick else 3):
                clock.sync()
                t0 = time.perf_counter()
                tokens = generate(n)
                clock.sync()
                times.append(time.perf_counter() - t0)
            spans[n] = (statistics.median(times), tokens.shape[-1])
        out["rows"][batch] = dict(seconds=spans[N][0], generated=spans[N][1], warmup_seconds=warm,
                                  per_token_ms=(spans[N][0] - spans[N // 2][0]) / (N - N // 2) * 1e3)
    print("HF_RESULT " + json.dumps(out), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--max-new-tokens", type=int, default=100)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--compile", action="store_true", help="static cache + torch.compile(mode='reduce-overhead')")
    ap.add_argument("--quick", action="store_true")
    hf_child(ap.parse_args(argv))


if __name__ == "__main__":
    main()

"""Decoder step microbenchmarks on real whisper-base (fp32, CPU or CUDA):
`python -m pytest bench/bench_step.py --benchmark-only --benchmark-group-by=group`.

Questions answered: what does one target step cost, and how much of it is the output head
(full float32 vs the screened bfloat16 argmax); how does a verify pass of n = k + 1 tokens scale."""
from __future__ import annotations

import pytest
import torch

from specwhisper.engine.decoding import LoadedModel
from specwhisper.model.whisper import DecoderCache
from specwhisper.tools.fetch import fetch

torch.set_num_threads(2)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POS = 12  # a typical early decoding position


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@pytest.fixture(scope="module")
def base():
    model = LoadedModel.load(fetch("base"), DEVICE, torch.float32)
    cache = DecoderCache.allocate(model.config, 1, DEVICE, torch.float32)
    with torch.inference_mode():
        features = model.model.encoder(torch.randn(1, 80, 3000, device=DEVICE))
        model.model.decoder.fill_cross(cache, features)
        prompt = torch.arange(POS, device=DEVICE)[None] + 440
        model.model.decoder(prompt, torch.arange(POS, device=DEVICE)[None], cache)
    return model, cache


@pytest.mark.benchmark(group="head")
@pytest.mark.parametrize("head", ["full-fp32", "screened-bf16"])
def test_head(benchmark, base, head):
    model, _ = base
    hidden = torch.randn(1, 1, model.config.d_model, device=DEVICE)

    def run():
        with torch.inference_mode():
            if head == "full-fp32":
                model.model.decoder.logits(hidden).masked_fill_(model.suppress, -float("inf")).argmax(-1)
            else:
                model.head.argmax(hidden[0], model.suppress)
        sync()

    benchmark(run)


@pytest.mark.benchmark(group="verify")
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 9])
def test_verify_pass(benchmark, base, n):
    """Blocks + screened greedy head for n tokens at once (n = 1 is a plain decode step)."""
    model, cache = base
    tokens = torch.full((1, n), 440, device=DEVICE)
    pos = torch.arange(POS, POS + n, device=DEVICE)[None]

    def run():
        with torch.inference_mode():
            hidden = model.model.decoder.hidden(tokens, pos, cache, kv_len=POS + n)
            model.pick(hidden, False, 0.0, 1.0, None)
        sync()

    benchmark(run)
    benchmark.extra_info["tokens"] = n

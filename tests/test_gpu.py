"""On the GPU (all `cuda`): a CUDA-graphed decoder step equals the eager step; speculative equals
target-only in fp32; the seeded accept step equals its reference bit for bit; half precision runs."""
from __future__ import annotations

import math

import pytest
import torch

from specwhisper import Engine, sampling
from specwhisper.backends import ops
from specwhisper.engine.decoding import LoadedModel
from specwhisper.engine.graphs import StepGraphs
from specwhisper.model.whisper import DecoderCache

pytestmark = pytest.mark.cuda


class DecoderStep:
    """tokens [B, width] at input_pos [B, width] -> (suppressed argmax, hidden), over static buffers."""

    def __init__(self, model: LoadedModel, cache: DecoderCache, width: int):
        self.model, self.cache = model, cache
        batch = cache.self_k.shape[1]
        self.tokens = torch.zeros(batch, width, dtype=torch.long, device="cuda")
        self.input_pos = torch.zeros(batch, width, dtype=torch.long, device="cuda")

    def __call__(self):
        dec = self.model.model.decoder
        hidden = dec.hidden(self.tokens, self.input_pos, self.cache)
        logits = dec.logits(hidden).float().masked_fill_(self.model.suppress, -math.inf)
        return logits.argmax(-1), hidden


def twin_caches(model: LoadedModel, batch: int, dtype):
    cfg = model.config
    g = torch.Generator(device="cuda").manual_seed(0)
    features = torch.randn(batch, cfg.max_source_positions, cfg.d_model, device="cuda", generator=g).to(dtype)
    caches = [DecoderCache.allocate(cfg, batch, "cuda", dtype) for _ in range(2)]
    for cache in caches:
        model.model.decoder.fill_cross(cache, features)
    return caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_graphed_decoder_steps_equal_eager(multilingual, dtype):
    """Many replays of a draft-width and a verify-width step; positions advance per row, and
    rows leave and rejoin the batch (a row out of the batch writes the scratch slot)."""
    model = LoadedModel.load(multilingual, "cuda", dtype)
    batch, eot, scratch = 4, model.tokenizer.eot, model.config.max_target_positions
    graphed_cache, eager_cache = twin_caches(model, batch, dtype)
    graphs = StepGraphs(True, "cuda")
    g = torch.Generator().manual_seed(1)
    lengths = torch.zeros(batch, dtype=torch.long)
    with torch.inference_mode():
        for width in (1, 4):
            graphed, eager = DecoderStep(model, graphed_cache, width), DecoderStep(model, eager_cache, width)
            for replay in range(60):
                tokens = torch.randint(0, eot, (batch, width), generator=g)
                member = torch.rand(batch, generator=g) < 0.75
                pos = torch.where(member[:, None], lengths[:, None] + torch.arange(width), scratch)
                lengths = torch.where(member, (lengths + width) % (scratch - width), lengths)
                for step in (graphed, eager):
                    step.tokens.copy_(tokens)
                    step.input_pos.copy_(pos)
                got, want = graphs.run(("step", width), graphed), eager()
                assert torch.equal(got[0], want[0]), (width, replay)
                assert torch.equal(got[1], want[1]), (width, replay)
    # every real slot alike; the scratch slot is left out: a row out of the batch writes all its
    # `width` positions into it at once, and which duplicate write lands last is unspecified on CUDA
    for a, b in zip(graphed_cache.buffers()[:2], eager_cache.buffers()[:2]):
        assert torch.equal(a[:, :, :, :scratch], b[:, :, :, :scratch])
    for a, b in zip(graphed_cache.buffers()[2:], eager_cache.buffers()[2:]):
        assert torch.equal(a, b)
    assert graphs.keys() == [("step", 1), ("step", 4)]


def test_speculative_equals_target_only_in_fp32(multilingual, ckpt_dir):
    draft = ckpt_dir("cuda-draft", vocab_size=51865, n_mels=80, d_model=32, heads=2, seed=11)
    mel = torch.randn(3, 80, 3000, generator=torch.Generator().manual_seed(5))
    plain = Engine(multilingual, device="cuda", dtype=torch.float32)
    spec = Engine(multilingual, draft=draft, device="cuda", dtype=torch.float32)
    selfdraft = Engine(multilingual, draft=multilingual, device="cuda", dtype=torch.float32)
    want = plain.transcribe(mel, language="en", max_new_tokens=48)
    for k in (1, 3, 6):
        got = spec.transcribe(mel, language="en", max_new_tokens=48, num_draft_tokens=k)
        assert [r.tokens for r in got] == [r.tokens for r in want], k
        same = selfdraft.transcribe(mel, language="en", max_new_tokens=48, num_draft_tokens=k)
        assert [r.tokens for r in same] == [r.tokens for r in want], k
        assert all(r.stats.acceptance_rate == 1.0 for r in same)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,k,V", [(1, 4, 51866), (3, 1, 51865), (5, 7, 1000)])
def test_seeded_accept_step_equals_reference(dtype, B, k, V):
    """`ops.speculative_sample` (the Triton kernel on CUDA) with a seeded CUDA generator: the same
    tokens every time, and the tokens the reference gives with the noise that seed draws (uniforms
    first, then Exp(1))."""
    g = torch.Generator(device="cuda").manual_seed(B * k)
    target = (3 * torch.randn(B, k + 1, V, device="cuda", generator=g)).to(dtype)
    draft = (3 * torch.randn(B, k, V, device="cuda", generator=g)).to(dtype)
    proposals = torch.randint(0, V, (B, k), device="cuda", generator=g)
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        runs = [ops.speculative_sample(target, draft, proposals, temperature, top_p,
                                       torch.Generator(device="cuda").manual_seed(42)) for _ in range(2)]
        noise_gen = torch.Generator(device="cuda").manual_seed(42)
        uniforms = sampling.draw_uniforms((B, k), "cuda", noise_gen)
        noise = sampling.draw_exp_noise((B, V), "cuda", noise_gen)
        want = sampling.speculative_sample_core(target.cpu(), draft.cpu(), proposals.cpu(), temperature, top_p,
                                                uniforms.cpu(), noise.cpu())
        for tokens, n_emitted in runs:
            assert torch.equal(tokens.cpu(), want[0]) and torch.equal(n_emitted.cpu(), want[1])


def test_half_precision_engine_runs(v3):
    mel = torch.randn(2, 128, 3000, generator=torch.Generator().manual_seed(7))
    for dtype in (torch.float16, torch.bfloat16):
        engine = Engine(v3, draft=v3, device="cuda", dtype=dtype)
        out = engine.transcribe(mel, language="en", max_new_tokens=24, num_draft_tokens=4)
        assert all(0 < len(r.tokens) <= 24 for r in out)
        assert all(0.0 <= r.stats.acceptance_rate <= 1.0 for r in out)


@pytest.mark.parametrize("sampling_rule,decode_ops", [("race", False), ("rejection", False), ("race", True)],
                         ids=["race", "rejection", "race-decode-ops"])
def test_graphed_engine_equals_eager_engine(multilingual, english, ckpt_dir, sampling_rule, decode_ops):
    """The engine's captured draft and verify steps (padded buckets, one graph per key) give the
    eager engine's tokens and counts: greedy and sampled rows, a same-vocabulary and a mapped
    draft, rows joining and leaving (3 slots: buckets 1, 2 and 4); on torch's ops and on the
    decode ops (their serial reductions' counters grown by the warm-up, before a capture)."""
    draft = ckpt_dir("cuda-draft", vocab_size=51865, n_mels=80, d_model=32, heads=2, seed=11)
    mel = torch.randn(5, 80, 3000, generator=torch.Generator().manual_seed(8))
    for folder in (draft, english):
        results = []
        for graphs in (False, True):
            engine = Engine(multilingual, draft=folder, device="cuda", dtype=torch.float32, max_batch=3,
                            cuda_graphs=True, sampling=sampling_rule, background=False, decode_ops=decode_ops)
            if not graphs:  # the same padded steps, run eagerly (same shapes: same cuBLAS kernels)
                engine.runner.graphs.capturing, engine.runner.graphs.rehearse = False, True
            futures = [engine.submit(m, language="en", max_new_tokens=40 - 6 * i, num_draft_tokens=3,
                                     temperature=0.0 if i % 2 else 0.8, seed=i) for i, m in enumerate(mel)]
            engine.run_until(futures)
            results.append([(f.result().tokens, f.result().stats.accepted) for f in futures])
            if graphs:
                assert engine.runner.graphs.capturing and len(engine.runner.graphs.keys()) >= 2
        assert results[0] == results[1]

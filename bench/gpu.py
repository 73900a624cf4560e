"""GPU benchmark: where does a large-v3 decode step stand against its bandwidth floor, what do CUDA
graphs buy the drafts, and what speedup does speculative decoding model and measure?

    python bench/gpu.py --out OUT_DIR [--models DIR] [--device cuda] [--dtype float16]
    python bench/gpu.py --out OUT_DIR --device cpu --quick      # smoke test: toy sizes, seconds

Side by side in one run, fp16, batch 1 and 8, on random weights at the real shapes
(bench/gpu_models.py; generated into --models when absent):
- copy bandwidth (a large device-to-device copy) and the target step's floor: (decoder weights +
  batch × cross K/V bytes) ÷ bandwidth;
- target single-token step and verify step (k+1 = 2..9), eager and CUDA-graphed (`StepGraphs`);
- draft step (tiny, distil-large-v3 shapes) eager vs graphed, chained (each step feeds its
  argmax to the next, as k draft steps do);
- the accept step (fused kernel via `specwhisper.backends.ops` or `specwhisper.backend`), eager and graphed;
- near ties: how often the argmax of a (k+1)-row verify pass differs from single-token steps;
- transformers `generate` per token (eager; static cache + torch.compile in a time-boxed child);
- end to end: `Engine(target)` and `Engine(target, draft=target)` (self draft: acceptance 1.0);
- the modeled speedup E[tokens/pass] × t_target ÷ (k·t_draft + t_verify(k+1) + t_accept).
Writes gpu.json (everything), gpu.md and gpu.png into --out after every section, so a run cut
short still leaves its results. Timings: warm-up first; CUDA synchronised inside the timed span.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu_models  # noqa: E402
import gpu_report  # noqa: E402
from specwhisper import sampling  # noqa: E402
from specwhisper.config import WhisperConfig  # noqa: E402
from specwhisper.engine.decoding import LoadedModel  # noqa: E402
from specwhisper.engine.graphs import StepGraphs  # noqa: E402
from specwhisper.model.whisper import DecoderCache  # noqa: E402

ALPHAS = (0.6, 0.7, 0.8, 0.9, 0.95)
KS = tuple(range(1, 9))
SECTIONS = ("bandwidth", "steps", "drafts", "accept", "near_ties", "e2e", "rtfx", "hf")
PREFIX = 64  # cached positions when a step is timed (mid-utterance)


class Clock:
    """Seconds per call of fn: warm-up, then the median over `repeats` spans of `iters` calls,
    each span closed by a device synchronisation."""

    def __init__(self, device: torch.device, quick: bool):
        self.device = device
        self.warm, self.iters, self.repeats = (1, 1, 1) if quick else (5, 30, 3)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn, iters: int | None = None) -> float:
        iters = iters or self.iters
        for _ in range(self.warm):
            fn()
        self.sync()
        spans = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            self.sync()
            spans.append((time.perf_counter() - start) / iters)
        return statistics.median(spans)


class StaticStep:
    """A fixed-shape decoder step over static buffers, as the runner will capture it:
    tokens [B, width] at input_pos [B, width] -> suppressed argmax [B, width]. `chain`: feed the
    argmax back and advance the position (k draft steps in a row)."""

    def __init__(self, model: LoadedModel, cache: DecoderCache, width: int, chain: bool = False):
        self.dec, self.cache, self.chain = model.model.decoder, cache, chain
        self.banned = model.suppress
        batch, device = cache.self_k.shape[1], cache.self_k.device
        g = torch.Generator(device=device).manual_seed(width)
        self.tokens = torch.randint(0, model.tokenizer.eot, (batch, width), device=device, generator=g)
        self.input_pos = (PREFIX + torch.arange(width, device=device)).expand(batch, width).contiguous()

    def __call__(self) -> torch.Tensor:
        hidden = self.dec.hidden(self.tokens, self.input_pos, self.cache)  # all 449 slots: fixed shape
        choice = self.dec.logits(hidden).float().masked_fill_(self.banned, -math.inf).argmax(-1)
        if self.chain:  # past position 447 writes land in the scratch slot: same cost
            self.tokens.copy_(choice)
            self.input_pos.add_(1)
        return choice


def filled_cache(model: LoadedModel, batch: int, device, dtype, seed: int = 0, prefix: int = PREFIX) -> DecoderCache:
    """A cache with cross K/V of random audio features and `prefix` random tokens prefilled."""
    cfg = model.config
    cache = DecoderCache.allocate(cfg, batch, device, dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    features = torch.randn(batch, cfg.max_source_positions, cfg.d_model, device=device, generator=g).to(dtype)
    dec = model.model.decoder
    dec.fill_cross(cache, features)
    tokens = torch.randint(0, model.tokenizer.eot, (batch, prefix), device=device, generator=g)
    dec.hidden(tokens, torch.arange(prefix, device=device).expand(batch, prefix), cache)
    return cache


def decoder_bytes(model: LoadedModel) -> int:
    """Bytes a decode step must read once: every decoder weight except the position table (one
    row is read); the token embedding counts once, as the output head. (Fused q/k/v parameters
    are views of the one fused matrix, so they count once too.)"""
    return sum(p.numel() * p.element_size() for name, p in model.model.decoder.named_parameters()
               if not name.startswith("embed_positions"))


def cross_kv_bytes(cfg, itemsize: int) -> int:
    """Cross-attention K and V of one row: read in full by every decode step."""
    return 2 * cfg.decoder_layers * cfg.max_source_positions * cfg.d_model * itemsize


def self_kv_bytes(cfg, itemsize: int, slots: int) -> int:
    return 2 * cfg.decoder_layers * slots * cfg.d_model * itemsize


class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = getattr(torch, args.dtype)
        self.clock = Clock(self.device, args.quick)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.started = time.perf_counter()
        self.results: dict = dict(env=environment(self.device), args=vars(args) | {"out": str(args.out)},
                                  errors={}, skipped={})
        self.models: dict[str, LoadedModel] = {}
        self.ks = (1, 2) if args.quick else KS  # draft lengths k timed and modeled
        self.widths = sorted({1} | {k + 1 for k in self.ks})  # tokens per target pass

    # ---------------------------------------------------------------- plumbing
    def left(self) -> float:
        return self.args.budget - (time.perf_counter() - self.started)

    def section(self, name: str, fn, min_seconds: float = 0.0) -> None:
        """Run one section; record its error instead of stopping the run; save after each."""
        if self.left() < min_seconds:
            self.results["skipped"][name] = f"time budget: {self.left():.0f}s left, needs ~{min_seconds:.0f}s"
            print(f"[gpu.py] skip {name}: time budget", flush=True)
            return
        start = time.perf_counter()
        print(f"[gpu.py] {name} ...", flush=True)
        try:
            self.results[name] = fn()
        except Exception as exc:  # one failing section must not hide the others
            self.results["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        self.results.setdefault("section_seconds", {})[name] = round(time.perf_counter() - start, 1)
        self.save()

    def save(self) -> None:
        (self.out / "gpu.json").write_text(json.dumps(self.results, indent=1, default=str))
        gpu_report.write(self.results, self.out)

    def free_models(self) -> None:
        self.models.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def model(self, name: str) -> LoadedModel:
        if name not in self.models:
            self.models[name] = LoadedModel.load(self.folders[name], self.device, self.dtype)
        return self.models[name]

    # ---------------------------------------------------------------- sections
    def make_models(self) -> dict:
        start = time.perf_counter()
        self.folders = gpu_models.make_models(self.args.models, self.device, self.dtype, self.args.quick)
        return dict(folders={k: str(v) for k, v in self.folders.items()}, seconds=time.perf_counter() - start,
                    gigabytes={k: (v / "model.safetensors").stat().st_size / 1e9 for k, v in self.folders.items()})

    def bandwidth(self) -> dict:
        n = (32 << 20) if self.args.quick else (2 << 30)
        src = torch.empty(n, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        seconds = self.clock(lambda: dst.copy_(src), iters=3 if self.args.quick else 20)
        return dict(bytes=n, seconds=seconds, gb_per_s=2 * n / seconds / 1e9)  # read + write

    def steps(self) -> dict:
        """Target single-token and verify steps, eager and graphed, per batch; the floor."""
        target = self.model("large-v3")
        cfg, item = target.config, self.dtype.itemsize
        bw = self.results.get("bandwidth", {}).get("gb_per_s")
        out = dict(decoder_weight_bytes=decoder_bytes(target), cross_kv_bytes_per_row=cross_kv_bytes(cfg, item),
                   self_kv_bytes_per_row_read=self_kv_bytes(cfg, item, cfg.max_target_positions + 1), rows={})
        for batch in self.args.batch:
            cache = filled_cache(target, batch, self.device, self.dtype)
            graphs = StepGraphs(True, self.device)
            widths = self.widths
            steps = {w: StaticStep(target, cache, w) for w in widths}
            graphs.capture([("target", batch, w) for w in widths], lambda key: steps[key[2]])
            row = {}
            for w in widths:
                eager = self.clock(steps[w], iters=5)  # launch-bound (~20 ms for large-v3): few suffice
                graphed = self.clock(lambda: graphs.run(("target", batch, w), steps[w]))
                row[w] = dict(eager_ms=eager * 1e3, graphed_ms=graphed * 1e3)
            for w, ms in self.decode_ops_times(target, lambda w: steps[w], widths).items():
                row[w]["decode_ops_graphed_ms"] = ms
            floor_bytes = out["decoder_weight_bytes"] + batch * out["cross_kv_bytes_per_row"]
            floor = dict(bytes=floor_bytes, ms=floor_bytes / (bw * 1e9) * 1e3 if bw else None)
            out["rows"][batch] = dict(width=row, floor=floor)
            del cache, steps, graphs
        return out

    def drafts(self) -> dict:
        out = {}
        for name in ("tiny", "distil-large-v3"):
            draft = self.model(name)
            out[name] = {}
            for batch in self.args.batch:
                cache = filled_cache(draft, batch, self.device, self.dtype)
                step = StaticStep(draft, cache, 1, chain=True)
                graphs = StepGraphs(True, self.device)
                graphs.capture([(name, batch)], lambda key: step)
                eager = self.clock(step)
                graphed = self.clock(lambda: graphs.run((name, batch), step))
                out[name][batch] = dict(eager_ms=eager * 1e3, graphed_ms=graphed * 1e3,
                                        graphs_captured=graphs.capturing)
                ops = self.decode_ops_times(draft, lambda w: step, [1])
                if ops:
                    out[name][batch]["decode_ops_graphed_ms"] = ops[1]
        return out

    def decode_ops_times(self, model, step_of, widths) -> dict:
        """{width: graphed ms} of `step_of(width)` with `model`'s decoder on the GPU decode ops
        (`Whisper.fuse_decode_ops`: Engine(decode_ops=True)), then back on torch's ops; {} off a
        GPU (the interpreter would time Python) or if the ops fail (their error is kept)."""
        if self.device.type != "cuda":
            return {}
        out = {}
        try:
            model.model.fuse_decode_ops()
            graphs = StepGraphs(True, self.device)
            for w in widths:
                out[w] = self.clock(lambda: graphs.run(("decode ops", w), step_of(w))) * 1e3
        except Exception as exc:  # recorded beside the torch timings, which stand
            self.results.setdefault("decode_ops_errors", []).append(f"{type(exc).__name__}: {str(exc)[:300]}")
        finally:
            model.model.decoder.fused_ops = None
        return out

    def accept(self) -> dict:
        op, where = accept_op(self.device)
        V, out = 51866, dict(op=where, rows={})
        for batch in self.args.batch:
            out["rows"][batch] = {}
            for k in self.ks:
                g = torch.Generator(device=self.device).manual_seed(k)
                target_logits = 3 * torch.randn(batch, k + 1, V, device=self.device, generator=g)
                draft_logits = 3 * torch.randn(batch, k, V, device=self.device, generator=g)
                draft_tokens = torch.randint(0, V, (batch, k), device=self.device, generator=g)
                uniforms = sampling.draw_uniforms((batch, k), self.device, g)
                noise = sampling.draw_exp_noise((batch, V), self.device, g)
                row = {}
                for mode, temperature in (("sample", 1.0), ("greedy", 0.0)):
                    def fn(t=temperature):
                        return op(target_logits, draft_logits, draft_tokens, t, 1.0, uniforms, noise)
                    graphs = StepGraphs(True, self.device)
                    row[f"{mode}_eager_us"] = self.clock(fn) * 1e6
                    row[f"{mode}_graphed_us"] = self.clock(lambda: graphs.run(mode, fn)) * 1e6
                # the engine's default (sampling="race"): the target's token at each of the k + 1
                # positions raced from its logits, then compared with the draft's (one small op)
                race = race_op(self.device)
                if race is not None:
                    n = batch * (k + 1)
                    flat = target_logits.view(n, V)
                    keys = (torch.ones(n, device=self.device), torch.ones(n, device=self.device),
                            torch.arange(n, device=self.device), torch.zeros(n, dtype=torch.int64, device=self.device))
                    for name, split in (("race", True), ("race_row", False)):
                        graphs = StepGraphs(True, self.device)
                        fn = lambda split=split: race(flat, *keys, None, split=split)  # noqa: E731
                        row[f"{name}_graphed_us"] = self.clock(lambda: graphs.run(name, fn)) * 1e6
                out["rows"][batch][k] = row
        return out

    def near_ties(self) -> dict:
        """Argmax of each position of a (k+1)-token verify pass vs the same positions decoded one
        token at a time (1-row steps, as target-only decoding runs), from the same cache over random
        prefixes: in fp16 the kernels differ by shape, so near ties can flip. Also the candidate
        identity mode: each single token run as a (k+1)-wide pass padded with scratch-slot rows
        (the verify pass's kernel shapes); if rows are computed independently it never flips."""
        target = self.model("large-v3")
        dec, eot, suppress = target.model.decoder, target.tokenizer.eot, target.suppress
        scratch = target.config.max_target_positions  # position 448: writes land in the scratch slot
        batch, trials = (2, 1) if self.args.quick else (8, self.args.tie_trials)
        last = PREFIX + 16 if self.args.quick else target.config.max_target_positions
        out = {}

        def logits(tokens, pos, cache):
            return dec.logits(dec.hidden(tokens, pos, cache)).float().masked_fill_(suppress, -math.inf)

        for k1 in ((2,) if self.args.quick else (2, 5, 9)):
            verify_cache = filled_cache(target, batch, self.device, self.dtype, seed=k1, prefix=last)
            single_cache = DecoderCache(*(t.clone() for t in verify_cache.buffers()))
            padded_cache = DecoderCache(*(t.clone() for t in verify_cache.buffers()))
            g = torch.Generator(device=self.device).manual_seed(100 + k1)
            count = dict(positions=0, flips=0, last_position_flips=0, gap_within_2x_diff=0, padded_flips=0)
            max_diff = padded_max_diff = 0.0
            gaps = []
            for _ in range(trials):
                n = torch.randint(PREFIX, last - k1, (batch, 1), device=self.device, generator=g)
                feed = torch.randint(0, eot, (batch, k1), device=self.device, generator=g)
                pos = n + torch.arange(k1, device=self.device)  # [B, k+1]
                for cache in (single_cache, padded_cache):  # the same prefix everywhere
                    cache.self_k.copy_(verify_cache.self_k)
                    cache.self_v.copy_(verify_cache.self_v)
                verify = logits(feed, pos, verify_cache)  # [B, k+1, V]
                single = torch.cat([logits(feed[:, j:j + 1], pos[:, j:j + 1], single_cache) for j in range(k1)], 1)
                pad_pos = torch.full_like(pos, scratch)
                padded = torch.cat([logits(feed[:, j:j + 1].expand(-1, k1),
                                           torch.cat([pos[:, j:j + 1], pad_pos[:, 1:]], 1), padded_cache)[:, :1]
                                    for j in range(k1)], 1)
                differ = verify.argmax(-1) != single.argmax(-1)  # [B, k+1]
                diff = (verify - single).nan_to_num(0.0, 0.0, 0.0).abs().amax(-1)  # [B, k+1]
                top2 = single.topk(2, dim=-1).values
                gap = top2[..., 0] - top2[..., 1]
                count["positions"] += differ.numel()
                count["flips"] += int(differ.sum())
                count["last_position_flips"] += int(differ[:, -1].sum())
                count["gap_within_2x_diff"] += int((gap <= 2 * diff).sum())
                count["padded_flips"] += int((verify.argmax(-1) != padded.argmax(-1)).sum())
                max_diff = max(max_diff, float(diff.max()))
                padded_max_diff = max(padded_max_diff, float((verify - padded).nan_to_num(0.0, 0.0, 0.0).abs().max()))
                gaps.append(gap.flatten())
            out[k1] = dict(count, flip_rate=count["flips"] / count["positions"], max_abs_logit_diff=max_diff,
                           padded_max_abs_logit_diff=padded_max_diff, median_top2_gap=float(torch.cat(gaps).median()))
        return dict(batch=batch, trials=trials, dtype=str(self.dtype), by_width=out)

    def hf(self) -> dict:
        out = {}
        for compiled in (False, True):
            if compiled and self.args.no_compile:
                out["compile"] = dict(error="skipped (--no-compile)")
                continue
            limit = max(10.0, min(self.args.hf_timeout, self.left() - 30))
            cmd = [sys.executable, str(ROOT / "bench" / "gpu_hf.py"), "--device", str(self.device),
                   "--dtype", self.args.dtype, "--models", str(self.args.models),
                   "--max-new-tokens", str(self.args.max_new_tokens),
                   "--batch", *map(str, self.args.batch[:1] if self.args.quick else self.args.hf_batch)]
            if compiled:
                cmd.append("--compile")
            if self.args.quick:
                cmd.append("--quick")
            key = "compile" if compiled else "eager"
            try:
                child = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
                line = [x for x in child.stdout.splitlines() if x.startswith("HF_RESULT ")]
                out[key] = json.loads(line[-1][10:]) if line else dict(
                    error=f"exit {child.returncode}: {child.stderr[-1500:]}")
            except subprocess.TimeoutExpired:
                out[key] = dict(error=f"timed out after {limit:.0f}s (compile included)")
        return out

    def e2e(self) -> dict:
        from specwhisper import Engine

        folder = self.folders["large-v3"]
        n_mels = WhisperConfig.from_hf(folder).num_mel_bins
        self.free_models()  # the engines load their own copies
        graphed = self.device.type == "cuda"  # the engine's default: draft and verify steps as CUDA graphs
        N, k = self.args.max_new_tokens, self.args.k
        # name: (draft, k, cuda_graphs, dtype, the target-only row it must equal, decode_ops); the
        # eager row shows what the graphs buy end to end. decode_ops None is the engine's default:
        # the Triton decode ops in half precision on CUDA (rows round independently of the pass's
        # shape, so speculative half precision is token-exact); the torch-ops rows show what torch's
        # kernels give, where a verify pass of k + 1 positions can round a near tie differently from
        # a one-token step; the float32 rows show exactness on the same weights (README, GPU)
        systems = {"target-only": (None, None, graphed, self.dtype, "target-only", None),
                   f"self-draft k={k}": (folder, k, graphed, self.dtype, "target-only", None),
                   "distil-large-v3 k=2": (self.folders["distil-large-v3"], 2, graphed, self.dtype, "target-only",
                                           None)}
        if graphed:
            systems["target-only eager"] = (None, None, False, self.dtype, "target-only", None)
            systems["target-only torch-ops"] = (None, None, graphed, self.dtype, "target-only torch-ops", False)
            systems[f"self-draft k={k} torch-ops"] = (folder, k, graphed, self.dtype, "target-only torch-ops", False)
        if self.dtype != torch.float32:
            systems["target-only float32"] = (None, None, graphed, torch.float32, "target-only float32", None)
            systems[f"self-draft k={k} float32"] = (folder, k, graphed, torch.float32, "target-only float32", None)
        if self.args.e2e_systems:  # a chosen few (a short device call)
            systems = {name: v for name, v in systems.items() if name in self.args.e2e_systems}
        out = dict(max_new_tokens=N, cuda_graphs=graphed, systems={})
        try:
            out["tiny_draft"] = self.e2e_tiny(folder, N)
        except Exception as exc:  # recorded beside the other rows, which stand
            out["tiny_draft"] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
        self.free_models()
        tokens_of = {}
        for name, (draft, k_draft, cuda_graphs, dtype, reference, decode_ops) in systems.items():
            out["systems"][name] = {}
            try:
                engine = Engine(folder, draft=draft, device=self.device, dtype=dtype, cuda_graphs=cuda_graphs,
                                decode_ops=decode_ops)
                self.e2e_rows(engine, name, reference, out["systems"][name], tokens_of, n_mels, N, k_draft)
            except Exception as exc:  # an experimental system must not cost the others
                out["systems"][name] = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
            engine = None
            self.free_models()
        return out

    def e2e_tiny(self, folder, N) -> str:
        """tiny (80 mel bins, its own encoder) drafting large-v3 (128): the draft reads its own
        log-mel of the same audio (`Drafter.own_mels`), so the call takes a waveform (30 s of
        noise, B = 1): per token, drafted and target-only, and whether the tokens are equal."""
        from specwhisper import Engine

        audio = 0.1 * torch.randn(30 * 16000, generator=torch.Generator().manual_seed(3))
        times, tokens = {}, {}
        for name, draft in (("target-only", None), ("tiny k=4", self.folders["tiny"])):
            engine = Engine(folder, draft=draft, device=self.device, dtype=self.dtype)

            def call(n, engine=engine, k=None if draft is None else 4):
                return engine.transcribe(audio, language="en", max_new_tokens=n, num_draft_tokens=k)
            call(N)  # warm-up
            full, result = self.clock_call(lambda: call(N), repeats=2)
            half, _ = self.clock_call(lambda: call(N // 2), repeats=2)
            times[name], tokens[name] = (full - half) / (N - N // 2) * 1e3, result[0].tokens
            skipped = result[0].stats.draft_skipped
            del engine
        return (f"accepted: drafts from its own 80-bin log-mel of the audio (30 s of noise, B = 1): "
                f"{times['tiny k=4']:.2f} ms a token vs target-only {times['target-only']:.2f} ms "
                f"(random weights: acceptance ~ 0), tokens equal: "
                f"{'yes' if tokens['tiny k=4'] == tokens['target-only'] else 'NO'}"
                + (f"; the draft stood aside: {skipped}" if skipped else ""))

    def e2e_rows(self, engine, name, reference, rows, tokens_of, n_mels, N, k_draft) -> None:
        """`e2e`'s timings of one system, per batch size, into `rows`."""
        for batch in self.args.batch[:1] if self.args.quick else self.args.batch:
            mel = torch.randn(batch, n_mels, 3000, generator=torch.Generator().manual_seed(batch))

            def call(n, mel=mel, k_draft=k_draft):
                return engine.transcribe(mel, language="en", max_new_tokens=n, num_draft_tokens=k_draft)
            call(N)  # warm-up
            full, results = self.clock_call(lambda: call(N), repeats=2)
            half, _ = self.clock_call(lambda: call(N // 2), repeats=2)
            tokens = sum(len(r.tokens) for r in results)
            tokens_of[(name, batch)] = [r.tokens for r in results]
            stats = results[0].stats
            rows[batch] = dict(
                seconds=full, tokens=tokens, tokens_per_s=tokens / full,
                per_token_ms=(full - half) / (N - N // 2) * 1e3,
                acceptance=statistics.mean(r.stats.acceptance_rate for r in results),
                tokens_per_pass=stats.tokens_per_pass,
                same_tokens_as_target_only=tokens_of[(name, batch)] == tokens_of.get((reference, batch)),
                graph_keys=len(engine.runner.graphs.keys()) if engine.runner.graphs is not None else 0,
                decode_ops=engine.decode_ops)

    def rtfx(self) -> dict:
        """Many concurrent long-form requests in one engine (continuous batching): audio seconds
        per wall second, speculation off and on (a self draft: on random weights the only draft
        that is ever right). Random mels of `seconds` each, greedy (no fallback), no previous-text
        prompt; a first call warms up (graphs captured) and is not timed, then `clock_call`'s median."""
        from specwhisper import Engine

        folder = self.folders["large-v3"]
        n_mels = WhisperConfig.from_hf(folder).num_mel_bins
        self.free_models()
        graphed = self.device.type == "cuda"
        requests, seconds = (2, 35) if self.args.quick else (self.args.rtfx_requests, 60)
        g = torch.Generator().manual_seed(11)
        mels = [torch.randn(n_mels, seconds * 100, generator=g) for _ in range(requests)]
        out = dict(requests=requests, seconds_each=seconds, cuda_graphs=graphed, systems={})
        k = self.args.k
        # name: (draft, k, decode_ops); None: the engine's default (the decode ops in half precision on CUDA)
        systems = {"target-only": (None, None, None), f"self-draft k={k}": (folder, k, None)}
        if graphed:
            systems["target-only torch-ops"] = (None, None, False)
        tokens_of = {}
        for name, (draft, k_draft, decode_ops) in systems.items():
            if out["systems"] and self.left() < 45:  # the first row always; the others while time is left
                out["systems"][name] = dict(skipped=f"time budget: {self.left():.0f}s left")
                continue
            engine = Engine(folder, draft=draft, device=self.device, dtype=self.dtype, max_batch=requests,
                            cuda_graphs=graphed, decode_ops=decode_ops)

            # the CPU smoke run (toy weights, random audio: every window runs to the token limit)
            # caps each window's tokens: 44 -> 3.5 s for the section on an AVX2-only EPYC
            cap = dict(max_new_tokens=self.args.max_new_tokens) if self.args.quick else {}

            def call(engine=engine, k=k_draft):
                return engine.transcribe(mels, language="en", temperature=(0.0,), num_draft_tokens=k,
                                         condition_on_previous_text=False, **cap)
            call()
            iterations, repeats = engine.iterations, 1 if self.args.quick else self.args.rtfx_repeats
            wall, results = self.clock_call(call, repeats=repeats)
            iterations = (engine.iterations - iterations) / repeats
            tokens = sum(len(r.tokens) for r in results)
            tokens_of[name] = [r.tokens for r in results]
            reference = "target-only torch-ops" if decode_ops is False else "target-only"
            out["systems"][name] = dict(wall_s=wall, rtfx=requests * seconds / wall, tokens=tokens,
                                        tokens_per_s=tokens / wall, decode_ops=engine.decode_ops,
                                        iterations=iterations, ms_per_iteration=wall / iterations * 1e3,
                                        same_tokens_as_target_only=tokens_of[name] == tokens_of.get(reference))
            if name == "target-only" and graphed:  # where the host's time goes, for the next change
                out["host_profile"] = host_profile(call)
            del engine
            self.free_models()
        return out

    def clock_call(self, fn, repeats: int = 3):
        """(median seconds, last result) of a whole call."""
        spans, result = [], None
        for _ in range(1 if self.args.quick else repeats):
            self.clock.sync()
            start = time.perf_counter()
            result = fn()
            self.clock.sync()
            spans.append(time.perf_counter() - start)
        return statistics.median(spans), result if isinstance(result, list) else [result]

    def modeled(self) -> dict:
        """Speedup tables over graphed target-only: on torch's ops, and (where timed) with every
        step on the decode ops, against the faster of the two target-only steps."""
        steps, drafts, accept = self.results["steps"], self.results["drafts"], self.results["accept"]
        out = {}
        for batch in self.args.batch:
            width = steps["rows"][batch]["width"]
            for ops, key in (("", "graphed_ms"), (" decode ops", "decode_ops_graphed_ms")):
                if any(key not in width[w] for w in width) or any(key not in rows[batch] for rows in drafts.values()):
                    continue
                t_target = min(width[1]["graphed_ms"], width[1][key])
                for name, rows in drafts.items():
                    t_draft = rows[batch][key]
                    table = {}
                    for alpha in ALPHAS:
                        for k in self.ks:
                            timed = accept["rows"][batch][k]
                            t_accept = (timed.get("race_graphed_us") or timed["sample_graphed_us"]) / 1e3
                            tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
                            cost = k * t_draft + width[k + 1][key] + t_accept
                            table[f"{alpha}:{k}"] = dict(alpha=alpha, k=k, tokens_per_pass=tokens,
                                                         ms_per_pass=cost, speedup=tokens * t_target / cost)
                    out[f"{name} B={batch}{ops}"] = dict(t_target_ms=t_target, t_draft_ms=t_draft, table=table)
        return out

    def run(self) -> dict:
        self.section("models", self.make_models)
        if self.args.sections:  # a chosen few (a second call for what a first one's budget skipped)
            for name in self.args.sections:
                self.section(name, getattr(self, name))
                self.save()  # what a killed run leaves: every section finished so far
            self.results["seconds"] = time.perf_counter() - self.started
            self.save()
            return self.results
        if "models" in self.results["errors"]:
            return self.results
        self.section("bandwidth", self.bandwidth)
        self.section("steps", self.steps)
        self.section("drafts", self.drafts)
        self.section("accept", self.accept)
        self.section("modeled", self.modeled)
        # the goals' sections first (rtfx, then e2e's target-only per token and hf's, their ratio),
        # the near-tie census last: a run cut by its budget loses the least
        self.section("rtfx", self.rtfx, min_seconds=60)
        self.section("e2e", self.e2e, min_seconds=60)
        self.section("hf", self.hf, min_seconds=40)
        self.section("near_ties", self.near_ties, min_seconds=20)
        self.results["seconds"] = time.perf_counter() - self.started
        self.save()
        return self.results


def host_profile(fn, top: int = 25) -> list[dict]:
    """The `top` functions by own (host) time over one call of fn, by cProfile."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    stats = pstats.Stats(profile).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [dict(function=f"{Path(file).name}:{line}({name})", calls=calls, own_s=round(own, 4),
                 cumulative_s=round(cum, 4))
            for (file, line, name), (_, calls, own, cum, _) in rows]


def accept_op(device):
    """The accept step the engine dispatches to: `specwhisper.backends.ops` when it exists, else backend."""
    try:
        from specwhisper.backends import ops

        return ops.speculative_sample_noise, "specwhisper.backends.ops.speculative_sample_noise"
    except (ImportError, AttributeError):
        from specwhisper.backends import ops as backend

        return backend.speculative_sample_noise, f"specwhisper.backend ({backend.which_backend(device)})"


def race_op(device):
    """The Triton race kernel (`split` keyword: chunked or one program per row), or None off CUDA."""
    if device.type != "cuda":
        return None
    from specwhisper.backends import ops

    kernels = ops.triton_kernels()
    return None if kernels is None else kernels.race_sample_triton


def environment(device: torch.device) -> dict:
    env = dict(torch=torch.__version__, python=platform.python_version(), device=str(device),
               machine=platform.machine())
    for name in ("triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except Exception:
            env[name] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= dict(gpu=props.name, cuda=torch.version.cuda, memory_gb=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}")
    else:
        env |= dict(gpu=None, threads=torch.get_num_threads())
    return env


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu.json / gpu.md / gpu.png")
    ap.add_argument("--models", type=Path, help="random checkpoints (default OUT/models; made if absent)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                    help="default float16 on cuda, float32 on cpu")
    ap.add_argument("--quick", action="store_true", help="toy sizes and few iterations (CPU smoke test)")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes (1 8; quick 1 2)")
    ap.add_argument("--k", type=int, default=4, help="num_draft_tokens of the self-draft end-to-end run")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="end-to-end tokens per row (100; quick 8)")
    ap.add_argument("--tie-trials", type=int, default=32, help="random prefixes per verify width (near ties)")
    ap.add_argument("--hf-timeout", type=float, default=200, help="seconds for each transformers child")
    ap.add_argument("--no-compile", action="store_true", help="skip transformers static cache + torch.compile")
    ap.add_argument("--e2e-systems", nargs="+", default=None,
                    help="only these rows of the e2e section, e.g. target-only 'self-draft k=4'")
    ap.add_argument("--rtfx-repeats", type=int, default=2, help="timed calls per rtfx system (median)")
    ap.add_argument("--rtfx-requests", type=int, default=64,
                    help="concurrent 60 s requests in the rtfx section (one engine, max_batch of as many)")
    ap.add_argument("--hf-batch", type=int, nargs="+", default=[1],
                    help="batch sizes of the transformers rows (the goal's ratio is at B=1)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=None,
                    help="run only these sections (no budget skips), e.g. rtfx hf")
    ap.add_argument("--budget", type=float, default=330, help="seconds; later sections are skipped past it")
    args = ap.parse_args(argv)
    if args.dtype is None:
        args.dtype = "float16" if args.device.startswith("cuda") else "float32"
    if args.max_new_tokens is None:
        args.max_new_tokens = 4 if args.quick else 100
    if args.batch is None:
        args.batch = [1, 2] if args.quick else [1, 8]
    if args.quick:
        args.no_compile = True  # compiling is minutes, not a smoke test
    if args.models is None:
        args.models = args.out / "models"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no CUDA device (use --device cpu --quick for the smoke test)")
    if args.quick and args.device == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    results = Bench(args).run()
    print(f"[gpu.py] wrote {args.out / 'gpu.json'}, gpu.md, gpu.png; errors: {results['errors'] or 'none'}")
    return results


if __name__ == "__main__":
    main()

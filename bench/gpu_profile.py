"""Where a large-v3 decoder step's time goes on a GPU, and what kernel fusion could buy:
- the CUDA kernels of one eager step (torch.profiler: count, GPU time by kernel), the graphed step;
- the graphed step on the GPU decode ops (`Whisper.fuse_decode_ops`, specwhisper/kernels/decode_ops.py);
- the graphed step with each set of torch's attention kernels;
- one layer's six linears as torch's ops against the fused decode linear at several tilings;
- the race-sampling kernel (chunked and one program per row) the engine's sampled steps run;
- one `Engine.transcribe` call profiled: wall and kernel time a token, the top host-side ops;
- the step compiled by torch.compile (inductor; cudagraphs only from `StepGraphs`), then captured.

    python bench/gpu_profile.py --models DIR --out OUT_DIR [--widths 1 5] [--no-compile]
    python bench/gpu_profile.py --models DIR --out OUT_DIR --device cpu --quick   # smoke test

Writes profile.json after each part and prints a summary. Random weights from bench/gpu_models.py.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_models  # noqa: E402
from gpu import Clock, StaticStep, filled_cache  # noqa: E402
from specwhisper.engine.decoding import LoadedModel  # noqa: E402
from specwhisper.engine.graphs import StepGraphs  # noqa: E402


def kernel_profile(step, device, steps: int = 5) -> dict:
    """GPU kernels of `steps` eager calls: per-step count and time, the top kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    by_name, count, total = defaultdict(float), 0, 0.0
    for e in prof.events():
        if device.type == "cuda" and e.device_type.name != "CUDA":
            continue
        if device.type != "cuda" and not e.name.startswith("aten::"):
            continue
        us = e.device_time if device.type == "cuda" else e.cpu_time
        by_name[e.name[:90]] += us / steps
        count += 1
        total += us
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:18]
    return dict(kernels_per_step=count / steps, kernel_us_per_step=total / steps,
                top=[dict(name=n, us_per_step=round(t, 1)) for n, t in top])


def decode_linear_section(device, dtype, clock, tiles=((32, 128, 4, 0), (32, 256, 4, 512), (32, 256, 4, 1024),
                                                      (32, 256, 4, 1024, 1), (64, 256, 8, 512, 1))) -> dict:
    from specwhisper.backends.ops import _import_kernels

    kernel = _import_kernels("decode_ops")
    import torch.nn.functional as F

    d, ffn = 1280, 5120
    g = torch.Generator(device=device).manual_seed(0)
    rand = lambda *shape: (torch.randn(*shape, device=device, generator=g) * 0.02).to(dtype)  # noqa: E731
    W = dict(qkv=rand(3 * d, d), out=rand(d, d), q=rand(d, d), xout=rand(d, d), fc1=rand(ffn, d), fc2=rand(d, ffn))
    B = {name: rand(w.shape[0]) for name, w in W.items()}
    LN = [(1 + rand(d), rand(d), 1e-5) for _ in range(3)]
    result = {}
    for rows in (1, 5):
        x = rand(rows, d)

        def torch_layer():
            h = F.linear(F.layer_norm(x, (d,), *LN[0]), W["qkv"], B["qkv"])
            y = x + F.linear(h[:, :d], W["out"], B["out"])
            q = F.linear(F.layer_norm(y, (d,), *LN[1]), W["q"], B["q"])
            y = y + F.linear(q, W["xout"], B["xout"])
            f = F.gelu(F.linear(F.layer_norm(y, (d,), *LN[2]), W["fc1"], B["fc1"]))
            return y + F.linear(f, W["fc2"], B["fc2"])

        def fused_layer(block_n, block_k, warps, split_k, serial=0):
            lin = lambda *a, **kw: kernel.decode_linear(*a, block_n=block_n, block_k=block_k,  # noqa: E731
                                                        num_warps=warps, split_k=split_k, serial=bool(serial), **kw)
            h = lin(x, W["qkv"], B["qkv"], layer_norm=LN[0])
            y = lin(h[:, :d].contiguous(), W["out"], B["out"], residual=x)
            q = lin(y, W["q"], B["q"], layer_norm=LN[1])
            y = lin(q, W["xout"], B["xout"], residual=y)
            f = lin(y, W["fc1"], B["fc1"], layer_norm=LN[2], gelu=True)
            return lin(f, W["fc2"], B["fc2"], residual=y)

        timed = {}
        graphs = StepGraphs(True, device)
        timed["torch"] = clock(lambda: graphs.run(("torch", rows), torch_layer)) * 1e6
        for tile in tiles:
            tile = (*tile, 0)[:5]  # serial 0 where left out
            name = "fused n{} k{} w{} split {} serial {}".format(*tile)
            fn = lambda tile=tile: fused_layer(*tile)  # noqa: E731
            try:
                timed[name] = clock(lambda: graphs.run(("fused", rows, *tile), fn)) * 1e6
            except Exception as exc:
                timed[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
        weights = sum(w.numel() * w.element_size() for w in W.values())
        result[f"rows={rows}"] = dict(us_per_layer=timed, weight_bytes=weights)
        print(f"decode_linear, one layer's linears, {rows} rows (us, graphed): {timed}", flush=True)
    return result


def engine_profile(folder, device, dtype, tokens: int, batch: int = 1, decode_ops: bool = False) -> dict:
    """Where an end-to-end token goes beyond the step: `Engine.transcribe` of `batch` random windows
    (target-only, graphs on CUDA, torch's ops or `decode_ops`), `tokens` new tokens a row, timed
    plain after a warm-up, then profiled: wall and kernel time per step (the encoder and the
    admission included), the top ops by self CPU time (the host's share), the tokens."""
    from torch.profiler import ProfilerActivity, profile

    from specwhisper import Engine
    from specwhisper.config import WhisperConfig

    engine = Engine(folder, device=device, dtype=dtype, background=False, decode_ops=decode_ops)
    mel = torch.randn(batch, WhisperConfig.from_hf(folder).num_mel_bins, 3000,
                      generator=torch.Generator().manual_seed(0))

    def call(n):
        result = engine.transcribe(mel, language="en", max_new_tokens=n)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return result if isinstance(result, list) else [result]
    call(tokens)
    start = time.perf_counter()
    result = call(tokens)
    plain = time.perf_counter() - start
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        call(tokens)
        wall = time.perf_counter() - start
    n = max(max(len(r.tokens) for r in result), 1)  # steps of the call
    kernel_us = sum(e.device_time for e in prof.events() if e.device_type.name == "CUDA") if device.type == "cuda" else 0.0
    host = sorted(((e.key, e.self_cpu_time_total) for e in prof.key_averages()), key=lambda kv: -kv[1])[:15]
    return dict(batch=batch, decode_ops=decode_ops, steps=n, plain_ms_per_step=plain / n * 1e3,
                profiled_ms_per_step=wall / n * 1e3, kernel_ms_per_step=kernel_us / n / 1e3,
                tokens=[list(r.tokens) for r in result],
                host_top=[dict(name=k[:80], self_ms_per_step=round(t / n / 1e3, 4)) for k, t in host])


SECTIONS = ("steps", "decode_ops", "attention", "linear", "engine", "race", "compile")


def _numbers(text: str, names: str) -> tuple[int, ...]:
    """'1,2,3' -> (1, 2, 3), as many as `names` lists ('[,X]': X optional, 0 if left out)."""
    values = [int(v) for v in text.split(",")]
    required, optional = names.split("[")[0].rstrip(",").split(","), names.count("[")
    if not len(required) <= len(values) <= len(required) + optional:
        raise argparse.ArgumentTypeError(f"{text!r}: want {names}")
    return tuple(values + [0] * (len(required) + optional - len(values)))


def _tile(text: str) -> tuple[int, ...]:
    return _numbers(text, "N,K,WARPS,SPLIT[,SERIAL]")


def _ops_config(text: str) -> tuple[int, ...]:
    return _numbers(text, "N,K,WARPS,SPLIT,CHUNK[,SERIAL]")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-mode", default="default", help="torch.compile mode (its own cudagraphs off)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    help="which parts to run (default: all)")
    ap.add_argument("--tiles", nargs="+", type=_tile, default=None,
                    help="decode_linear tiles N,K,WARPS,SPLIT[,SERIAL] for the linear sweep (SPLIT 0: one "
                         "split; SERIAL 1: the splits added by the tile's last program)")
    ap.add_argument("--decode-ops", nargs="+", type=_ops_config, default=None,
                    help="decode-ops step configurations N,K,WARPS,SPLIT,CHUNK[,SERIAL] (default: the kernels' own, "
                         "and it with SERIAL flipped)")
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    folders = gpu_models.make_models(args.models, device, dtype, args.quick)
    target = LoadedModel.load(folders["large-v3"], device, dtype)
    clock = Clock(device, args.quick)
    out: dict = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     batch=args.batch, widths={})
    path = args.out / "profile.json"

    def save():
        path.write_text(json.dumps(out, indent=1))

    cache = filled_cache(target, args.batch, device, dtype)
    for w in args.widths if "steps" in args.sections else ():
        step = StaticStep(target, cache, w)
        graphs = StepGraphs(True, device)
        row = dict(eager_ms=clock(step) * 1e3,
                   graphed_ms=clock(lambda: graphs.run(("t", w), step)) * 1e3)
        row["profile"] = kernel_profile(step, device)
        out["widths"][w] = row
        print(f"width {w}: eager {row['eager_ms']:.3f} ms, graphed {row['graphed_ms']:.3f} ms, "
              f"{row['profile']['kernels_per_step']:.0f} kernels, {row['profile']['kernel_us_per_step']:.0f} us "
              "of kernel time per step", flush=True)
        for t in row["profile"]["top"][:12]:
            print(f"   {t['us_per_step']:8.1f} us  {t['name']}", flush=True)
        save()

    # the whole step on the GPU decode ops (Whisper.fuse_decode_ops): time, kernels, argmax, for
    # each configuration asked for (decode_linear's tile, decode_attention's chunk)
    if device.type == "cuda" and "decode_ops" in args.sections:
        from specwhisper.backends.ops import _import_kernels

        kernel = _import_kernels("decode_ops")
        own = (*kernel.LINEAR_TILE, kernel.CHUNK, int(kernel.SERIAL))
        fused = {}
        # by default the kernels' own configuration and the same with the other split reduction
        for config in args.decode_ops or [own, (*own[:5], 1 - own[5])]:
            kernel.LINEAR_TILE, kernel.CHUNK, kernel.SERIAL = config[:4], config[4], bool(config[5])
            for w in args.widths:
                name = "width {} n{} k{} w{} split {} chunk {} serial {}".format(w, *config)
                step = StaticStep(target, cache, w)
                reference = step().clone()
                target.model.fuse_decode_ops(kernel)
                try:
                    graphs = StepGraphs(True, device)
                    fused[name] = dict(graphed_ms=clock(lambda: graphs.run(("fused", w), step)) * 1e3,
                                       same_argmax=bool(torch.equal(step(), reference)))
                    fused[name]["profile"] = kernel_profile(step, device)
                except Exception as exc:
                    fused[name] = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
                finally:
                    target.model.decoder.fused_ops = None
                top = fused[name].get("profile", {}).get("top", [])[:4]
                print(f"decode ops, {name}: {fused[name].get('graphed_ms', fused[name].get('error'))} ms graphed, "
                      f"same argmax {fused[name].get('same_argmax')}, top "
                      f"{[(t['name'][:40], t['us_per_step']) for t in top]}", flush=True)
        kernel.LINEAR_TILE, kernel.CHUNK, kernel.SERIAL = own[:4], own[4], bool(own[5])
        out["fused_ops_step"] = fused
        save()

    # attention: which of torch's SDPA kernels serves the decode step's shapes best (cuDNN's is
    # chosen by default: 1 query and 5 queries over 449 self slots and 1500 audio frames)
    if device.type == "cuda" and "attention" in args.sections:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sets = {"default": None, "no cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                              SDPBackend.MATH],
                "efficient + math": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
                "math": [SDPBackend.MATH]}
        attention = {}
        for w in args.widths:
            step = StaticStep(target, cache, w)
            reference = step().clone()
            for name, backends in sets.items():
                graphs = StepGraphs(True, device)
                try:
                    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                        ms = clock(lambda: graphs.run(("a", w), step)) * 1e3
                        same = bool(torch.equal(graphs.run(("a", w), step), reference))
                    attention[f"width {w}: {name}"] = dict(graphed_ms=round(ms, 3), same_argmax=same)
                except Exception as exc:  # a backend that refuses these shapes
                    attention[f"width {w}: {name}"] = dict(error=f"{type(exc).__name__}: {str(exc)[:200]}")
                print(f"attention width {w} {name}: {attention[f'width {w}: {name}']}", flush=True)
        out["attention"] = attention
        save()

    # the fused decode linear (specwhisper/kernels/decode_ops.py) against torch's ops for one large-v3 layer's
    # six linears with their layer norms, GELU and residual adds, graphed, 1 and 5 rows
    if device.type == "cuda" and dtype != torch.float32 and "linear" in args.sections:
        out["decode_linear"] = decode_linear_section(device, dtype, clock, *([args.tiles] if args.tiles else []))
        save()

    # one call end to end: what a step costs beyond the graphed step, torch's ops and the decode ops
    if "engine" in args.sections:
        runs = out["engine"] = {}
        for ops_on in (False, True) if device.type == "cuda" and dtype != torch.float32 else (False,):
            for b in sorted({1, args.batch}):
                name = f"{'decode ops' if ops_on else 'torch ops'} B={b}"
                try:
                    e = runs[name] = engine_profile(folders["large-v3"], device, dtype, 8 if args.quick else 64,
                                                    b, ops_on)
                    print(f"engine, target-only, {name}, {e['steps']} steps: {e['plain_ms_per_step']:.3f} ms a "
                          f"step ({e['profiled_ms_per_step']:.3f} profiled), {e['kernel_ms_per_step']:.3f} ms of "
                          f"kernels; top self CPU: {e['host_top'][:6]}", flush=True)
                except Exception as exc:
                    runs[name] = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
                    print(f"engine {name}: {runs[name]['error']}", flush=True)
                save()
        for b in sorted({1, args.batch}):  # the decode ops' tokens against torch's (half precision may flip)
            a, d = runs.get(f"torch ops B={b}", {}), runs.get(f"decode ops B={b}", {})
            if "tokens" in a and "tokens" in d:
                print(f"engine B={b}: decode ops' tokens equal torch ops' in {sum(x == y for x, y in zip(a['tokens'], d['tokens']))}"
                      f" of {b} rows", flush=True)
        one, many = runs.get("decode ops B=1", {}), runs.get(f"decode ops B={args.batch}", {})
        if args.batch > 1 and "tokens" in one and "tokens" in many:
            print(f"engine: decode ops, row 0 of B={args.batch} equals B=1: {many['tokens'][0] == one['tokens'][0]}",
                  flush=True)

    # the race kernel of a sampled verify: B x (k+1) rows of the vocabulary
    from specwhisper.backends import ops

    kernels = ops.triton_kernels() if device.type == "cuda" and "race" in args.sections else None
    if kernels is not None:
        V, race = 51866, {}
        for n in (1, 5, 40):
            g = torch.Generator(device=device).manual_seed(n)
            logits = 3 * torch.randn(n, V, device=device, dtype=dtype, generator=g)
            temp = torch.ones(n, device=device)
            seed = torch.arange(n, device=device, dtype=torch.int64)
            pos = torch.zeros(n, device=device, dtype=torch.int64)
            for top_p in (1.0, 0.95):
                tp = torch.full((n,), top_p, device=device)
                graphs = StepGraphs(True, device)

                for split in (True, False):  # chunked (the default) / one program per row
                    def fn(logits=logits, temp=temp, tp=tp, seed=seed, pos=pos, split=split):
                        return kernels.race_sample_triton(logits, temp, tp, seed, pos, split=split)
                    name = f"rows={n} top_p={top_p} {'chunked' if split else 'per-row'}"
                    race[name] = round(clock(lambda: graphs.run(("race", n, top_p, split), fn)) * 1e6, 1)
            greedy = StepGraphs(True, device)
            race[f"rows={n} argmax"] = round(clock(lambda: greedy.run(("argmax", n), lambda: logits.argmax(-1))) * 1e6, 1)
        out["race_us_graphed"] = race
        print("race sampling (us, graphed):", race, flush=True)
        save()

    if not args.no_compile and "compile" in args.sections:
        compiled = {}
        for w in args.widths:
            step = StaticStep(target, cache, w)
            fn = torch.compile(step.__call__, mode=None if args.compile_mode == "default" else args.compile_mode,
                               dynamic=False)
            start = time.perf_counter()
            fn()
            compile_s = time.perf_counter() - start
            same = bool(torch.equal(fn(), step()))
            graphs = StepGraphs(True, device)
            compiled[w] = dict(compile_s=round(compile_s, 1), same_argmax_as_eager=same,
                               compiled_eager_ms=clock(fn) * 1e3,
                               compiled_graphed_ms=clock(lambda: graphs.run(("c", w), fn)) * 1e3)
            print(f"compiled width {w}: {compiled[w]}", flush=True)
            out["compiled"] = compiled
            save()


if __name__ == "__main__":
    main()

"""The encoder against the CPU's float32 peak, in one run.

Question answered: how many GFLOP/s does whisper's encoder (float32, one full 30 s window of
speech: the demo recording's first) reach,
fast path (`specwhisper/model/encoder_cpu.py`) and reference forward, beside the float32 FMA peak
measured in the same run by bench/fma_peak.cpp (independent FMA chains on every thread, 256-bit
AVX2 or 512-bit AVX-512 as torch's kernels use)? Peak and encoders are timed interleaved (each
repeat runs all of them in turn), so a busy spell of a shared machine hits all alike; medians and
spreads (min..max) are reported. On a machine shared with other work, wall-clock figures
measure the share of the cores this process got; the run also reports GFLOP per CPU-second
(process CPU time of all threads, for the FMA loop and the encoder alike; an OpenMP thread
spinning at a barrier counts as busy, so this understates the encoder), which such sharing
disturbs far less.

    python bench/encoder.py                     # base, 2 threads, 5 repeats
    ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python bench/encoder.py

FLOPs are counted analytically (multiply-add = 2): the two convolutions, per layer the q/k/v and
out projections, attention's QK^T and PV over all positions, and the MLP. Layer norms, GELU,
softmax and adds are not counted.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specwhisper.backends import cpu_ops  # before torch: its huge pages (specwhisper/__init__.py)
import torch  # noqa: E402, I001

FMA_SOURCE = Path(__file__).with_name("fma_peak.cpp")


def encoder_flops(cfg, frames: int = 3000) -> float:
    """Multiply-add FLOPs of one encoder pass over `frames` mel frames."""
    d, T, F = cfg.d_model, frames // 2, cfg.encoder_ffn_dim
    conv = 2 * frames * d * cfg.num_mel_bins * 3 + 2 * T * d * d * 3
    layer = 2 * T * d * 3 * d + 2 * T * d * d + 2 * 2 * T * T * d + 2 * 2 * T * d * F
    return conv + cfg.encoder_layers * layer


def fma_binary(width: int, build_dir: Path, vnni: bool = False) -> Path:
    """Compile bench/fma_peak.cpp for 8 (AVX2) or 16 (AVX-512) float lanes (g++); `vnni`: its 16-bit
    multiply-adds as AVX512-VNNI's vpdpwssd, as the screened head runs them on such a CPU."""
    build_dir.mkdir(parents=True, exist_ok=True)
    out = build_dir / f"fma_peak{width}{'vnni' if vnni else ''}"
    isa = ["-mavx2", "-mfma"] if width == 8 else ["-mavx512f", "-mavx512bw", "-mfma"] + (["-mavx512vnni"] if vnni else [])
    if not out.exists() or out.stat().st_mtime < FMA_SOURCE.stat().st_mtime:
        subprocess.run(["g++", "-O2", f"-DWIDTH={width}", *isa, "-pthread", str(FMA_SOURCE), "-o", str(out)],
                       check=True)
    return out


def fma_peak(binary: Path, threads: int, seconds: float = 0.3, kind: str = "fma") -> tuple[float, float]:
    """(G operations/s, G operations per CPU-second) on `threads` threads, measured now: independent
    float32 FMA chains (`kind` "fma": GFLOP), or chains of the screened head's 16-bit integer
    multiply-adds ("madd16"; 2 operations a multiply-add, as for the FMAs)."""
    done = subprocess.run([str(binary), str(threads), str(seconds), kind], capture_output=True, text=True, check=True)
    wall, cpu = done.stdout.split()[:2]
    return float(wall), float(cpu)


def speech_window(n_mels: int) -> torch.Tensor:
    """[1, n_mels, 3000]: the log-mel of the demo recording's first 30 s (real speech: on random
    input no query attends sharply, and the subnormal weights of a sharp softmax, which cost
    base's first layer 1.8x its time on an Intel core until the attention kernel flushed them,
    never arise)."""
    from specwhisper import load_audio, log_mel_spectrogram
    from specwhisper.audio import pad_or_trim
    from specwhisper.samples import demo_recording

    return log_mel_spectrogram(pad_or_trim(load_audio(str(demo_recording()[0]))), n_mels)[None]


def flash_attention(run):
    """`run` with the C++ ops held to the scalar level: the fast encoder then attends with torch's
    flash kernel instead of csrc/encoder_ops.h (its only C++ op)."""
    def held():
        with cpu_ops.vector_level(0):
            return run()
    return held


def vector_width() -> int:
    """Float lanes of the vector level torch's kernels use (ATEN_CPU_CAPABILITY may hold it lower)."""
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


def measure(encoder, cfg, threads: int, repeats: int, build_dir: Path) -> dict:
    """Interleaved: FMA peak, fast encoder, reference encoder -> GFLOP/s medians and spreads."""
    torch.set_num_threads(threads)
    binary = fma_binary(vector_width(), build_dir)
    mel = speech_window(cfg.num_mel_bins)
    flops = encoder_flops(cfg)
    runs = {"fast": lambda: encoder(mel), "reference": lambda: encoder.reference(mel)}
    with torch.no_grad():
        own_attention = cpu_ops.encoder_attention_usable(mel)
    if own_attention:  # the fast path with its own attention kernel (AVX2, AVX-512), and with torch's flash kernel
        runs["fast, flash attention"] = flash_attention(lambda: encoder(mel))
    seconds = {name: [] for name in runs}
    cpu_seconds = {name: [] for name in runs}
    peaks, cpu_peaks = [], []
    with torch.inference_mode():
        for run in runs.values():
            run()  # warm-up (and the fast path's weight packing)
        for _ in range(repeats):
            wall, cpu = fma_peak(binary, threads)
            peaks.append(wall)
            cpu_peaks.append(cpu)
            for name, run in runs.items():
                start, cpu_start = time.perf_counter(), time.process_time()
                run()
                seconds[name].append(time.perf_counter() - start)
                cpu_seconds[name].append(time.process_time() - cpu_start)
    out = dict(threads=threads, capability=torch.backends.cpu.get_cpu_capability(), gflop=flops / 1e9,
               peak_gflops=statistics.median(peaks), peak_spread=(min(peaks), max(peaks)),
               peak_gflop_per_cpu_s=statistics.median(cpu_peaks))
    if "fast, flash attention" in seconds:  # paired within each repeat
        out["flash_over_own"] = statistics.median(
            b / a for a, b in zip(seconds["fast"], seconds["fast, flash attention"]))
    for name, s in seconds.items():
        out[name] = dict(seconds=statistics.median(s), spread=(min(s), max(s)),
                         gflops=flops / statistics.median(s) / 1e9,
                         gflop_per_cpu_s=flops / statistics.median(cpu_seconds[name]) / 1e9)
        out[name]["of_peak"] = out[name]["gflops"] / out["peak_gflops"]
        out[name]["of_peak_cpu"] = out[name]["gflop_per_cpu_s"] / out["peak_gflop_per_cpu_s"]
    return out


def line(r: dict) -> str:
    return (f"{r['capability']}, {r['threads']} thread(s): FMA peak {r['peak_gflops']:.1f} GFLOP/s "
            f"({r['peak_spread'][0]:.1f}..{r['peak_spread'][1]:.1f}), {r['peak_gflop_per_cpu_s']:.1f} GFLOP per "
            f"CPU-s; encoder {r['gflop']:.1f} GFLOP: "
            + "; ".join(f"{name} {r[name]['seconds']:.3f} s ({r[name]['spread'][0]:.3f}..{r[name]['spread'][1]:.3f}) "
                        f"= {r[name]['gflops']:.1f} GFLOP/s, {r[name]['of_peak']:.0%} of peak; "
                        f"{r[name]['gflop_per_cpu_s']:.1f} GFLOP per CPU-s, {r[name]['of_peak_cpu']:.0%} of peak"
                        for name in ("fast", "reference", "fast, flash attention") if name in r)
            + (f"; fast with torch's flash attention / with the own kernel, paired median "
               f"{r['flash_over_own']:.3f}" if "flash_over_own" in r else ""))


def main() -> None:
    from specwhisper.model.weights import load_whisper
    from specwhisper.tools.fetch import fetch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="base")
    p.add_argument("--threads", type=int, nargs="+", default=[2])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--build-dir", type=Path, default=Path(".build"))
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu import cpu_model  # bench/cpu.py: the CPU's model and vector extensions

    print(f"CPU: {cpu_model()}", flush=True)
    model = load_whisper(fetch(args.model))
    for threads in args.threads:
        print(line(measure(model.encoder, model.config, threads, args.repeats, args.build_dir)), flush=True)


if __name__ == "__main__":
    main()

"""CPU decoding on realistic windows, in one run: where a token's time goes and how it compares.

Question answered: on ≈ 25 s speech windows (whisper-base, 2 threads), what does one target
decoder step cost against the memory-bandwidth floor, against CTranslate2 float32 and
`transformers` generate; what does a verify pass of k+1 = 2..9 rows cost relative to one step;
what does a draft step cost; and what are the end-to-end tokens/s and speedups of target-only and
speculative decoding (tiny.en, self, optionally a distilled draft), plus the bfloat16 path and
CTranslate2 int8 (faster-whisper's CPU default)? Where does a target-only call spend its time
outside the steps (timed inside the engine's own calls)? It also prints the CPU model and flags, and the
encoder's GFLOP/s beside the float32 FMA peak measured in the same run (bench/encoder.py), and
beside the verify passes what they would cost if the rows past the first added their arithmetic
after the weight stream or hid it all under the stream (`verify_bounds`: a row's float32 and 16-bit
multiply-adds at the FMA and vpmaddwd peaks measured in the same run, bench/fma_peak.cpp).

    python bench/cpu.py                                  # 3 windows, base, drafts tiny.en, self, base-2l
    python bench/cpu.py --windows 6 --repeats 3 --distilled ~/drafts/base-2l --out bench/results
    python bench/cpu.py --distilled ~/drafts/base-2l --k 2 3 --draft-head-tokens 8192   # + a pruned draft head
    python bench/cpu.py --vector-level 1                 # an AVX2-only CPU, measured on an AVX-512 one

Decode time per token = (median whole call − the system's median encoder time) / tokens, so a
draft's own encoder (tiny.en) counts as decode time; "whole call" compares complete calls. The
float32 specwhisper systems run the same target encoder, so their encoder samples are pooled into
one median, subtracted from each alike.
All systems are timed interleaved (each round takes each window through every system in turn);
besides the ratios of medians, the table gives paired ratios against target-only: each round's
decode (and whole-call) seconds against target-only's in the same round, median and range over rounds.
Each adaptive draft's proposals and target passes are listed round by round beside that round's
paired decode ratio (0 proposals: the draft kept off that round). The last system is target-only
again on a second engine (the control): its paired ratio against the first says what the order of
the calls and the machine's noise alone make of a ratio that should read 1.00.
CTranslate2 runs in a worker process (bench/ct2_worker.py): its OpenMP runtime and PyTorch's in
one process contend for the cores and slowed both by ≈ 40% on 2 cores.

Writes <out>/cpu.json (everything), cpu.md (the tables) and cpu.png. Windows are ≈ 25 s of flite
speech (several voices per window), synthesized into a temporary folder. Step timings are medians
of back-to-back repetitions at a mid-window position (64 tokens in).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from specwhisper import Engine, load_audio, log_mel_spectrogram  # before torch: its huge pages (specwhisper/__init__.py)
import torch  # noqa: E402, I001
from specwhisper.backends import cpu_ops
from specwhisper.engine.draft import compact_draft_head
from specwhisper.model import encoder_cpu
from specwhisper.model.whisper import DecoderCache
from specwhisper.tools.fetch import NAMES, ct2_dir, fetch
from specwhisper.wer import wer

sys.path.insert(0, str(Path(__file__).parent))
import encoder as encoder_bench  # noqa: E402  (bench/encoder.py: encoder GFLOP/s beside the FMA peak)

SENTENCES = [
    "The weather today will be mostly sunny, with a high of seventy two degrees.",
    "Please turn off the lights and lock the door before you leave the office.",
    "The city council voted on Tuesday to build a new library near the river.",
    "To reset your password, open the settings page and click on security.",
    "The train to Boston leaves from platform four in twenty minutes.",
    "Traffic on the main highway is moving slowly because of an accident.",
    "Our store is open from nine in the morning until six in the evening.",
    "The meeting has been moved to Thursday afternoon in the large conference room.",
    "Scientists have discovered a new species of frog in the mountains of Peru.",
    "Remember to bring your passport and a printed copy of your ticket.",
    "The museum will offer free admission to students every Sunday this summer.",
    "Heavy rain is expected tonight, so drivers should take extra care on the roads.",
    "She finished the marathon in just under four hours and felt wonderful.",
    "The restaurant on the corner serves the best pancakes in the whole town.",
    "Our flight was delayed by two hours because of a problem with the engine.",
    "The children planted tomatoes, beans and sunflowers in the school garden.",
    "Please send me the report by Friday so that I can review it over the weekend.",
    "The orchestra will perform music by Mozart and Beethoven at eight o'clock.",
    "A strong wind knocked down several trees along the coast last night.",
    "He opened the old wooden box and found a letter written by his grandfather.",
    "The new software update makes the phone faster and improves the battery life.",
    "We walked along the beach at sunset and watched the boats come back to the harbor.",
    "The bakery sells fresh bread every morning before the sun comes up.",
    "Students must submit their applications before the end of the month.",
]
VOICES = ["slt", "rms", "awb", "kal16"]
WINDOW_SECONDS, GAP_SECONDS, SR = 25.0, 0.3, 16000
POSITION = 64  # decoding position of the step microbenchmarks
AVX2_ENVIRONMENT = dict(SPECWHISPER_VECTOR_LEVEL="1", ATEN_CPU_CAPABILITY="avx2", DNNL_MAX_CPU_ISA="AVX2",
                        MKL_ENABLE_INSTRUCTIONS="AVX2", SPECWHISPER_NO_BF16="1",
                        FBGEMM_ENABLE_INSTRUCTIONS="AVX2",  # fbgemm (int8 draft encoders) picks its own ISA
                        CT2_FORCE_CPU_ISA="AVX2")  # CTranslate2's own kernels (its worker inherits this)


WHOLE_CALL_GOAL = 1.3  # the distilled draft's whole-call goal (bench/README)


def synthesize_windows(n: int, folder: Path) -> list[tuple[np.ndarray, str]]:
    """n windows of ≈ 25 s, each sentences spoken by rotating voices -> (audio, reference text)."""
    windows, s = [], 0
    for w in range(n):
        parts, texts, seconds = [], [], 0.0
        while seconds < WINDOW_SECONDS - 2.5:
            text, voice = SENTENCES[s % len(SENTENCES)], VOICES[(s + w) % len(VOICES)]
            path = folder / f"s{s}.wav"
            subprocess.run(["flite", "-voice", voice, "-t", text, "-o", str(path)], check=True)
            audio = load_audio(path)
            if seconds + len(audio) / SR > 28.5:
                break
            parts += [audio, np.zeros(int(GAP_SECONDS * SR), np.float32)]
            texts.append(text)
            seconds += len(audio) / SR + GAP_SECONDS
            s += 1
        windows.append((np.concatenate(parts), " ".join(texts)))
    return windows


def cpu_model() -> str:
    """The CPU's model name and vector extensions that matter here (sessions get different machines)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.machine())
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    ext = [f for f in ("avx2", "fma", "avx_vnni", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    # the last-level cache beside the flags: a step's ≈ 110 MB stream fits some (an Intel Xeon's
    # 480 MB, shared with the host's other tenants) and reads partly from it, below the DRAM floor
    try:
        l3 = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()  # e.g. 491520K
        l3 = f"{int(l3[:-1]) // 1024} MB" if l3.endswith("K") and l3[:-1].isdigit() else l3
    except OSError:
        l3 = ""
    return f"{name}, {' '.join(ext)}" + (f", L3 {l3}" if l3 else "")


class CT2Worker:
    """CTranslate2 in a subprocess (bench/ct2_worker.py): its OpenMP runtime must not share this
    process's cores with PyTorch's."""

    def __init__(self, folder, mels, threads: int, prompt: list[int], tmp: Path, compute_type: str = "float32"):
        self.mels = mels
        path = tmp / "mels.npy"
        np.save(path, np.stack([m.numpy() for m in mels]))
        worker = Path(__file__).with_name("ct2_worker.py")
        self.proc = subprocess.Popen([sys.executable, str(worker), str(folder), str(path), str(threads),
                                      json.dumps(prompt), compute_type],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if not json.loads(self.proc.stdout.readline() or "{}").get("ready"):
            raise RuntimeError("the CTranslate2 worker did not start (see its error above)")

    def call(self, op: str, mel):
        index = next(i for i, m in enumerate(self.mels) if m is mel)
        self.proc.stdin.write(json.dumps({"op": op, "mel": index}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline()).get("tokens")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bandwidth() -> dict:
    """Memory bandwidth measured now: a 256 MB read (sum) and copy (read + write bytes)."""
    src = torch.ones(64 * 2**20)
    dst = torch.empty_like(src)
    read = src.numel() * 4 / timed(lambda: src.sum(), 5)
    copy = 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), 5)
    return dict(read_GBps=read / 1e9, copy_GBps=copy / 1e9, GBps=max(read, copy) / 1e9)


def bytes_per_token(engine: Engine) -> dict:
    """Bytes one decode step must read: decoder blocks (the tensors the C++ step reads: float16
    copies of a float16 checkpoint's projections, `Whisper.half_projections`), output head
    (screened int8 or own dtype), cross-attention K/V (the self-attention cache at POSITION is
    small but counted)."""
    dec, cfg = engine.target.model.decoder, engine.target.config
    blocks = sum(p.numel() * p.element_size() for p in dec.layer_params())  # cross K/V projections: once a window
    blocks += sum(p.numel() * p.element_size() for p in dec.layer_norm.parameters())
    w = dec.embed_tokens.weight
    head = w.numel() * (1 if engine.target.head is not None else w.element_size())  # screened: int8
    item = torch.finfo(engine.dtype).bits // 8
    cross = 2 * cfg.decoder_layers * cfg.max_source_positions * cfg.d_model * item
    self_kv = 2 * cfg.decoder_layers * POSITION * cfg.d_model * item
    return dict(blocks=blocks, head=head, cross_kv=cross, self_kv=self_kv, total=blocks + head + cross + self_kv)


def row_macs(engine: Engine) -> dict:
    """Multiply-adds one row of a target pass makes at POSITION: float32 ones (the blocks' linears,
    their weights as the C++ step reads them; self-attention over POSITION keys, cross-attention
    over every audio position) and the screened head's 16-bit integer ones (its screen over the
    whole vocabulary; the few candidates it rescores exactly are left out). A head that is not
    screened counts as float32."""
    dec, cfg = engine.target.model.decoder, engine.target.config
    d, V = cfg.d_model, dec.embed_tokens.weight.shape[0]
    linears = sum(p.numel() for p in dec.layer_params() if p.dim() == 2)
    attention = 2 * cfg.decoder_layers * d * (POSITION + cfg.max_source_positions)
    screened = engine.target.head is not None
    return dict(float32=linears + attention + (0 if screened else V * d), int16=V * d if screened else 0)


def verify_bounds(macs: dict, peaks: dict, step_ms: float, rows=range(1, 10)) -> dict:
    """A verify pass of r rows in one-row steps at two extremes, from a row's arithmetic at the peaks
    measured now (GMAC/s: `peaks` float32 and int16), a = float32 / its peak + int16 / its peak:
    `serial`, every row past the first adding its arithmetic after the weight stream (none of it
    hidden), 1 + (r - 1) a / step; `overlapped`, all of it hidden under the stream, max(1, r a / step).
    A pass measured near `serial` is bounded by arithmetic that does not overlap the stream."""
    a_ms = 1e3 * (macs["float32"] / (peaks["float32"] * 1e9) + macs["int16"] / (peaks["int16"] * 1e9))
    return dict(row_ms=a_ms, serial={r: 1 + (r - 1) * a_ms / step_ms for r in rows},
                overlapped={r: max(1.0, r * a_ms / step_ms) for r in rows})


def mac_peaks(threads: int, build_dir: Path, repeats: int = 3) -> dict:
    """GMAC/s on `threads` threads at the vector level of the C++ ops (AVX2 or AVX-512): float32 FMAs
    and the screened head's 16-bit multiply-adds (vpmaddwd + vpaddd; AVX512-VNNI's vpdpwssd where
    the screen runs it), the medians of `repeats` alternated runs."""
    wide = cpu_ops.available() and cpu_ops._ops().vector_level() >= 2
    vnni = wide and "avx512_vnni" in cpu_model()
    fma = encoder_bench.fma_binary(16 if wide else 8, build_dir)
    madd = encoder_bench.fma_binary(16 if wide else 8, build_dir, vnni=vnni)
    runs = [(encoder_bench.fma_peak(fma, threads)[0], encoder_bench.fma_peak(madd, threads, kind="madd16")[0])
            for _ in range(repeats)]
    return dict(float32=statistics.median(f for f, _ in runs) / 2, int16=statistics.median(m for _, m in runs) / 2,
                int16_instruction="vpdpwssd" if vnni else "vpmaddwd + vpaddd", width=16 if wide else 8)


def step_times(engine: Engine, mel: torch.Tensor, repeats: int, rows=range(1, 10), cross_dtype=None,
               read_bytes: int = 0) -> dict:
    """Seconds of one pass (blocks + greedy head) over T rows at POSITION, T in `rows`
    (`cross_dtype`: the cross-attention K/V cache's, e.g. bfloat16 as a compact draft keeps it), as
    an engine's iterations run it where the C++ step applies: one call, without the check of the
    weights' versions that `Decoder.hidden` makes on every call and an engine at each window's start
    (`Decoder.layer_params`: 108 counters of base's copies, ≈ 0.15 ms on cold caches).
    `read_bytes` > 0: also "read", a plain read (torch sum) of a buffer of that many bytes timed in
    the same rounds, after the passes: the memory floor of that moment (a shared VM's bandwidth
    moves by up to 2x within minutes, so a floor measured once, minutes apart, can mislead)."""
    lm = engine.target
    dec, cfg = lm.model.decoder, lm.config
    cache = DecoderCache.allocate(cfg, 1, "cpu", engine.dtype, cross_dtype)
    out = {}

    def one_pass(t: int):
        tokens, pos = torch.full((1, t), 440), torch.arange(POSITION, POSITION + t)[None]
        if dec.cpu_fused():
            args = cpu_ops._step_args(dec, cache, POSITION + t, check=False)
            return lambda: lm.greedy(cpu_ops._ops().decoder_step(tokens, pos, *args, 0), lm.suppress)
        return lambda: lm.greedy(dec.hidden(tokens, pos, cache, kv_len=POSITION + t), lm.suppress)

    with torch.inference_mode():
        dec.fill_cross(cache, lm.model.encoder(mel[None].to(engine.dtype)))
        dec.hidden(torch.full((1, POSITION), 440), torch.arange(POSITION)[None], cache)
        passes = {t: one_pass(t) for t in rows}
        if read_bytes > 0:
            buffer = torch.ones(read_bytes // 4)
            passes["read"] = buffer.sum
        for _ in range(3):  # warm-up
            for run in passes.values():
                run()
        times = {t: [] for t in passes}
        for _ in range(repeats):  # interleaved rounds: a slow spell of the machine hits every T alike
            for t, run in passes.items():
                start = time.perf_counter()
                run()
                times[t].append(time.perf_counter() - start)
        out = {t: statistics.median(v) for t, v in times.items()}
    return out


def compact_step_ms(engine: Engine, mel: torch.Tensor, repeats: int) -> float:
    """Milliseconds of one step of `engine`'s model with its decoder compacted as Engine(target,
    draft) compacts a draft's on the CPU (`Backend.compact_draft`), its cross K/V cache in the
    dtype the engine gives such a draft (`Backend.draft_cross_dtype`: bfloat16 on the CPU), its
    greedy head the 4-bit copy a compact draft proposes through (`draft.compact_draft_head`)."""
    lm = engine.target
    lm.backend.compact_draft(lm.model, own_encoder=False)
    lm.head = compact_draft_head(lm.model) or lm.head
    cross = lm.backend.draft_cross_dtype(lm.model.decoder, engine.dtype)
    return 1e3 * step_times(engine, mel, repeats, rows=[1], cross_dtype=cross)[1]


def window_setup(engine: Engine, mel: torch.Tensor, repeats: int) -> dict:
    """Seconds of what a window costs once, outside its steps: the cross-attention K/V projections
    (`fill_cross`, a GEMM over the encoder output) and the prompt pass (the prompt's rows through
    the blocks, then the head of its last row), medians of interleaved repetitions."""
    lm = engine.target
    dec, cfg = lm.model.decoder, lm.config
    cache = DecoderCache.allocate(cfg, 1, "cpu", engine.dtype)
    prompt = torch.tensor([lm.tokenizer.prompt("en", "transcribe")])
    P = prompt.shape[1]
    fill, first = [], []
    with torch.inference_mode():
        features = lm.model.encoder(mel[None].to(engine.dtype))
        for i in range(repeats + 2):  # the first two: warm-up
            start = time.perf_counter()
            dec.fill_cross(cache, features)
            mid = time.perf_counter()
            lm.greedy(dec.hidden(prompt, torch.arange(P)[None], cache, kv_len=P)[:, -1:], lm.suppress)
            if i >= 2:
                fill.append(mid - start)
                first.append(time.perf_counter() - mid)
    flop = 4 * cfg.decoder_layers * cfg.max_source_positions * cfg.d_model ** 2  # K and V: 2 GEMMs a layer
    return dict(cross_kv_s=statistics.median(fill), cross_kv_gflop=flop / 1e9, prompt_s=statistics.median(first),
                prompt_rows=P)


def engine_split(engine: Engine, mels, repeats: int) -> dict:
    """Where a target-only call's seconds go, timed inside the engine's own calls (the runner's
    methods wrapped; medians over `repeats` rounds of one call per window): the encoder, the steps
    (`verify_step`: blocks, head, token choice), the admission (cross K/V, prompt pass, first
    token) and the rest (host loop, bookkeeping: each round's call less its parts), with the tokens
    decoded. An engine with a draft (adaptive k) also has its draft steps (`draft`) and draft starts
    (`start_drafts`: its own encoder pass or the target's K/V copied, its prompt) timed, and
    `verify_step` times its verify passes and plain steps together (a target-only call's draft
    parts are never called: 0)."""
    runner = engine.runner
    parts = tuple(p for p in ("encode_windows", "verify_step", "admit", "draft", "start_drafts") if hasattr(runner, p))
    acc = dict.fromkeys(parts, 0.0)

    def wrap(name):
        f = getattr(runner, name)

        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[name] += time.perf_counter() - start
        return timed

    for name in parts:
        setattr(runner, name, wrap(name))  # an instance attribute shadows the method
    rounds = []
    try:
        for _ in range(repeats):
            acc.update(dict.fromkeys(parts, 0.0))
            start, tokens = time.perf_counter(), 0
            for mel in mels:
                tokens += len(engine.transcribe(mel, language="en").tokens) + 1
            call = time.perf_counter() - start
            # the rest of each round from that round's own parts: a difference of medians taken
            # over different rounds moved by a slow round's share (0.21 and 0.72 ms a token in two
            # runs of the same code, AVX2-only Zen 3)
            rounds.append(dict(acc, call=call, rest=call - sum(acc.values()), tokens=tokens))
    finally:
        for name in parts:
            delattr(runner, name)
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def whole_call_bound(encoder_share: float, goal: float) -> dict:
    """What a draft can do for a whole call when `encoder_share` of target-only's call is its encoder
    (every system runs it alike; speculation shortens the rest): the whole call's speed-up is
    1 / (e + (1 - e) / s) for a decode (the call less its encoder) s times faster, so at most 1 / e,
    and `goal` needs s >= (1 - e) / (1 / goal - e) (None: beyond that ceiling)."""
    e = encoder_share
    need = (1 - e) / (1 / goal - e) if 1 / goal > e else None
    return dict(ceiling=1 / e if e > 0 else float("inf"), goal=goal, decode_needed=need)


def interleaved_splits(engines: dict, mels, repeats: int) -> dict:
    """{name: engine_split of that engine} with the engines' rounds interleaved (each round one
    call per window of every engine, the order reversed every other round; medians over rounds),
    so a slow phase of a shared machine hits every engine alike."""
    rounds = {name: [] for name in engines}
    names = list(engines)
    for i in range(repeats):
        for name in (names if i % 2 == 0 else names[::-1]):
            rounds[name].append(engine_split(engines[name], mels, 1))
    return {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in rounds.items()}


def step_in_thread(engine: Engine, mel: torch.Tensor, repeats: int, rounds: int = 3) -> tuple[float, float]:
    """(main thread, second thread) seconds of a one-row step: `step_times` called from a second
    thread as an engine's loop thread calls it (`Engine.submit`, the server; the C++ ops run on
    their own workers there, decode_ops.cpp), in rounds alternating with the main thread (timed
    minutes apart, the two differed by up to 20% on a shared machine; side by side they agree)."""
    main, other = [], []
    for _ in range(rounds):
        main.append(step_times(engine, mel, repeats, rows=[1])[1])
        out = {}
        thread = threading.Thread(target=lambda: out.update(step_times(engine, mel, repeats, rows=[1])))
        thread.start()
        thread.join()
        other.append(out[1])
    return statistics.median(main), statistics.median(other)


def profile_step(engine: Engine, mel: torch.Tensor) -> str:
    lm = engine.target
    dec = lm.model.decoder
    cache = DecoderCache.allocate(lm.config, 1, "cpu", engine.dtype)
    tokens, pos = torch.full((1, 1), 440), torch.tensor([[POSITION]])
    with torch.inference_mode():
        dec.fill_cross(cache, lm.model.encoder(mel[None].to(engine.dtype)))
        for _ in range(3):
            lm.greedy(dec.hidden(tokens, pos, cache, kv_len=POSITION + 1), lm.suppress)
        with torch.profiler.profile() as prof:
            for _ in range(5):
                lm.greedy(dec.hidden(tokens, pos, cache, kv_len=POSITION + 1), lm.suppress)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


CONTROL = "specwhisper target-only, a second engine (control)"


def end_to_end(systems: list[tuple], mels, repeats: int) -> list[dict]:
    """Every system's whole call per window, interleaved window by window (each round takes each
    window in turn through every system, so the calls compared are seconds apart and a slow spell
    of the machine hits all alike; every other round in reverse order); decode seconds per window =
    median call minus the system's median encoder time. Besides the medians, each round's sums give
    paired ratios against the first system (decode and whole call, that round's calls only): their
    median and range over the rounds. systems: (name, run, encode) or (name, run, encode, group):
    systems of one group run the same encoder on the same weights, and their encoder samples are
    pooled into one median (a median per engine differed by 4% of a decode round between two
    engines in one run, which moved every paired decode ratio by that much)."""
    systems = [(*s, s[0]) if len(s) == 3 else s for s in systems]
    tokens = {name: [run(mel) for mel in mels] for name, run, _, _ in systems}  # also the warm-up
    calls = {name: [[] for _ in mels] for name, _, _, _ in systems}
    encs = {group: [] for _, _, _, group in systems}
    for r in range(repeats):
        # every other round backwards: no system always runs right after the same neighbour (the
        # CTranslate2 workers' processes, a draft engine's setup) or always first on cold caches
        for i, mel in enumerate(mels):
            for name, run, encode, group in (systems if r % 2 == 0 else systems[::-1]):
                t = time.perf_counter()
                run(mel)
                calls[name][i].append(time.perf_counter() - t)
                t = time.perf_counter()
                encode(mel)
                encs[group].append(time.perf_counter() - t)
    out = []
    for name, _, _, group in systems:
        totals = [statistics.median(c) for c in calls[name]]
        enc = statistics.median(encs[group])
        decode = [t - enc for t in totals]
        n = sum(len(t) + 1 for t in tokens[name])  # + 1: the EOT step
        seconds = sum(decode) if min(decode) > 0 else float("nan")  # nan: swamped by noise
        rounds = [sum(c[r] for c in calls[name]) for r in range(repeats)]  # whole calls of round r
        print(f"{name}: {1e3 * seconds / n:.1f} ms/token, {sum(totals):.2f} s per {len(mels)} calls", flush=True)
        out.append(dict(name=name, tokens=tokens[name], call_seconds=totals, encoder_seconds=enc,
                        decode_seconds=decode, tokens_per_s=n / seconds, ms_per_token=1e3 * seconds / n,
                        round_call_seconds=rounds, round_decode_seconds=[c - len(mels) * enc for c in rounds]))
    first = out[0]
    for x in out:
        for key in ("call", "decode"):
            ratios = [a / b if a > 0 and b > 0 else float("nan")
                      for a, b in zip(first[f"round_{key}_seconds"], x[f"round_{key}_seconds"])]
            x[f"paired_{key}_vs_first"] = dict(median=statistics.median(ratios), low=min(ratios), high=max(ratios))
    return out


def round_sums(stats: list, field: str, windows: int, repeats: int) -> list[int]:
    """A system's calls' `field` (their `Stats`, in `end_to_end`'s call order: a warm-up call per
    window, then each round's) summed round by round over the timed calls: where an adaptive k
    drafted and where it kept its draft off, beside that round's paired ratio."""
    if len(stats) != windows * (repeats + 1):
        raise ValueError(f"{len(stats)} calls, expected {windows} windows x ({repeats} rounds + a warm-up)")
    return [sum(getattr(s, field) for s in stats[windows * (r + 1):windows * (r + 2)]) for r in range(repeats)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--repeats", type=int, default=4,
                   help="interleaved rounds, every other one in reverse order: an even count runs each order as "
                        "often (with 3, two forward rounds decide the medians; the control read 0.74-0.83x on "
                        "an Ice Lake VM, 0.98x with 4)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--k", type=int, nargs="+", default=[4],
                   help="fixed num_draft_tokens values of the speculative runs (besides adaptive)")
    p.add_argument("--distilled", default="base-2l",
                   help="a shared-encoder draft folder (specwhisper distill) or a bundled draft's name "
                        "(default: base-2l, assembled beside base); 'none' skips it")
    p.add_argument("--draft-head-tokens", type=int, default=None, metavar="N",
                   help="also run the distilled draft with its output head pruned to N tokens (draft_head_tokens)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--vector-level", type=int, choices=[1], default=None,
                   help="1: measure an AVX2-only CPU on a wider one: the C++ ops held to AVX2, torch's kernels "
                        "(ATen, oneDNN, MKL) to AVX2, no bfloat16 paths (the process restarts with that environment)")
    args = p.parse_args()
    if args.vector_level is not None and os.environ.get("SPECWHISPER_VECTOR_LEVEL") != str(args.vector_level):
        os.environ.update(AVX2_ENVIRONMENT)  # read when torch and the ops load: start again
        os.execv(sys.executable, [sys.executable] + sys.argv)
    torch.set_num_threads(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    base, tiny = fetch("base"), fetch("tiny.en")
    if args.distilled == "none":
        args.distilled = None
    elif args.distilled in NAMES:
        args.distilled = str(fetch(args.distilled))

    tmp_dir = tempfile.TemporaryDirectory()
    windows = synthesize_windows(args.windows, Path(tmp_dir.name))
    mels = [log_mel_spectrogram(a) for a, _ in windows]
    texts = [t for _, t in windows]
    # a draft's own int8 encoder (tiny.en): weights within 63 where the int8 kernels lack VNNI
    int8_max = encoder_cpu.int8_weight_max() if encoder_cpu.int8_usable() else None
    stream = "to L2" if cpu_ops.stream_prefetch_l2() else "non-temporally"
    print(f"CPU: {cpu_model()}; torch kernels {torch.backends.cpu.get_cpu_capability()}; "
          f"huge pages {cpu_ops.huge_pages()}; int8 draft weights up to {int8_max}; weight streams "
          f"prefetched {stream}", flush=True)
    result = dict(machine=cpu_model(), threads=args.threads, huge_pages=cpu_ops.huge_pages(), streams=stream,
                  torch=torch.__version__, decode_ops=cpu_ops.available(), int8_weight_max=int8_max,
                  held_to=os.environ.get("SPECWHISPER_VECTOR_LEVEL") and "AVX2 (--vector-level 1)",
                  window_seconds=[len(a) / SR for a, _ in windows], position=POSITION)

    engine = Engine(base)
    result["encoder"] = encoder_bench.measure(engine.target.model.encoder, engine.target.config, args.threads,
                                              args.repeats, Path(os.environ.get("SPECWHISPER_BUILD_DIR", ".build")))
    print(f"encoder: {encoder_bench.line(result['encoder'])}", flush=True)
    result["bandwidth"] = bandwidth()
    result["bytes_per_token"] = bytes_per_token(engine)
    floor_ms = 1e3 * result["bytes_per_token"]["total"] / (result["bandwidth"]["GBps"] * 1e9)
    steps = step_times(engine, mels[0], args.repeats * 5, read_bytes=result["bytes_per_token"]["total"])
    result["read_ms"] = 1e3 * steps.pop("read")
    result["step_ms"] = {t: 1e3 * s for t, s in steps.items()}
    result["verify_over_step"] = {t: s / steps[1] for t, s in steps.items()}
    result["mac_peaks"] = mac_peaks(args.threads, Path(os.environ.get("SPECWHISPER_BUILD_DIR", ".build")))
    result["row_macs"] = row_macs(engine)
    result["verify_bounds"] = verify_bounds(result["row_macs"], result["mac_peaks"], result["step_ms"][1],
                                            rows=list(steps))
    result["window_setup"] = window_setup(engine, mels[0], args.repeats * 5)
    result["engine_split"] = engine_split(engine, mels, args.repeats)
    main_step, thread_step = step_in_thread(engine, mels[0], max(20, args.repeats * 5))
    result["thread_step_ms"], result["thread_step_main_ms"] = 1e3 * thread_step, 1e3 * main_step
    result["floor_ms"] = floor_ms
    draft_engine = Engine(tiny)
    result["draft_step_ms"] = {"tiny.en": 1e3 * step_times(draft_engine, mels[0], args.repeats * 5, rows=[1])[1]}
    result["draft_step_ms"]["tiny.en compact"] = compact_step_ms(draft_engine, mels[0], args.repeats * 5)
    if args.distilled:
        draft_engine = Engine(args.distilled)
        result["draft_step_ms"]["distilled compact"] = compact_step_ms(draft_engine, mels[0], args.repeats * 5)
    del draft_engine
    result["profile"] = profile_step(engine, mels[0])

    seen = {}  # system name -> the stats of its calls (acceptance over the timed runs themselves)

    def ours(e, k=None, name=None):
        def run(mel):
            out = e.transcribe(mel, language="en", num_draft_tokens=k)
            if name is not None:
                seen.setdefault(name, []).append(out.stats)
            return out.tokens
        return run

    def our_encoder(e):
        return lambda mel: e.target.model.encoder(mel[None].to(e.dtype))

    f32 = "specwhisper float32 encoder"  # every float32 engine's target encoder: one pooled median

    prompt = engine.target.tokenizer.prompt("en", "transcribe")
    ct2 = CT2Worker(ct2_dir("base"), mels, args.threads, prompt, Path(tmp_dir.name))
    ct2_int8 = CT2Worker(ct2_dir("base"), mels, args.threads, prompt, Path(tmp_dir.name), "int8")
    systems = [("specwhisper target-only", ours(engine), our_encoder(engine), f32),
               ("CTranslate2 float32", lambda mel: ct2.call("generate", mel),
                lambda mel: ct2.call("encode", mel)),
               ("CTranslate2 int8", lambda mel: ct2_int8.call("generate", mel),
                lambda mel: ct2_int8.call("encode", mel))]
    if not args.no_hf:
        from transformers import WhisperForConditionalGeneration

        hf = WhisperForConditionalGeneration.from_pretrained(base, dtype=torch.float32).eval()

        def hf_run(mel):
            with torch.inference_mode():
                return hf.generate(mel[None], language="en", task="transcribe", do_sample=False,
                                   num_beams=1)[0].tolist()

        def hf_encode(mel):
            with torch.inference_mode():
                return hf.model.encoder(mel[None])

        systems.append(("transformers generate", hf_run, hf_encode))
    drafts = {"tiny.en": (tiny, None), "self": (base, None)}
    if args.distilled:
        drafts["distilled"] = (args.distilled, None)
        if args.draft_head_tokens:
            drafts[f"distilled/head{args.draft_head_tokens}"] = (args.distilled, args.draft_head_tokens)
    draft_engines = {}
    for name, (folder, head_tokens) in drafts.items():
        e = draft_engines[name] = Engine(base, folder, draft_head_tokens=head_tokens)
        for k in (None, *args.k):
            label = f"specwhisper + {name} (k={k or 'adaptive'})"
            systems.append((label, ours(e, k, label), our_encoder(e), f32))
    bf16 = Engine(base, dtype=torch.bfloat16)
    systems.append(("specwhisper bfloat16 target-only", ours(bf16), our_encoder(bf16)))
    control = Engine(base)  # the same system as the first, last in the order: the noise control
    systems.append((CONTROL, ours(control), our_encoder(control), f32))
    runs = end_to_end(systems, mels, args.repeats)
    ct2.close()
    ct2_int8.close()
    for r in runs:
        if r["name"] in seen:
            stats = seen[r["name"]]
            r["drafted"] = sum(s.drafted for s in stats)
            r["acceptance"] = sum(s.accepted for s in stats) / max(1, r["drafted"])
            r["round_drafted"] = round_sums(stats, "drafted", len(mels), args.repeats)
            r["round_target_passes"] = round_sums(stats, "target_passes", len(mels), args.repeats)
    ref_tokens = runs[0]["tokens"]
    decode = lambda toks: [engine.target.tokenizer.decode(t) for t in toks]  # noqa: E731
    for r in runs:
        r["identical_to_target_only"] = r["tokens"] == ref_tokens
        r["speedup_vs_target_only"] = runs[0]["ms_per_token"] / r["ms_per_token"]
        r["call_speedup_vs_ct2"] = sum(runs[1]["call_seconds"]) / sum(r["call_seconds"])
        r["wer"] = wer(texts, decode(r["tokens"]))
    result["runs"] = runs
    result["bf16_step_ms"] = 1e3 * step_times(bf16, mels[0], args.repeats * 5, rows=[1])[1]
    # where each draft's decoding goes, inside its own adaptive calls, beside target-only's
    split_engines = {"target-only": engine, **{n: e for n, e in draft_engines.items() if n != "self"}}
    result["draft_split"] = interleaved_splits(split_engines, mels, args.repeats)

    (out_dir / "cpu.json").write_text(json.dumps(result, indent=1, default=str))
    md = markdown(result)
    (out_dir / "cpu.md").write_text(md)
    plot(result, out_dir / "cpu.png")
    print(md)
    tmp_dir.cleanup()


def markdown(r: dict) -> str:
    ct2 = next(x for x in r["runs"] if x["name"].startswith("CTranslate2"))
    lines = [f"# CPU decode, whisper-base, {r['threads']} threads, {len(r['window_seconds'])} windows "
             f"of {statistics.mean(r['window_seconds']):.1f} s ({r['machine']}, torch {r['torch']}, "
             f"decode ops {'on' if r['decode_ops'] else 'off'}"
             f"{', held to ' + r['held_to'] if r.get('held_to') else ''}"
             f"{', int8 draft weights up to ' + str(r['int8_weight_max']) if r.get('int8_weight_max') else ''}"
             f"{', weight streams prefetched ' + r['streams'] if r.get('streams') else ''})", "",
             f"Bandwidth {r['bandwidth']['GBps']:.1f} GB/s (read {r['bandwidth']['read_GBps']:.1f}, copy "
             f"{r['bandwidth']['copy_GBps']:.1f}); bytes per token {r['bytes_per_token']['total'] / 1e6:.0f} MB "
             f"(blocks {r['bytes_per_token']['blocks'] / 1e6:.0f}, head {r['bytes_per_token']['head'] / 1e6:.0f}, "
             f"cross K/V {r['bytes_per_token']['cross_kv'] / 1e6:.0f}) -> floor {r['floor_ms']:.1f} ms/token", "",
             f"Encoder (float32, one window) beside the FMA peak measured in the same run: "
             f"{encoder_bench.line(r['encoder'])}", "",
             "| per token | ms | × floor |", "|---|---|---|",
             f"| target step (blocks + screened head, position {r['position']}) | {r['step_ms'][1]:.1f} | "
             f"{r['step_ms'][1] / r['floor_ms']:.2f} |",
             f"| a plain read of as many bytes (torch sum of {r['bytes_per_token']['total'] / 1e6:.0f} MB) in the same "
             f"rounds as that step: {r['bytes_per_token']['total'] / r['read_ms'] / 1e6:.1f} GB/s; the step "
             f"{r['step_ms'][1] / r['read_ms']:.2f}× it | {r['read_ms']:.1f} | {r['read_ms'] / r['floor_ms']:.2f} |",
             f"| target step, called from a second thread (an engine's loop thread; the main thread in the "
             f"same rounds: {r['thread_step_main_ms']:.1f}) | {r['thread_step_ms']:.1f} | "
             f"{r['thread_step_ms'] / r['floor_ms']:.2f} |",
             f"| target step, bfloat16 model | {r['bf16_step_ms']:.1f} | {r['bf16_step_ms'] / r['floor_ms']:.2f} |",
             f"| draft step tiny.en | {r['draft_step_ms']['tiny.en']:.1f} | |",
             f"| draft step tiny.en, compact (int8 projections, bfloat16 cross K/V, 4-bit head, as drafts run) | "
             f"{r['draft_step_ms']['tiny.en compact']:.1f} | |"]
    if "distilled compact" in r["draft_step_ms"]:
        lines.append(f"| draft step distilled, compact (shares the target's encoder) | "
                     f"{r['draft_step_ms']['distilled compact']:.1f} | |")
    lines += [f"| decode, {x['name']} | {x['ms_per_token']:.1f} | {x['ms_per_token'] / r['floor_ms']:.2f} |"
              for x in r["runs"] if not x["name"].startswith("specwhisper +")]
    ws, split = r["window_setup"], r["engine_split"]
    n = split["tokens"]
    per = {key: 1e3 * split[key] / n for key in ("call", "encode_windows", "verify_step", "admit")}
    rest = 1e3 * split["rest"] / n
    lines += ["", f"Outside the step, timed inside the engine's own target-only calls ({n} tokens, medians of "
              f"rounds): a call costs {per['call']:.2f} ms/token; its steps (blocks, head, token choice) "
              f"{per['verify_step']:.2f}; the encoder {per['encode_windows']:.2f}; admissions "
              f"{per['admit']:.2f} (the cross-attention K/V projections, timed alone "
              f"{1e3 * ws['cross_kv_s']:.0f} ms a window = {ws['cross_kv_gflop']:.1f} GFLOP at "
              f"{ws['cross_kv_gflop'] / ws['cross_kv_s']:.0f} GFLOP/s, encoder-side GEMM work every system does; "
              f"the prompt pass of {ws['prompt_rows']} rows, {1e3 * ws['prompt_s']:.0f} ms alone; the first token); "
              f"the rest (host loop, bookkeeping) **{rest:.2f} ms/token**."]
    share = split["encode_windows"] / split["call"]
    bound = whole_call_bound(share, WHOLE_CALL_GOAL)
    need = (f"needs the decode (a call less its encoder, admissions included) {bound['decode_needed']:.2f}× "
            f"faster" if bound["decode_needed"] else "is out of reach")
    lines += ["", f"The encoder is {100 * share:.0f}% of a target-only call here, the same work in every "
              f"system: no draft can make a whole call more than {bound['ceiling']:.2f}× faster, and "
              f"{bound['goal']:.1f}× {need}."]
    if r.get("draft_split"):
        def per_token(sp, key):
            return 1e3 * sp.get(key, 0.0) / sp["tokens"]

        def decode_ms(sp):  # a call less its encoder and admissions, as the tables' decode
            return per_token(sp, "call") - per_token(sp, "encode_windows") - per_token(sp, "admit")

        lines += ["", "Where decoding goes, timed inside each engine's own calls (adaptive k; ms a token, "
                  "medians of interleaved rounds; a draft's starts: its own encoder pass and cross K/V, "
                  "or the target's K/V copied, and its prompt):", "",
                  "| engine | target passes (steps and verify passes) | draft steps | draft starts | rest | "
                  "decode | vs target-only |", "|---|---|---|---|---|---|---|"]
        alone = r["draft_split"]["target-only"]
        for name, sp in r["draft_split"].items():
            lines.append(f"| {name} | {per_token(sp, 'verify_step'):.2f} | {per_token(sp, 'draft'):.2f} | "
                         f"{per_token(sp, 'start_drafts'):.2f} | {per_token(sp, 'rest'):.2f} | "
                         f"{decode_ms(sp):.2f} | {decode_ms(alone) / decode_ms(sp):.2f}× |")
    lines += ["", "| rows k+1 | " + " | ".join(str(t) for t in r["verify_over_step"]) + " |",
              "|---" * (len(r["verify_over_step"]) + 1) + "|",
              "| verify / step | " + " | ".join(f"{v:.2f}" for v in r["verify_over_step"].values()) + " |"]
    # a step the L3 serves runs below the DRAM floor: the extra rows then read dearer per step
    lines.append("| verify / the memory floor | "
                 + " | ".join(f"{ms / r['floor_ms']:.2f}" for ms in r["step_ms"].values()) + " |")
    if "verify_bounds" in r:
        b, m, pk = r["verify_bounds"], r["row_macs"], r["mac_peaks"]
        lines += ["| if the extra rows' arithmetic ran after the stream | "
                  + " | ".join(f"{v:.2f}" for v in b["serial"].values()) + " |",
                  "| if it all hid under the stream | " + " | ".join(f"{v:.2f}" for v in b["overlapped"].values()) + " |",
                  "", f"A row's arithmetic: {m['float32'] / 1e6:.1f} M float32 multiply-adds at the FMA peak "
                  f"({pk['float32']:.0f} GMAC/s) and {m['int16'] / 1e6:.1f} M 16-bit ones (the head's screen) at "
                  f"the {pk['int16_instruction']} peak ({pk['int16']:.0f} GMAC/s), both measured now on "
                  f"{r['threads']} threads: {b['row_ms']:.2f} ms, against a {r['step_ms'][1]:.1f} ms step."]
    lines += ["",
              "| system | tokens/s (decode) | ms/token | vs target-only | paired per round: decode / whole call "
              "(range) | vs CT2 (decode) | vs CT2 (whole call) | acceptance | tokens = target-only | WER |",
              "|---|---|---|---|---|---|---|---|---|---|"]

    def paired(x, key):
        p = x.get(f"paired_{key}_vs_first")
        return "" if p is None else f"{p['median']:.2f}× ({p['low']:.2f}–{p['high']:.2f})"

    for x in r["runs"]:
        acc = "" if "acceptance" not in x else f"{x['acceptance']:.2f}" if x["drafted"] else "off"
        lines.append(f"| {x['name']} | {x['tokens_per_s']:.1f} | {x['ms_per_token']:.1f} | "
                     f"{x['speedup_vs_target_only']:.2f}× | {paired(x, 'decode')} / {paired(x, 'call')} | "
                     f"{ct2['ms_per_token'] / x['ms_per_token']:.2f}× | "
                     f"{x['call_speedup_vs_ct2']:.2f}× | {acc} | "
                     f"{'yes' if x['identical_to_target_only'] else 'NO'} | {x['wer']:.3f} |")
    adaptive = [x for x in r["runs"] if "k=adaptive" in x["name"] and "round_drafted" in x]
    if adaptive:
        lines += ["", "The adaptive k round by round (timed calls; proposals / target passes, and the round's paired "
                      "decode ratio against target-only; 0 proposals: the draft kept off that round):"]
        for x in adaptive:
            decode = [a / b for a, b in zip(r["runs"][0]["round_decode_seconds"], x["round_decode_seconds"])]
            lines.append(f"- {x['name']}: " + ", ".join(
                f"{d} / {t} ({q:.2f}×)" for d, t, q in zip(x["round_drafted"], x["round_target_passes"], decode)))
    lines += ["", "One target step, torch.profiler (5 steps):", "```", r["profile"], "```"]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [x["name"].replace("specwhisper", "sw") for x in r["runs"]]
    a.barh(names, [x["ms_per_token"] for x in r["runs"]], color="tab:blue")
    a.axvline(r["floor_ms"], color="k", ls="--", label=f"bandwidth floor {r['floor_ms']:.1f} ms")
    a.set_xlabel("decode ms per token (lower is better)")
    a.invert_yaxis()
    a.legend()
    rows = list(r["verify_over_step"])
    b.plot(rows, list(r["verify_over_step"].values()), "o-")
    b.axhline(1.0, color="k", lw=0.5)
    b.set_xlabel("rows in one verify pass (k+1)")
    b.set_ylabel("time / one-row step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

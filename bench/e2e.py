"""End-to-end comparison on the same audio and weights, side by side in one process: transformers
`generate` (greedy), transformers assisted generation, CTranslate2 greedy, specwhisper target-only
and specwhisper speculative (per draft; adaptive k and each fixed --k).

Question answered: how fast does each system decode (tokens/s after the encoder) and is its output
the target's greedy output? See bench/README.md for the columns.

    python bench/e2e.py                       # base, drafts tiny.en and self, bundled samples, CPU
    python bench/e2e.py --device cuda --draft tiny.en --k 3 4 5 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from specwhisper import Engine, load_audio, log_mel_spectrogram
from specwhisper.samples import references, sample_paths
from specwhisper.tools.fetch import MODELS, NAMES, ct2_dir, fetch
from specwhisper.wer import wer

LANGUAGE = "en"


def model_dir(spec: str) -> Path:
    return fetch(spec) if spec in NAMES else Path(spec).expanduser()


def load_inputs(folder: str | None) -> tuple[list[Path], list[str] | None]:
    """Audio paths and reference texts (None when the folder has no references.json / *.txt)."""
    if folder is None:
        refs = references()
        paths = sample_paths()
        return paths, [refs[p.name] for p in paths]
    folder = Path(folder)
    paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".wav", ".flac"))
    if not paths:
        raise SystemExit(f"no *.wav or *.flac files in {folder}")
    if (folder / "references.json").is_file():
        refs = {e["file"]: e["text"] for e in json.loads((folder / "references.json").read_text())}
    else:
        refs = {p.name: p.with_suffix(".txt").read_text().strip() for p in paths if p.with_suffix(".txt").is_file()}
    return paths, ([refs[p.name] for p in paths] if all(p.name in refs for p in paths) else None)


class System:
    """One decoder under test: prepare(mel) -> its input; run(x) -> dict(tokens, passes, drafted,
    accepted); encode(x) runs the target encoder alone (its time is subtracted from the total)."""

    name = ""

    def prepare(self, mel):
        return mel

    def sync(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()


class HF(System):
    def __init__(self, name, model, prompt, max_new, eot, assistant=None):
        self.name, self.model, self.assistant = name, model, assistant
        self.prompt, self.max_new, self.eot = set(prompt), max_new, eot
        self.calls = 0
        model.model.decoder.register_forward_pre_hook(self._count)  # target passes (assistant not counted)

    def _count(self, *_):
        self.calls += 1

    def prepare(self, mel):
        return mel[None].to(self.model.device, self.model.dtype)

    @torch.inference_mode()
    def run(self, x):
        extra = {"assistant_model": self.assistant} if self.assistant is not None else {}
        self.calls = 0
        out = self.model.generate(x, language=LANGUAGE, task="transcribe", do_sample=False, num_beams=1,
                                  return_timestamps=False, max_new_tokens=self.max_new, **extra)
        self.sync()
        row = out[0].tolist()  # generated ids; assisted generation also returns the start token
        while row and row[0] in self.prompt:
            row.pop(0)
        while row and row[-1] == self.eot:
            row.pop()
        return dict(tokens=row, passes=self.calls)

    @torch.inference_mode()
    def encode(self, x):
        self.model.model.encoder(x)
        self.sync()


class CT2(System):
    def __init__(self, name, folder, device, threads, prompt, max_new):
        import ctranslate2

        self.name, self.prompt, self.max_new, self.ct2 = name, prompt, max_new, ctranslate2
        self.model = ctranslate2.models.Whisper(str(folder), device=device, compute_type="float32",
                                                intra_threads=threads)

    def prepare(self, mel):
        return self.ct2.StorageView.from_array(np.ascontiguousarray(mel[None].float().cpu().numpy()))

    def run(self, x):
        # ctranslate2 4.8 has no without_timestamps: <|notimestamps|> is in the prompt instead.
        result = self.model.generate(x, [self.prompt], beam_size=1, max_length=self.max_new)
        return dict(tokens=list(result[0].sequences_ids[0]))

    def encode(self, x):
        self.model.encode(x, to_cpu=True)


class SW(System):
    def __init__(self, name, engine, k):
        self.name, self.engine, self.k = name, engine, k

    def prepare(self, mel):
        return mel.to(self.engine.device)

    def run(self, x):
        out = self.engine.transcribe(x, language=LANGUAGE, num_draft_tokens=self.k)
        s = out.stats
        return dict(tokens=out.tokens, passes=s.target_passes, drafted=s.drafted, accepted=s.accepted)

    @torch.inference_mode()
    def encode(self, x):
        self.engine.target.model.encoder(x[None].to(self.engine.dtype))
        self.sync()


def timed(fn, x) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn(x)
    return time.perf_counter() - start, result


def build_systems(args, target: Path, dtype) -> tuple[list[System], dict[str, str], Engine, int]:
    """The systems under test, those skipped (name -> why), the target-only engine, max new tokens."""
    from transformers import WhisperForConditionalGeneration
    from transformers.utils import logging

    logging.set_verbosity_error()
    target_engine = Engine(target, device=args.device, dtype=dtype)
    tok = target_engine.target.tokenizer
    prompt = tok.prompt(LANGUAGE, "transcribe")
    max_new = target_engine.target.config.max_target_positions - len(prompt)
    load = lambda d: WhisperForConditionalGeneration.from_pretrained(d, dtype=dtype).to(args.device).eval()  # noqa: E731
    hf = load(target)
    systems: list[System] = [HF("transformers generate", hf, prompt, max_new, tok.eot)]
    skipped = {}
    drafts = [(d, target if d == "self" else model_dir(d)) for d in args.draft if d != "none"]
    for name, folder in drafts:
        systems.append(HF(f"transformers assisted ({name})", hf, prompt, max_new, tok.eot, assistant=load(folder)))
    ct2 = args.ct2 or (str(ct2_dir(args.target)) if args.target in MODELS else "none")
    if ct2 != "none":
        systems.append(CT2("ctranslate2 greedy", ct2, args.device, args.threads, prompt, max_new))
    else:
        skipped["ctranslate2 greedy"] = "no CTranslate2 folder (--ct2)"
    systems.append(SW("specwhisper target-only", target_engine, None))
    for name, folder in drafts:
        engine = Engine(target, draft=folder, device=args.device, dtype=dtype)
        for k in [None, *args.k]:
            systems.append(SW(f"specwhisper {name} k={'adaptive' if k is None else k}", engine, k))
    return systems, skipped, target_engine, max_new


def summarize(name, rows, ref_tokens, sw_tokens, texts_ref, decode_text, max_new) -> dict:
    total = sum(r["total_s"] for r in rows)
    encoder = sum(r["encoder_s"] for r in rows)
    generated = sum(len(r["tokens"]) + (len(r["tokens"]) < max_new) for r in rows)  # + EOT
    passes = [r.get("passes") for r in rows]
    drafted, accepted = sum(r.get("drafted", 0) for r in rows), sum(r.get("accepted", 0) for r in rows)
    hyps = [decode_text(r["tokens"]) for r in rows]
    return dict(
        system=name, total_s=total, encoder_s=encoder, generated_tokens=generated,
        decode_tok_s=generated / (total - encoder) if total > encoder else float("nan"),
        exact_vs_hf=sum(r["tokens"] == t for r, t in zip(rows, ref_tokens)) if ref_tokens else None,
        exact_vs_sw=sum(r["tokens"] == t for r, t in zip(rows, sw_tokens)) if sw_tokens else None,
        wer=wer(texts_ref, hyps) if texts_ref else None,
        acceptance=accepted / drafted if drafted else None, drafted=drafted, accepted=accepted,
        tokens_per_pass=generated / sum(passes) if all(passes) else None,
        utterances=[dict(r, text=h) for r, h in zip(rows, hyps)])


def fmt(v, spec):
    return "n/a" if v is None or (isinstance(v, float) and np.isnan(v)) else format(v, spec)


def table(results, n, skipped) -> str:
    hf = next((r for r in results if r["system"] == "transformers generate"), None)
    lines = ["| system | total s | encoder s | decode tok/s | decode speedup | e2e speedup | = HF greedy "
             "| = SW target | WER % | acceptance | tokens/pass |", "|" + "---|" * 11]
    for r in results:
        speed = r["decode_tok_s"] / hf["decode_tok_s"] if hf else None
        e2e = hf["total_s"] / r["total_s"] if hf else None
        r["decode_speedup"], r["e2e_speedup"] = speed, e2e
        lines.append(f"| {r['system']} | {r['total_s']:.2f} | {r['encoder_s']:.2f} | {fmt(r['decode_tok_s'], '.1f')} "
                     f"| {fmt(speed, '.2f')}x | {fmt(e2e, '.2f')}x | {fmt(r['exact_vs_hf'], 'd')}/{n} "
                     f"| {fmt(r['exact_vs_sw'], 'd')}/{n} | {fmt(None if r['wer'] is None else 100 * r['wer'], '.1f')} "
                     f"| {fmt(r['acceptance'], '.3f')} | {fmt(r['tokens_per_pass'], '.2f')} |")
    for name, why in skipped.items():
        lines.append(f"| {name} | n/a: {why} |" + " |" * 9)
    return "\n".join(lines)


def chart(results, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.get("decode_speedup") is not None][::-1]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    ax.barh([r["system"] for r in rows], [r["decode_speedup"] for r in rows], color="tab:blue")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("decode speedup vs transformers generate (tokens/s after the encoder)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="base", help="HF Whisper folder, or a fetchable name (base, tiny.en)")
    p.add_argument("--draft", nargs="+", default=["tiny.en", "self"], help="folders/names, 'self' or 'none'")
    p.add_argument("--k", nargs="*", type=int, default=[3, 4], help="fixed num_draft_tokens (adaptive always runs)")
    p.add_argument("--audio", help="folder of *.wav/*.flac (default: bundled samples)")
    p.add_argument("--ct2", help="CTranslate2 folder of the same target ('none' to skip)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per utterance (median taken)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target = model_dir(args.target)
    paths, texts_ref = load_inputs(args.audio)
    systems, skipped, engine, max_new = build_systems(args, target, dtype)
    mels = [log_mel_spectrogram(load_audio(p), n_mels=engine.n_mels) for p in paths]
    inputs = {s.name: [s.prepare(m) for m in mels] for s in systems}
    load_before = os.getloadavg()

    for s in list(systems):  # warm-up (also finds the pairs a system does not support)
        try:
            s.run(inputs[s.name][0])
            s.encode(inputs[s.name][0])
        except Exception as exc:  # noqa: BLE001 - reported as n/a with the reason
            skipped[s.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            systems.remove(s)
    times = {s.name: [[] for _ in paths] for s in systems}
    enc = {s.name: [[] for _ in paths] for s in systems}
    last = {s.name: [None] * len(paths) for s in systems}
    for rep in range(args.repeats):  # interleaved, so background load hits every system alike
        for i, path in enumerate(paths):
            for s in systems:
                x = inputs[s.name][i]
                t, last[s.name][i] = timed(s.run, x)
                times[s.name][i].append(t)
                enc[s.name][i].append(timed(s.encode, x)[0])
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)

    rows = {s.name: [dict(last[s.name][i], file=paths[i].name, total_s=statistics.median(times[s.name][i]),
                          encoder_s=statistics.median(enc[s.name][i])) for i in range(len(paths))]
            for s in systems}
    tokens_of = lambda name: [r["tokens"] for r in rows[name]] if name in rows else None  # noqa: E731
    results = [summarize(s.name, rows[s.name], tokens_of("transformers generate"),
                         tokens_of("specwhisper target-only"), texts_ref, engine.target.tokenizer.decode, max_new) for s in systems]
    n = len(paths)
    md = table(results, n, skipped)
    title = (f"{args.target} on {args.device} ({args.dtype}, {args.threads} threads), {n} utterances, "
             f"median of {args.repeats}; load avg {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"\n{title}\n\n{md}")
    for r in results:
        if r["system"].startswith("specwhisper self") and r["acceptance"] not in (None, 1.0):
            print(f"WARNING: {r['system']}: acceptance {r['acceptance']:.4f} != 1.0 with the target as its own draft")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(title=title, args=vars(args), target=str(target), torch=torch.__version__,
                  machine=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
                  load_avg_before=load_before, load_avg_after=os.getloadavg(), skipped=skipped,
                  results=results, table=md)
    (out / f"e2e-{args.device}.json").write_text(json.dumps(report, indent=1))
    chart(results, out / f"e2e-{args.device}.png", title)
    print(f"\nwrote {out / f'e2e-{args.device}.json'} and {out / f'e2e-{args.device}.png'}")


if __name__ == "__main__":
    main()

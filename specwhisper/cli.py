"""Command line: `specwhisper transcribe | demo | fetch | convert | distill`."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def model_folder(name: str) -> str:
    """A folder as is; `base` / `tiny.en` resolve to the fetched, converted checkpoints."""
    from .fetch import MODELS, fetch

    if not Path(name).is_dir() and name in MODELS:
        return str(fetch(name))
    return name


def cmd_transcribe(args) -> int:
    import torch
    from tqdm import tqdm

    from . import Engine, load_audio, log_mel_spectrogram

    engine = Engine(model_folder(args.target), model_folder(args.draft) if args.draft else None,
                    device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None)
    results = []
    for path in tqdm(args.audio, disable=len(args.audio) < 2 or args.json, unit="file"):
        mel = log_mel_spectrogram(load_audio(path), n_mels=engine.n_mels, device=engine.device)
        out = engine.transcribe(mel, language=args.language, temperature=args.temperature, top_p=args.top_p,
                                num_draft_tokens=args.k, max_new_tokens=args.max_new_tokens, seed=args.seed)
        results.append({"file": str(path), "text": out.text, "language": out.language,
                        "tokens": out.tokens, "stats": out.stats.__dict__})
        if not args.json:
            tqdm.write(f"{path}: {out.text}")
    if args.json:
        json.dump(results if len(results) > 1 else results[0], sys.stdout, indent=2)
        print()
    return 0


def cmd_demo(args) -> int:
    """The main job: real whisper-base, drafted by tiny.en, on the bundled samples."""
    import torch

    from . import Engine, load_audio, log_mel_spectrogram
    from .samples import references, sample_paths
    from .wer import wer

    torch.set_num_threads(args.threads)
    target, draft = model_folder(args.target), model_folder(args.draft)
    plain, spec = Engine(target), Engine(target, draft)
    refs = references()
    paths = sample_paths()
    mels = [log_mel_spectrogram(load_audio(p), n_mels=plain.n_mels) for p in paths]
    plain.transcribe(mels[0], language="en")  # warm-up
    spec.transcribe(mels[0], language="en", num_draft_tokens=args.k)
    hyps, same = [], 0
    t_plain = t_spec = 0.0
    for path, mel in zip(paths, mels):
        t0 = time.perf_counter()
        a = plain.transcribe(mel, language="en")
        t1 = time.perf_counter()
        b = spec.transcribe(mel, language="en", num_draft_tokens=args.k)
        t2 = time.perf_counter()
        t_plain, t_spec = t_plain + t1 - t0, t_spec + t2 - t1
        same += a.tokens == b.tokens
        hyps.append(b.text)
        print(f"{path.name}: {b.text}\n    reference: {refs[path.name]}\n"
              f"    target-only {t1 - t0:.2f}s, speculative {t2 - t1:.2f}s, acceptance "
              f"{b.stats.acceptance_rate:.2f}, tokens/target pass {b.stats.tokens_per_pass:.2f}, "
              f"identical: {a.tokens == b.tokens}")
    score = wer([refs[p.name] for p in paths], hyps)
    print(f"\n{len(paths)} utterances: WER {score:.1%}; speculative output identical to target-only on "
          f"{same}/{len(paths)}; total target-only {t_plain:.2f}s, speculative {t_spec:.2f}s "
          f"({t_plain / t_spec:.2f}x)")
    return 0 if same == len(paths) else 1


def cmd_fetch(args) -> int:
    from .fetch import ct2_dir, fetch

    for name in args.names:
        print(f"{name}: {fetch(name, args.cache_dir)} (CTranslate2 original: {ct2_dir(name, args.cache_dir)})")
    return 0


def cmd_convert(args) -> int:
    from .convert import convert_ct2

    print(convert_ct2(args.ct2_dir, args.out_dir))
    return 0


def cmd_distill(args) -> int:
    import torch

    from .distill import DistillOptions, distill

    if args.threads:
        torch.set_num_threads(args.threads)
    opts = DistillOptions(layers=args.layers, steps=args.steps, minutes=args.minutes, batch_size=args.batch_size,
                          lr=args.lr, seed=args.seed, language=args.language, max_new_tokens=args.max_new_tokens,
                          bf16=args.bf16, device=args.device)
    report = distill(model_folder(args.target), args.audio, args.out, opts)
    for line in report.skipped:
        print(f"skipped {line}", file=sys.stderr)
    last = report.losses[-20:]
    print(f"{report.out}: {report.step} steps in all ({len(report.losses)} now, {report.train_seconds:.0f} s; "
          f"teacher pass {report.teacher_seconds:.0f} s over {report.examples} windows)"
          + (f", loss {sum(last) / len(last):.3f}" if last else ""))
    return 0


def add_distill_parser(sub) -> None:
    d = sub.add_parser("distill", help="train a small draft that shares the target's encoder, from the "
                                       "target's own transcripts of your audio")
    d.add_argument("--target", required=True, help="HF folder (or `base` / `tiny.en`: fetched)")
    d.add_argument("--audio", required=True, type=Path, help="folder of audio files (searched recursively)")
    d.add_argument("--out", required=True, type=Path, help="draft folder to write (a rerun resumes it)")
    d.add_argument("--layers", type=int, default=2, help="decoder blocks of the draft")
    d.add_argument("--steps", type=int, default=1000, help="optimizer steps in all")
    d.add_argument("--minutes", type=float, default=None, help="wall-time bound of this run's training phase")
    d.add_argument("--batch-size", type=int, default=8)
    d.add_argument("--lr", type=float, default=3e-4)
    d.add_argument("--language", default=None, help="language of the audio (default: detected per window)")
    d.add_argument("--max-new-tokens", type=int, default=None, help="cap on the teacher's tokens per window")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--bf16", action="store_true", help="bfloat16 autocast while training (for GPUs; "
                   "CPU builds without bf16 kernels run it far slower)")
    d.add_argument("--device", default=None)
    d.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    d.set_defaults(func=cmd_distill)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="specwhisper", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("transcribe", help="transcribe audio files")
    t.add_argument("audio", nargs="+", type=Path)
    t.add_argument("--target", required=True, help="HF folder (or `base` / `tiny.en`: fetched)")
    t.add_argument("--draft", help="draft model folder (speculative decoding)")
    t.add_argument("--language", help="language code (default: detect)")
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--top-p", type=float, default=1.0)
    t.add_argument("--k", type=int, default=None, help="draft tokens per verify pass (default: adaptive)")
    t.add_argument("--seed", type=int, default=None)
    t.add_argument("--max-new-tokens", type=int, default=None)
    t.add_argument("--device", default=None)
    t.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    t.add_argument("--json", action="store_true", help="print JSON with tokens and stats")
    t.set_defaults(func=cmd_transcribe)

    d = sub.add_parser("demo", help="whisper-base drafted by tiny.en on the bundled samples")
    d.add_argument("--target", default="base")
    d.add_argument("--draft", default="tiny.en")
    d.add_argument("--k", type=int, default=None)
    d.add_argument("--threads", type=int, default=2)
    d.set_defaults(func=cmd_demo)

    f = sub.add_parser("fetch", help="download and convert real checkpoints (base, tiny.en)")
    f.add_argument("names", nargs="+")
    f.add_argument("--cache-dir", default=None)
    f.set_defaults(func=cmd_fetch)

    c = sub.add_parser("convert", help="CTranslate2 Whisper checkpoint -> HF safetensors folder")
    c.add_argument("ct2_dir", type=Path)
    c.add_argument("out_dir", type=Path)
    c.set_defaults(func=cmd_convert)

    add_distill_parser(sub)

    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""Command line: `specwhisper transcribe | demo | fetch | convert | serve | bulk | distill`."""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path


def model_folder(name: str) -> str:
    """A folder as is; `base` / `tiny.en` resolve to the fetched, converted checkpoints, `base-2l`
    to the bundled draft assembled beside base."""
    from .fetch import NAMES, fetch

    if not Path(name).is_dir() and name in NAMES:
        return str(fetch(name))
    return name


def parse_temperatures(text: str) -> tuple[float, ...]:
    """"0" -> (0.0,); "0,0.2,0.4" -> a fallback list."""
    try:
        return tuple(float(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--temperature takes a number or a comma list of numbers, got {text!r}") from None


DRAFT_HELP = "draft model folder or fetched name (tiny.en; base-2l: base's bundled draft) for speculative decoding"
OUTPUT_EXTENSIONS = {"txt": "txt", "srt": "srt", "vtt": "vtt", "json": "json", "verbose_json": "verbose.json"}


def cmd_transcribe(args) -> int:
    """Any length: openai-whisper's long-form algorithm (30 s windows, timestamps, fallback)."""
    import torch
    from tqdm import tqdm

    from .. import Engine, load_audio
    from ..config import TranscribeOptions
    from ..formats import render

    options = TranscribeOptions(temperature=args.temperature, language=args.language, task=args.task,
                                top_p=args.top_p, initial_prompt=args.initial_prompt,
                                condition_on_previous_text=not args.no_condition_on_previous_text,
                                word_timestamps=args.word_timestamps, prepend_punctuations=args.prepend_punctuations,
                                append_punctuations=args.append_punctuations,
                                hallucination_silence_threshold=args.hallucination_silence_threshold)
    word_options = dict(highlight_words=args.highlight_words, max_line_width=args.max_line_width,
                        max_line_count=args.max_line_count, max_words_per_line=args.max_words_per_line)
    formats = list(OUTPUT_EXTENSIONS) if args.output_format == "all" else [args.output_format]
    engine = Engine(model_folder(args.target), model_folder(args.draft) if args.draft else None,
                    device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None)
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for path in args.audio:
        audio = load_audio(path)
        seconds = len(audio) / 16000
        with tqdm(total=round(seconds, 2), unit="s", desc=path.name, disable=args.quiet,
                  bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} s audio [{elapsed}<{remaining}]") as bar:
            def progress(seek: int, frames: int) -> None:
                bar.update(round(seek / 100, 2) - bar.n)

            out = engine.submit(audio, language=options.language, task=options.task,
                                temperature=options.temperature, top_p=options.top_p, num_draft_tokens=args.k,
                                seed=args.seed, initial_prompt=options.initial_prompt,
                                condition_on_previous_text=options.condition_on_previous_text,
                                timestamps=True, word_timestamps=options.word_timestamps,
                                prepend_punctuations=options.prepend_punctuations,
                                append_punctuations=options.append_punctuations,
                                hallucination_silence_threshold=options.hallucination_silence_threshold,
                                progress=progress).result()
        rows.append({"file": str(path), "text": out.text, "language": out.language, "duration": out.duration,
                     "tokens": out.tokens, "segments": [s.to_dict() for s in out.segments],
                     "stats": out.stats.__dict__})
        if args.json:
            continue
        for fmt in formats:
            text = render(out, fmt, task=args.task, **(word_options if fmt in ("srt", "vtt") else {}))
            if args.output_dir is None:
                sys.stdout.write(text)
            else:
                target = args.output_dir / f"{path.stem}.{OUTPUT_EXTENSIONS[fmt]}"
                target.write_text(text, encoding="utf-8")
                print(f"{path}: wrote {target}", file=sys.stderr)
    if args.json:
        json.dump(rows if len(rows) > 1 else rows[0], sys.stdout, indent=2)
        print()
    return 0


def cmd_demo(args) -> int:
    """The main job: a ≈ 2 minute recording, target-only vs speculative vs CTranslate2 int8."""
    from .demo import run_demo

    drafts = args.draft or (["base-2l", "tiny.en"] if args.target == "base" else ["tiny.en"])
    return run_demo(model_folder(args.target), [model_folder(d) for d in drafts], args.target, args.k,
                    args.threads, args.seconds, ct2=not args.no_ctranslate2, repeats=args.repeats,
                    draft_names=[Path(d).name for d in drafts])


def cmd_fetch(args) -> int:
    from .fetch import DRAFTS, ct2_dir, fetch

    for name in args.names:
        folder = fetch(name, args.cache_dir)
        if name in DRAFTS:
            print(f"{name}: {folder} (bundled draft for {DRAFTS[name][0]}, sharing its encoder)")
        else:
            print(f"{name}: {folder} (CTranslate2 original: {ct2_dir(name, args.cache_dir)})")
    return 0


def cmd_convert(args) -> int:
    from .convert import convert_ct2

    print(convert_ct2(args.ct2_dir, args.out_dir))
    return 0


def cmd_serve(args) -> int:
    """The OpenAI-compatible HTTP server (needs the `server` extra: pip install -e ".[server]")."""
    import torch
    import uvicorn

    from .. import Engine
    from ..serving.server import create_app

    engine_options = {}
    if args.max_batch is not None:
        engine_options["max_batch"] = args.max_batch
    engine = Engine(model_folder(args.target), model_folder(args.draft) if args.draft else None,
                    device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None,
                    **engine_options)
    seconds = engine.warm_up()  # the first request does not pay the one-time work
    print(f"specwhisper serve: engine ready (warm-up {seconds:.1f} s)", file=sys.stderr, flush=True)
    app = create_app(engine, max_queue=args.max_queue, max_upload_mb=args.max_upload_mb,
                     model_name=args.model_name or Path(args.target).name, max_new_tokens=args.max_new_tokens,
                     max_audio_seconds=args.max_audio_seconds, read_timeout=args.read_timeout or None)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def cmd_bulk(args) -> int:
    """Transcribe a folder or glob of audio files on a Ray cluster (see specwhisper/serving/distributed.py).
    Errors the user can act on are one line on stderr; the exit code says what happened
    (distributed.EXIT_*: 0 all done, 1 some files failed, 2 input/options, 3 output folder,
    4 model folder, 5 Ray)."""
    try:
        from ..serving.distributed import EXIT_BAD_INPUT, EXIT_FILES_FAILED, EXIT_MODEL, BulkError, BulkJob, run_bulk
    except ImportError as e:
        print(f"specwhisper bulk: {e}", file=sys.stderr)
        return 2
    options = {k: v for k, v in (("max_new_tokens", args.max_new_tokens), ("num_draft_tokens", args.k))
               if v is not None}
    try:
        target, draft = model_folder(args.target), model_folder(args.draft) if args.draft else None
    except Exception as e:  # a named checkpoint that cannot be fetched
        print(f"specwhisper bulk: error: cannot get the model: {e}", file=sys.stderr)
        return EXIT_MODEL
    try:
        job = BulkJob(args.source, args.out, target, draft, language=args.language, device=args.device,
                      dtype=args.dtype, actors=args.actors, cpus_per_actor=args.cpus_per_actor,
                      batch_size=args.batch_size, output_format=args.output_format,
                      retry_failed=args.retry_failed, decode_options=options)
        summary = run_bulk(job, address=args.address)
    except BulkError as e:
        print(f"specwhisper bulk: error: {e}", file=sys.stderr)
        return e.exit_code
    except ValueError as e:  # options the job or the cluster cannot take
        print(f"specwhisper bulk: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(summary.format())
    return EXIT_FILES_FAILED if summary.failures else 0


def add_bulk_parser(sub) -> None:
    b = sub.add_parser("bulk", help="transcribe many files on a Ray cluster (needs the [ray] extra)")
    b.add_argument("source", help="folder (searched recursively), glob, file, or URI (s3://...)")
    b.add_argument("--out", required=True, help="results folder; files already recorded there are skipped")
    b.add_argument("--target", required=True, help="HF folder (or `base` / `tiny.en`: fetched)")
    b.add_argument("--draft", help=DRAFT_HELP)
    b.add_argument("--address", default="local",
                   help="`local` (default): start Ray here; `auto`: join the running cluster; or host:port")
    b.add_argument("--actors", type=int, default=None, help="engines (default: one per GPU / per CPU share)")
    b.add_argument("--cpus-per-actor", type=float, default=1.0)
    b.add_argument("--batch-size", type=int, default=4, help="files per actor call")
    b.add_argument("--output-format", choices=["jsonl", "parquet"], default="jsonl")
    b.add_argument("--retry-failed", action="store_true", help="also redo files recorded as failures")
    b.add_argument("--language", help="language code (default: detect per file)")
    b.add_argument("--k", type=int, default=None, help="draft tokens per verify pass (default: adaptive)")
    b.add_argument("--max-new-tokens", type=int, default=None)
    b.add_argument("--device", choices=["cuda", "cpu"], help="default: GPU actors if the cluster has GPUs")
    b.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    b.set_defaults(func=cmd_bulk)
def cmd_distill(args) -> int:
    import torch

    from .distill import DistillOptions, distill

    if args.threads:
        torch.set_num_threads(args.threads)
    opts = DistillOptions(layers=args.layers, steps=args.steps, minutes=args.minutes, batch_size=args.batch_size,
                          lr=args.lr, seed=args.seed, language=args.language, max_new_tokens=args.max_new_tokens,
                          bf16=args.bf16, device=args.device, kd=args.kd, holdout=args.holdout,
                          eval_every=args.eval_every, pack=not args.no_pack, ema=args.ema,
                          longform=not args.no_longform,
                          prev_tokens=DistillOptions.prev_tokens if args.prev_tokens is None else args.prev_tokens,
                          init=None if args.init is None else str(model_folder(args.init)))
    report = distill(model_folder(args.target), args.audio, args.out, opts)
    for line in report.skipped:
        print(f"skipped {line}", file=sys.stderr)
    last = report.losses[-20:]
    print(f"{report.out}: {report.step} steps in all ({len(report.losses)} now, {report.train_seconds:.0f} s; "
          f"teacher pass {report.teacher_seconds:.0f} s over {report.examples} "
          f"window{'s' if report.examples != 1 else ''}"
          + (f", {report.longform} of them long-form" if opts.longform else "") + ")"
          + (f", loss {sum(last) / len(last):.3f}" if last else ""))
    if report.agreement is not None:
        print(f"held-out agreement with the target ({report.held_out} of {report.held_out + report.examples} "
              f"windows held out): {report.agreement_start:.3f} "
              f"before training, {report.agreement:.3f} saved, from step {report.best_step} (the expected "
              f"greedy acceptance per proposal; the best of "
              + (f"the checks every {args.eval_every} steps)" if args.eval_every else "the start and the end)"))
    return 0


def add_distill_parser(sub) -> None:
    d = sub.add_parser("distill", help="train a small draft that shares the target's encoder, from the "
                                       "target's own transcripts of your audio")
    d.add_argument("--target", required=True, help="HF folder (or `base` / `tiny.en`: fetched)")
    d.add_argument("--audio", required=True, type=Path, help="folder of audio files (searched recursively)")
    d.add_argument("--out", required=True, type=Path, help="draft folder to write (a rerun resumes it)")
    d.add_argument("--layers", type=int, default=2, help="decoder blocks of the draft")
    d.add_argument("--init", default=None, help="start from this draft of the target (a folder, or "
                   "`base-2l`: fetched) instead of the target's blocks: train it further on more audio")
    d.add_argument("--steps", type=int, default=1000, help="optimizer steps in all")
    d.add_argument("--minutes", type=float, default=None, help="wall-time bound of this run's training phase")
    d.add_argument("--batch-size", type=int, default=8)
    d.add_argument("--lr", type=float, default=1e-4)
    d.add_argument("--language", default=None, help="language of the audio (default: detected per window)")
    d.add_argument("--max-new-tokens", type=int, default=None, help="cap on the teacher's tokens per window")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--kd", type=float, default=1.0,
                   help="weight of the loss against the target's distribution (0: its tokens only)")
    d.add_argument("--holdout", type=float, default=0.1,
                   help="share of recordings (with --no-longform: windows) kept out of training to measure "
                        "agreement (with 10 or more)")
    d.add_argument("--no-pack", action="store_true", help="one window per short file (default: consecutive "
                   "files shorter than 30 s are joined into full windows, as long-form transcription decodes)")
    d.add_argument("--no-longform", action="store_true", help="learn from short-form transcripts only "
                   "(default: the audio is also transcribed as long recordings, with timestamps and "
                   "previous-text prompts, as long-form transcription and `specwhisper demo` decode)")
    d.add_argument("--prev-tokens", type=int, default=None,
                   help="previous-text tokens the draft's prompts keep while it learns, the last ones (default: "
                        "as many as the engine gives a draft, 64; 224 keeps all of the target's)")
    d.add_argument("--ema", type=float, default=0.99, help="the draft is this moving average of the "
                   "trained weights (0: the last weights)")
    d.add_argument("--eval-every", type=int, default=50,
                   help="steps between held-out agreement checks; the best draft seen is saved (0: the last)")
    d.add_argument("--bf16", action="store_true", help="bfloat16 autocast while training (for GPUs; "
                   "CPU builds without bf16 kernels run it far slower)")
    d.add_argument("--device", default=None)
    d.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    d.set_defaults(func=cmd_distill)


def main(argv=None) -> int:
    from ..longform.timing import APPEND_PUNCTUATIONS, PREPEND_PUNCTUATIONS

    p = argparse.ArgumentParser(prog="specwhisper", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("transcribe", help="transcribe audio files of any length (segments, timestamps)")
    t.add_argument("audio", nargs="+", type=Path)
    t.add_argument("--target", required=True, help="HF folder (or `base` / `tiny.en`: fetched)")
    t.add_argument("--draft", help=DRAFT_HELP)
    t.add_argument("--language", help="language code (default: detect on the first 30 s)")
    t.add_argument("--task", choices=["transcribe", "translate"], default="transcribe")
    t.add_argument("--temperature", type=parse_temperatures, default=(0.0, 0.2, 0.4, 0.6, 0.8, 1.0),
                   help="one value, or a comma list tried in turn when a window fails (default 0,0.2,...,1)")
    t.add_argument("--top-p", type=float, default=1.0)
    t.add_argument("--k", type=int, default=None, help="draft tokens per verify pass (default: adaptive)")
    t.add_argument("--seed", type=int, default=None, help="seed of the fallback samples (reproducible output)")
    t.add_argument("--initial-prompt", default=None, help="text prompting the first window")
    t.add_argument("--no-condition-on-previous-text", action="store_true",
                   help="do not prompt each window with the previous windows' text")
    t.add_argument("--word-timestamps", action="store_true",
                   help="word-level timestamps (openai-whisper's word_timestamps): segments get their words, "
                        "json output carries them, srt/vtt can be cut and highlighted by word")
    t.add_argument("--prepend-punctuations", default=PREPEND_PUNCTUATIONS,
                   help="with --word-timestamps: merge these punctuation symbols with the next word")
    t.add_argument("--append-punctuations", default=APPEND_PUNCTUATIONS,
                   help="with --word-timestamps: merge these punctuation symbols with the previous word")
    t.add_argument("--highlight-words", action="store_true",
                   help="(requires --word-timestamps) underline each word as it is spoken in srt and vtt")
    t.add_argument("--max-line-width", type=int, default=None,
                   help="(requires --word-timestamps) the most characters in a line before breaking it (srt, vtt)")
    t.add_argument("--max-line-count", type=int, default=None,
                   help="(requires --word-timestamps) the most lines in a subtitle (srt, vtt)")
    t.add_argument("--max-words-per-line", type=int, default=None,
                   help="(requires --word-timestamps, no effect with --max-line-width) the most words in a line")
    t.add_argument("--hallucination-silence-threshold", type=float, default=None,
                   help="(requires --word-timestamps) skip silent periods longer than this many seconds "
                        "when a possible hallucination is detected")
    t.add_argument("--output-format", choices=[*OUTPUT_EXTENSIONS, "all"], default="txt")
    t.add_argument("--output-dir", type=Path, default=None, help="write <name>.<format> files here (default: stdout)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--device", default=None)
    t.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    t.add_argument("--json", action="store_true", help="print JSON with tokens, segments and stats")
    t.set_defaults(func=cmd_transcribe)

    d = sub.add_parser("demo", help="whisper-base drafted by its bundled distilled draft and by tiny.en on a "
                                     "bundled 2-minute recording, timed against target-only (and CTranslate2 "
                                     "int8 when installed)")
    d.add_argument("--target", default="base", help="HF folder or a fetched name (base, tiny.en)")
    d.add_argument("--draft", nargs="+", default=None,
                   help="draft model folders or fetched names, each timed in turn "
                        "(default: base-2l and tiny.en for base, else tiny.en)")
    d.add_argument("--k", type=int, default=None, help="draft tokens per step (default: adaptive)")
    d.add_argument("--threads", type=int, default=2)
    d.add_argument("--seconds", type=float, default=None, help="transcribe only the first SECONDS of the recording")
    d.add_argument("--no-ctranslate2", action="store_true", help="skip the CTranslate2 int8 comparison")
    d.add_argument("--repeats", type=int, default=1,
                   help="time target-only and speculative this many interleaved rounds (medians)")
    d.set_defaults(func=cmd_demo)

    f = sub.add_parser("fetch", help="download and convert real checkpoints (base, tiny.en); "
                                     "assemble the bundled draft base-2l beside base")
    f.add_argument("names", nargs="+")
    f.add_argument("--cache-dir", default=None)
    f.set_defaults(func=cmd_fetch)

    c = sub.add_parser("convert", help="CTranslate2 Whisper checkpoint -> HF safetensors folder")
    c.add_argument("ct2_dir", type=Path)
    c.add_argument("out_dir", type=Path)
    c.set_defaults(func=cmd_convert)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (POST /v1/audio/transcriptions, ...)")
    s.add_argument("--target", required=True, help="HF folder (or `base` / `tiny.en`: fetched)")
    s.add_argument("--draft", help=DRAFT_HELP)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--device", default=None)
    s.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    s.add_argument("--max-batch", type=int, default=None, help="rows the engine decodes together")
    s.add_argument("--max-queue", type=int, default=64, help="requests in flight before 429")
    s.add_argument("--max-upload-mb", type=float, default=25.0, help="larger request bodies get 413")
    s.add_argument("--max-new-tokens", type=int, default=None, help="per-request token cap")
    s.add_argument("--max-audio-seconds", type=float, default=7200.0,
                   help="longest audio accepted (400 past it, refused from the file's declared duration "
                        "before decoding when it has one); bounds the work a small compressed upload can ask for")
    s.add_argument("--read-timeout", type=float, default=60.0,
                   help="seconds a request's whole body may take to arrive (408 past it; 0: no limit)")
    s.add_argument("--model-name", default=None, help="name in /v1/models (default: the target's)")
    s.add_argument("--log-level", default="info")
    s.set_defaults(func=cmd_serve)
    add_bulk_parser(sub)
    add_distill_parser(sub)

    args = p.parse_args(argv)
    if args.command == "transcribe":
        check_word_options(p, args)
    return args.func(args)


def check_word_options(parser, args) -> None:
    """openai-whisper's CLI checks: the subtitle word options need --word-timestamps."""
    import warnings

    for option in ("highlight_words", "max_line_count", "max_line_width", "max_words_per_line",
                   "hallucination_silence_threshold"):
        if getattr(args, option) and not args.word_timestamps:
            parser.error(f"--{option.replace('_', '-')} requires --word-timestamps")
    if args.max_line_count and not args.max_line_width:
        warnings.warn("--max-line-count has no effect without --max-line-width", stacklevel=2)
    if args.max_words_per_line and args.max_line_width:
        warnings.warn("--max-words-per-line has no effect with --max-line-width", stacklevel=2)


def run() -> int:
    """The `specwhisper` program: `main`, then every object alive frozen out of the garbage
    collector (`gc.freeze`). At exit the interpreter's last collections walk every object torch and
    the models created, ≈ 1 s of each call here (import torch and exit: 1.0-1.1 s after the imports,
    0.3 s frozen); the process ends anyway. Not in `main`, which tests and embedders call in a
    process that goes on."""
    code = main()
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(run())

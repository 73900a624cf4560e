"""Load on the HTTP server over loopback: N concurrent clients (1, 4, 16) posting the same audio
to `POST /v1/audio/transcriptions`, target-only and speculative.

Question answered: how many requests/s and audio-seconds/s (RTFx) does the server sustain at each
concurrency, at what latency (p50/p99), and does speculation change that? Bounded: each client
sends at most --requests-per-client requests and stops issuing new ones after --time-limit seconds
per level; every HTTP call has a timeout.

    python bench/serve_load.py                                   # base, tiny.en draft, bundled samples
    python bench/serve_load.py --clients 1 4 --requests-per-client 2 --time-limit 120
    python bench/serve_load.py --target ~/models/whisper-large-v3 --draft ~/models/whisper-tiny --device cuda

The server runs in this process (uvicorn in a thread, `specwhisper.serving.server.serve_in_thread`); the
clients are threads with their own httpx connections. Writes serve_load-<device>.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from specwhisper import Engine
from specwhisper.audio import SAMPLE_RATE, decode_audio_bytes
from specwhisper.samples import sample_paths
from specwhisper.serving.server import create_app, serve_in_thread
from specwhisper.tools.fetch import NAMES, fetch

REQUEST_TIMEOUT = 600.0  # seconds, one HTTP call


def model_dir(spec: str) -> Path:
    return fetch(spec) if spec in NAMES else Path(spec).expanduser()


def load_audio_files(folder: str | None) -> list[tuple[str, bytes, float]]:
    """(name, file bytes, seconds of audio) for each file posted."""
    paths = sample_paths() if folder is None else sorted(
        p for p in Path(folder).expanduser().iterdir() if p.suffix.lower() in (".wav", ".flac", ".mp3", ".ogg", ".m4a"))
    if not paths:
        raise SystemExit(f"no audio files in {folder}")
    return [(p.name, p.read_bytes(), decode_audio_bytes(p.read_bytes()).size / SAMPLE_RATE) for p in paths]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def scrape(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def run_level(url: str, files, clients: int, per_client: int, time_limit: float, form: dict) -> dict:
    """`clients` threads, each posting files round-robin (offset by its index) until it has sent
    `per_client` requests or `time_limit` seconds have passed since the level started."""
    records, lock = [], threading.Lock()
    deadline = time.monotonic() + time_limit

    def client(index: int):
        with httpx.Client(timeout=REQUEST_TIMEOUT) as http:
            for i in range(per_client):
                if time.monotonic() > deadline:
                    return
                name, data, seconds = files[(index + i * clients) % len(files)]
                t0 = time.perf_counter()
                try:
                    r = http.post(url + "/v1/audio/transcriptions", files={"file": (name, data)}, data=form)
                    status, text = r.status_code, (r.json().get("text") if r.status_code == 200 else r.text[:200])
                except httpx.HTTPError as exc:
                    status, text = -1, repr(exc)
                with lock:
                    records.append(dict(file=name, audio_seconds=seconds, status=status, text=text,
                                        latency=time.perf_counter() - t0))

    drafted0 = scrape(url, "specwhisper_draft_tokens_total")
    accepted0 = scrape(url, "specwhisper_draft_accepted_tokens_total")
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(time_limit + REQUEST_TIMEOUT)
    wall = time.perf_counter() - start
    ok = [r for r in records if r["status"] == 200]
    latencies = [r["latency"] for r in ok]
    drafted = scrape(url, "specwhisper_draft_tokens_total") - drafted0
    accepted = scrape(url, "specwhisper_draft_accepted_tokens_total") - accepted0
    return dict(clients=clients, requests=len(records), ok=len(ok), errors=len(records) - len(ok), wall_s=wall,
                requests_per_s=len(ok) / wall, rtfx=sum(r["audio_seconds"] for r in ok) / wall,
                p50_s=percentile(latencies, 50), p99_s=percentile(latencies, 99),
                mean_s=statistics.fmean(latencies) if latencies else float("nan"),
                acceptance=accepted / drafted if drafted else None, records=records)


def markdown(report: dict) -> str:
    lines = [f"# HTTP server load ({report['device']}, {report['dtype']}, target {report['target']})", "",
             f"{len(report['audio'])} files, {report['audio_seconds']:.1f} s of audio; load average before "
             f"{report['loadavg_before']}, after {report['loadavg_after']}. Measured over loopback, server and "
             "clients in one process.", "",
             "| system | clients | ok/sent | requests/s | RTFx | p50 s | p99 s | acceptance | = target-only |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        acc = "n/a" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        lines.append(f"| {row['system']} | {row['clients']} | {row['ok']}/{row['requests']} | "
                     f"{row['requests_per_s']:.2f} | {row['rtfx']:.2f} | {row['p50_s']:.2f} | {row['p99_s']:.2f} | "
                     f"{acc} | {row['same_as_target']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="base", help="HF Whisper folder, or a fetchable name (base, tiny.en)")
    p.add_argument("--draft", default="tiny.en", help="draft folder/name for the speculative runs ('none': skip)")
    p.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per level before clients stop issuing")
    p.add_argument("--audio", help="folder of audio files (default: bundled samples)")
    p.add_argument("--language", default="en")
    p.add_argument("--k", type=int, default=None, help="num_draft_tokens for speculative runs (default: adaptive)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    files = load_audio_files(args.audio)
    target = model_dir(args.target)
    systems = [("target-only", None)] + ([] if args.draft == "none" else [(f"speculative ({args.draft})",
                                                                           model_dir(args.draft))])
    form = {"model": "whisper-1", "language": args.language}
    report = dict(target=str(args.target), draft=args.draft, device=args.device, dtype=args.dtype,
                  threads=args.threads, machine=platform.platform(), loadavg_before=os.getloadavg(),
                  audio=[f[0] for f in files], audio_seconds=sum(f[2] for f in files), rows=[])
    reference: dict[str, str] = {}  # target-only text per file (greedy speculative must equal it)
    for system, draft in systems:
        engine = Engine(target, draft, device=args.device, dtype=getattr(torch, args.dtype))
        app = create_app(engine, max_queue=max(args.clients) * 2, max_new_tokens=args.max_new_tokens)
        level_form = dict(form, **({"num_draft_tokens": str(args.k)} if draft is not None and args.k else {}))
        with serve_in_thread(app) as url:
            warm = run_level(url, files, 1, 1, args.time_limit, level_form)  # warm-up, not reported
            if warm["errors"]:
                raise SystemExit(f"warm-up failed: {warm['records']}")
            for clients in args.clients:
                row = run_level(url, files, clients, args.requests_per_client, args.time_limit, level_form)
                for r in row["records"]:
                    if draft is None and r["status"] == 200:
                        reference.setdefault(r["file"], r["text"])
                same = [reference.get(r["file"]) == r["text"] for r in row["records"] if r["status"] == 200]
                row.update(system=system, same_as_target=f"{sum(same)}/{len(same)}")
                report["rows"].append(row)
                print(f"{system:>28} clients={clients:>2}: {row['ok']}/{row['requests']} ok, "
                      f"{row['requests_per_s']:.2f} req/s, RTFx {row['rtfx']:.2f}, p50 {row['p50_s']:.2f} s, "
                      f"p99 {row['p99_s']:.2f} s, = target-only {row['same_as_target']}", flush=True)
        del engine
    report["loadavg_after"] = os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"serve_load-{args.device}.json").write_text(json.dumps(report, indent=1))
    (out / f"serve_load-{args.device}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()

"""Bulk transcription on a Ray cluster (the optional `[ray]` extra): `BulkJob` and `run_bulk`.

Pipeline (Ray Data, streaming):
    file paths ─ map (CPU tasks): read + decode to 16 kHz float32 ─ map_batches (actor pool: one
    `Engine` per actor, `num_gpus=1` on GPU clusters) ─ map_batches (CPU tasks): write one part file
    of results ─ the driver collects (path, duration, error) rows for the summary.
One result per input file: `path, text, segments, language, duration, stats, error` (`error` is None
on success; a failure keeps the message and empty fields). Bad files never stop the job. Part files
(`part-*.jsonl` / `part-*.parquet`) are written under a temporary name and renamed, so a rerun sees
only whole parts, and skips every file that already has a record there.

Before any Ray work the driver checks what the user can fix (the input exists, the output folder
is writable, the model folders load: `bulk_checks.py`) and raises `BulkError`, one line with an
exit code for the CLI. A local cluster (the default) listens on 127.0.0.1 only, and a watchdog process
(`ray_reaper`) ends its processes if the driver is killed.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import time
import typing
import uuid
from pathlib import Path

import numpy as np

try:
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq
    import ray
    import ray.data
except ImportError as e:  # pragma: no cover - depends on the installed extras
    raise ImportError("bulk transcription needs Ray Data: pip install 'specwhisper[ray]'") from e

from ..results import Segment, Stats
from .bulk_checks import (EXIT_BAD_INPUT, EXIT_CLUSTER, EXIT_FILES_FAILED, EXIT_MODEL, EXIT_OUTPUT,  # noqa: F401
                          BulkError, check_model_folder, check_output)

AUDIO_EXTENSIONS = frozenset(
    ".wav .flac .mp3 .ogg .oga .opus .m4a .mp4 .aac .webm .mkv .mka .wma .aiff .aif .au .caf .amr "
    ".3gp .mov .avi".split())
OUTPUT_FORMATS = ("jsonl", "parquet")
TASK_CPUS = 0.5  # CPUs per decoding / writing task (light next to transcription)


@dataclasses.dataclass(frozen=True)
class BulkJob:
    source: str  # a folder (searched recursively for audio files), a glob, one file, or a URI (s3://...)
    out: str  # results folder (local, shared, or a URI pyarrow can write)
    target: str  # target model folder; must exist at this path on every worker node
    draft: str | None = None  # draft model folder (speculative decoding), or None
    language: str | None = None  # language code; None detects it per file (multilingual models)
    device: str | None = None  # "cuda" / "cpu"; None: GPU actors when the cluster has GPUs
    dtype: str | None = None  # "float32" / "float16" / "bfloat16"; None: the engine's default
    actors: int | None = None  # engines in the pool; None: one per GPU, or one per `cpus_per_actor` CPUs
    cpus_per_actor: float = 1.0  # CPUs reserved per actor (and torch threads on CPU actors)
    batch_size: int = 4  # files handed to an actor per call (submitted to its engine together)
    output_format: str = "jsonl"  # "jsonl" or "parquet"
    retry_failed: bool = False  # rerun files whose earlier record is a failure
    decode_options: dict = dataclasses.field(default_factory=dict)  # more `Engine.transcribe` keywords

    def __post_init__(self):
        if self.output_format not in OUTPUT_FORMATS:
            raise ValueError(f"output_format must be one of {OUTPUT_FORMATS}, got {self.output_format!r}")
        if self.actors is not None and self.actors < 1:
            raise ValueError(f"actors must be >= 1, got {self.actors}")
        if self.cpus_per_actor <= 0 or self.batch_size < 1:
            raise ValueError("cpus_per_actor must be > 0 and batch_size >= 1")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda (Ray picks the GPU), got {self.device!r}")
        if self.dtype not in (None, "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if "language" in self.decode_options:
            raise ValueError("decode_options must not repeat language: it is a job field")


@dataclasses.dataclass
class BulkSummary:
    files: int  # files transcribed (or failed) in this run
    skipped: int  # files skipped because `out` already had their record
    audio_seconds: float  # audio transcribed in this run
    wall_seconds: float  # pipeline wall time (actor start-up included)
    failures: list[tuple[str, str]]  # (path, reason) for every file that failed in this run

    @property
    def rtfx(self) -> float:
        """Seconds of audio transcribed per second of wall time."""
        return self.audio_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def format(self, max_failures: int = 50) -> str:
        lines = [f"{self.files} files ({self.skipped} skipped, already done), "
                 f"{self.audio_seconds / 3600:.4f} h of audio in {self.wall_seconds:.1f} s: "
                 f"RTFx {self.rtfx:.2f}; {len(self.failures)} failed"]
        lines += [f"  failed: {path}: {reason}" for path, reason in self.failures[:max_failures]]
        if len(self.failures) > max_failures:
            lines.append(f"  ... and {len(self.failures) - max_failures} more (records with an error)")
        return "\n".join(lines)


# ---------------------------------------------------------------- files in, files out
def _is_uri(location: str) -> bool:
    return "://" in location


def _filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it); local paths are made absolute."""
    if _is_uri(location):
        return pafs.FileSystem.from_uri(location)
    return pafs.LocalFileSystem(), str(Path(location).expanduser().resolve())


def list_audio(source: str) -> list[str]:
    """Input files, sorted: a folder's audio files (recursive, by extension), a glob's matches
    (any extension), one file, or the same for a URI folder/file."""
    if _is_uri(source):
        fs, root = pafs.FileSystem.from_uri(source)
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.File:
            return [source]
        if info.type != pafs.FileType.Directory:
            raise FileNotFoundError(f"no such file or folder: {source!r}")
        scheme = source.split("://", 1)[0]
        return sorted(f"{scheme}://{i.path}" for i in fs.get_file_info(pafs.FileSelector(root, recursive=True))
                      if i.type == pafs.FileType.File and Path(i.path).suffix.lower() in AUDIO_EXTENSIONS)
    path = Path(source).expanduser()
    if path.is_dir():
        found = (p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in AUDIO_EXTENSIONS)
    elif path.is_file():
        found = [path]
    elif glob.has_magic(source):
        found = (Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True) if Path(p).is_file())
    else:
        raise FileNotFoundError(f"no such file, folder or glob match: {source!r}")
    return sorted({str(p.resolve()) for p in found})


def read_results(out: str) -> list[dict]:
    """Every record in `out`'s part files (jsonl and parquet), one per path: a success wins over a
    failure, otherwise the latest part (by modification time) wins."""
    fs, root = _filesystem(out)
    infos = [i for i in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
             if i.type == pafs.FileType.File and i.base_name.startswith("part-")
             and i.base_name.endswith((".jsonl", ".parquet"))]
    best: dict[str, dict] = {}
    for info in sorted(infos, key=lambda i: (i.mtime_ns or 0, i.path)):
        if info.path.endswith(".parquet"):
            rows = pq.read_table(info.path, filesystem=fs).to_pylist()
            for row in rows:
                for name in _json_columns():
                    if isinstance(row.get(name), str):
                        row[name] = json.loads(row[name])
        else:
            with fs.open_input_stream(info.path) as f:
                rows = [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]
        for row in rows:
            old = best.get(row["path"])
            if old is None or row["error"] is None or old["error"] is not None:
                best[row["path"]] = row
    return list(best.values())


def _write_part(records: list[dict], out: str, output_format: str) -> None:
    """One part file, written under a temporary name and renamed into place."""
    fs, root = _filesystem(out)
    name = f"{root}/part-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:12]}.{output_format}"
    tmp = name + ".tmp"
    if output_format == "jsonl":
        with fs.open_output_stream(tmp) as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode())
    else:
        json_cols = _json_columns()
        rows = [{k: json.dumps(v) if k in json_cols else v for k, v in r.items()} for r in records]
        pq.write_table(pa.Table.from_pylist(rows, schema=_parquet_schema()), tmp, filesystem=fs)
    fs.move(tmp, name)


_ARROW_TYPES = {int: pa.int64(), float: pa.float64(), str: pa.string(), bool: pa.bool_(),
                str | None: pa.string(), int | None: pa.int64(), float | None: pa.float64(),
                list[int]: pa.list_(pa.int64())}


def _struct(cls) -> pa.DataType | None:
    """Arrow struct of a results dataclass, or None when a field has no plain Arrow type."""
    hints = typing.get_type_hints(cls)
    types = [_ARROW_TYPES.get(hints[f.name]) for f in dataclasses.fields(cls)]
    if any(t is None for t in types):
        return None
    return pa.struct([pa.field(f.name, t) for f, t in zip(dataclasses.fields(cls), types)])


def _json_columns() -> set[str]:
    """Nested columns stored in Parquet as JSON text (results dataclasses Arrow cannot type)."""
    return {name for name, cls in (("segments", Segment), ("stats", Stats)) if _struct(cls) is None}


def _parquet_schema() -> pa.Schema:
    segment, stats = _struct(Segment), _struct(Stats)
    return pa.schema([
        ("path", pa.string()), ("text", pa.string()),
        ("segments", pa.list_(segment) if segment is not None else pa.string()),
        ("language", pa.string()), ("duration", pa.float64()),
        ("stats", stats if stats is not None else pa.string()), ("error", pa.string())])


def _failure(path: str, error: str, duration: float = 0.0) -> dict:
    return {"path": path, "text": "", "segments": [], "language": None, "duration": duration,
            "stats": None, "error": error}


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------- pipeline stages
def decode_file(row: dict) -> dict:
    """CPU task: one path -> {path, audio (float32 16 kHz samples as bytes), error}."""
    from ..audio import SAMPLE_RATE, load_audio

    path = row["path"]
    try:
        if _is_uri(path):
            fs, inner = pafs.FileSystem.from_uri(path)
            with fs.open_input_stream(inner) as f:
                samples = load_audio(f.read())
        else:
            samples = load_audio(path)
        if samples.size == 0:
            raise ValueError("audio is empty (0 samples)")
        return {"path": path, "audio": samples.tobytes(), "seconds": samples.size / SAMPLE_RATE, "error": ""}
    except Exception as e:  # any bad file becomes a failure record
        return {"path": path, "audio": b"", "seconds": 0.0, "error": _reason(e)}


class Transcriber:
    """Actor: holds one `Engine`; a batch of decoded files -> {path, record (JSON text)}."""

    def __init__(self, target: str, draft: str | None, device: str | None, dtype: str | None,
                 language: str | None, decode_options: dict, threads: int | None):
        import torch

        from ..engine.engine import Engine

        if threads:
            torch.set_num_threads(threads)
        self.engine = Engine(target, draft, device=device, dtype=getattr(torch, dtype) if dtype else None)
        self.language, self.decode_options = language, dict(decode_options)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        futures = []  # all submitted before any is awaited: a batching engine decodes them together
        for audio, error in zip(batch["audio"], batch["error"]):
            if error:
                futures.append(None)
                continue
            samples = np.frombuffer(audio, dtype=np.float32).copy()
            try:
                futures.append(self.engine.submit(samples, language=self.language, **self.decode_options))
            except Exception as e:  # refused up front
                futures.append(e)
        records = []
        for path, seconds, error, future in zip(batch["path"], batch["seconds"], batch["error"], futures):
            path = str(path)
            if future is None:
                records.append(_failure(path, str(error)))
                continue
            try:
                if isinstance(future, Exception):
                    raise future
                out = future.result()
                records.append({"path": path, "text": out.text, "segments": [s.to_dict() for s in out.segments],
                                "language": out.language, "duration": out.duration,
                                "stats": dataclasses.asdict(out.stats), "error": None})
            except Exception as e:  # e.g. audio longer than the engine accepts
                records.append(_failure(path, _reason(e), float(seconds)))
        return {"path": np.array([r["path"] for r in records], dtype=object),
                "record": np.array([json.dumps(r, ensure_ascii=False) for r in records], dtype=object)}


def write_results(batch: dict[str, np.ndarray], out: str, output_format: str) -> dict[str, np.ndarray]:
    """CPU task: one part file per batch -> the rows the driver's summary needs."""
    records = [json.loads(r) for r in batch["record"]]
    _write_part(records, out, output_format)
    return {"path": np.array([r["path"] for r in records], dtype=object),
            "duration": np.array([float(r["duration"]) if r["error"] is None else 0.0 for r in records]),
            "error": np.array([r["error"] or "" for r in records], dtype=object)}


# ---------------------------------------------------------------- the job
_REAPERS = []  # the watchdog of the local cluster this process started (kept alive with it)


def connect(address: str | None = None) -> None:
    """Join a cluster: an already initialised Ray as is; None / "local": start a local one,
    listening on 127.0.0.1 only, without the dashboard, watched so that it dies with this
    process (`ray_reaper`); "auto" or "host:port" / "ray://...": connect to that cluster."""
    if ray.is_initialized():
        return
    if address in (None, "local"):
        # Ray resolves 127.0.0.1 to the machine's external address (so other nodes could join)
        # unless it runs as a single-machine cluster, which it does by default only on macOS
        # and Windows; this switch makes every Ray process (gRPC servers and agents) listen on
        # loopback only. Set in the environment too, for the processes Ray starts.
        from ray._private import ray_constants

        from .ray_reaper import start_reaper

        os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
        _REAPERS.append(start_reaper())
        ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    else:
        ray.init(address=address)


def _pool(job: BulkJob, n_files: int) -> tuple[int, float, str, int | None]:
    """(actors, GPUs per actor, engine device, torch threads per actor) for this cluster."""
    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), float(resources.get("CPU", 1))
    if job.device == "cuda" or (job.device is None and gpus > 0):
        if gpus == 0:
            raise ValueError("device='cuda' asks for GPU actors but the Ray cluster has no GPU")
        # Ray gives each actor its own GPU (CUDA_VISIBLE_DEVICES), which the engine sees as "cuda"
        actors, gpus_per_actor, device, threads = job.actors or gpus, 1.0, "cuda", None
    else:
        actors = job.actors or max(1, int((cpus - TASK_CPUS) // job.cpus_per_actor))
        gpus_per_actor, device, threads = 0.0, "cpu", max(1, round(job.cpus_per_actor))
    actors = min(actors, n_files)
    if actors * job.cpus_per_actor + TASK_CPUS > cpus:
        raise ValueError(f"{actors} actors x {job.cpus_per_actor:g} CPUs leave less than {TASK_CPUS} of the "
                         f"cluster's {cpus:g} CPUs for decoding files; use fewer actors or CPUs per actor")
    return actors, gpus_per_actor, device, threads


def run_bulk(job: BulkJob, address: str | None = None) -> BulkSummary:
    """Transcribe every file of `job.source` not yet recorded in `job.out`; returns this run's summary.
    Raises BulkError (one line, an exit code) for a missing input, an unwritable output folder, a
    model folder that does not load, or a cluster that cannot start or run the pipeline."""
    try:
        inputs = list_audio(job.source)
    except (FileNotFoundError, OSError) as e:
        raise BulkError(str(e), EXIT_BAD_INPUT) from None
    if not inputs:
        raise BulkError(f"no audio files in {job.source!r} (looked for {', '.join(sorted(AUDIO_EXTENSIONS)[:6])}, ...)",
                        EXIT_BAD_INPUT)
    check_output(job.out, *_filesystem(job.out))
    for folder, role in ((job.target, "target"), (job.draft, "draft")):
        if folder is not None and not _is_uri(folder):
            check_model_folder(folder, role)
    try:
        done = {r["path"] for r in read_results(job.out) if r["error"] is None or not job.retry_failed}
    except Exception as e:
        raise BulkError(f"cannot read the earlier results in {job.out!r}: {_reason(e)}", EXIT_OUTPUT) from None
    todo = [p for p in inputs if p not in done]
    skipped = len(inputs) - len(todo)
    if not todo:
        return BulkSummary(0, skipped, 0.0, 0.0, [])

    try:
        connect(address)
    except Exception as e:
        raise BulkError(f"Ray did not start or connect (address {address or 'local'!r}): {_reason(e)}",
                        EXIT_CLUSTER) from None
    try:
        return _run_pipeline(job, todo, skipped)
    except ray.exceptions.RayError as e:
        raise BulkError(f"the Ray pipeline failed: {_root_cause(e)}", EXIT_CLUSTER) from None


def _root_cause(e: BaseException) -> str:
    """The first line of the innermost error a Ray exception wraps (tracebacks stay in Ray's logs)."""
    while getattr(e, "cause", None) is not None and e.cause is not e:
        e = e.cause
    while e.__cause__ is not None:
        e = e.__cause__
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1].strip() if lines else ''}"


def _run_pipeline(job: BulkJob, todo: list[str], skipped: int) -> BulkSummary:
    actors, gpus, device, threads = _pool(job, len(todo))
    start = time.perf_counter()
    ds = ray.data.from_items([{"path": p} for p in todo], override_num_blocks=min(len(todo), 1000))
    ds = ds.map(decode_file, num_cpus=TASK_CPUS)
    ds = ds.map_batches(
        Transcriber, batch_size=job.batch_size, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_gpus=gpus, num_cpus=job.cpus_per_actor,
        fn_constructor_kwargs=dict(target=job.target, draft=job.draft, device=device, dtype=job.dtype,
                                   language=job.language, decode_options=job.decode_options,
                                   threads=threads))
    ds = ds.map_batches(write_results, batch_size=max(16, job.batch_size), batch_format="numpy",
                        num_cpus=TASK_CPUS, fn_kwargs=dict(out=job.out, output_format=job.output_format))
    audio_seconds, failures = 0.0, []
    for row in ds.iter_rows():
        audio_seconds += float(row["duration"])
        if row["error"]:
            failures.append((str(row["path"]), str(row["error"])))
    return BulkSummary(len(todo), skipped, audio_seconds, time.perf_counter() - start, sorted(failures))

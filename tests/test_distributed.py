"""Bulk transcription with Ray Data on a local Ray cluster started inside the tests: every good file's
record equals `Engine.transcribe` on that file, bad files become failure records, reruns resume."""
from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
soundfile = pytest.importorskip("soundfile")  # absent on GPU images with their own packages

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from conftest import real_folder  # noqa: E402
from specwhisper import Engine, load_audio  # noqa: E402
from specwhisper.samples import sample_paths  # noqa: E402
from specwhisper.serving.distributed import (BulkJob, Transcriber, _pool, _write_part, decode_file,  # noqa: E402
                                             list_audio, read_results, run_bulk)
from specwhisper.tools.cli import main  # noqa: E402

SENTENCES = ["The bus leaves at noon.", "Please close the window.", "It will rain tomorrow.",
             "Call me after lunch.", "The shop opens at nine.", "She reads a book every week."]
VOICES = [("flite", "slt"), ("flite", "rms"), ("flite", "awb"), ("flite", "kal16"), ("flite", "kal"),
          ("espeak-ng", "en-us"), ("espeak-ng", "en-us+f3"), ("espeak-ng", "en-gb")]
OPTIONS = {"max_new_tokens": 6}  # random tiny checkpoint: a few tokens are enough to compare


def bounded(fn, *args, timeout: float = 150.0, **kwargs):
    """Call fn in a daemon thread; fail the test instead of hanging past `timeout` seconds."""
    result, error = [], []

    def target():
        try:
            result.append(fn(*args, **kwargs))
        except BaseException as e:  # handed back to the test thread
            error.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not finish within {timeout:.0f} s")
    if error:
        raise error[0]
    return result[0]


def synthesize(path, engine: str, voice: str, text: str) -> None:
    if engine == "flite":
        cmd = ["flite", "-voice", voice, "-t", text, "-o", str(path)]
    else:
        cmd = ["espeak-ng", "-v", voice, "-s", "170", "-w", str(path), text]
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture
def speech_folder(tmp_path):
    """11 speech files (flite and espeak-ng voices, 8 and 16 kHz) + a garbage file + an empty file."""
    if shutil.which("flite") is None or shutil.which("espeak-ng") is None:
        pytest.skip("needs flite and espeak-ng")
    folder = tmp_path / "audio"
    (folder / "nested").mkdir(parents=True)
    for i in range(11):
        engine, voice = VOICES[i % len(VOICES)]
        sub = folder / "nested" if i % 3 == 0 else folder
        synthesize(sub / f"{voice.replace('+', '_')}_{i:02d}.wav", engine, voice, SENTENCES[i % len(SENTENCES)])
    (folder / "garbage.wav").write_bytes(np.random.default_rng(0).bytes(3000))
    (folder / "empty.flac").write_bytes(b"")
    (folder / "notes.txt").write_text("not audio: ignored when a folder is searched")
    return folder


def test_list_audio_folder_glob_file_and_uri(tmp_path):
    for name in ("a.wav", "sub/b.FLAC", "sub/deep/c.mp3", "notes.txt", "d.wav.tmp"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    audio = [str(tmp_path / n) for n in ("a.wav", "sub/b.FLAC", "sub/deep/c.mp3")]
    assert list_audio(str(tmp_path)) == sorted(audio)
    assert list_audio(str(tmp_path / "**" / "*.txt")) == [str(tmp_path / "notes.txt")]  # a glob takes any file
    assert list_audio(str(tmp_path / "a.wav")) == [audio[0]]
    assert list_audio(f"file://{tmp_path}") == sorted(f"file://{p}" for p in audio)
    with pytest.raises(FileNotFoundError, match="no such"):
        list_audio(str(tmp_path / "missing"))


def test_decode_file_records_bad_files_and_reads_uris(tmp_path):
    good = sample_paths()[0]
    (tmp_path / "garbage.wav").write_bytes(np.random.default_rng(1).bytes(2000))
    (tmp_path / "empty.wav").write_bytes(b"")
    header_only = tmp_path / "silent.wav"  # a valid WAV with no samples
    soundfile.write(header_only, np.zeros(0, np.float32), 16000)
    row = decode_file({"path": f"file://{good}"})
    assert row["error"] == "" and np.array_equal(np.frombuffer(row["audio"], np.float32), load_audio(good))
    assert row["seconds"] == len(load_audio(good)) / 16000
    for name, reason in (("garbage.wav", "decode"), ("empty.wav", "decode"), ("silent.wav", "empty")):
        row = decode_file({"path": str(tmp_path / name)})
        assert reason in row["error"] and row["audio"] == b"", row
    assert "FileNotFoundError" in decode_file({"path": str(tmp_path / "gone.wav")})["error"]


def test_transcriber_turns_engine_errors_into_records(multilingual):
    transcriber = Transcriber(str(multilingual), None, "cpu", None, "en", OPTIONS, threads=None)
    good = load_audio(sample_paths()[0])
    batch = {"path": np.array(["good", "nan", "undecodable"], dtype=object),
             "audio": np.array([good.tobytes(), np.full(800, np.nan, np.float32).tobytes(), b""], dtype=object),
             "seconds": np.array([len(good) / 16000, 0.05, 0.0]),
             "error": np.array(["", "", "RuntimeError: cannot decode"], dtype=object)}
    records = [json.loads(r) for r in transcriber(batch)["record"]]
    ref = Engine(str(multilingual)).transcribe(good, language="en", **OPTIONS)
    assert records[0]["error"] is None and records[0]["text"] == ref.text
    assert records[1]["error"].startswith("ValueError") and "NaN" in records[1]["error"]
    assert records[2]["error"] == "RuntimeError: cannot decode" and records[2]["segments"] == []


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_results_round_trip_and_success_wins(tmp_path, fmt):
    ok = {"path": "/a.wav", "text": "hi", "language": "en", "duration": 1.5, "error": None,
          "segments": [{"id": 0, "seek": 0, "start": 0.0, "end": 1.5, "text": "hi", "tokens": [1, 2],
                        "temperature": 0.0, "avg_logprob": -0.1, "compression_ratio": 1.0, "no_speech_prob": 0.0}],
          "stats": {"drafted": 3, "accepted": 2, "target_passes": 2, "draft_passes": 3, "acceptance_rate": 2 / 3,
                    "tokens_per_pass": 1.5, "seconds": 0.25, "draft_skipped": None}}
    bad = {"path": "/b.wav", "text": "", "segments": [], "language": None, "duration": 0.0, "stats": None,
           "error": "RuntimeError: cannot decode"}
    _write_part([ok, bad], str(tmp_path), fmt)
    _write_part([{**bad, "path": "/a.wav"}], str(tmp_path), fmt)  # a later failure never hides a success
    assert sorted(read_results(str(tmp_path)), key=lambda r: r["path"]) == [ok, bad]
    assert not list(tmp_path.glob("*.tmp"))


def test_job_validation():
    with pytest.raises(ValueError, match="output_format"):
        BulkJob("in", "out", "t", output_format="csv")
    with pytest.raises(ValueError, match="device"):
        BulkJob("in", "out", "t", device="cuda:1")
    with pytest.raises(ValueError, match="job field"):
        BulkJob("in", "out", "t", decode_options={"language": "en"})


def test_actor_pool_shape_follows_the_cluster(monkeypatch):
    def cluster(**resources):
        monkeypatch.setattr(ray, "cluster_resources", lambda: resources)

    cluster(CPU=64.0, GPU=4.0)
    assert _pool(BulkJob("in", "out", "t"), n_files=100) == (4, 1.0, "cuda", None)  # one actor per GPU
    assert _pool(BulkJob("in", "out", "t"), n_files=3) == (3, 1.0, "cuda", None)  # never more than files
    assert _pool(BulkJob("in", "out", "t", device="cpu", cpus_per_actor=8), n_files=100) == (7, 0.0, "cpu", 8)
    cluster(CPU=2.0)
    assert _pool(BulkJob("in", "out", "t", cpus_per_actor=1.5), n_files=10) == (1, 0.0, "cpu", 2)
    with pytest.raises(ValueError, match="no GPU"):
        _pool(BulkJob("in", "out", "t", device="cuda"), n_files=10)
    with pytest.raises(ValueError, match="for decoding files"):
        _pool(BulkJob("in", "out", "t", actors=2, cpus_per_actor=1.0), n_files=10)


def check_equal_to_engine(records: dict, paths, engine: Engine) -> None:
    for path in paths:
        rec, ref = records[str(path.resolve())], engine.transcribe(load_audio(path), language="en", **OPTIONS)
        assert rec["error"] is None, rec
        assert rec["text"] == ref.text and rec["language"] == ref.language
        assert rec["segments"] == [s.to_dict() for s in ref.segments]  # tokens included
        assert rec["duration"] == pytest.approx(ref.duration)
        assert rec["stats"]["target_passes"] == ref.stats.target_passes


@pytest.mark.slow  # ~70 s on 2 loaded cores, mostly Ray workers importing torch
def test_bulk_matches_engine_reports_bad_files_and_resumes(ray_cluster, speech_folder, multilingual, tmp_path,
                                                           capsys):
    out = tmp_path / "results"
    job = BulkJob(str(speech_folder), str(out), str(multilingual), language="en", actors=2,
                  cpus_per_actor=0.5, batch_size=2, decode_options=OPTIONS)
    summary = bounded(run_bulk, job)
    good = sorted(p for p in speech_folder.rglob("*.wav") if p.name != "garbage.wav")
    assert len(good) == 11
    assert summary.files == 13 and summary.skipped == 0
    failed = dict(summary.failures)
    assert set(failed) == {str((speech_folder / n).resolve()) for n in ("garbage.wav", "empty.flac")}
    assert all("decode" in reason or "empty" in reason for reason in failed.values()), failed
    records = {r["path"]: r for r in read_results(str(out))}
    assert len(records) == 13
    assert summary.audio_seconds == pytest.approx(sum(r["duration"] for r in records.values()))
    for path, reason in failed.items():
        assert records[path]["error"] == reason and records[path]["text"] == "" and records[path]["stats"] is None
    engine = Engine(str(multilingual))
    check_equal_to_engine(records, good, engine)

    # Rerun through the CLI with one new file: only that file is transcribed (written as Parquet).
    new = speech_folder / "late_arrival.wav"
    synthesize(new, "flite", "slt", "A new file arrived late.")
    capsys.readouterr()
    rc = bounded(main, ["bulk", str(speech_folder), "--out", str(out), "--target", str(multilingual),
                        "--language", "en", "--actors", "1", "--cpus-per-actor", "0.5",
                        "--max-new-tokens", str(OPTIONS["max_new_tokens"]), "--output-format", "parquet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "1 files (13 skipped" in printed and "0 failed" in printed, printed
    assert len(list(out.glob("part-*.parquet"))) == 1
    records = {r["path"]: r for r in read_results(str(out))}
    assert len(records) == 14
    check_equal_to_engine(records, [new], engine)

    # Nothing left to do: no Ray work at all.
    assert bounded(run_bulk, job).files == 0


@pytest.mark.real
@pytest.mark.slow
def test_bulk_real_base_equals_engine(ray_cluster, tmp_path):
    base = real_folder("base")
    folder = tmp_path / "audio"
    folder.mkdir()
    paths = [Path(shutil.copy(p, folder / p.name)) for p in sample_paths()[:2]]
    job = BulkJob(str(folder), str(tmp_path / "results"), str(base), language="en", actors=1, cpus_per_actor=1.0)
    summary = bounded(run_bulk, job, timeout=300)
    assert summary.files == 2 and not summary.failures
    records = {r["path"]: r for r in read_results(str(tmp_path / "results"))}
    engine = Engine(str(base))
    for path in paths:
        ref = engine.transcribe(load_audio(path), language="en")
        assert records[str(path.resolve())]["text"] == ref.text
        assert records[str(path.resolve())]["segments"] == [s.to_dict() for s in ref.segments]

"""Bulk transcription with Ray Data on a local Ray cluster started inside the tests: every good file's
record equals `Engine.transcribe` on that file, bad files become failure records, reruns resume."""
from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from conftest import real_folder  # noqa: E402
from specwhisper import Engine, load_audio  # noqa: E402
from specwhisper.cli import main  # noqa: E402
from specwhisper.distributed import BulkJob, read_results, run_bulk  # noqa: E402
from specwhisper.samples import sample_paths  # noqa: E402

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

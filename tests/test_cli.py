"""The command line: `transcribe` (long-form, output formats) with the engine stubbed, and once on
real weights."""
from __future__ import annotations

import json

import pytest

from specwhisper import cli
from specwhisper.cli import main
from specwhisper.results import Segment, Transcription
from specwhisper.samples import sample_paths


@pytest.fixture
def stub_engine(monkeypatch):
    """Engine whose submit returns two fixed segments and records its arguments."""
    calls = []

    class StubEngine:
        def __init__(self, target, draft=None, device=None, dtype=None):
            self.n_mels = 80

        def submit(self, audio, seed=None, progress=None, timestamps=None, num_draft_tokens=None, **options):
            from concurrent.futures import Future
            from types import SimpleNamespace

            assert timestamps is True
            calls.append((SimpleNamespace(**options), seed))
            future = Future()
            future.set_result(self.transcribe_long(progress))
            return future

        def transcribe_long(self, progress):
            progress(150, 300)
            progress(300, 300)
            segs = [Segment(0, 0, 0.0, 1.5, " Hello there.", [1, 2]), Segment(1, 0, 1.5, 3.0, " Bye.", [3])]
            return Transcription(" Hello there. Bye.", [1, 2, 3], "en", segments=segs, duration=3.0)

    monkeypatch.setattr("specwhisper.Engine", StubEngine)
    return calls


def test_transcribe_writes_every_format(stub_engine, tmp_path, capsys):
    audio = sample_paths()[0]
    assert main(["transcribe", str(audio), "--target", "x", "--output-format", "all", "--output-dir",
                 str(tmp_path), "--temperature", "0,0.5", "--initial-prompt", "Hi", "--seed", "3",
                 "--no-condition-on-previous-text", "--language", "en"]) == 0
    options, seed = stub_engine[0]
    assert options.temperature == (0.0, 0.5) and options.initial_prompt == "Hi" and seed == 3
    assert not options.condition_on_previous_text and options.language == "en"
    stem = audio.stem
    assert (tmp_path / f"{stem}.txt").read_text() == " Hello there. Bye.\n"
    assert "00:00:01,500 --> 00:00:03,000\nBye." in (tmp_path / f"{stem}.srt").read_text()
    assert (tmp_path / f"{stem}.vtt").read_text().startswith("WEBVTT")
    assert json.loads((tmp_path / f"{stem}.verbose.json").read_text())["segments"][1]["start"] == 1.5
    assert json.loads((tmp_path / f"{stem}.json").read_text()) == {"text": " Hello there. Bye."}


def test_transcribe_prints_srt_and_json(stub_engine, capsys):
    audio = [str(p) for p in sample_paths()[:2]]
    assert main(["transcribe", *audio, "--target", "x", "--output-format", "srt", "--quiet"]) == 0
    assert capsys.readouterr().out.count("-->") == 4
    assert stub_engine[0][0].temperature == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # fallback by default
    assert main(["transcribe", *audio, "--target", "x", "--json", "--quiet", "--temperature", "0.3"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["file"] for r in rows] == audio and rows[0]["segments"][0]["text"] == " Hello there."
    with pytest.raises(SystemExit):
        main(["transcribe", audio[0], "--target", "x", "--temperature", "hot"])


def test_parse_temperatures():
    assert cli.parse_temperatures("0") == (0.0,)
    assert cli.parse_temperatures("0,0.2, 1") == (0.0, 0.2, 1.0)


def test_unknown_model_name_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        main(["transcribe", str(sample_paths()[0]), "--target", str(tmp_path / "missing")])


@pytest.mark.real
def test_transcribe_real(tmp_path, capsys):
    from conftest import real_folder

    audio = sample_paths()[0]
    assert main(["transcribe", str(audio), "--target", str(real_folder("base")), "--language", "en",
                 "--output-format", "verbose_json", "--quiet", "--temperature", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["language"] == "english" and out["segments"] and out["text"].strip()
    assert out["segments"][-1]["end"] <= out["duration"] + 0.02


@pytest.mark.real
def test_transcribe_real_speculative_long(tmp_path, capsys):
    """A 35 s recording through the CLI with base drafted by tiny.en: long-form, speculative,
    the same segments as target-only through the API."""
    import numpy as np

    from conftest import real_folder
    from specwhisper import Engine, load_audio

    import soundfile

    clips = [load_audio(p) for p in sample_paths() if "flite" in p.name]
    audio = np.concatenate([np.concatenate([c, np.zeros(8000, np.float32)]) for c in clips * 2])[:16000 * 35]
    path = tmp_path / "long.wav"
    soundfile.write(path, audio, 16000)
    assert main(["transcribe", str(path), "--target", str(real_folder("base")), "--draft",
                 str(real_folder("tiny.en")), "--language", "en", "--json", "--quiet", "--k", "3", "--seed", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = Engine(real_folder("base")).transcribe(load_audio(path), language="en", seed=0)
    assert [s["text"] for s in out["segments"]] == [s.text for s in want.segments]
    assert out["duration"] > 30 and out["stats"]["drafted"] > 0

"""The command line: `transcribe` (long-form, output formats) with the engine stubbed, and once on
real weights."""
from __future__ import annotations

import json

import pytest

from specwhisper.results import Segment, Transcription
from specwhisper.samples import sample_paths
from specwhisper.tools import cli
from specwhisper.tools.cli import main


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
@pytest.mark.parametrize("temperature", ["0", "0.7"])
def test_transcribe_real_with_the_bundled_draft_by_name(temperature, capsys):
    """`--target base --draft base-2l` by name: the bundled draft assembled beside base, greedy and
    sampled (seeded), the same tokens as base alone through the API."""
    from conftest import real_folder
    from specwhisper import Engine, load_audio

    real_folder("base-2l")  # fetched (CI) or skipped, never downloaded here
    audio = sample_paths()[0]
    assert main(["transcribe", str(audio), "--target", "base", "--draft", "base-2l", "--language", "en",
                 "--json", "--quiet", "--temperature", temperature, "--seed", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = Engine(real_folder("base")).transcribe(load_audio(audio), language="en", temperature=(float(temperature),),
                                                  seed=5, timestamps=True)
    assert out["tokens"] == want.tokens and out["text"] == want.text


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


WORDS = [[(" Hello", 0.0, 0.42, 0.9), (" there.", 0.42, 1.1, 0.8), (" How", 1.3, 1.5, 0.7), (" are", 1.5, 1.62, 0.9),
          (" you", 1.62, 1.8, 0.95), (" doing", 1.8, 2.3, 0.9), (" today?", 2.3, 2.9, 0.6)],
         [(" Bye", 6.2, 6.5, 0.9), (" --> ", 6.5, 6.6, 0.1), (" now.", 6.6, 7.04, 0.8)]]


@pytest.fixture
def word_engine(monkeypatch, stub_engine):
    """The stub engine, its segments carrying words when word timestamps are asked for."""
    from specwhisper.results import Word

    def transcribe_long(self, progress):
        segs = [Segment(0, 0, 0.0, 2.9, " Hello there. How are you doing today?", [1, 2]),
                Segment(1, 0, 6.2, 7.04, " Bye --> now.", [3])]
        if stub_engine[-1][0].word_timestamps:
            for segment, words in zip(segs, WORDS):
                segment.words = [Word(*w) for w in words]
        return Transcription("".join(s.text for s in segs), [1, 2, 3], "en", segments=segs, duration=7.5)

    monkeypatch.setattr("specwhisper.Engine.transcribe_long", transcribe_long)
    return stub_engine


@pytest.mark.parametrize("options", [
    [], ["--highlight-words"], ["--max-line-width", "12"], ["--max-line-width", "16", "--max-line-count", "1"],
    ["--max-words-per-line", "2", "--highlight-words"], ["--max-line-width", "10", "--max-line-count", "2",
                                                         "--highlight-words"],
])
def test_word_subtitles_equal_openai_writers(word_engine, tmp_path, options):
    """srt / vtt from words (cut by width, line count, words per line; highlighted) equal what
    openai-whisper's writers write for the same result."""
    from whisper.utils import WriteSRT, WriteVTT

    audio = sample_paths()[0]
    assert main(["transcribe", str(audio), "--target", "x", "--output-format", "all", "--output-dir", str(tmp_path),
                 "--word-timestamps", "--quiet", "--hallucination-silence-threshold", "2", *options]) == 0
    assert word_engine[-1][0].word_timestamps and word_engine[-1][0].hallucination_silence_threshold == 2.0
    verbose = json.loads((tmp_path / f"{audio.stem}.verbose.json").read_text())
    assert verbose["segments"][0]["words"][1] == {"word": " there.", "start": 0.42, "end": 1.1, "probability": 0.8}
    assert [w["word"] for w in verbose["words"]][:3] == ["Hello", "there", "How"]
    result = {"segments": verbose["segments"]}
    writer_options = {"highlight_words": "--highlight-words" in options}
    for flag in ("--max-line-width", "--max-line-count", "--max-words-per-line"):
        writer_options[flag[2:].replace("-", "_")] = int(options[options.index(flag) + 1]) if flag in options else None
    (tmp_path / "openai").mkdir()
    for writer, ext in ((WriteSRT, "srt"), (WriteVTT, "vtt")):
        writer(str(tmp_path / "openai"))(result, str(audio), **writer_options)
        assert (tmp_path / f"{audio.stem}.{ext}").read_text() == (tmp_path / "openai" / f"{audio.stem}.{ext}").read_text()


def test_segment_subtitles_equal_openai_writers(stub_engine, tmp_path):
    from whisper.utils import WriteSRT, WriteVTT

    audio = sample_paths()[0]
    assert main(["transcribe", str(audio), "--target", "x", "--output-format", "all", "--output-dir", str(tmp_path),
                 "--quiet"]) == 0
    result = {"segments": json.loads((tmp_path / f"{audio.stem}.verbose.json").read_text())["segments"]}
    assert "words" not in result["segments"][0]
    (tmp_path / "openai").mkdir()
    for writer, ext in ((WriteSRT, "srt"), (WriteVTT, "vtt")):
        writer(str(tmp_path / "openai"))(result, str(audio))
        assert (tmp_path / f"{audio.stem}.{ext}").read_text() == (tmp_path / "openai" / f"{audio.stem}.{ext}").read_text()


def test_word_options_need_word_timestamps(stub_engine):
    for option in (["--highlight-words"], ["--max-line-width", "10"], ["--hallucination-silence-threshold", "1"]):
        with pytest.raises(SystemExit):
            main(["transcribe", str(sample_paths()[0]), "--target", "x", *option])

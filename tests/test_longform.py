"""Long-form transcription: the seek loop on scripted window results, and parity with
openai-whisper's `transcribe()` on the same weights and recordings (real checkpoints)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specwhisper.config import TranscribeOptions
from specwhisper.longform.transcribe import LongformJob, compression_ratio, run_job
from specwhisper.longform.window import WindowRequest, WindowResult
from specwhisper.tokenizer import Tokenizer, split_at_timestamps

# ---------------------------------------------------------------- the seek loop, scripted


@pytest.fixture(scope="module")
def tok(multilingual):
    return Tokenizer.from_folder(multilingual, 51865)


def scripted(results):
    """A decoder answering the requests with `results` in order; the requests are kept."""
    requests = []

    def decode(request: WindowRequest) -> WindowResult:
        requests.append(request)
        tokens, avg, no_speech = results[len(requests) - 1]
        return WindowResult(list(tokens), avg * (len(tokens) + 1), avg, no_speech, request.temperature,
                            request.language)

    decode.requests = requests
    return decode


def job_for(tok, seconds: float, **options) -> LongformJob:
    mel = torch.randn(80, int(seconds * 100))
    return LongformJob(mel, tok, TranscribeOptions(language="en", **options), seed=0)


def test_whole_recording_mel_matches_openai():
    """log_mel_spectrogram(whole=True) is openai's transcribe() mel (30 s of zeros appended, one
    normalization) without the padding frames."""
    import whisper

    from specwhisper.audio import N_SAMPLES, log_mel_spectrogram

    audio = (np.random.default_rng(1).standard_normal(16000 * 33 + 77) * 0.1).astype(np.float32)
    audio[16000 * 20:] *= 0.01  # a quiet part: the floor (max - 8) matters
    ours = log_mel_spectrogram(audio, 80, whole=True)
    ref = whisper.log_mel_spectrogram(audio, 80, padding=N_SAMPLES)
    assert ours.shape == (80, len(audio) // 160) == (80, ref.shape[1] - 3000)
    torch.testing.assert_close(ours, ref[:, :ours.shape[1]], atol=1e-5, rtol=0)


def test_split_at_timestamps():
    tb = 1000
    assert split_at_timestamps([tb, 5, 6, tb + 100, tb + 100, 7, tb + 200, tb + 210, 8], tb) == ([(0, 4), (4, 7)], False)
    assert split_at_timestamps([tb, 5, tb + 50, tb + 50, 6, tb + 80], tb) == ([(0, 3), (3, 6)], True)
    assert split_at_timestamps([tb + 10, 5, 6], tb) == ([], False)
    assert split_at_timestamps([tb, 5, tb + 9], tb) == ([], True)
    assert split_at_timestamps([], tb) == ([], False)


def test_seek_by_timestamps(tok):
    """Consecutive timestamps cut segments; without a single timestamp at the end, seek goes to
    the last timestamp; a single one at the end moves a whole window; then a window whose only
    timestamp gives the segment's end."""
    tb, w = tok.timestamp_begin, tok.encode("x")[0]
    decode = scripted([
        ([tb, w, w, tb + 100, tb + 100, w, tb + 200, tb + 210, w], 0.0, 0.0),  # seek += 200 * 2
        ([tb, w, tb + 50, tb + 50, w, tb + 80], 0.0, 0.0),  # single timestamp ending: seek += 3000
        ([tb + 10, w, w], 0.0, 0.0),  # no pair: one segment, end at its last timestamp
    ])
    job = job_for(tok, 64.0, temperature=0.0)
    out = run_job(job, decode)
    assert [r.seek for r in decode.requests] == [0, 400, 3400]
    assert [(s.seek, round(s.start, 2), round(s.end, 2)) for s in out.segments] == [
        (0, 0.0, 2.0), (0, 2.0, 4.0), (400, 4.0, 5.0), (400, 5.0, 5.6), (3400, 34.0, 34.2)]
    assert out.segments[0].tokens == [tb, w, w, tb + 100] and out.segments[0].text == "xx"
    assert [s.id for s in out.segments] == list(range(5))
    assert out.duration == 64.0 and job.seek >= job.content_frames
    # previous text prompts the next window: <|startofprev|> + all tokens so far + sot sequence
    assert decode.requests[1].prompt == (tok.sot_prev, tb, w, w, tb + 100, tb + 100, w, tb + 200,
                                         *tok.sot_sequence("en", "transcribe"))
    assert out.text == tok.decode_text(out.tokens) and out.text.startswith("xx")


def test_silence_is_skipped_and_fallback_retries_hotter(tok):
    tb, w = tok.timestamp_begin, tok.encode("x")[0]
    decode = scripted([
        ([tb, w, tb + 5], -2.0, 0.9),  # silence: no_speech high and logprob low -> skipped
        ([tb, w, tb + 5], -2.0, 0.1),  # logprob too low -> retried at 0.2
        ([tb] + [w] * 60 + [tb + 20], -0.2, 0.1),  # too repetitive (compression) -> retried at 0.6
        ([tb, w, tb + 30, tb + 30, w, tb + 50], -0.3, 0.1),  # kept, at 0.6 > 0.5: prompt reset
        ([tb, w, tb + 40], -0.3, 0.1),
    ])
    job = job_for(tok, 65.0, temperature=(0.0, 0.2, 0.6))
    out = run_job(job, decode)
    reqs = decode.requests
    assert [(r.seek, r.temperature) for r in reqs] == [(0, 0.0), (3000, 0.0), (3000, 0.2), (3000, 0.6), (6000, 0.0)]
    assert reqs[2].mel is reqs[1].mel and reqs[3].mel is reqs[1].mel  # retries reuse the window
    assert len({r.seed for r in reqs[1:4]}) == 3
    assert [s.temperature for s in out.segments] == [0.6, 0.6, 0.0]
    assert reqs[4].prompt == tuple(tok.sot_sequence("en", "transcribe"))  # reset after T > 0.5
    assert compression_ratio(tok.decode_text([w] * 60).strip()) > 2.4


def test_condition_off_and_initial_prompt(tok):
    tb, w = tok.timestamp_begin, tok.encode("x")[0]
    decode = scripted([([tb, w, tb + 5], -0.1, 0.0), ([tb, w, tb + 5], -0.1, 0.0)])
    job = job_for(tok, 40.0, temperature=0.0, condition_on_previous_text=False, initial_prompt="  Names: Ada.")
    out = run_job(job, decode)
    initial = tok.encode(" Names: Ada.")
    assert decode.requests[0].prompt == (tok.sot_prev, *initial, *tok.sot_sequence("en", "transcribe"))
    assert decode.requests[1].prompt == tuple(tok.sot_sequence("en", "transcribe"))
    assert out.tokens == [tb, w, tb + 5] * 2 and "Names" not in out.text


def test_empty_segments_are_cleared_and_prompt_is_truncated(tok):
    tb, w = tok.timestamp_begin, tok.encode("x")[0]
    decode = scripted([([tb, tb + 5, tb + 5, w] + [w] * 300 + [tb + 900], -0.1, 0.0),
                       ([tb, w, tb + 5], -0.1, 0.0)])
    out = run_job(job_for(tok, 40.0, temperature=0.0), decode)
    assert out.segments[0].text == "" and out.segments[0].tokens == []  # no text: cleared
    assert len(decode.requests[1].prompt) == 1 + 223 + 3  # openai keeps the last 223 tokens


def test_job_refuses_bad_use(tok):
    with pytest.raises(ValueError, match="needs a language"):
        LongformJob(torch.zeros(80, 4000), tok, TranscribeOptions(), seed=0)
    with pytest.raises(ValueError, match="temperatures"):
        TranscribeOptions(temperature=(0.0, -1.0))
    job = job_for(tok, 40.0)
    with pytest.raises(RuntimeError, match="next_window"):
        job.record(WindowResult([], 0.0, 0.0, 0.0, 0.0, "en"))
    job.next_window()
    with pytest.raises(RuntimeError, match="record"):
        job.next_window()


def test_engine_routes_long_input(multilingual):
    """Inputs longer than 30 s run the long-form job in the engine: any length, no truncation."""
    from specwhisper import Engine

    engine = Engine(multilingual)
    torch.manual_seed(0)
    audio = (0.1 * torch.randn(16000 * 31 + 5)).numpy()
    out = engine.transcribe(audio, language="en", temperature=0.0, seed=4)
    assert out.duration == pytest.approx(31.0, abs=0.02)
    assert out.segments and all(0.0 <= s.start <= s.end for s in out.segments)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.transcribe(audio, language="en", max_new_tokens=300)
    capped = engine.transcribe(audio, language="en", temperature=0.0, seed=4, max_new_tokens=5)
    assert all(len(s.tokens) <= 5 for s in capped.segments)
    with pytest.raises(ValueError, match="timestamps=False"):
        engine.transcribe(audio, language="en", timestamps=False)


def test_reference_window_decoder_runs_a_random_model(english):
    """Greedy and sampled windows on a tiny random model: timestamp rules hold, seeds reproduce."""
    from specwhisper.engine.decoding import LoadedModel
    from specwhisper.longform.window import decode_window_reference

    model = LoadedModel.load(english, torch.device("cpu"), torch.float32)
    tok = model.tokenizer
    mel = torch.randn(80, 3000, generator=torch.Generator().manual_seed(0))
    base = WindowRequest(mel=mel, prompt=tok.sot_sequence(None, "transcribe"), max_new_tokens=24)
    greedy = decode_window_reference(model, base)
    assert greedy.tokens[0] >= tok.timestamp_begin and greedy.tokens[0] - tok.timestamp_begin <= 50
    sampled = [decode_window_reference(model, WindowRequest(**{**base.__dict__, "temperature": 1.0, "seed": s}))
               for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] and sampled[0].tokens != sampled[2].tokens
    for r in [greedy, *sampled]:
        ts = [t for t in r.tokens if t >= tok.timestamp_begin]
        assert ts == sorted(ts)
        assert r.avg_logprob == pytest.approx(r.sum_logprob / (len(r.tokens) + 1), rel=1e-6)


# ---------------------------------------------------------------- parity with openai-whisper


@pytest.fixture(scope="module")
def base_model():
    from conftest import real_folder

    from specwhisper.engine.decoding import LoadedModel

    return LoadedModel.load(real_folder("base"), torch.device("cpu"), torch.float32)


def ours(model, audio, **options):
    from specwhisper.audio import log_mel_spectrogram
    from specwhisper.longform.window import ReferenceWindowDecoder

    job = LongformJob(log_mel_spectrogram(audio, 80, whole=True), model.tokenizer,
                      TranscribeOptions(language="en", **options), seed=0)
    return run_job(job, ReferenceWindowDecoder(model))


def assert_same(out, ref):
    assert [s.text for s in out.segments] == [s["text"] for s in ref["segments"]]
    assert [(s.start, s.end) for s in out.segments] == [(s["start"], s["end"]) for s in ref["segments"]]
    assert [s.tokens for s in out.segments] == [s["tokens"] for s in ref["segments"]]
    assert [s.seek for s in out.segments] == [s["seek"] for s in ref["segments"]]
    assert out.text == ref["text"]


@pytest.mark.real
@pytest.mark.slow
def test_parity_with_openai_whisper(base_model, recording):
    """Default fallback temperatures and previous-text conditioning: identical segments and text;
    with fallback off (temperature 0.0) too, since no window needed the fallback."""
    from conftest import real_folder
    from whisper_ref import openai_transcribe

    model = base_model
    ref = openai_transcribe(real_folder("base"), recording, language="en")
    assert len(ref["segments"]) >= 8 and all(s["temperature"] == 0.0 for s in ref["segments"])
    out = ours(model, recording)
    assert_same(out, ref)
    assert [s.avg_logprob for s in out.segments] == pytest.approx([s["avg_logprob"] for s in ref["segments"]], abs=1e-3)
    assert [s.compression_ratio for s in out.segments] == [s["compression_ratio"] for s in ref["segments"]]
    assert_same(ours(model, recording, temperature=0.0), ref)


@pytest.mark.real
@pytest.mark.slow
def test_parity_without_conditioning_with_initial_prompt(base_model, recording):
    from conftest import real_folder
    from whisper_ref import openai_transcribe

    model = base_model
    prompt = "Trains, museums and frogs."
    ref = openai_transcribe(real_folder("base"), recording, language="en", temperature=0.0,
                            condition_on_previous_text=False, initial_prompt=prompt)
    out = ours(model, recording, temperature=0.0, condition_on_previous_text=False, initial_prompt=prompt)
    assert_same(out, ref)


@pytest.mark.slow
def test_fallback_really_triggers_and_reproduces(english):
    """A random model's windows have avg_logprob far below -1: every window falls back to the last
    temperature, records it, and a seed reproduces the sampled transcript (another seed does not)."""
    from specwhisper import Engine

    engine = Engine(english)
    audio = (np.random.default_rng(0).standard_normal(16000 * 4) * 0.1).astype(np.float32)
    options = TranscribeOptions(language="en", temperature=(0.0, 1.0))
    runs = [engine.transcribe_long(audio, options, seed=s) for s in (1, 1, 2)]
    assert runs[0].segments and all(s.temperature == 1.0 and s.avg_logprob < -1.0 for s in runs[0].segments)
    assert [s.to_dict() for s in runs[0].segments] == [s.to_dict() for s in runs[1].segments]
    assert runs[0].tokens != runs[2].tokens

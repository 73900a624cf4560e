"""The HTTP server, for real: uvicorn on a free loopback port in a thread, spoken to with the
official `openai` client and with httpx. Most tests serve a tiny random checkpoint with a low
per-request token cap (fast); one end-to-end test serves real base drafted by tiny.en."""
from __future__ import annotations

import io
import subprocess
import sys
import threading
import time
import wave
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from conftest import real_folder, require_real

if not require_real():  # CI installs the server extra, so a missing package fails there
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
import openai  # noqa: E402

from specwhisper import Engine, load_audio  # noqa: E402
from specwhisper.audio import decode_audio_bytes  # noqa: E402
from specwhisper.formats import language_name, render  # noqa: E402
from specwhisper.samples import sample_paths  # noqa: E402
from specwhisper.serving.server import create_app, serve_in_thread  # noqa: E402

MAX_NEW = 8  # the server's per-request cap in these tests; direct engine calls use the same
SAMPLES = sample_paths()
TIMEOUT = 120.0  # seconds, any single HTTP call


def wav_bytes(samples: np.ndarray, sr: int = 16000, channels: int = 1) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def openai_client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


def post(url: str, path: str = "/v1/audio/transcriptions", sample=SAMPLES[0], data=None, **kwargs):
    files = kwargs.pop("files", None) or {"file": (sample.name, sample.read_bytes(), "audio/wav")}
    kwargs.setdefault("timeout", TIMEOUT)
    return httpx.post(url + path, files=files, data={"model": "whisper-1", **(data or {})}, **kwargs)


def assert_openai_error(response: httpx.Response, status: int, param=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def metric(text: str, name: str, **labels) -> float:
    """A sample's value from Prometheus text (0.0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def wait_until(predicate, seconds: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds} s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def engine(multilingual):
    return Engine(multilingual)


@pytest.fixture(scope="module")
def url(engine):
    with serve_in_thread(create_app(engine, max_new_tokens=MAX_NEW, max_upload_mb=1)) as base:
        yield base


@pytest.fixture(scope="module")
def expected(engine):
    """Direct engine results for (sample, task, language), computed once each."""
    cache = {}

    def get(sample=SAMPLES[0], task="transcribe", language="en", **options):
        key = (sample.name, task, language, tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = engine.transcribe(load_audio(sample), language=language, task=task,
                                           max_new_tokens=MAX_NEW, **options)
        return cache[key]
    return get


class GatedEngine:
    """The real engine behind a gate: submitted work waits in one worker (a queue, as in the
    engine) until the test opens the gate, then goes to the engine's `submit` (any of its
    options). Counts the transcriptions that actually started."""

    def __init__(self, engine):
        self.engine, self.target, self.n_mels = engine, engine.target, engine.n_mels
        self.transcribe = engine.transcribe
        self.gate = threading.Event()
        self.started = 0
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="gated")

    def submit(self, x, **options):
        def run():
            self.started += 1
            if not self.gate.wait(60):
                raise RuntimeError("gate never opened")
            return self.engine.submit(x, **options).result()
        return self.pool.submit(run)


# ---------------------------------------------------------------- audio decoding
def test_decode_audio_bytes_equals_load_audio_and_resamples():
    for path in SAMPLES[:3]:
        np.testing.assert_array_equal(decode_audio_bytes(path.read_bytes()), load_audio(path))
    tone = np.sin(2 * np.pi * 440 * np.arange(44100) / 44100).astype(np.float32) * 0.5
    stereo = np.stack([tone, tone], axis=1).reshape(-1)  # interleaved, 1 s at 44.1 kHz
    out = decode_audio_bytes(wav_bytes(stereo, sr=44100, channels=2))
    assert out.dtype == np.float32 and out.ndim == 1 and abs(out.size - 16000) <= 64
    assert 0.3 < np.abs(out).max() < 0.6  # a 0.5 tone, downmixed and resampled


@pytest.mark.parametrize("data, match", [
    (b"", "empty"), (b"this is plain text, not audio" * 10, "not an audio file"),
    (SAMPLES[0].read_bytes()[:30], "truncated"), (SAMPLES[0].read_bytes()[:44], "no decodable audio"),
])
def test_decode_audio_bytes_refuses_bad_data(data, match):
    with pytest.raises(ValueError, match=match):
        decode_audio_bytes(data)


def test_decode_audio_bytes_stops_at_max_seconds():
    with pytest.raises(ValueError, match="longer than the limit of 1 s"):
        decode_audio_bytes(SAMPLES[0].read_bytes(), max_seconds=1.0)


# ---------------------------------------------------------------- OpenAI client, every format
def test_every_response_format_equals_the_engine(url, expected):
    client, want = openai_client(url), expected()
    for sample in SAMPLES[:2]:
        got = client.audio.transcriptions.create(file=sample.open("rb"), model="whisper-1", language="en")
        assert got.text == expected(sample).text
    assert client.audio.transcriptions.create(
        file=SAMPLES[0].open("rb"), model="whisper-1", language="en", response_format="text") == want.text + "\n"
    for fmt in ("srt", "vtt"):
        got = client.audio.transcriptions.create(file=SAMPLES[0].open("rb"), model="whisper-1", language="en",
                                                 response_format=fmt)
        assert got == render(want, fmt) and want.text in got
    verbose = client.audio.transcriptions.create(
        file=SAMPLES[0].open("rb"), model="whisper-1", language="en", response_format="verbose_json",
        timestamp_granularities=["segment"])
    assert (verbose.task, verbose.language, verbose.text) == ("transcribe", "english", want.text)
    assert verbose.duration == pytest.approx(want.duration)
    assert [s.text for s in verbose.segments] == [s.text for s in want.segments]
    assert verbose.segments[0].tokens == want.segments[0].tokens


def test_word_timestamps_through_the_openai_client(url, expected):
    """timestamp_granularities[]=word: OpenAI's top-level words, equal to the engine's word
    timestamps; segments too when both granularities are asked for, none for words alone."""
    from specwhisper.formats import to_verbose_json

    client, want = openai_client(url), expected(word_timestamps=True, temperature=0.0)
    want_words = [(w.word.strip(), w.start, w.end) for s in want.segments for w in s.words]
    assert want_words and [(w["word"], w["start"], w["end"]) for w in to_verbose_json(want)["words"]] == want_words
    words_only = client.audio.transcriptions.create(file=SAMPLES[0].open("rb"), model="whisper-1", language="en", temperature=0.0,
                                                    response_format="verbose_json", timestamp_granularities=["word"])
    assert [(w.word, w.start, w.end) for w in words_only.words] == want_words
    assert words_only.segments is None and words_only.text == want.text
    both = client.audio.transcriptions.create(file=SAMPLES[0].open("rb"), model="whisper-1", language="en", temperature=0.0,
                                              response_format="verbose_json",
                                              timestamp_granularities=["word", "segment"])
    assert [(w.word, w.start, w.end) for w in both.words] == want_words
    assert [(s.text, s.start, s.end) for s in both.segments] == [(s.text, s.start, s.end) for s in want.segments]
    segments_only = client.audio.transcriptions.create(file=SAMPLES[0].open("rb"), model="whisper-1", language="en", temperature=0.0,
                                                       response_format="verbose_json",
                                                       timestamp_granularities=["segment"])
    assert segments_only.words is None and segments_only.segments


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the SDK marks translations deprecated
def test_language_detection_and_translation_equal_the_engine(url, expected):
    client = openai_client(url)
    detected = client.audio.transcriptions.create(file=SAMPLES[1].open("rb"), model="whisper-1",
                                                  response_format="verbose_json")
    want = expected(SAMPLES[1], language=None)
    assert detected.text == want.text and detected.language == language_name(want.language)
    translated = client.audio.translations.create(file=SAMPLES[1].open("rb"), model="whisper-1")
    assert translated.text == expected(SAMPLES[1], task="translate", language=None).text
    verbose = client.audio.translations.create(file=SAMPLES[1].open("rb"), model="whisper-1",
                                               response_format="verbose_json")
    assert verbose.task == "translate"


def test_extras_reach_the_engine(url, expected):
    """top_p, seed, temperature through the openai client's extra_body: sampling is seeded, so the
    server's text equals the engine's for the same options."""
    client = openai_client(url)
    options = dict(temperature=0.8, top_p=0.9, seed=1234)
    got = client.audio.transcriptions.create(file=SAMPLES[2].open("rb"), model="whisper-1", language="en",
                                             temperature=0.8, extra_body={"top_p": 0.9, "seed": 1234})
    assert got.text == expected(SAMPLES[2], **options).text
    r = post(url, sample=SAMPLES[2], data={"language": "en", **{k: str(v) for k, v in options.items()},
                                           "num_draft_tokens": "3"})
    assert r.status_code == 200 and r.json()["text"] == got.text
    assert r.headers["openai-model"] == "multilingual"


def test_stream_sends_one_event_per_segment_then_done(url, expected):
    want = expected()
    events = list(openai_client(url).audio.transcriptions.create(
        file=SAMPLES[0].open("rb"), model="whisper-1", language="en", stream=True))
    assert [e.type for e in events] == ["transcript.text.delta"] * len(want.segments) + ["transcript.text.done"]
    assert [e.delta for e in events[:-1]] == [s.text for s in want.segments]
    assert events[-1].text == want.text
    raw = post(url, data={"language": "en", "stream": "true"})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.count("data: ") == len(events) and raw.text.endswith("\n\n")


def test_transcribe_form_takes_several_files(url, expected):
    files = [("file", (p.name, p.read_bytes(), "audio/wav")) for p in SAMPLES[:3]]
    r = httpx.post(url + "/transcribe", files=files, data={"language": "en"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == [expected(p).text for p in SAMPLES[:3]] and body["duration"] > 0


def test_sixteen_concurrent_requests_all_correct(url, expected):
    jobs = [(SAMPLES[i % len(SAMPLES)], ("json", "text", "verbose_json", "srt")[i % 4]) for i in range(16)]
    wants = {p.name: expected(p) for p, _ in jobs}
    client = openai_client(url)

    def one(job):
        sample, fmt = job
        return client.audio.transcriptions.create(file=sample.open("rb"), model="whisper-1", language="en",
                                                  response_format=fmt)
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(one, jobs, timeout=300))
    for (sample, fmt), out in zip(jobs, outs):
        want = wants[sample.name]
        if fmt in ("json", "verbose_json"):
            assert out.text == want.text, (sample.name, fmt)
        else:
            assert out == render(want, "txt" if fmt == "text" else fmt), (sample.name, fmt)
    health = httpx.get(url + "/health", timeout=TIMEOUT).json()
    assert health["in_flight"] == 0


# ---------------------------------------------------------------- bad input, then still correct
def _streamed_multipart(n_chunks: int):
    yield b'--b0undary\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
    for _ in range(n_chunks):
        yield b"\0" * 65536
    yield b"\r\n--b0undary--\r\n"


BAD_REQUESTS = {
    "empty file": (dict(files={"file": ("a.wav", b"", "audio/wav")}), 400, "file", "invalid_audio"),
    "not audio": (dict(files={"file": ("a.wav", b"GIF89a" + bytes(range(256)) * 4, "audio/wav")}),
                  400, "file", "invalid_audio"),
    "truncated header": (dict(files={"file": ("a.wav", SAMPLES[0].read_bytes()[:30], "audio/wav")}),
                         400, "file", "invalid_audio"),
    "header only": (dict(files={"file": ("a.wav", SAMPLES[0].read_bytes()[:44], "audio/wav")}),
                    400, "file", "invalid_audio"),
    "no file": (dict(files={"other": ("a.wav", b"x", "audio/wav")}), 422, "file", None),
    "unknown language": (dict(data={"language": "xx"}), 400, "language", "unsupported_language"),
    "bad temperature": (dict(data={"temperature": "5"}), 422, "temperature", None),
    "temperature not a number": (dict(data={"temperature": "warm"}), 422, "temperature", None),
    "bad top_p": (dict(data={"top_p": "0"}), 422, "top_p", None),
    "bad k": (dict(data={"num_draft_tokens": "99"}), 422, "num_draft_tokens", None),
    "negative seed": (dict(data={"seed": "-1"}), 422, "seed", None),
    "bad format": (dict(data={"response_format": "xml"}), 422, "response_format", None),
    "granularities without verbose_json": (dict(data={"timestamp_granularities[]": ["segment", "word"]}), 400,
                                           "timestamp_granularities[]", "invalid_value"),
    "granularities with stream": (dict(data={"timestamp_granularities[]": ["word"], "stream": "true",
                                             "response_format": "verbose_json"}), 400,
                                  "timestamp_granularities[]", "invalid_value"),
    "unknown granularity": (dict(data={"timestamp_granularities[]": ["sentence"], "response_format": "verbose_json"}),
                            422, None, None),
    "too large (content-length)": (dict(files={"file": ("a.wav", b"\0" * (2 << 20), "audio/wav")}),
                                   413, "file", "file_too_large"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_its_status_then_server_still_correct(url, expected, case):
    kwargs, status, param, code = BAD_REQUESTS[case]
    assert_openai_error(post(url, **kwargs), status, param, code)
    r = post(url, data={"language": "en"})
    assert r.status_code == 200 and r.json()["text"] == expected().text


def test_prompt_is_the_initial_prompt(url, engine):
    """OpenAI's `prompt` field prompts the first window (openai-whisper's initial_prompt)."""
    r = post(url, data={"language": "en", "prompt": "Hello.", "response_format": "verbose_json", "seed": "7"})
    assert r.status_code == 200, r.text
    want = engine.transcribe(load_audio(SAMPLES[0]), language="en", initial_prompt="Hello.", max_new_tokens=MAX_NEW,
                             seed=7)  # the engine's default temperatures, as the server's
    assert r.json()["text"] == want.text and [s["text"] for s in r.json()["segments"]] == [s.text for s in want.segments]


def test_chunked_upload_over_the_limit_is_413(url, expected):
    r = httpx.post(url + "/v1/audio/transcriptions", content=_streamed_multipart(40), timeout=TIMEOUT,
                   headers={"content-type": "multipart/form-data; boundary=b0undary"})
    assert "content-length" not in r.request.headers
    assert_openai_error(r, 413, "file", "file_too_large")
    assert post(url, data={"language": "en"}).json()["text"] == expected().text


def test_oversized_uploads_always_get_their_413(url, expected):
    """An early refusal reaches the client whole every time: the server reads and drops the
    refused body before it answers (closing on unread input resets the connection, and a reset
    could discard the 413 before the client read it). 30 uploads of 8 MB each way, a few seconds."""
    big = b"\0" * (8 << 20)
    for i in range(30):
        if i % 2:
            r = httpx.post(url + "/v1/audio/transcriptions", content=_streamed_multipart(128), timeout=TIMEOUT,
                           headers={"content-type": "multipart/form-data; boundary=b0undary"})
        else:
            r = post(url, files={"file": ("a.wav", big, "audio/wav")})
        assert_openai_error(r, 413, "file", "file_too_large")
    assert post(url, data={"language": "en"}).json()["text"] == expected().text


def test_openai_client_sees_typed_errors(url):
    client = openai_client(url)
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.transcriptions.create(file=("x.mp3", b"garbage" * 50), model="whisper-1")
    assert err.value.code == "invalid_audio" and err.value.param == "file"
    with pytest.raises(openai.BadRequestError, match="English-only|unknown or unsupported language"):
        client.audio.transcriptions.create(file=SAMPLES[0].open("rb"), model="whisper-1", language="tlh")


def test_engine_value_error_is_a_400(engine):
    """What the engine refuses (e.g. > 30 s before long-form decoding) is the client's error."""
    class Refusing(GatedEngine):
        def submit(self, x, **options):
            return self.pool.submit(self._refuse)

        def _refuse(self):
            raise ValueError("audio is 31.0 s long; inputs longer than 30 s need long-form decoding")

    with serve_in_thread(create_app(Refusing(engine), max_new_tokens=MAX_NEW)) as base:
        error = assert_openai_error(post(base), 400, code="invalid_request")
        assert "30 s" in error["message"]
        assert httpx.get(base + "/health", timeout=TIMEOUT).json()["in_flight"] == 0


def test_full_server_answers_429_then_recovers(engine, expected):
    gated = GatedEngine(engine)
    with serve_in_thread(create_app(gated, max_new_tokens=MAX_NEW, max_queue=2)) as base, \
            ThreadPoolExecutor(2) as pool:
        health = lambda: httpx.get(base + "/health", timeout=TIMEOUT).json()  # noqa: E731
        try:
            held = [pool.submit(post, base, data={"language": "en"}) for _ in range(2)]
            wait_until(lambda: health()["in_flight"] == 2, what="two requests in flight")
            r = post(base, data={"language": "en"})
            assert_openai_error(r, 429, code="rate_limit_exceeded")
            assert r.headers["retry-after"] == "1"
            with pytest.raises(openai.RateLimitError):
                openai_client(base).audio.transcriptions.create(file=SAMPLES[0].open("rb"), model="whisper-1")
            metrics = httpx.get(base + "/metrics", timeout=TIMEOUT).text
            assert metric(metrics, "specwhisper_in_flight_requests") == 2
            assert metric(metrics, "specwhisper_queue_depth") + metric(metrics, "specwhisper_running_batch_size") == 2
        finally:
            gated.gate.set()
        assert [f.result(TIMEOUT).json()["text"] for f in held] == [expected().text] * 2
        wait_until(lambda: health()["in_flight"] == 0, what="slots released")
        assert post(base, data={"language": "en"}).json()["text"] == expected().text


def test_client_disconnect_cancels_its_queued_request(engine, expected):
    gated = GatedEngine(engine)
    with serve_in_thread(create_app(gated, max_new_tokens=MAX_NEW, max_queue=4)) as base, \
            ThreadPoolExecutor(1) as pool:
        health = lambda: httpx.get(base + "/health", timeout=TIMEOUT).json()  # noqa: E731
        try:
            first = pool.submit(post, base, data={"language": "en"})
            wait_until(lambda: gated.started == 1, what="the first request to start")
            with pytest.raises(httpx.ReadTimeout):  # the client gives up while its request is queued
                post(base, data={"language": "en"}, timeout=httpx.Timeout(TIMEOUT, read=1.0))
            wait_until(lambda: health()["in_flight"] == 1, what="the abandoned request's slot")
        finally:
            gated.gate.set()
        assert first.result(TIMEOUT).json()["text"] == expected().text
        wait_until(lambda: health()["in_flight"] == 0, what="slots released")
        assert gated.started == 1  # the abandoned request never ran
        metrics = httpx.get(base + "/metrics", timeout=TIMEOUT).text
        assert metric(metrics, "specwhisper_requests_total", status="499") == 1


# ---------------------------------------------------------------- models, health, metrics, embedding
def test_models_health_and_metrics(url):
    models = openai_client(url).models.list()
    assert [m.id for m in models.data] == ["multilingual"]
    assert httpx.get(url + "/health", timeout=TIMEOUT).json()["status"] == "ok"
    post(url, data={"language": "en"})
    metrics = httpx.get(url + "/metrics", timeout=TIMEOUT)
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    for name in ('specwhisper_requests_total{path="/v1/audio/transcriptions",status="200"}',
                 "specwhisper_generated_tokens_total", "specwhisper_queue_depth", "specwhisper_running_batch_size",
                 "specwhisper_request_seconds_bucket", "specwhisper_engine_seconds_count",
                 "specwhisper_draft_tokens_total"):
        assert name in text, name
    assert metric(text, "specwhisper_generated_tokens_total") >= 1
    assert metric(text, "specwhisper_audio_seconds_total") > 0
    assert_openai_error(httpx.get(url + "/nope", timeout=TIMEOUT), 404)
    assert_openai_error(httpx.get(url + "/v1/audio/transcriptions", timeout=TIMEOUT), 405)


def test_mounted_in_another_app_with_its_own_metrics(engine, expected):
    from fastapi import FastAPI

    outer = FastAPI()
    outer.mount("/asr", create_app(engine, max_new_tokens=MAX_NEW, model_name="inner"))
    second = create_app(engine, max_new_tokens=MAX_NEW)  # another registry in the same process

    @outer.get("/direct")
    def direct():
        return {"text": engine.transcribe(load_audio(SAMPLES[0]), language="en", max_new_tokens=MAX_NEW).text}

    with serve_in_thread(outer) as base:
        r = post(base, path="/asr/v1/audio/transcriptions", data={"language": "en"})
        assert r.status_code == 200 and r.json()["text"] == expected().text
        assert httpx.get(base + "/direct", timeout=TIMEOUT).json()["text"] == expected().text
        metrics = httpx.get(base + "/asr/metrics", timeout=TIMEOUT).text
        assert metric(metrics, "specwhisper_requests_total", path="/v1/audio/transcriptions", status="200") == 1
    assert b"specwhisper_requests_total{" not in second.state.metrics.render()


@pytest.mark.slow
def test_serve_command_starts_a_server(multilingual):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "specwhisper.tools.cli", "serve", "--target", str(multilingual),
                             "--port", str(port), "--max-new-tokens", str(MAX_NEW), "--log-level", "warning",
                             "--max-audio-seconds", "20", "--read-timeout", "30"])
    try:
        base = f"http://127.0.0.1:{port}"

        def up():
            assert proc.poll() is None, "the server exited"
            try:
                return httpx.get(base + "/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False
        wait_until(up, seconds=120, what="specwhisper serve to answer")
        assert post(base, data={"language": "en"}).status_code == 200
        long = {"file": ("long.wav", wav_bytes(np.zeros(16000 * 25, np.float32)), "audio/wav")}
        assert "limit of 20 s" in assert_openai_error(post(base, files=long), 400, "file", "invalid_audio")["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---------------------------------------------------------------- real weights, speculative
@pytest.mark.real
@pytest.mark.slow
def test_real_base_with_tiny_en_draft_matches_the_engine():
    engine = Engine(real_folder("base"), real_folder("tiny.en"))
    sample = SAMPLES[0]
    want = engine.transcribe(load_audio(sample), language="en", num_draft_tokens=3)
    with serve_in_thread(create_app(engine)) as base:
        client = openai_client(base)
        got = client.audio.transcriptions.create(file=sample.open("rb"), model="whisper-1", language="en",
                                                 response_format="verbose_json",
                                                 extra_body={"num_draft_tokens": 3})
        assert got.text == want.text and got.language == "english" and len(want.text) > 10
        metrics = httpx.get(base + "/metrics", timeout=TIMEOUT).text
        assert metric(metrics, "specwhisper_draft_tokens_total") > 0


def test_long_audio_streams_its_segments_and_matches_the_engine(multilingual):
    """A 40 s upload: long-form through the server, every response format equal to the engine's
    long-form result, and stream=true sends its segments as delta events (as windows finish)."""
    engine = Engine(multilingual)
    clips = [load_audio(p) for p in SAMPLES]
    audio = np.concatenate([np.concatenate([c, np.zeros(8000, np.float32)]) for c in clips * 3])[:16000 * 40]
    body = wav_bytes(audio)
    want = engine.transcribe(decode_audio_bytes(body), language="en", temperature=0.0)
    assert want.duration > 30 and want.segments
    with serve_in_thread(create_app(engine, max_upload_mb=5)) as base:
        files = {"file": ("long.wav", body, "audio/wav")}
        data = {"model": "whisper-1", "language": "en", "temperature": "0"}
        r = httpx.post(base + "/v1/audio/transcriptions", files=files,
                       data={**data, "response_format": "verbose_json"}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["text"] == want.text and [s["text"] for s in got["segments"]] == [s.text for s in want.segments]
        assert got["duration"] == pytest.approx(want.duration)
        events = list(openai_client(base).audio.transcriptions.create(
            file=("long.wav", body), model="whisper-1", language="en", temperature=0.0, stream=True))
        assert [e.type for e in events] == ["transcript.text.delta"] * len(want.segments) + ["transcript.text.done"]
        assert [e.delta for e in events[:-1]] == [s.text for s in want.segments]
        assert events[-1].text == want.text

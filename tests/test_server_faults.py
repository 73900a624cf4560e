"""The HTTP server under faults (issue #28's probe, kept as tests): what OpenAI's API refuses is
refused in its error shape (two files, audio under 0.1 s), over-long audio is refused from its
container's metadata before decoding, silence gives no text, unset fields take the engine's
defaults, slow senders get 408, every response content type is documented, and the server's RSS
returns to its warmed-up level after a sequence of bad, oversized, overloading, abandoned and
slow requests. Loopback only; a tiny random checkpoint; every case bounded in time."""
from __future__ import annotations

import io
import socket
import time
import wave
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
soundfile = pytest.importorskip("soundfile")  # absent on GPU images with their own packages
from conftest import require_real

if not require_real():  # CI installs the server extra, so a missing package fails there
    pytest.importorskip("fastapi")
from specwhisper import Engine  # noqa: E402
from specwhisper.samples import sample_paths  # noqa: E402
from specwhisper.serving.server import create_app, serve_in_thread  # noqa: E402

TIMEOUT = 60.0
SAMPLE = sample_paths()[0]


def wav_bytes(samples: np.ndarray, sr: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def silent_flac(seconds: float, sr: int = 8000) -> bytes:
    """`seconds` of digital silence as FLAC, written a minute at a time (a 2-hour file is ~180 KB)."""
    buf = io.BytesIO()
    minute = np.zeros(sr * 60, np.int16)
    with soundfile.SoundFile(buf, "w", samplerate=sr, channels=1, format="FLAC") as f:
        left = int(seconds * sr)
        while left > 0:
            f.write(minute[:left])
            left -= minute.size
    return buf.getvalue()


def post(url, body: bytes, name="a.wav", data=None, files=None, timeout=TIMEOUT, path="/v1/audio/transcriptions"):
    files = files or {"file": (name, body, "application/octet-stream")}
    return httpx.post(url + path, files=files, data={"model": "whisper-1", **(data or {})}, timeout=timeout)


def error_of(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if code is not None:
        assert error["code"] == code, error
    return error


def in_flight(url) -> int:
    return httpx.get(url + "/health", timeout=TIMEOUT).json()["in_flight"]


class SpyEngine:
    """The engine, with the keywords of every `submit` recorded."""

    def __init__(self, engine):
        self.engine, self.target, self.n_mels, self.transcribe = engine, engine.target, engine.n_mels, engine.transcribe
        self.calls = []

    def submit(self, x, **options):
        self.calls.append(options)
        return self.engine.submit(x, **options)


@pytest.fixture(scope="module")
def engine(multilingual):
    return SpyEngine(Engine(multilingual))


@pytest.fixture(scope="module")
def url(engine):
    app = create_app(engine, max_queue=4, max_upload_mb=2, max_new_tokens=4, max_audio_seconds=7200, read_timeout=2)
    with serve_in_thread(app) as base:
        yield base


@pytest.fixture(scope="module")
def two_hours():
    return silent_flac(7300)


# ---------------------------------------------------------------- what OpenAI refuses
def test_two_files_in_one_request_are_refused(url):
    body = SAMPLE.read_bytes()
    files = [("file", ("a.wav", body, "audio/wav")), ("file", ("b.wav", body, "audio/wav"))]
    error = error_of(post(url, b"", files=files), 400, "invalid_value")
    assert error["param"] == "file" and "one audio file" in error["message"]


def test_audio_shorter_than_a_tenth_of_a_second_is_refused(url):
    tiny = wav_bytes(np.full(8, 0.1, np.float32))
    assert len(tiny) == 60
    error = error_of(post(url, tiny), 400, "audio_too_short")
    assert "0.1 s" in error["message"] and error["param"] == "file"
    assert in_flight(url) == 0


def test_over_long_audio_is_refused_from_its_metadata(url, two_hours):
    """A 2-hour FLAC (~180 KB) over the 7200 s limit: 400 at once, without decoding it."""
    start = time.perf_counter()
    error = error_of(post(url, two_hours, "long.flac"), 400, "invalid_audio")
    assert time.perf_counter() - start < 2.0
    assert "7300.0 s long" in error["message"] and "7200" in error["message"]


def test_the_audio_limit_is_settable(engine):
    with serve_in_thread(create_app(engine, max_audio_seconds=60)) as base:
        start = time.perf_counter()
        error = error_of(post(base, silent_flac(61), "a.flac"), 400, "invalid_audio")
        assert "limit of 60 s" in error["message"] and time.perf_counter() - start < 2.0


# ---------------------------------------------------------------- streaming decode
def test_decode_grows_past_a_short_declared_duration_and_stops_at_the_limit_without_one(monkeypatch):
    """The buffer sized from the declared duration grows when the file holds more (same samples
    as an honest file), and a file declaring no duration is cut off at the limit while decoding."""
    from specwhisper import audio

    body = SAMPLE.read_bytes()
    honest = audio.decode_audio_bytes(body)
    monkeypatch.setattr(audio, "declared_seconds", lambda container, stream: 0.2)
    np.testing.assert_array_equal(audio.decode_audio_bytes(body), honest)
    monkeypatch.setattr(audio, "declared_seconds", lambda container, stream: None)
    np.testing.assert_array_equal(audio.decode_audio_bytes(body), honest)
    with pytest.raises(ValueError, match="longer than the limit of 1 s"):
        audio.decode_audio_bytes(body, max_seconds=1.0)
    with pytest.raises(ValueError, match="channels"):
        monkeypatch.setattr(audio, "MAX_CHANNELS", 0)
        audio.decode_audio_bytes(body)


# ---------------------------------------------------------------- silence, defaults
def test_silence_gives_no_text(url, engine):
    """A tenth of a second of silence without a language, and 10 minutes of it: empty text, no
    language guessed (a random model would otherwise write tokens for both)."""
    short = post(url, wav_bytes(np.zeros(1600, np.float32)), data={"response_format": "verbose_json"})
    assert short.status_code == 200, short.text
    assert short.json()["text"] == "" and short.json()["language"] is None and short.json()["segments"] == []
    assert engine.engine.transcribe(np.full(16000, 0.05, np.float32) * np.sin(np.arange(16000)), language="en",
                                    max_new_tokens=4).tokens  # sound, unlike silence, is decoded
    flac = silent_flac(600, sr=16000)
    start = time.perf_counter()
    long = post(url, flac, "silence.flac", data={"response_format": "verbose_json"})
    assert long.status_code == 200, long.text
    assert long.json()["text"] == "" and long.json()["segments"] == [] and long.json()["duration"] == 600.0
    assert time.perf_counter() - start < 30.0  # nothing decoded: the log-mel of 10 minutes only


def test_unset_fields_take_the_engines_defaults(url, engine):
    engine.calls.clear()
    assert post(url, SAMPLE.read_bytes(), data={"language": "en"}).status_code == 200
    assert post(url, SAMPLE.read_bytes(), data={"language": "en", "temperature": "0.4"}).status_code == 200
    unset, given = engine.calls
    assert unset["temperature"] is None  # the engine's default: 0, or openai's fallback list for long audio
    assert given["temperature"] == 0.4


# ---------------------------------------------------------------- slow clients, documentation
def test_slow_sender_gets_408_and_frees_nothing(url):
    host, port = url.removeprefix("http://").split(":")
    body = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n' + b"\0" * 1000
    head = (f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: {host}\r\nContent-Type: multipart/form-data; "
            f"boundary=b\r\nContent-Length: {len(body) + 100000}\r\n\r\n").encode()
    start = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(head + body)  # then nothing more: a stalled upload
        reply = b""
        while b"request_timeout" not in reply:  # the headers and the body may come in two reads
            part = s.recv(65536)
            if not part:
                break
            reply += part
        reply = reply.decode(errors="replace")
    assert reply.startswith("HTTP/1.1 408"), reply[:200]
    assert '"request_timeout"' in reply and 1.5 < time.perf_counter() - start < 10.0
    assert in_flight(url) == 0


def test_every_response_content_type_is_documented(url):
    doc = httpx.get(url + "/openapi.json", timeout=TIMEOUT).json()
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/plain", "text/event-stream"}
        assert "408" in doc["paths"][path]["post"]["responses"]
    r = post(url, SAMPLE.read_bytes(), data={"language": "en", "stream": "true"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")


# ---------------------------------------------------------------- memory after faults
def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def fault_phases(base: str, two_hours: bytes, minutes: bytes) -> None:
    """One round of the probe's fault phases: bad uploads, an over-long file, a long silent one,
    an oversized body, overload (429s), clients that give up mid-request, a stalled sender."""
    speech = SAMPLE.read_bytes()
    for body in (b"", b"garbage" * 200, speech[:44], speech[:30], two_hours):
        assert post(base, body).status_code == 400
    assert post(base, minutes, "silence.flac").status_code == 200
    assert post(base, b"\0" * (3 << 20)).status_code == 413
    with ThreadPoolExecutor(6) as pool:
        statuses = list(pool.map(lambda _: post(base, speech, data={"language": "en"}).status_code, range(6)))
    assert set(statuses) <= {200, 429} and 200 in statuses
    for _ in range(3):  # clients that give up mid-request (a quick machine may answer first: fine)
        try:
            post(base, speech, data={"language": "en"}, timeout=httpx.Timeout(TIMEOUT, read=0.01))
        except httpx.ReadTimeout:
            pass
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
                  b"boundary=b\r\nContent-Length: 100000\r\n\r\n--b\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 408")


def settled_rss(base: str) -> float:
    deadline = time.monotonic() + 60
    while in_flight(base) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # the idle trim runs in its own thread
    return rss_mb()


def test_rss_returns_to_the_warmed_up_level_after_faults(engine, two_hours):
    minutes = silent_flac(180, sr=16000)
    app = create_app(engine, max_queue=4, max_upload_mb=2, max_new_tokens=4, read_timeout=1)
    with serve_in_thread(app) as base:
        fault_phases(base, two_hours, minutes)  # warm-up: allocator pools, threads, caches
        warm = settled_rss(base)
        after = []
        for _ in range(2):
            fault_phases(base, two_hours, minutes)
            after.append(settled_rss(base))
        print(f"RSS warmed up {warm:.0f} MB, after fault rounds {[round(a) for a in after]} MB")
        assert max(after) - warm <= 100, (warm, after)
        assert app.state.service.trimmer.trims > 0

"""OpenAI-compatible HTTP API over an `Engine`: `create_app(engine) -> FastAPI`.

Routes: `POST /v1/audio/transcriptions`, `POST /v1/audio/translations` (OpenAI's multipart fields,
plus `top_p`, `seed`, `num_draft_tokens`, `stream`), `GET /v1/models`, `GET /health`, `GET /metrics`
(Prometheus), and the simple `POST /transcribe` (one or more `file` fields -> texts).

A request's life: the guard middleware refuses bodies over the upload limit (413) and, when the
server is full, audio requests before their upload is read (429); the form is validated (OpenAI
error shape, 400/422; one `file` only, as OpenAI takes one); the upload is refused from its
container's declared duration when it is over the limit, else decoded by PyAV, streaming, in one
of two audio threads (at least 0.1 s of audio, as OpenAI requires); the waveform goes to
`engine.submit`, whose scheduler batches concurrent requests; the handler awaits the Future while
watching the connection, and cancels a request whose client left (a queued one never runs, a
long-form one is not admitted again). When no request is left in flight, freed heap memory goes
back to the OS (`memory_release`). Unset decoding fields take the engine's defaults (temperature:
openai's fallback list for long audio). The server only calls the engine's public API, so it
embeds anywhere an Engine does.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from fastapi import Depends, FastAPI, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .. import __version__
from .admission import Admission, UploadGuard
from .api_errors import ApiError, error_responses, install_error_handlers
from ..audio import SAMPLE_RATE, decode_audio_bytes
from ..formats import render, to_verbose_json
from .memory_release import IdleTrimmer
from .server_metrics import ServerMetrics

log = logging.getLogger("specwhisper.server")

ResponseFormat = Literal["json", "text", "srt", "vtt", "verbose_json"]
AUDIO_ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations", "/transcribe")
ROUTES = (*AUDIO_ROUTES, "/v1/models", "/health", "/metrics", "/openapi.json", "/docs")
MAX_SEED = 2**63 - 1
MIN_AUDIO_SECONDS = 0.1  # OpenAI's minimum; shorter uploads get 400 audio_too_short
AUDIO_THREADS = 2  # threads decoding uploads (few threads: few glibc arenas hold their garbage)
TEMPERATURE_DEFAULT = ("unset: the engine's default, 0 for audio up to 30 s; longer audio (or a prompt) falls "
                       "back through 0, 0.2, ..., 1 as openai-whisper's transcribe()")


@dataclass(frozen=True)
class ServerOptions:
    max_queue: int = 64  # admitted requests (audio decoding, queued, decoding); more get 429
    max_upload_mb: float = 25.0  # request body limit in MB (OpenAI's file limit); larger gets 413
    model_name: str = "specwhisper"  # the model /v1/models lists and responses echo (`openai-model`)
    max_new_tokens: int | None = None  # per-request token cap passed to the engine (None: its default)
    max_audio_seconds: float = 7200.0  # longest audio decoded; a small compressed file can expand a lot
    read_timeout: float | None = 60.0  # seconds for a request's whole body to arrive; later gets 408

    def __post_init__(self):
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if not self.max_upload_mb > 0:
            raise ValueError(f"max_upload_mb must be > 0, got {self.max_upload_mb}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 or None, got {self.max_new_tokens}")
        if not self.max_audio_seconds > 0:
            raise ValueError(f"max_audio_seconds must be > 0, got {self.max_audio_seconds}")
        if self.read_timeout is not None and not self.read_timeout > 0:
            raise ValueError(f"read_timeout must be > 0 or None, got {self.read_timeout}")

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)


@dataclass
class CommonFields:
    """Form fields shared by transcriptions and translations."""

    file: UploadFile
    model: str | None
    prompt: str | None
    response_format: str
    temperature: float | None
    top_p: float
    seed: int | None
    num_draft_tokens: int | None
    stream: bool


def common_fields(
    file: Annotated[UploadFile, File(description="audio in any format FFmpeg decodes (wav, mp3, flac, m4a, ...)")],
    model: Annotated[str | None, Form(description="accepted and ignored: the served model answers")] = None,
    prompt: Annotated[str | None, Form(description="text the first window is conditioned on (openai-whisper's "
                                                   "initial_prompt; decodes long-form)")] = None,
    response_format: Annotated[ResponseFormat, Form()] = "json",
    temperature: Annotated[float | None, Form(ge=0.0, le=1.0, description=TEMPERATURE_DEFAULT)] = None,
    top_p: Annotated[float, Form(gt=0.0, le=1.0, description="nucleus mass when sampling (extension)")] = 1.0,
    seed: Annotated[int | None, Form(ge=0, le=MAX_SEED, description="sampling seed (extension)")] = None,
    num_draft_tokens: Annotated[int | None, Form(ge=1, le=16, description="draft tokens per verify pass; "
                                                 "unset: adaptive (extension)")] = None,
    stream: Annotated[bool, Form(description="server-sent events: transcript.text.delta per finished segment, "
                                             "then transcript.text.done")] = False,
) -> CommonFields:
    return CommonFields(file, model, prompt, response_format, temperature, top_p, seed, num_draft_tokens, stream)


class TranscriptionService:
    """What the routes do, over one engine: validate, admit, decode audio, submit, wait, render."""

    def __init__(self, engine, options: ServerOptions):
        self.engine = engine
        self.options = options
        self.trimmer = IdleTrimmer()
        self.admission = Admission(options.max_queue, on_idle=self.trimmer.poke)
        self.audio_threads = ThreadPoolExecutor(AUDIO_THREADS, thread_name_prefix="specwhisper-audio")
        self.metrics = ServerMetrics(lambda: self.admission.count, self.admission.waiting, self.admission.running)
        self.created = int(time.time())

    # ------------------------------------------------------------ validation
    def decode_options(self, fields: CommonFields | None, task: str, language: str | None) -> dict:
        tokenizer = self.engine.target.tokenizer
        if task == "translate" and not tokenizer.multilingual:
            raise ApiError(400, f"{self.options.model_name} is English-only and cannot translate",
                           code="unsupported_task")
        if language is not None and language.strip():
            code = language.strip().lower()
            known = tokenizer.languages if tokenizer.multilingual else {"en": None}
            if code not in known:
                raise ApiError(400, f"unknown or unsupported language {language!r}; {self.options.model_name} "
                               f"knows: {', '.join(known)}", param="language", code="unsupported_language")
            language = code
        else:
            language = None
        options = dict(language=language, task=task, max_new_tokens=self.options.max_new_tokens)
        if fields is not None:
            options.update(temperature=fields.temperature, top_p=fields.top_p, seed=fields.seed,
                           num_draft_tokens=fields.num_draft_tokens)
            if fields.prompt:
                options["initial_prompt"] = fields.prompt
        return options

    # ------------------------------------------------------------ the work
    async def read_audio(self, upload: UploadFile, param: str = "file"):
        """The upload's samples, decoded from its spooled file (never copied whole into memory)
        in an audio thread; ApiError 400 for what cannot be decoded or is too short."""
        name = upload.filename or param
        loop = asyncio.get_running_loop()
        try:
            audio = await loop.run_in_executor(self.audio_threads, functools.partial(
                decode_audio_bytes, upload.file, max_seconds=self.options.max_audio_seconds))
        except ValueError as exc:
            raise ApiError(400, f"{name}: {exc}", param=param, code="invalid_audio") from None
        except Exception as exc:  # whatever FFmpeg trips on in hostile input is the input's fault
            log.warning("audio decode failed for %s: %r", name, exc)
            raise ApiError(400, f"{name}: could not decode the audio ({type(exc).__name__})", param=param,
                           code="invalid_audio") from None
        finally:
            await upload.close()
        if audio.size < MIN_AUDIO_SECONDS * SAMPLE_RATE:
            raise ApiError(400, f"{name}: the audio is too short ({audio.size / SAMPLE_RATE:.3f} s); the minimum "
                           f"audio length is {MIN_AUDIO_SECONDS} s", param=param, code="audio_too_short")
        return audio

    async def submit(self, audio, options: dict) -> Future:
        """`engine.submit` in a worker thread (it may compute the log-mel before queueing); the
        caller's admission slot is then held until the Future is done."""
        try:
            future = await run_in_threadpool(self.engine.submit, audio, **options)
        except ValueError as exc:
            self.admission.release()
            raise ApiError(400, str(exc), code="invalid_request") from None
        except BaseException:
            self.admission.release()
            raise
        self.admission.hold_until_done(future)
        future.add_done_callback(self._observe)
        return future

    def _observe(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is None:
            try:
                self.metrics.observe_result(future.result())
            except Exception:  # metrics never fail a request
                log.exception("metrics update failed")

    async def wait(self, request: Request, futures: list[Future]) -> list:
        """The Futures' results, or ApiError: 400 for the engine's ValueErrors, 499 (and the
        queued ones cancelled) when the client disconnects first."""
        waiters = [asyncio.wrap_future(f) for f in futures]
        gone = asyncio.ensure_future(_wait_for_disconnect(request.receive))
        pending = set(waiters)
        try:
            while pending and not gone.done():  # at most len(futures) + 1 rounds
                done, _ = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
                pending -= done
        finally:
            gone.cancel()
            if pending:
                for f in futures:
                    f.cancel()  # a queued request never runs; a running one is abandoned if the engine can
                for w in pending:
                    w.add_done_callback(_discard_outcome)
        if pending:
            raise ApiError(499, "the client closed the request", code="client_disconnected")
        results = []
        for w in waiters:
            if w.cancelled():
                raise ApiError(503, "the transcription was cancelled", code="cancelled")
            exc = w.exception()
            if isinstance(exc, (asyncio.CancelledError, CancelledError)):  # the engine gave it up
                raise ApiError(503, "the transcription was cancelled", code="cancelled")
            if isinstance(exc, ValueError):
                raise ApiError(400, str(exc), code="invalid_request")
            if exc is not None:
                raise exc
            results.append(w.result())
        return results

    async def transcribe(self, request: Request, fields: CommonFields, task: str, language: str | None,
                         granularities: list[str] | None = None):
        """`granularities`: OpenAI's timestamp_granularities[] (verbose_json only); "word" runs
        word timestamps."""
        if len((await request.form()).getlist("file")) > 1:  # the parsed form, cached by the request
            raise ApiError(400, "send one audio file per request (several `file` fields were sent); "
                           "POST /transcribe takes several", param="file", code="invalid_value")
        options = self.decode_options(fields, task, language)
        if granularities and "word" in granularities:
            options["word_timestamps"] = True
        if not self.admission.try_acquire():
            raise self.admission.busy_error()
        try:
            audio = await self.read_audio(fields.file)
        except BaseException:
            self.admission.release()
            raise
        if fields.stream:
            # segments go out as their windows finish (long-form), the rest with the result
            loop, queue = asyncio.get_running_loop(), asyncio.Queue()
            options["on_segment"] = lambda segment: loop.call_soon_threadsafe(queue.put_nowait, segment)
            future = await self.submit(audio, options)
            return StreamingResponse(_sse_live(queue, future, task), media_type="text/event-stream",
                                     headers={"openai-model": self.options.model_name, "Cache-Control": "no-cache"})
        [result] = await self.wait(request, [await self.submit(audio, options)])
        return self.respond(result, fields, task, granularities)

    # ------------------------------------------------------------ responses
    def respond(self, result, fields: CommonFields, task: str, granularities: list[str] | None = None) -> Response:
        headers = {"openai-model": self.options.model_name}
        fmt = fields.response_format
        if fmt == "json":
            return JSONResponse({"text": result.text}, headers=headers)
        if fmt == "verbose_json":
            # OpenAI's granularities: segments unless only words were asked for, words when asked for
            segments = not granularities or "segment" in granularities
            words = bool(granularities) and "word" in granularities
            return JSONResponse(to_verbose_json(result, task, segments=segments, words=words), headers=headers)
        return PlainTextResponse(render(result, "txt" if fmt == "text" else fmt, task), headers=headers)


# What a transcription route's 200 can be: JSON (json, verbose_json), plain text (text, srt, vtt)
# or server-sent events (stream=true); documented so clients and schema fuzzers know all three.
TRANSCRIPTION_CONTENT = {"description": "the transcription: JSON (json, verbose_json), text (text, srt, vtt) "
                                        "or server-sent events (stream=true)",
                         "content": {"application/json": {"schema": {"type": "object"}},
                                     "text/plain": {"schema": {"type": "string"}},
                                     "text/event-stream": {"schema": {"type": "string"}}}}


def _sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _sse_live(queue: asyncio.Queue, future: Future, task: str):
    """`transcript.text.delta` per segment as the engine keeps it, then the segments the result
    adds (a short window's one segment) and `transcript.text.done`; an `error` event if the
    decode fails. A client that goes away cancels the request."""
    waiter = asyncio.wrap_future(future)
    sent = 0
    try:
        while True:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                break
            segment = getter.result()
            sent += 1
            yield _sse_event({"type": "transcript.text.delta", "delta": segment.text, "segment": segment.to_dict()})
        while not queue.empty():
            segment = queue.get_nowait()
            sent += 1
            yield _sse_event({"type": "transcript.text.delta", "delta": segment.text, "segment": segment.to_dict()})
        exc = None if waiter.cancelled() else waiter.exception()
        if waiter.cancelled() or exc is not None:
            message = "the transcription was cancelled" if exc is None or isinstance(exc, CancelledError) else str(exc)
            yield _sse_event({"type": "error", "error": {"message": message, "type": "server_error",
                                                         "param": None, "code": "decode_failed"}})
            return
        result = waiter.result()
        events = list(_sse_events(result, task))
        for event in events[sent:]:
            yield event
    finally:
        if not future.done():
            future.cancel()


def _sse_events(result, task: str):
    """OpenAI's streaming transcription events: `transcript.text.delta` per finished segment
    (with the segment itself), then `transcript.text.done` with the whole text."""
    for segment in result.segments:
        event = {"type": "transcript.text.delta", "delta": segment.text, "segment": segment.to_dict()}
        yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
    done = {"type": "transcript.text.done", "text": result.text, "task": task,
            "language": to_verbose_json(result, task)["language"], "duration": result.duration}
    yield f"data: {json.dumps(done, ensure_ascii=False)}\n\n"


async def _wait_for_disconnect(receive) -> None:
    """Returns when the client disconnects. Called once the body is read, so only
    `http.disconnect` (or, from some servers, trailing empty body messages) can arrive."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.01)  # never a busy loop, whatever the ASGI server hands back


def _discard_outcome(waiter: asyncio.Future) -> None:
    if not waiter.cancelled():
        waiter.exception()  # retrieved, so asyncio does not log "exception never retrieved"


def create_app(engine, *, max_queue: int = 64, max_upload_mb: float = 25.0, model_name: str | None = None,
               max_new_tokens: int | None = None, max_audio_seconds: float = 7200.0,
               read_timeout: float | None = 60.0) -> FastAPI:
    """The ASGI app serving `engine` (see the module docstring). Mount it in another FastAPI or
    Starlette app (`outer.mount("/asr", create_app(engine))`) or run it with uvicorn. The app owns
    no engine resources; `app.state.engine` and `app.state.metrics` give them back."""
    if model_name is None:
        model_name = Path(str(getattr(getattr(engine, "target", None), "path", "specwhisper"))).name
    options = ServerOptions(max_queue, max_upload_mb, model_name, max_new_tokens, max_audio_seconds, read_timeout)
    service = TranscriptionService(engine, options)
    app = FastAPI(title="specwhisper", version=__version__,
                  description="OpenAI-compatible speech-to-text over an exact speculative Whisper engine")
    app.state.engine, app.state.metrics, app.state.service = engine, service.metrics, service
    install_error_handlers(app)
    app.add_middleware(UploadGuard, admission=service.admission, metrics=service.metrics,
                       max_upload_bytes=options.max_upload_bytes, audio_routes=AUDIO_ROUTES, known_routes=ROUTES,
                       read_timeout=options.read_timeout)
    errors = error_responses(400, 408, 413, 422, 429)
    openai_responses = {**errors, 200: TRANSCRIPTION_CONTENT}

    @app.post("/v1/audio/transcriptions", responses=openai_responses, summary="Transcribe audio (OpenAI-compatible)")
    async def transcriptions(
        request: Request,
        fields: Annotated[CommonFields, Depends(common_fields)],
        language: Annotated[str | None, Form(description="ISO-639-1 code; unset: detected")] = None,
        timestamp_granularities: Annotated[list[Literal["segment", "word"]] | None,
                                           Form(alias="timestamp_granularities[]")] = None,
    ):
        if timestamp_granularities:
            if fields.response_format != "verbose_json":
                raise ApiError(400, "`response_format` must be `verbose_json` if `timestamp_granularities[]` is provided",
                               param="timestamp_granularities[]", code="invalid_value")
            if fields.stream:
                raise ApiError(400, "`timestamp_granularities[]` is not supported with `stream`",
                               param="timestamp_granularities[]", code="invalid_value")
        return await service.transcribe(request, fields, "transcribe", language, timestamp_granularities)

    @app.post("/v1/audio/translations", responses=openai_responses, summary="Translate audio to English text")
    async def translations(request: Request, fields: Annotated[CommonFields, Depends(common_fields)]):
        return await service.transcribe(request, fields, "translate", None)

    @app.post("/transcribe", responses=errors, summary="Transcribe one or more files: {text: [...], duration}")
    async def transcribe_files(
        request: Request,
        file: Annotated[list[UploadFile], File(description="one or more audio files")],
        language: Annotated[str | None, Form(description="ISO-639-1 code; unset: detected")] = None,
    ):
        started = time.perf_counter()
        if not 1 <= len(file) <= options.max_queue:
            raise ApiError(400, f"send 1..{options.max_queue} files, got {len(file)}", param="file")
        decode_options = service.decode_options(None, "transcribe", language)
        if not service.admission.try_acquire(len(file)):
            raise service.admission.busy_error()
        try:
            audios = await asyncio.gather(*(service.read_audio(f, f"file[{i}]") for i, f in enumerate(file)))
        except BaseException:
            service.admission.release(len(file))
            raise
        futures = []
        for i, audio in enumerate(audios):
            try:
                futures.append(await service.submit(audio, decode_options))
            except BaseException:
                service.admission.release(len(file) - i - 1)  # submit released this file's own slot
                for f in futures:
                    f.cancel()
                raise
        results = await service.wait(request, futures)
        return {"text": [r.text for r in results], "duration": time.perf_counter() - started}

    @app.get("/v1/models", summary="The served model")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": service.created,
                                            "owned_by": "specwhisper"}]}

    @app.get("/health", summary="Liveness and load")
    async def health():
        return {"status": "ok", "model": model_name, "in_flight": service.admission.count,
                "max_queue": options.max_queue}

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def metrics():
        return Response(service.metrics.render(), media_type=service.metrics.content_type)

    return app


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 30.0):
    """Run `app` with uvicorn in a background thread -> its base URL ("http://127.0.0.1:PORT");
    port 0 picks a free port. Stops the server on exit (tests, benchmarks, notebooks)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name="specwhisper-uvicorn")
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {host}:{sock.getsockname()[1]}")
            time.sleep(0.02)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()

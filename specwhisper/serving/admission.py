"""Load and size limits of the HTTP server: `Admission` bounds the requests in flight (429 past
it), `UploadGuard` is the outermost ASGI layer (413 for oversized bodies, an early 429 before an
upload is read, 408 for a body that does not arrive within the read timeout, request metrics by
route and status)."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

from .api_errors import ApiError, error_response

RETRY_AFTER_SECONDS = 1
# a refused request's body is read and dropped, up to these bounds, before the refusal is sent
DRAIN_SECONDS, DRAIN_BYTES = 2.0, 64 * 2**20


class Admission:
    """Admitted requests, bounded; released from engine threads when a request's Future is done.
    Also tracks live Futures so metrics can tell queued from running transcriptions.
    `on_idle()` is called (outside the lock) each time the count returns to 0."""

    def __init__(self, limit: int, on_idle=None):
        self.limit = limit
        self.on_idle = on_idle
        self.count = 0
        self._futures: set[Future] = set()
        self._lock = threading.Lock()

    def try_acquire(self, n: int = 1) -> bool:
        with self._lock:
            if self.count + n > self.limit:
                return False
            self.count += n
            return True

    def release(self, n: int = 1) -> None:
        with self._lock:
            self.count -= n
            idle = self.count == 0
        if idle and self.on_idle is not None:
            self.on_idle()

    def full(self) -> bool:
        return self.count >= self.limit

    def busy_error(self) -> ApiError:
        return ApiError(429, f"the server is at its limit of {self.limit} requests in flight; retry later",
                        code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    def hold_until_done(self, future: Future) -> None:
        """One acquired slot stays taken until the engine is done with `future` (or it is cancelled)."""
        with self._lock:
            self._futures.add(future)

        def done(f):
            with self._lock:
                self._futures.discard(f)
                self.count -= 1
                idle = self.count == 0
            if idle and self.on_idle is not None:
                self.on_idle()
        future.add_done_callback(done)  # runs at once (outside the lock) if already done

    def waiting(self) -> int:
        with self._lock:
            return sum(not f.running() and not f.done() for f in self._futures)

    def running(self) -> int:
        with self._lock:
            return sum(f.running() for f in self._futures)


class UploadGuard:
    """Pure-ASGI middleware: 413 for bodies over `max_upload_bytes` (from Content-Length, before
    the body is kept anywhere, and counted while chunked uploads stream), 429 for POSTs to
    `audio_routes` while `admission` is full (before their upload is kept; a refused body is read
    and dropped first, within bounds: `drain`), 408 when the whole body has not arrived `read_timeout`
    seconds after the request started (a slow or stalled sender holds no slot for long), and
    `metrics.observe_request` for every request."""

    def __init__(self, app, admission: Admission, metrics, max_upload_bytes: int,
                 audio_routes: tuple, known_routes: tuple, read_timeout: float | None = None):
        self.app, self.admission, self.metrics = app, admission, metrics
        self.max_upload_bytes, self.audio_routes, self.known_routes = max_upload_bytes, audio_routes, known_routes
        self.read_timeout = read_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = route_path(scope)
        status, started = 500, time.perf_counter()

        async def send_observed(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self.refusal(scope, path)
            if refusal is not None:
                await drain(receive)
                return await refusal(scope, receive, send_observed)
            await self.app(scope, self.limited(receive), send_observed)
        finally:
            self.metrics.observe_request(path if path in self.known_routes else "other", status,
                                         time.perf_counter() - started)

    def too_large(self, what: str) -> ApiError:
        mb = self.max_upload_bytes / 2**20
        return ApiError(413, f"{what}; this server accepts at most {self.max_upload_bytes} bytes ({mb:g} MB)",
                        param="file", code="file_too_large", headers={"Connection": "close"})

    def refusal(self, scope, path: str):
        length = content_length(scope)
        if length is not None and length > self.max_upload_bytes:
            e = self.too_large(f"the request body is {length} bytes")
        elif scope["method"] == "POST" and path in self.audio_routes and self.admission.full():
            e = self.admission.busy_error()
        else:
            return None
        return error_response(e.status_code, e.message, e.param, e.code, {**e.headers, "Connection": "close"})

    def limited(self, receive):
        total, body_done = 0, False
        deadline = None if self.read_timeout is None else time.monotonic() + self.read_timeout

        async def receive_limited():
            nonlocal total, body_done
            if body_done or deadline is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
                except asyncio.TimeoutError:
                    raise ApiError(408, f"the request body did not arrive within {self.read_timeout:g} s",
                                   code="request_timeout", headers={"Connection": "close"}) from None
            if message["type"] == "http.request":
                body_done = not message.get("more_body", False)
                total += len(message.get("body", b""))
                if total > self.max_upload_bytes:
                    if not body_done:
                        await drain(receive)
                    raise self.too_large(f"the request body exceeds {self.max_upload_bytes} bytes")
            return message
        return receive_limited


async def drain(receive, seconds: float = DRAIN_SECONDS, max_bytes: int = DRAIN_BYTES) -> None:
    """Read and drop what a refused request still sends (at most `max_bytes`, `seconds`). A
    server that closes a connection with unread input makes the kernel reset it, and a reset
    can discard the refusal before the client reads it (the client then sees "peer closed
    connection" instead of a 413 or 429; seen on loaded machines). The body is not kept."""
    total, deadline = 0, time.monotonic() + seconds
    while total <= max_bytes:
        try:
            message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request":
            return  # the client went away
        total += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def route_path(scope) -> str:
    """The path inside this app (a mounted app sees its mount prefix in root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


def content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None

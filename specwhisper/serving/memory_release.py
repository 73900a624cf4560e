"""Give freed heap memory back to the operating system when a server goes idle.

glibc's malloc keeps freed memory inside its arenas (one per thread that allocated, up to 8 per
core), so after a large upload is decoded and transcribed the server's RSS stays at its peak
although nothing holds the memory. `malloc_trim(0)` returns every arena's free pages. Measured on
the HTTP server: without it, a sequence of bad, oversized and cancelled uploads grew RSS by
~470 MB and every repetition added more; with it, RSS returns to the warmed-up level.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import threading

log = logging.getLogger("specwhisper.server")


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """libc's `malloc_trim`, or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """`malloc_trim(0)`: whether the C library had it (and something was returned)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


class IdleTrimmer:
    """Calls `release_freed_memory` in its own daemon thread each time `poke()` is called (e.g.
    when the last request in flight ends), so no request thread or event loop waits for it.
    Pokes that arrive while a trim runs are folded into one more trim."""

    def __init__(self):
        self._wanted = threading.Event()
        self.trims = 0  # trims done (tests read it)
        self._thread = threading.Thread(target=self._run, name="specwhisper-trim", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        self._wanted.set()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            try:
                release_freed_memory()
            except Exception:  # never fatal: memory stays with the process
                log.exception("malloc_trim failed")
            self.trims += 1

"""Capture and replay of fixed-shape decode steps as CUDA graphs (one graph per key).

A *step* is a function `fn()` that reads and writes only static tensors (the runner's
preallocated buffers: tokens, positions, caches, noise) and returns a tensor or a tuple/list of
tensors. The runner writes a step's inputs into those buffers, then calls `graphs.run(key, fn)`
with a key naming the step's shape (e.g. `("verify", bucket, k)`). On CUDA, the first use of a key
warms the step up on a side stream, captures it into a `torch.cuda.CUDAGraph`, and every later call
replays it: one launch instead of hundreds, no Python in between. Elsewhere (CPU, or
`enabled=False`) the same code runs eagerly, so CPU CI covers the static-buffer path.

Models: nano-vllm's `ModelRunner.capture_cudagraph` (largest batch first, one memory pool shared by
every graph) and gpt-fast's static-cache decode step.

What a captured step must obey (the eager path does not check these; the GPU tests do):
- no host sync inside (`.item()`, `.tolist()`, `.nonzero()`, printing a tensor, Python branches on
  tensor values): capture fails, and the error says so;
- inputs only through the static buffers: a tensor created on the host and used inside is frozen
  into the graph at its capture-time value;
- the returned tensors are the graph's own outputs, overwritten by the next replay of that key:
  copy what must outlive it;
- warm-up calls `fn` `warmup` extra times before capture (capture itself runs nothing), so a step
  that is not *idempotent* (e.g. `length += n` in place) must be captured ahead with `capture()` on
  scratch state, before real state exists, or be given a `rewind`: a callable that saves the
  state the step changes and returns a function restoring it, called after each warm-up call, so
  the first use has the effect of exactly one call; `rehearse=True` makes the eager path call `fn`
  as often as capture would (rewinding alike), so CPU tests see the same effect.

The engine's runner uses this for its two per-iteration steps, `draft(k)` and
`verify_accept_commit(k)`, keyed by (step, batch bucket, k, modes): the live rows padded with inert
rows to a power-of-two bucket, one graph per key captured on first use (rewound), replayed after.
"""
from __future__ import annotations

from typing import Callable, Hashable, Iterable, Sequence

import torch

Outputs = torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]
WARMUP = 3  # eager calls on a side stream before capture (cuBLAS/Triton autotune, allocator warm-up)


def graphs_supported(device: torch.device | str | None) -> bool:
    """True when steps on `device` can be captured as CUDA graphs."""
    if device is None:
        return False
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available()


class StepGraphs:
    """One CUDA graph per step key, all sharing one memory pool; eager where graphs cannot run.

    `enabled`: capture on CUDA (False keeps every step eager, e.g. for debugging or timing).
    `device`: where the steps run; None means the current CUDA device when CUDA is available.
    `warmup`: eager calls before each capture. `rehearse`: in eager mode, call `fn` warmup + 1
    times on a key's first use, as the capture path would (so CPU tests catch steps that are not
    idempotent).
    """

    def __init__(self, enabled: bool, device: torch.device | str | None = None, warmup: int = WARMUP,
                 rehearse: bool = False):
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (capture needs warmed-up kernels), got {warmup}")
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.enabled = enabled
        self.capturing = enabled and graphs_supported(self.device)  # False: eager
        self.warmup, self.rehearse = warmup, rehearse
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Outputs]] = {}
        self._seen: set[Hashable] = set()  # keys already run (eager mode)
        self._pool = None  # the memory pool of the first graph, shared by the others
        self._in_step = False

    # ------------------------------------------------------------------ public
    def run(self, key: Hashable, fn: Callable[[], Outputs],
            rewind: Callable[[], Callable[[], None]] | None = None) -> Outputs:
        """The outputs of step `key`: replayed from its graph (captured on first use) on CUDA,
        `fn()` itself in eager mode. `fn` must be the same computation every time for a key.
        `rewind()` (optional) saves the state `fn` changes and returns a function restoring it:
        warm-up calls are then undone, and the first use changes the state as one call does."""
        _check_key(key)
        if not callable(fn):
            raise TypeError(f"fn for step {key!r} must be callable, got {type(fn).__name__}")
        if self._in_step:
            raise RuntimeError(f"StepGraphs.run({key!r}) was called from inside a step; steps cannot nest")
        if not self.capturing:
            if self.rehearse and key not in self._seen:
                restore = rewind() if rewind is not None else None
                for _ in range(self.warmup):
                    self._call(key, fn)
                    if restore is not None:
                        restore()
            self._seen.add(key)
            return self._call(key, fn)
        if key not in self._graphs:
            self._capture(key, fn, rewind)
        graph, outputs = self._graphs[key]
        graph.replay()
        return outputs

    def capture(self, keys_in_order: Iterable[Hashable],
                fn_for_key: Callable[[Hashable], Callable[[], Outputs]]) -> None:
        """Capture the steps `keys_in_order` now, in that order (largest batch bucket first, so
        the smaller graphs fit in the memory the first one reserved). `fn_for_key(key)` returns
        the step function of a key. Nothing runs in eager mode. Capturing a key twice is an error."""
        keys = list(keys_in_order)
        for key in keys:
            _check_key(key)
        dup = sorted({repr(k) for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"capture() got duplicate keys: {', '.join(dup)}")
        already = [repr(k) for k in keys if k in self._graphs]
        if already:
            raise ValueError(f"steps already captured: {', '.join(already)}")
        if not self.capturing:
            return
        for key in keys:
            self._capture(key, fn_for_key(key))

    def __contains__(self, key: Hashable) -> bool:
        """Whether `key` has a captured graph."""
        return key in self._graphs

    def keys(self) -> list[Hashable]:
        return list(self._graphs)

    def reset(self) -> None:
        """Drop every graph and the pool (e.g. after the static buffers were reallocated)."""
        self._graphs.clear()
        self._seen.clear()
        self._pool = None

    # ------------------------------------------------------------------ internals
    def _call(self, key, fn) -> Outputs:
        self._in_step = True
        try:
            outputs = fn()
        finally:
            self._in_step = False
        _check_outputs(key, outputs)
        return outputs

    def _capture(self, key, fn, rewind=None) -> None:
        device = self.device
        restore = rewind() if rewind is not None else None  # saved on the current stream
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self._call(key, fn)
                if restore is not None:
                    restore()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        self._in_step = True
        try:
            # thread_local: other threads (e.g. the audio front end) may use CUDA meanwhile
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                outputs = fn()
        except Exception as exc:
            raise RuntimeError(
                f"capturing step {key!r} as a CUDA graph failed: {exc}. A captured step must not "
                "sync with the host (.item(), .tolist(), .nonzero(), printing tensors, branching on "
                "tensor values) nor touch CPU tensors; run it with enabled=False to debug") from exc
        finally:
            self._in_step = False
        _check_outputs(key, outputs)
        for t in _tensors(outputs):
            if t.device.type != "cuda":
                raise ValueError(f"step {key!r} returned a {t.device.type} tensor; a CUDA graph only "
                                 "replays CUDA work (use enabled=False or device='cpu' for CPU steps)")
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[key] = (graph, outputs)


def _check_key(key) -> None:
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"step key must be hashable (e.g. a tuple like ('verify', 8, 4)), got {key!r}") from None


def _tensors(outputs: Outputs) -> Sequence[torch.Tensor]:
    return (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)


def _check_outputs(key, outputs) -> None:
    ok = isinstance(outputs, torch.Tensor) or (
        isinstance(outputs, (tuple, list)) and len(outputs) > 0
        and all(isinstance(t, torch.Tensor) for t in outputs))
    if not ok:
        raise TypeError(f"step {key!r} must return a tensor or a non-empty tuple/list of tensors (its "
                        f"outputs live in static memory a replay rewrites), got {type(outputs).__name__}")

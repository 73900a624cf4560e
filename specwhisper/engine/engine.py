"""The engine facade: `transcribe` (blocking) and `submit` (a Future), one decode loop for all.

Every request joins one running batch, whose iterations one thread at a time runs: the caller of
`transcribe` when no other thread is decoding, else the thread
decoding already (a caller, or the engine's loop thread, which `submit` starts and which takes
over what callers leave):
`scheduler.schedule()` (admit waiting windows into free slots) -> `speculation.begin()` (this
iteration's k) -> `runner.draft(k)` -> `runner.verify_accept_commit(k)` -> one small host read ->
`speculation.end(...)` (the adaptive k learns) -> `scheduler.postprocess(...)` (finished windows
leave). Concurrent callers are decoded together, not one after another. The
decode loop itself, and the glossary of speculative decoding, are in runner.py.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import random
import threading
import time
import warnings
import weakref

import numpy as np
import torch

from ..backends import backend_for, default_device
from ..config import DEFAULT_FALLBACK_TEMPERATURES as DEFAULT_FALLBACK, DecodeOptions
from ..constants import FRAMES_PER_SECOND, N_FRAMES, SAMPLE_RATE
from ..longform.timing import APPEND_PUNCTUATIONS, PREPEND_PUNCTUATIONS
from ..longform.window import SAMPLE_LEN
from ..results import Segment, Stats, Transcription  # noqa: F401 (re-exported)
from .decoding import LoadedModel
from .draft import Drafter, same_weights
from .jobs import LongformRequest, ShortJob
from .runner import Runner
from .scheduler import Request, RequestFuture, Scheduler
from .speculation import Speculation


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic collector off for the block, on again after (unless it was off already).
    Loading builds ~10^5 objects (tokenizer tables, vocabulary maps, modules), whose allocations set
    off full collections over the heap torch's import left: `Engine("base")` 0.64 -> 0.47 s,
    `Engine("base", "tiny.en")` 1.94 -> 1.53 s (fresh processes, medians of 4; 0.12 and 0.30 s of
    it in collections that found nothing to free)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def check_sample_len(max_new_tokens: int | None) -> None:
    """A long-form `max_new_tokens` caps each window: openai's sample_len, 1..SAMPLE_LEN."""
    if max_new_tokens is not None and not 1 <= max_new_tokens <= SAMPLE_LEN:
        raise ValueError(f"max_new_tokens caps each long-form window (openai's sample_len, at most {SAMPLE_LEN}), "
                         f"got {max_new_tokens}")


def fuse_or_warn(model, role: str) -> bool:
    """`model.fuse_decode_ops()` where it can run (Triton importable, a power-of-two head size),
    else a warning and torch's ops: whether it fused."""
    try:
        model.fuse_decode_ops()
        return True
    except (RuntimeError, ValueError) as exc:
        note = (" (in half precision a verify pass can then round a near-tied argmax differently from a "
                "one-token step: speculative tokens may differ from target-only's)" if role == "target" else "")
        warnings.warn(f"{exc}: the {role} decodes on torch's ops{note}", stacklevel=3)
        return False


class Engine:
    """Exact Whisper decoding, speculative when a draft is given.

    Thread-safe: any number of threads may call `transcribe` / `submit`; their requests share
    one running batch of at most `max_batch` windows (more wait for a free slot).
    """

    def __init__(self, target, draft=None, device=None, dtype=None, shared_encoder: bool | None = None,
                 draft_head_tokens: int | None = None, max_batch: int = 8, background: bool = True,
                 compact_draft: bool | None = None, cuda_graphs: bool | None = None, sampling: str = "race",
                 decode_ops: bool | None = None):
        """`dtype`: None is float32 on a CPU and float16 on CUDA. In float16/bfloat16 on torch's
        GPU kernels (`decode_ops=False`) a verify pass of k + 1 positions (or another batch
        bucket) can round a near-tied argmax differently from a one-token step, so speculative
        tokens can differ from target-only's there (README, GPU); the decode ops (the default in
        half precision on CUDA) and float32 are token-exact.
        `shared_encoder`: None detects a draft whose encoder equals the target's (it then
        runs once); `draft_head_tokens`: greedy drafts propose only among that many of their
        lowest target-spellable text ids (a cheaper draft head; output stays exact);
        `compact_draft`: store the draft decoder's projection weights and its cross-attention
        K/V in bfloat16, its C++ step reading int8 copies of the projections (a quarter of the
        float32 bytes of a draft step) and a 2-bit copy of its output head (`Q2Head`; 4-bit,
        `Q4Head`, where its width is not a multiple of 64), and run a
        draft's own encoder cheaper (int8 projections or bfloat16, attention within 3-second
        blocks); the output stays exact, the target verifies every proposal; None:
        on for float32 drafts on the CPU when the C++ decode ops are built, except a self draft
        (the target's own weights, kept exact);
        `max_batch`: windows decoded together (memory: one KV-cache slot each); `background`:
        True: a caller of `transcribe` decodes in its own thread when no other thread is decoding,
        and a loop thread serves `submit` and whatever callers leave; False: no thread is ever
        started (the calling thread of `transcribe` runs the iterations, `step()` runs one; for
        single-threaded hosts and deterministic tests); `cuda_graphs`: run each iteration's
        draft and verify steps on the graph-shaped path (rows padded to a power-of-two bucket,
        fixed shapes), captured as CUDA graphs per (bucket, k) on a GPU; True on a CPU runs that
        same path eagerly (for tests); None: on for CUDA, off elsewhere; `sampling`: how a
        sampled row accepts proposals: "race" keeps a proposal equal to the target's own seeded
        race winner (a seed gives the same tokens whatever k, batch or draft), "rejection" runs
        Leviathan et al.'s acceptance test and residual resampling (rejection.py: accepts a little
        more; tokens then depend on the draft); both sample exactly the target's distribution.
        `decode_ops` (CUDA only): the decoders' layers and heads on the Triton decode ops
        (`Whisper.fuse_decode_ops`: fused linears, chunked attention, each row's and query's bits
        independent of the others, so that half precision is token-exact too: on an H100 a float16
        self draft's tokens equalled target-only's at B = 1 and 8, where torch's ops flip near
        ties); None: on for float16/bfloat16 on CUDA where Triton compiles them (else torch's ops,
        with a warning), off elsewhere; large-v3's graphed step on an H100 2.35 / 3.27 ms at
        B = 1 / 8 against 2.80 / 3.91 on torch's ops (README, GPU)."""
        self.device = torch.device(device) if device is not None else default_device()
        self.backend = backend_for(self.device)  # every device-dependent decision (backends/)
        if dtype is None:
            dtype = self.backend.default_dtype
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        if sampling not in ("race", "rejection"):
            raise ValueError(f"sampling must be 'race' or 'rejection', got {sampling!r}")
        if not (isinstance(max_batch, int) and 1 <= max_batch <= 256):
            raise ValueError(f"max_batch must be an int in 1..256, got {max_batch!r}")
        if decode_ops and self.device.type != "cuda":
            raise ValueError(f"decode_ops=True runs Triton kernels on a CUDA device, not on {self.device}")
        self.dtype = dtype
        with gc_paused():  # loading makes ~10^5 objects: no collection over the heap meanwhile
            self.target = LoadedModel.load(target, self.device, dtype)
            if decode_ops is None:
                decode_ops = self.backend.fuses_decode_ops(dtype) and fuse_or_warn(self.target.model, "target")
            elif decode_ops:
                self.target.model.fuse_decode_ops()
            self.decode_ops = decode_ops
            self.drafter = None
            if draft is not None:
                draft_model = LoadedModel.load(draft, self.device, dtype)
                if decode_ops:  # the draft only proposes: its own ops never change the output
                    fuse_or_warn(draft_model.model, "draft")
                if compact_draft is None:  # a self draft stays the target's exact copy (acceptance 1.0)
                    compact_draft = (self.backend.compacts_drafts(dtype)
                                     and not same_decoder(draft_model.model, self.target.model))
                self.drafter = Drafter(draft_model, self.target, shared_encoder, draft_head_tokens)
                if compact_draft:
                    self.backend.compact_draft(draft_model.model, own_encoder=not self.drafter.shared_encoder)
                    self.drafter.compact_head()
            graphs = self.backend.step_graphs(cuda_graphs)
            self.runner = Runner(self.target, self.drafter, max_batch, self.device, dtype, graphs, sampling)
            self.scheduler = Scheduler(self.runner, self.drafter.stands_aside if self.drafter else None)
            self.speculation = Speculation(self.runner, self.drafter, self.backend)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False  # set at interpreter exit: the loop thread returns (see _stop_loops)
        _ENGINES.add(self)
        self.background = background
        self._driver = threading.Lock()  # held by the one thread running iterations (caller or loop)
        self.host_syncs = 0  # host reads of device state by the loop (one per iteration)
        self.iterations = 0
        self.peak_batch = 0  # the most windows decoded together so far

    @property
    def n_mels(self) -> int:
        return self.target.config.num_mel_bins

    # ---------------------------------------------------------------- public API
    def transcribe(self, x, language: str | None = None, task: str = "transcribe",
                   temperature: float | tuple[float, ...] | None = None, top_p: float = 1.0,
                   num_draft_tokens: int | None = None, max_new_tokens: int | None = None,
                   seed: int | None = None, initial_prompt: str | None = None,
                   condition_on_previous_text: bool = True, timestamps: bool | None = None,
                   word_timestamps: bool = False, prepend_punctuations: str = PREPEND_PUNCTUATIONS,
                   append_punctuations: str = APPEND_PUNCTUATIONS,
                   hallucination_silence_threshold: float | None = None):
        """Decode `x` -> a Transcription (a list of them for a batch mel or a list of inputs).

        `x`: a path or encoded bytes, a 1-D 16 kHz waveform, a log-mel [n_mels, frames] or a batch
        [batch, n_mels, frames], or a list of these. Input of at most 30 s decodes as one window
        (Whisper's standard prompt, no timestamps); longer input, or `timestamps=True`, runs
        openai-whisper's long-form algorithm (segments with timestamps, `initial_prompt`,
        `condition_on_previous_text`, temperature fallback). `temperature`: None is Whisper's
        default for the input (0.0 for one window; (0.0, 0.2, ..., 1.0) for long-form); a tuple
        is a fallback list (long-form). `word_timestamps=True` (long-form, any length) gives each
        segment its words, as openai-whisper's `transcribe(word_timestamps=True)`, with its
        `prepend_punctuations`, `append_punctuations` and `hallucination_silence_threshold`."""
        kwargs = dict(language=language, task=task, temperature=temperature, top_p=top_p,
                      num_draft_tokens=num_draft_tokens, max_new_tokens=max_new_tokens, seed=seed,
                      initial_prompt=initial_prompt, condition_on_previous_text=condition_on_previous_text,
                      timestamps=timestamps, word_timestamps=word_timestamps,
                      prepend_punctuations=prepend_punctuations, append_punctuations=append_punctuations,
                      hallucination_silence_threshold=hallucination_silence_threshold)
        if isinstance(x, (list, tuple)):
            if not x:
                raise ValueError("the input list is empty")
            futures = [f for item in x for f in self._submit(item, **kwargs)[1]]
            single = False
        else:
            single, futures = self._submit(x, **kwargs)
        self._wait(futures)
        results = [f.result() for f in futures]
        return results[0] if single else results

    def submit(self, x, language: str | None = None, task: str = "transcribe",
               temperature: float | tuple[float, ...] | None = None, top_p: float = 1.0,
               num_draft_tokens: int | None = None, max_new_tokens: int | None = None,
               seed: int | None = None, initial_prompt: str | None = None,
               condition_on_previous_text: bool = True, timestamps: bool | None = None,
               word_timestamps: bool = False, prepend_punctuations: str = PREPEND_PUNCTUATIONS,
               append_punctuations: str = APPEND_PUNCTUATIONS, hallucination_silence_threshold: float | None = None,
               progress=None, on_segment=None) -> RequestFuture:
        """Queue one input for decoding -> a Future of its Transcription (arguments as in
        `transcribe`). Requests submitted concurrently are decoded together; `future.cancel()`
        frees a request's slot. `progress(seek, frames)` follows a long-form request's windows;
        `on_segment(segment)` receives each segment as soon as its window is kept (long-form; both
        are called from the thread running the engine's iterations and must be quick)."""
        single, futures = self._submit(x, language=language, task=task, temperature=temperature, top_p=top_p,
                                       num_draft_tokens=num_draft_tokens, max_new_tokens=max_new_tokens,
                                       seed=seed, initial_prompt=initial_prompt,
                                       condition_on_previous_text=condition_on_previous_text,
                                       timestamps=timestamps, word_timestamps=word_timestamps,
                                       prepend_punctuations=prepend_punctuations,
                                       append_punctuations=append_punctuations,
                                       hallucination_silence_threshold=hallucination_silence_threshold,
                                       progress=progress, on_segment=on_segment)
        if not single:
            raise ValueError("submit takes one input; submit each row of a batch separately")
        if self.background:
            with self._cond:
                self._start_loop()
        return futures[0]

    def warm_up(self) -> float:
        """A first call's one-time work, done now rather than in a first request's time: one call
        on a second of faint noise (digital silence returns no tokens without running a model: the
        encoders' packed weights, the decoder's float16 copies, the
        screened head, the first touch of the caches; a draft's own encoder and steps at a fixed
        k = 1, which the adaptive k does not learn from) and the adaptive k's pass costs
        (`Speculation.calibrate`, kept on disk per machine). `specwhisper serve` runs it before it
        listens. Call it before requests come in. -> the seconds it took."""
        start = time.perf_counter()
        noise = np.random.default_rng(0).standard_normal(SAMPLE_RATE).astype(np.float32) * 0.01
        self.transcribe(noise, language="en", max_new_tokens=4,
                        num_draft_tokens=1 if self.drafter is not None else None)
        with self._driver, torch.inference_mode():  # no iteration runs meanwhile
            self.speculation.calibrate()
        return time.perf_counter() - start

    def transcribe_long(self, audio, options, seed: int | None = None, progress=None, on_window=None,
                        max_new_tokens: int | None = None) -> Transcription:
        """openai-whisper's long-form `transcribe()` with `TranscribeOptions` on a recording of any
        length (audio, a path, bytes, or the whole recording's log-mel [n_mels, frames]).
        `on_window(request, output, features)` sees each window decoded (fallback attempts too):
        its `WindowRequest`, `SeqOutput` and target encoder output [1500, d]. `max_new_tokens` caps
        each window (openai's sample_len, at most SAMPLE_LEN = 224)."""
        single, mel, draft_mel = self._as_mel(audio, whole=True)
        if not single:
            raise ValueError("transcribe_long takes one recording")
        check_sample_len(max_new_tokens)
        job = self._longform_job(mel, options, seed, None, progress, draft_mel)
        job.on_window, job.sample_len = on_window, max_new_tokens
        future = self._enqueue(job)
        self._wait([future])
        return future.result()

    def run_until(self, futures) -> None:
        """background=False: run iterations in this thread until every future is done."""
        with self._driver:
            self._drive(futures)

    def _drive(self, futures) -> None:
        """Run iterations in this thread (holding the driver lock) until `futures` are done or the
        interpreter exits; a failed iteration fails its requests, not the engine."""
        while not all(f.done() for f in futures) and not self._stopping:
            try:
                with torch.inference_mode():
                    self.step()
            except BaseException as exc:
                with self._cond:
                    self.scheduler.fail_all(exc)

    def _wait(self, futures) -> None:
        """Return when `futures` are done. background=False: this thread runs the iterations.
        Otherwise this thread runs them itself when no loop thread is running and no other
        caller is driving (a single caller then decodes in its own thread, with no hand-over;
        the C++ ops are as fast in any thread, see decode_ops.cpp's SpinPool), and hands what is
        left of other callers' work to a loop thread when its own is done; else the thread that
        is driving decodes this request too."""
        if not self.background:
            self.run_until(futures)
            return
        with self._cond:
            looping = self._thread is not None and self._thread.is_alive()
        if looping or not self._driver.acquire(blocking=False):
            return  # the loop thread, or the caller driving now, decodes these requests too
        try:
            self._drive(futures)
        finally:
            self._driver.release()
            with self._cond:
                if self.scheduler.has_work() and not self._stopping:
                    self._start_loop()

    def _start_loop(self) -> None:
        """Start the loop thread unless it runs (call with self._cond held)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="specwhisper-engine", daemon=True)
            self._thread.start()
        self._cond.notify()

    # ---------------------------------------------------------------- requests
    def _submit(self, x, language=None, task="transcribe", temperature=None, top_p=1.0, num_draft_tokens=None,
                max_new_tokens=None, seed=None, initial_prompt=None, condition_on_previous_text=True,
                timestamps=None, word_timestamps=False, prepend_punctuations=PREPEND_PUNCTUATIONS,
                append_punctuations=APPEND_PUNCTUATIONS, hallucination_silence_threshold=None, progress=None,
                on_segment=None) -> tuple[bool, list[RequestFuture]]:
        if word_timestamps:
            if timestamps is False:
                raise ValueError("word_timestamps runs openai-whisper's long-form algorithm; it needs timestamps")
            self.target.alignment_heads  # noqa: B018 (ValueError for a model without known alignment heads)
            timestamps = True
        elif hallucination_silence_threshold is not None:
            raise ValueError("hallucination_silence_threshold needs word_timestamps=True")
        single, mel, draft_mel = self._as_mel(x, whole=bool(timestamps))
        long = single and (mel.shape[-1] > N_FRAMES or bool(timestamps))
        if long or initial_prompt is not None or isinstance(temperature, (tuple, list)):
            if not single:
                raise ValueError("long-form options (timestamps, initial_prompt, a temperature list) apply "
                                 "to one recording at a time; pass a list of recordings instead of a batch mel")
            check_sample_len(max_new_tokens)
            if timestamps is False:
                raise ValueError("audio longer than 30 s is decoded with timestamps (openai-whisper's "
                                 "long-form algorithm); timestamps=False is only for single windows")
            from ..config import TranscribeOptions

            temps = DEFAULT_FALLBACK if temperature is None else temperature
            options = TranscribeOptions(temperature=temps, language=language, task=task, top_p=top_p,
                                        initial_prompt=initial_prompt,
                                        condition_on_previous_text=condition_on_previous_text,
                                        word_timestamps=bool(word_timestamps), prepend_punctuations=prepend_punctuations,
                                        append_punctuations=append_punctuations,
                                        hallucination_silence_threshold=hallucination_silence_threshold)
            if num_draft_tokens is not None:
                DecodeOptions(num_draft_tokens=num_draft_tokens)  # validates k
            job = self._longform_job(mel, options, seed, num_draft_tokens, progress, draft_mel)
            job.on_segment, job.sample_len = on_segment, max_new_tokens
            return True, [self._enqueue(job)]
        opts = DecodeOptions(language, task, 0.0 if temperature is None else temperature, top_p,
                             num_draft_tokens, max_new_tokens, seed)
        batch = self._check_mel(mel)
        tok = self.target.tokenizer
        if opts.language is not None or not tok.multilingual:
            tok.prompt(opts.language, opts.task)  # validates language and task before any work
        prompt_len = 4 if tok.multilingual else 2
        limit = self.target.config.max_target_positions
        if opts.max_new_tokens is not None and prompt_len + opts.max_new_tokens > limit:
            raise ValueError(f"max_new_tokens={opts.max_new_tokens} plus the {prompt_len}-token prompt exceeds "
                             f"the decoder cache of {limit} positions")
        frames = min(mel.shape[-1], N_FRAMES)
        draft_batch = None if draft_mel is None else self._check_mel(draft_mel, self.drafter.own_mels)
        futures = []
        for i, row in enumerate(batch):
            # row i of a batch samples with seed + i: rows differ, and each row reproduces
            seed_i = opts.seed + i if opts.seed is not None else random.getrandbits(62)
            job = ShortJob(row, frames / FRAMES_PER_SECOND, opts, tok, limit, seed_i,
                           None if draft_batch is None else draft_batch[i])
            futures.append(self._enqueue(job))
        return single, futures

    def _longform_job(self, mel, options, seed, num_draft_tokens, progress, draft_mel=None) -> LongformRequest:
        if mel.ndim != 2 or mel.shape[0] != self.n_mels or mel.shape[1] == 0:
            raise ValueError(f"long-form input must be audio or a log-mel [{self.n_mels}, frames], "
                             f"got shape {tuple(mel.shape)}")
        mel = mel.to(self.device, torch.float32)
        if not torch.isfinite(mel).all():
            raise ValueError("mel contains NaN or infinite values")
        tok = self.target.tokenizer
        if options.language is not None or not tok.multilingual:
            tok.prompt(options.language, options.task)  # validates language and task before any work
        if options.word_timestamps:
            self.target.alignment_heads  # noqa: B018 (ValueError for a model without known alignment heads)
        seed = seed if seed is not None else random.getrandbits(62)
        draft_mel = None if draft_mel is None else draft_mel.to(self.device, torch.float32)
        return LongformRequest(mel, options, tok, seed, num_draft_tokens, progress, draft_mel)

    def _enqueue(self, job) -> RequestFuture:
        future = RequestFuture()
        with self._cond:
            self.scheduler.add(Request(job, future))
            if self.background and self._thread is not None and self._thread.is_alive():
                self._cond.notify()  # the running loop takes it
        return future

    # ---------------------------------------------------------------- the loop
    def _loop(self) -> None:
        while not self._stopping:
            with self._cond:
                while not self.scheduler.has_work():
                    if self._stopping:
                        return
                    if not self._cond.wait(timeout=30.0):
                        if not self.scheduler.has_work():
                            self._thread = None  # idle: the next request starts a new loop
                            return
            try:
                with self._driver, torch.inference_mode():  # never beside a caller that drives
                    self.step()
            except BaseException as exc:  # a failed iteration fails its requests, not the engine
                with self._cond:
                    self.scheduler.fail_all(exc)

    def step(self) -> None:
        """One iteration: admit, draft, verify-accept-commit, let finished windows leave."""
        with self._cond:
            admitted = self.scheduler.schedule()
        B = len(self.scheduler.running)
        if B == 0:
            return
        self.peak_batch = max(self.peak_batch, B)
        if admitted:
            self.runner.progress(B)  # the host's view of lengths after prefills
        modes = self.runner.modes(B)
        k = self.speculation.begin(B)
        if k > 0:
            k = self.runner.draft(B, k, modes)  # the columns proposed (a draft may stop early)
        self.speculation.drafted(k)
        self.runner.verify_accept_commit(B, k, modes)
        progress = self.runner.progress(B)  # the one host read of the iteration
        self.speculation.end(progress)
        self.host_syncs += 1
        self.iterations += 1
        with self._cond:
            self.scheduler.postprocess(progress)

    # ---------------------------------------------------------------- input checks
    def _as_mel(self, x, whole: bool = False) -> tuple[bool, torch.Tensor, torch.Tensor | None]:
        """Any accepted input -> (single?, mel [n_mels, frames] or [batch, n_mels, frames], the
        draft's mel). Audio (a path, encoded bytes, or a 1-D 16 kHz waveform) is turned into a
        log-mel here, and into the draft's too where the draft has its own mel front end
        (`Drafter.own_mels`; else, and for log-mel input, None)."""
        from ..audio import HOP_LENGTH, load_audio, log_mel_spectrogram

        if isinstance(x, (str, bytes, bytearray, memoryview)) or hasattr(x, "__fspath__"):
            x = load_audio(x)
        if isinstance(x, np.ndarray):
            x = torch.from_numpy(x)
        if isinstance(x, torch.Tensor) and x.ndim == 1:
            if x.numel() == 0:
                raise ValueError("audio is empty (0 samples)")
            whole = whole or x.numel() > N_FRAMES * HOP_LENGTH  # the whole recording's log-mel: long-form
            frames = None if whole else -(-x.numel() // HOP_LENGTH)  # one window: its frames of audio
            x = x.float()

            def mel_of(n):
                return log_mel_spectrogram(x, n_mels=n, whole=whole)[:, :frames]
            own = self.drafter.own_mels if self.drafter is not None else None
            return True, mel_of(self.n_mels), mel_of(own) if own else None
        return getattr(x, "ndim", None) == 2, x, None

    def _check_mel(self, mel, n_mels: int | None = None) -> torch.Tensor:
        """A log-mel input of `n_mels` bins (default: the target's) -> a float32 batch [B, n_mels,
        3000] on the device, padded past the clip's end as Whisper pads audio with silence."""
        n_mels = n_mels or self.n_mels
        if isinstance(mel, np.ndarray):
            mel = torch.from_numpy(mel)
        if not isinstance(mel, torch.Tensor):
            raise TypeError(f"mel must be a torch.Tensor or numpy array, got {type(mel).__name__}")
        if not mel.is_floating_point():
            raise TypeError(f"mel must be a floating-point log-mel spectrogram, got dtype {mel.dtype}")
        if mel.ndim not in (2, 3):
            raise ValueError(f"mel must be [n_mels, frames] or [batch, n_mels, frames], got shape {tuple(mel.shape)}")
        batch = mel if mel.ndim == 3 else mel[None]
        if batch.shape[0] == 0:
            raise ValueError("mel batch is empty")
        if batch.shape[1] != n_mels:
            raise ValueError(f"mel has {batch.shape[1]} mel bins but the target expects n_mels={n_mels} "
                             f"(shape {tuple(mel.shape)})")
        frames = batch.shape[2]
        if not 0 < frames <= N_FRAMES:
            raise ValueError(f"mel has {frames} frames; 1..{N_FRAMES} (30 s) are supported per utterance")
        batch = batch.to(self.device, torch.float32)
        # one clip expanded into a batch (stride 0) is checked once, not once a row (128 rows: 92 ms)
        if not torch.isfinite(batch[:1] if batch.stride(0) == 0 else batch).all():
            raise ValueError("mel contains NaN or infinite values")
        if frames < N_FRAMES:
            # Whisper pads audio with silence; in normalized log-mel space silence sits at the
            # per-utterance floor max - 2 (the extractor clamps at max - 8 before (x + 4) / 4).
            floor = (batch.amax(dim=(1, 2), keepdim=True) - 2.0).clamp(min=-1.5)
            batch = torch.cat([batch, floor.expand(-1, batch.shape[1], N_FRAMES - frames)], dim=2)
        return batch


_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _stop_loops() -> None:
    """At interpreter exit, before daemon threads are frozen: let every engine's loop thread
    finish its iteration and return. A loop thread still running during finalization (one waking
    from its idle wait, say) would be killed while it frees tensors, which aborts the process
    under some native runtimes (Ray's terminate handler)."""
    engines = list(_ENGINES)
    for engine in engines:
        engine._stopping = True
        with engine._cond:
            engine._cond.notify_all()
    for engine in engines:
        thread = engine._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10.0)


def same_decoder(a, b) -> bool:
    """Whether two models have the same decoder blocks (a self draft, perhaps with its vocabulary
    spelled differently)."""
    return same_weights(a.decoder.layers, b.decoder.layers)

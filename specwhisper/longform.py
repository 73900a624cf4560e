"""Long-form transcription: openai-whisper's `transcribe()` (whisper/transcribe.py) as a job.

A `LongformJob` walks the recording's log-mel in 30 s windows. `next_window()` says which window
to decode next (the same window again at the next temperature after a failed check), `record()`
takes its result and moves `seek` by the predicted timestamps, exactly as openai does:
segments cut at consecutive timestamps, a single timestamp at the end means no speech after it,
otherwise seek to the last timestamp; windows judged silent are skipped; the previous windows'
tokens prompt the next one unless a high temperature was needed. The job never decodes: windows
of many jobs can share a running batch (`run_job` drives one job sequentially).

Names follow openai's so the two read side by side: seek, segments, all_tokens,
prompt_reset_since, compression_ratio, no_speech_prob, decode_with_fallback.
"""
from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from .audio import HOP_LENGTH, N_FRAMES, SAMPLE_RATE, pad_or_trim
from .config import TranscribeOptions
from .constants import N_AUDIO_CTX, N_TEXT_CTX, NO_LIMIT, TIME_PRECISION
from .results import Segment, Stats, Transcription
from .tokenizer import Tokenizer, split_at_timestamps
from .window import SAMPLE_LEN, WindowRequest, WindowResult

INPUT_STRIDE = N_FRAMES // N_AUDIO_CTX  # mel frames per timestamp step: 2


def compression_ratio(text: str) -> float:
    """openai's gzip (zlib) compression ratio of the UTF-8 text: high means repetitive."""
    text_bytes = text.encode("utf-8")
    return len(text_bytes) / len(zlib.compress(text_bytes))


class LongformJob:
    """openai-whisper's `transcribe()` over `mel_full` [n_mels, frames] (the whole recording's
    log-mel from `log_mel_spectrogram(audio, whole=True)`), one window at a time."""

    def __init__(self, mel_full: torch.Tensor, tokenizer: Tokenizer, options: TranscribeOptions,
                 seed: int | None = None):
        if mel_full.ndim != 2:
            raise ValueError(f"mel_full must be [n_mels, frames], got shape {tuple(mel_full.shape)}")
        language = options.language
        if not tokenizer.multilingual:
            language = None
            tokenizer.prompt(options.language, options.task)  # refuses other languages / translate
        elif language is None:
            raise ValueError("a multilingual long-form job needs a language; detect it first "
                             "(window.detect_language_reference on the first 30 s)")
        else:
            language = language.lower()
            tokenizer.language_id(language)
        self.mel, self.tokenizer, self.options = mel_full, tokenizer, options
        self.language = language
        self.seed = int(seed) if seed is not None else int(np.random.SeedSequence().generate_state(1)[0])
        self.content_frames = mel_full.shape[-1]
        self.duration = float(self.content_frames * HOP_LENGTH / SAMPLE_RATE)
        # openai's `max_initial_timestamp` option: falsy (None or 0.0) means no limit
        mit = options.max_initial_timestamp
        self.max_initial_timestamp_index = round(mit / TIME_PRECISION) if mit else NO_LIMIT

        self.seek = 0  # mel frame where the next window starts
        self.segment_size = 0  # mel frames of audio in the current window
        self.all_tokens: list[int] = []
        self.all_segments: list[Segment] = []
        self.prompt_reset_since = 0
        self.initial_prompt_tokens: list[int] = []
        if options.initial_prompt is not None:
            self.initial_prompt_tokens = tokenizer.encode(" " + options.initial_prompt.strip())
            self.all_tokens.extend(self.initial_prompt_tokens)
        self.windows = 0  # decodes run (fallback retries included)
        self._request: WindowRequest | None = None  # the window being decoded
        self._attempt = 0  # index into options.temperature
        self._retry = False  # the last result failed its checks: decode it again, hotter

    # ---------------------------------------------------------------- the seek loop
    @property
    def done(self) -> bool:
        return self._request is None and self.seek >= self.content_frames

    def next_window(self) -> WindowRequest | None:
        """The next window to decode (the same one at the next temperature after a failure), or
        None when the recording is done. Call `record` with its result before asking again."""
        if self._request is not None:
            if not self._retry:
                raise RuntimeError("record() the result of the previous window first")
            self._retry = False
            self._attempt += 1
            self._request = self._at_attempt(self._request, self._attempt)
            return self._request
        if self.seek >= self.content_frames:
            return None
        self.segment_size = min(N_FRAMES, self.content_frames - self.seek)
        mel_segment = pad_or_trim(self.mel[:, self.seek:self.seek + self.segment_size], N_FRAMES)
        previous = self.all_tokens[self.prompt_reset_since:]
        prompt = self.tokenizer.window_prompt(previous, self.language, self.options.task, self.options.timestamps,
                                              max_previous=N_TEXT_CTX // 2 - 1)
        self._attempt = 0
        self._request = self._at_attempt(WindowRequest(
            mel=mel_segment, prompt=prompt, top_p=self.options.top_p, max_new_tokens=SAMPLE_LEN,
            timestamps=self.options.timestamps, max_initial_timestamp=self.max_initial_timestamp_index,
            language=self.language, task=self.options.task, seek=self.seek), 0)
        return self._request

    def _at_attempt(self, request: WindowRequest, attempt: int) -> WindowRequest:
        # one seed per (job, window, attempt): reruns reproduce, whatever decodes the window
        seed = int(np.random.SeedSequence([self.seed, request.seek, attempt]).generate_state(1, np.uint64)[0] >> 1)
        return replace(request, temperature=self.options.temperature[attempt], seed=seed)

    def record(self, result: WindowResult) -> None:
        """Take the result of the window `next_window` returned: retry it hotter, or keep it."""
        if self._request is None or self._retry:
            raise RuntimeError("record() needs a window from next_window() first")
        self.windows += 1
        text = self.tokenizer.decode_text(result.tokens).strip()
        ratio = compression_ratio(text)
        if self._needs_fallback(result, ratio) and self._attempt + 1 < len(self.options.temperature):
            self._retry = True
            return
        self._request = None
        self._advance(result, ratio)

    def _needs_fallback(self, result: WindowResult, ratio: float) -> bool:
        """openai's `decode_with_fallback` test."""
        o = self.options
        needs_fallback = False
        if o.compression_ratio_threshold is not None and ratio > o.compression_ratio_threshold:
            needs_fallback = True  # too repetitive
        if o.logprob_threshold is not None and result.avg_logprob < o.logprob_threshold:
            needs_fallback = True  # average log probability is too low
        if (o.no_speech_threshold is not None and result.no_speech_prob > o.no_speech_threshold
                and o.logprob_threshold is not None and result.avg_logprob < o.logprob_threshold):
            needs_fallback = False  # silence
        return needs_fallback

    def _advance(self, result: WindowResult, ratio: float) -> None:
        o, tok, tokens = self.options, self.tokenizer, result.tokens
        seek, segment_size = self.seek, self.segment_size
        time_offset = float(seek * HOP_LENGTH / SAMPLE_RATE)
        segment_duration = segment_size * HOP_LENGTH / SAMPLE_RATE

        if o.no_speech_threshold is not None:
            # no voice activity: skip the window, unless the logprob is high enough
            should_skip = result.no_speech_prob > o.no_speech_threshold
            if o.logprob_threshold is not None and result.avg_logprob > o.logprob_threshold:
                should_skip = False
            if should_skip:
                self.seek += segment_size  # fast-forward to the next segment boundary
                return

        def new_segment(start: float, end: float, seg_tokens: list[int]) -> Segment:
            return Segment(id=0, seek=seek, start=start, end=end,
                           text=tok.decode_text([t for t in seg_tokens if t < tok.eot]), tokens=list(seg_tokens),
                           temperature=result.temperature, avg_logprob=result.avg_logprob,
                           compression_ratio=ratio, no_speech_prob=result.no_speech_prob)

        tb = tok.timestamp_begin
        current_segments = []
        slices, single_timestamp_ending = split_at_timestamps(tokens, tb)
        if slices:  # the output has two consecutive timestamp tokens
            for start, end in slices:
                sliced = tokens[start:end]
                current_segments.append(new_segment(time_offset + (sliced[0] - tb) * TIME_PRECISION,
                                                    time_offset + (sliced[-1] - tb) * TIME_PRECISION, sliced))
            if single_timestamp_ending:
                # a single timestamp at the end means no speech after the last timestamp
                self.seek += segment_size
            else:
                # otherwise ignore the unfinished segment and seek to the last timestamp
                last_timestamp_pos = tokens[slices[-1][1] - 1] - tb
                self.seek += last_timestamp_pos * INPUT_STRIDE
        else:
            duration = segment_duration
            timestamps = [t for t in tokens if t >= tb]
            if timestamps and timestamps[-1] != tb:
                # no consecutive timestamps but a timestamp: use the last one
                duration = (timestamps[-1] - tb) * TIME_PRECISION
            current_segments.append(new_segment(time_offset, time_offset + duration, tokens))
            self.seek += segment_size

        # an instantaneous segment or one without text is cleared
        for segment in current_segments:
            if segment.start == segment.end or segment.text.strip() == "":
                segment.text, segment.tokens = "", []
        for segment in current_segments:
            segment.id = len(self.all_segments)
            self.all_segments.append(segment)
            self.all_tokens.extend(segment.tokens)

        if not o.condition_on_previous_text or result.temperature > 0.5:
            # do not feed the prompt tokens if a high temperature was used
            self.prompt_reset_since = len(self.all_tokens)

    @property
    def retrying(self) -> bool:
        """The last result failed its checks; next_window() returns the same window, hotter."""
        return self._retry

    # ---------------------------------------------------------------- the result
    def result(self) -> Transcription:
        tokens = self.all_tokens[len(self.initial_prompt_tokens):]
        return Transcription(text=self.tokenizer.decode_text(tokens), tokens=tokens, language=self.language,
                             segments=self.all_segments, duration=self.duration)


def run_job(job: LongformJob, decode: Callable[[WindowRequest], WindowResult],
            progress: Callable[[int, int], None] | None = None) -> Transcription:
    """Drive `job` to the end, one window at a time, with `decode`. `progress(seek, frames)` is
    called after every kept window (mel frames done, frames in all)."""
    start = time.perf_counter()
    while (request := job.next_window()) is not None:
        job.record(decode(request))
        if progress is not None and not job.retrying:
            progress(min(job.seek, job.content_frames), job.content_frames)
    out = job.result()
    out.stats = Stats(seconds=time.perf_counter() - start)
    return out

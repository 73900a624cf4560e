"""Long-form transcription: openai-whisper's `transcribe()` (whisper/transcribe.py) as a job.

A `LongformJob` walks the recording's log-mel in 30 s windows. `next_window()` says which window
to decode next (the same window again at the next temperature after a failed check), `record()`
takes its result and moves `seek` by the predicted timestamps, exactly as openai does:
segments cut at consecutive timestamps, a single timestamp at the end means no speech after it,
otherwise seek to the last timestamp; windows judged silent are skipped; the previous windows'
tokens prompt the next one unless a high temperature was needed.

One addition to openai's loop (`TranscribeOptions.skip_silence`, on by default): a window whose
audio holds no signal at all (`audio.is_silent`: digital silence or dither, or nothing within
80 dB of the recording's loudest sound) is skipped without being decoded, as openai's no-speech
rule skips a silent window it has decoded. Whisper decodes such windows into confident
hallucinations (" you", "Thank you.") that the rule keeps because their avg_logprob is high;
windows holding any sound are decoded exactly as openai does. The job never decodes: windows
of many jobs can share a running batch (`run_job` drives one job sequentially).

With word timestamps, a kept window waits for its alignment pass (`alignment_request`, answered
with `add_alignment`) before its segments are final: the words (timing.py) may move segment
bounds, `seek` goes to the end of the last word, and with `hallucination_silence_threshold`
silence before a likely hallucination is skipped, as openai's `transcribe()` does.

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

from ..audio import HOP_LENGTH, N_FRAMES, SAMPLE_RATE, is_silent, pad_or_trim
from ..config import TranscribeOptions
from ..constants import FRAMES_PER_SECOND, N_AUDIO_CTX, N_TEXT_CTX, NO_LIMIT, TIME_PRECISION
from ..results import Segment, Stats, Transcription
from ..tokenizer import Tokenizer, split_at_timestamps
from .timing import AlignmentRequest, add_word_timestamps, find_alignment, get_end, is_segment_anomaly, \
    next_words_segment
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
        self.floor = float(mel_full.max()) - 2.0 if self.content_frames else 0.0  # log10 power max - 8, normalized
        self.silent_windows = 0  # windows skipped undecoded (skip_silence)
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
        self.last_speech_timestamp = 0.0  # end of the last word so far (word timestamps)
        self.alignment_request: AlignmentRequest | None = None  # a kept window waiting for its alignment pass
        self._window_words = None  # (segments, result, seek, segment_size, single_timestamp_ending) of that window
        self._request: WindowRequest | None = None  # the window being decoded
        self._attempt = 0  # index into options.temperature
        self._retry = False  # the last result failed its checks: decode it again, hotter

    # ---------------------------------------------------------------- the seek loop
    @property
    def done(self) -> bool:
        return self._request is None and self.alignment_request is None and self.seek >= self.content_frames

    def next_window(self) -> WindowRequest | None:
        """The next window to decode (the same one at the next temperature after a failure), or
        None when the recording is done. Call `record` with its result before asking again."""
        if self.alignment_request is not None:
            raise RuntimeError("add_alignment() the kept window's alignment first")
        if self._request is not None:
            if not self._retry:
                raise RuntimeError("record() the result of the previous window first")
            self._retry = False
            self._attempt += 1
            self._request = self._at_attempt(self._request, self._attempt)
            return self._request
        while self.seek < self.content_frames:
            self.segment_size = min(N_FRAMES, self.content_frames - self.seek)
            if not (self.options.skip_silence and self.is_silent_at(self.seek)):
                break
            self.seek += self.segment_size  # as openai skips a window judged silent
            self.silent_windows += 1
        else:
            return None
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

    def is_silent_at(self, seek: int) -> bool:
        """Whether the window starting at mel frame `seek` holds no signal (see the module docstring)."""
        return is_silent(self.mel[:, seek:seek + N_FRAMES], self.floor)

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

        if o.word_timestamps:
            text_tokens = [t for segment in current_segments for t in segment.tokens if t < tok.eot]
            self._window_words = (current_segments, result, seek, segment_size, single_timestamp_ending)
            if text_tokens:  # openai aligns nothing (and runs no pass) without text
                prompt = tok.prompt(self.language, o.task)
                self.alignment_request = AlignmentRequest(prompt + text_tokens + [tok.eot], len(prompt) - 1,
                                                          text_tokens, segment_size)
            else:
                self.add_alignment(None, [])
            return
        self._commit(current_segments, result)

    # ---------------------------------------------------------------- word timestamps
    def add_alignment(self, weights: torch.Tensor | None, text_token_probs: list[float]) -> None:
        """Finish the window waiting for words with its alignment pass's output (`alignment.py`):
        words, then openai's long-form adjustments that use them."""
        if self._window_words is None:
            raise RuntimeError("no kept window is waiting for its alignment")
        current_segments, result, previous_seek, segment_size, single_timestamp_ending = self._window_words
        request, self.alignment_request, self._window_words = self.alignment_request, None, None
        o = self.options
        alignment = [] if request is None else find_alignment(self.tokenizer, self.language, request, weights,
                                                              text_token_probs)
        add_word_timestamps(current_segments, alignment, self.tokenizer, prepend_punctuations=o.prepend_punctuations,
                            append_punctuations=o.append_punctuations,
                            last_speech_timestamp=self.last_speech_timestamp)
        time_offset = float(previous_seek * HOP_LENGTH / SAMPLE_RATE)
        window_end_time = float((previous_seek + N_FRAMES) * HOP_LENGTH / SAMPLE_RATE)
        if not single_timestamp_ending:
            last_word_end = get_end(current_segments)
            if last_word_end is not None and last_word_end > time_offset:
                self.seek = round(last_word_end * FRAMES_PER_SECOND)

        threshold = o.hallucination_silence_threshold
        if threshold is not None:  # skip silence before possible hallucinations
            if not single_timestamp_ending:
                last_word_end = get_end(current_segments)
                if last_word_end is not None and last_word_end > time_offset:
                    remaining_duration = window_end_time - last_word_end
                    if remaining_duration > threshold:
                        self.seek = round(last_word_end * FRAMES_PER_SECOND)
                    else:
                        self.seek = previous_seek + segment_size

            # if the first segment might be a hallucination, skip the leading silence
            first_segment = next_words_segment(current_segments)
            if first_segment is not None and is_segment_anomaly(first_segment):
                gap = first_segment.start - time_offset
                if gap > threshold:
                    self.seek = previous_seek + round(gap * FRAMES_PER_SECOND)
                    return  # the window's segments are dropped

            # skip silence before any possible hallucination surrounded by silence or more hallucinations
            hal_last_end = self.last_speech_timestamp
            for si in range(len(current_segments)):
                segment = current_segments[si]
                if not segment.words:
                    continue
                if is_segment_anomaly(segment):
                    next_segment = next_words_segment(current_segments[si + 1:])
                    if next_segment is not None:
                        hal_next_start = next_segment.words[0].start
                    else:
                        hal_next_start = time_offset + segment_size * HOP_LENGTH / SAMPLE_RATE
                    silence_before = (segment.start - hal_last_end > threshold or segment.start < threshold
                                      or segment.start - time_offset < 2.0)
                    silence_after = (hal_next_start - segment.end > threshold or is_segment_anomaly(next_segment)
                                     or window_end_time - segment.end < 2.0)
                    if silence_before and silence_after:
                        self.seek = round(max(time_offset + 1, segment.start) * FRAMES_PER_SECOND)
                        if self.duration - segment.end < threshold:
                            self.seek = self.content_frames
                        current_segments[si:] = []
                        break
                hal_last_end = segment.end

        last_word_end = get_end(current_segments)
        if last_word_end is not None:
            self.last_speech_timestamp = last_word_end
        self._commit(current_segments, result)

    def _commit(self, current_segments: list[Segment], result: WindowResult) -> None:
        """Keep the window's segments (cleared when instantaneous or empty) and reset the prompt
        after a high temperature."""
        o = self.options
        for segment in current_segments:
            if segment.start == segment.end or segment.text.strip() == "":
                segment.text, segment.tokens = "", []
                if segment.words is not None:
                    segment.words = []
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
            progress: Callable[[int, int], None] | None = None, align=None) -> Transcription:
    """Drive `job` to the end, one window at a time, with `decode` (and `align`, the alignment
    pass of a kept window, with word timestamps: `ReferenceWindowDecoder.align`).
    `progress(seek, frames)` is called after every kept window (mel frames done, frames in all)."""
    start = time.perf_counter()
    while (request := job.next_window()) is not None:
        job.record(decode(request))
        if job.alignment_request is not None:
            if align is None:
                raise ValueError("word timestamps need `align`, the windows' alignment pass")
            job.add_alignment(*align(job.alignment_request))
        if progress is not None and not job.retrying:
            progress(min(job.seek, job.content_frames), job.content_frames)
    out = job.result()
    out.stats = Stats(seconds=time.perf_counter() - start)
    return out

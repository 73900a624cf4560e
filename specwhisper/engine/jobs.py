"""Short-form jobs: one window of at most 30 s decoded with the standard prompt (no timestamps),
the way `transformers` generate and openai-whisper's `decode()` decode one window. A window
without signal (`audio.is_silent`: digital silence or dither) is not decoded: its text is empty
and no language is guessed from it (Whisper turns such windows into confident hallucinations)."""
from __future__ import annotations

from ..audio import N_FRAMES, is_silent, pad_or_trim
from ..config import DecodeOptions
from ..results import Segment, Transcription
from .scheduler import Window
from .slots import SeqOutput, SeqSpec


class ShortJob:
    def __init__(self, mel, duration: float, opts: DecodeOptions, tokenizer, max_positions: int, seed: int,
                 draft_mel=None):
        self.mel, self.duration, self.opts, self.tok = mel, duration, opts, tokenizer
        self.draft_mel = draft_mel  # the draft's log-mel of the same audio (`Drafter.own_mels`), or None
        self.max_positions, self.seed = max_positions, seed
        self.output: SeqOutput | None = None
        self.language = opts.language.lower() if opts.language and tokenizer.multilingual else None
        self.sent = False
        self.silent = is_silent(mel)

    def prompt(self, language: str | None) -> list[int]:
        return self.tok.prompt(language if self.tok.multilingual else self.opts.language, self.opts.task)

    def spec(self, language: str | None) -> SeqSpec:
        prompt = self.prompt(language)
        o = self.opts
        max_new = o.max_new_tokens if o.max_new_tokens is not None else self.max_positions - len(prompt)
        self.language = language
        return SeqSpec(prompt, language if self.tok.multilingual else "en", o.task, max_new, o.temperature,
                       o.top_p, self.seed, num_draft_tokens=o.num_draft_tokens)

    def next_window(self) -> Window | None:
        if self.sent:
            return None
        self.sent = True
        if self.silent:
            return None
        return Window(self.mel, self.spec, self.language, draft_mel=self.draft_mel)

    def record(self, output: SeqOutput, language: str | None) -> None:
        self.output, self.language = output, language

    def result(self) -> Transcription:
        if self.output is None:  # silent: nothing decoded
            return Transcription("", [], self.language, segments=[], duration=self.duration)
        tokens = self.output.tokens
        text = self.tok.decode(tokens)
        segment = Segment(0, 0, 0.0, self.duration, text, tokens, self.opts.temperature,
                          no_speech_prob=self.output.no_speech_prob)
        return Transcription(text, tokens, self.language if self.tok.multilingual else None,
                             segments=[segment], duration=self.duration)


class LongformRequest:
    """A long-form request for the scheduler: openai-whisper's seek loop (`LongformJob`), its
    windows decoded by the runner (speculative inside each window when a draft is given).

    The job is made once the language is known: with `options.language` None on a multilingual
    target, the first window goes out with language None, the scheduler detects it from that
    window's encoder output, and the job starts with it (openai detects on the first 30 s too;
    with `skip_silence`, on the first 30 s window that holds signal, and a recording silent
    throughout gets no language). A window's encoder output is kept for its fallback retries."""

    def __init__(self, mel_full, options, tokenizer, seed: int, num_draft_tokens, progress=None,
                 draft_mel_full=None):
        self.mel_full, self.options, self.tok, self.seed = mel_full, options, tokenizer, seed
        # the draft's log-mel of the whole recording (`Drafter.own_mels`): each window's is cut at
        # the same frames as the target's (both front ends hop 10 ms); None: the target's serves
        self.draft_mel_full = draft_mel_full
        self.k, self.progress = num_draft_tokens, progress
        self.on_segment = None  # called with each kept segment, in order
        self.on_window = None  # called with (WindowRequest, SeqOutput, encoder output) of each window decoded
        self.sample_len = None  # tokens per window at most (None: openai's 224)
        self.segments_sent = 0
        self.job = None
        self.silent_throughout = False  # multilingual, no language given, and no window with signal
        self.request = None  # the WindowRequest being decoded
        self.kept = (None, None)  # (seek, encoder output) of the last window
        self.detect_seek = self._first_sound() if options.skip_silence else 0  # None: silent throughout
        start = self.detect_seek or 0
        self.first_mel = pad_or_trim(mel_full[:, start:start + N_FRAMES], N_FRAMES)

    def _first_sound(self) -> int | None:
        """The mel frame where the first window with signal starts (the job's windows, as it
        skips silent ones, start at multiples of 30 s until the first is decoded), or None."""
        floor = float(self.mel_full.max()) - 2.0
        for seek in range(0, self.mel_full.shape[-1], N_FRAMES):
            if not is_silent(self.mel_full[:, seek:seek + N_FRAMES], floor):
                return seek
        return None

    def _start(self, language):
        from dataclasses import replace

        from ..longform.transcribe import LongformJob

        options = self.options
        if language is not None and options.language is None:
            options = replace(options, language=language)
        self.job = LongformJob(self.mel_full, self.tok, options, self.seed)

    def next_window(self) -> Window | None:
        if self.job is None and self.options.language is None and self.tok.multilingual:
            if self.detect_seek is not None:
                return Window(self.first_mel, self._first_spec, None,
                              draft_mel=self._draft_mel(self.detect_seek, N_FRAMES))
            self._start("en")  # silent throughout: no window is decoded, no language reported
            self.silent_throughout = True
        if self.job is None:
            self._start(None)
        self.request = self.job.next_window()
        if self.request is None:
            return None
        seek, features = self.kept
        return Window(self.request.mel, self._spec, self.request.language,
                      features if seek == self.request.seek else None,
                      self._draft_mel(self.request.seek, self.job.segment_size))

    def _draft_mel(self, seek: int, frames: int):
        """The draft's mel of the window of `frames` frames at `seek`, as the target's is cut."""
        if self.draft_mel_full is None:
            return None
        return pad_or_trim(self.draft_mel_full[:, seek:seek + frames], N_FRAMES)

    def _first_spec(self, language) -> SeqSpec:
        self._start(language)
        self.request = self.job.next_window()
        return self._spec(language)

    def _spec(self, language) -> SeqSpec:
        r = self.request
        prompt = list(r.prompt)
        max_new = min(r.max_new_tokens, self.sample_len or r.max_new_tokens, 449 - len(prompt))  # openai stops past 448
        return SeqSpec(prompt, r.language or "en", r.task, max_new, r.temperature, r.top_p, r.seed,
                       timestamps=r.timestamps, max_initial_timestamp=r.max_initial_timestamp,
                       num_draft_tokens=self.k, sot_index=prompt.index(self.tok.sot), need_logprobs=True)

    def keep_features(self, features) -> None:
        self.kept = (self.request.seek if self.request is not None else self.detect_seek, features)

    def record(self, output: SeqOutput, language: str | None) -> None:
        from ..longform.window import WindowResult

        tokens = output.tokens
        if self.on_window is not None:
            self.on_window(self.request, output, self.kept[1])
        self.job.record(WindowResult(tokens, output.sum_logprob, output.sum_logprob / (len(tokens) + 1),
                                     output.no_speech_prob, self.request.temperature, self.request.language))
        if not self.job.retrying and self.job.alignment_request is None:
            self._kept()

    @property
    def alignment_request(self):
        """The kept window's `timing.AlignmentRequest` while it waits for its alignment pass
        (word timestamps), else None."""
        return self.job.alignment_request if self.job is not None else None

    def add_alignment(self, weights, text_token_probs) -> None:
        self.job.add_alignment(weights, text_token_probs)
        self._kept()

    def _kept(self) -> None:
        """A window is final: report progress and its segments."""
        if self.progress is not None:
            self.progress(min(self.job.seek, self.job.content_frames), self.job.content_frames)
        if self.on_segment is not None:
            for segment in self.job.all_segments[self.segments_sent:]:
                self.on_segment(segment)
            self.segments_sent = len(self.job.all_segments)

    def result(self) -> Transcription:
        out = self.job.result()
        if self.silent_throughout:
            out.language = None
        return out

"""Short-form jobs: one window of at most 30 s decoded with the standard prompt (no timestamps),
the way `transformers` generate and openai-whisper's `decode()` decode one window."""
from __future__ import annotations

from .config import DecodeOptions
from .results import Segment, Transcription
from .runner import SeqOutput, SeqSpec
from .scheduler import Window


class ShortJob:
    def __init__(self, mel, duration: float, opts: DecodeOptions, tokenizer, max_positions: int, seed: int):
        self.mel, self.duration, self.opts, self.tok = mel, duration, opts, tokenizer
        self.max_positions, self.seed = max_positions, seed
        self.output: SeqOutput | None = None
        self.language = opts.language.lower() if opts.language and tokenizer.multilingual else None
        self.sent = False

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
        return Window(self.mel, self.spec, self.language)

    def record(self, output: SeqOutput, language: str | None) -> None:
        self.output, self.language = output, language

    def result(self) -> Transcription:
        tokens = self.output.tokens
        text = self.tok.decode(tokens)
        segment = Segment(0, 0, 0.0, self.duration, text, tokens, self.opts.temperature,
                          no_speech_prob=self.output.no_speech_prob)
        return Transcription(text, tokens, self.language if self.tok.multilingual else None,
                             segments=[segment], duration=self.duration)

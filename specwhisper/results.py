"""What decoding returns: `Transcription` (text, tokens, segments, stats) and its parts."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    drafted: int = 0  # draft tokens proposed to the target
    accepted: int = 0  # draft tokens the target kept
    target_passes: int = 0  # target decoder forward passes (prefill included)
    draft_passes: int = 0  # draft decoder forward passes (prefill included)
    acceptance_rate: float = 1.0  # accepted / drafted (1.0 when nothing was drafted)
    tokens_per_pass: float = 0.0  # generated tokens incl. EOT / target passes
    seconds: float = 0.0  # wall time from admission to the last token
    draft_skipped: str | None = None  # why the draft stood aside for this request (None: it did not)


@dataclass
class Word:
    """One word of a segment, as openai-whisper's `word_timestamps=True` reports it."""

    word: str  # its text, with the leading space and the punctuation merged into it
    start: float  # seconds from the start of the audio (0.01 s steps, except where clipped)
    end: float  # seconds
    probability: float  # mean probability of its tokens

    def to_dict(self) -> dict:
        return {"word": self.word, "start": float(self.start), "end": float(self.end),
                "probability": float(self.probability)}


@dataclass
class Segment:
    """One timed piece of a transcript, as openai-whisper's `transcribe()` reports it."""

    id: int  # index in the transcript
    seek: int  # mel frame (10 ms) where the window that produced it started
    start: float  # seconds from the start of the audio
    end: float  # seconds
    text: str  # decoded text of the segment
    tokens: list[int]  # its token ids (timestamps included when timestamps were predicted)
    temperature: float = 0.0  # temperature of the decode that was kept
    avg_logprob: float = 0.0  # mean log-probability of the window's tokens
    compression_ratio: float = 0.0  # gzip compression ratio of the window's text
    no_speech_prob: float = 0.0  # probability of <|nospeech|> at the start of the window
    words: list[Word] | None = None  # word timestamps (None: not asked for)

    def to_dict(self) -> dict:
        """openai's segment dict; `words` only when word timestamps were asked for."""
        d = asdict(self)
        d.pop("words")
        if self.words is not None:
            d["words"] = [w.to_dict() for w in self.words]
        return d


@dataclass
class Transcription:
    text: str  # whole transcript, special tokens removed
    tokens: list[int]  # generated ids after the prompt, without EOT (all windows for long-form)
    language: str | None  # language code used (None for English-only models)
    stats: Stats = field(default_factory=Stats)
    segments: list[Segment] = field(default_factory=list)  # timed segments (one for a short window)
    duration: float = 0.0  # seconds of audio transcribed

"""Model and decoding configuration as frozen dataclasses (config is data)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .constants import MAX_INITIAL_TIMESTAMP, N_AUDIO_CTX, N_TEXT_CTX as MAX_TARGET_POSITIONS

VOCAB_SIZES = (51864, 51865, 51866)  # English-only, multilingual, large-v3


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}: {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what}: {path} is not valid JSON ({exc})") from None


@dataclass(frozen=True)
class WhisperConfig:
    d_model: int  # hidden width of encoder and decoder
    encoder_layers: int  # number of encoder blocks
    encoder_attention_heads: int  # heads per encoder self-attention
    encoder_ffn_dim: int  # encoder MLP width
    decoder_layers: int  # number of decoder blocks
    decoder_attention_heads: int  # heads per decoder self/cross attention
    decoder_ffn_dim: int  # decoder MLP width
    vocab_size: int  # 51864 (.en), 51865 (multilingual) or 51866 (v3)
    num_mel_bins: int  # 80, or 128 for large-v3
    max_source_positions: int = N_AUDIO_CTX  # encoder frames after the stride-2 conv
    max_target_positions: int = MAX_TARGET_POSITIONS  # decoder positions (prompt + generated)

    def __post_init__(self):
        if self.vocab_size not in VOCAB_SIZES:
            raise ValueError(f"vocab_size {self.vocab_size} is not a Whisper vocabulary {VOCAB_SIZES}")
        if self.num_mel_bins not in (80, 128):
            raise ValueError(f"num_mel_bins must be 80 or 128, got {self.num_mel_bins}")
        for name in ("encoder_attention_heads", "decoder_attention_heads"):
            if self.d_model % getattr(self, name):
                raise ValueError(f"d_model {self.d_model} is not divisible by {name} {getattr(self, name)}")
        if min(self.encoder_layers, self.decoder_layers, self.d_model) < 1:
            raise ValueError("layer counts and d_model must be positive")

    @property
    def is_multilingual(self) -> bool:
        return self.vocab_size >= 51865

    @classmethod
    def from_hf(cls, folder: str | Path) -> "WhisperConfig":
        """Read a Hugging Face Whisper `config.json`."""
        raw = read_json(Path(folder) / "config.json", "Whisper config")
        if raw.get("model_type", "whisper") != "whisper":
            raise ValueError(f"{folder}/config.json has model_type {raw['model_type']!r}, expected 'whisper'")
        act = raw.get("activation_function", "gelu")
        if act != "gelu":
            raise ValueError(f"{folder}: activation_function {act!r} is not supported (only 'gelu')")
        if raw.get("scale_embedding", False):
            raise ValueError(f"{folder}: scale_embedding=true is not supported")
        try:
            return cls(**{name: int(raw[name]) for name in (
                "d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim",
                "decoder_layers", "decoder_attention_heads", "decoder_ffn_dim", "vocab_size",
                "num_mel_bins")},
                max_source_positions=int(raw.get("max_source_positions", 1500)),
                max_target_positions=int(raw.get("max_target_positions", MAX_TARGET_POSITIONS)))
        except KeyError as exc:
            raise ValueError(f"{folder}/config.json is missing the field {exc.args[0]!r}") from None


@dataclass(frozen=True)
class DecodeOptions:
    language: str | None = None  # language code; None detects it (multilingual) or "en" (English-only)
    task: str = "transcribe"  # "transcribe" or "translate"
    temperature: float = 0.0  # 0 is greedy; > 0 samples from softmax(logits / temperature)
    top_p: float = 1.0  # nucleus mass kept when sampling
    num_draft_tokens: int | None = None  # k per verify pass; None adapts it to the acceptance
    max_new_tokens: int | None = None  # generated tokens incl. EOT; None fills the 448 positions
    seed: int | None = None  # sampling seed (reproducible results)

    def __post_init__(self):
        if self.task not in ("transcribe", "translate"):
            raise ValueError(f"task must be 'transcribe' or 'translate', got {self.task!r}")
        if not (self.temperature >= 0.0 and self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.num_draft_tokens is not None and not 1 <= self.num_draft_tokens <= 16:
            raise ValueError(f"num_draft_tokens must be in 1..16 or None, got {self.num_draft_tokens}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


DEFAULT_FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@dataclass(frozen=True)
class TranscribeOptions:
    """Long-form transcription (openai-whisper's `transcribe()` arguments, same defaults)."""

    temperature: tuple = DEFAULT_FALLBACK_TEMPERATURES  # tried in order while a window fails; a float: no fallback
    compression_ratio_threshold: float | None = 2.4  # gzip ratio above this fails a window (too repetitive)
    logprob_threshold: float | None = -1.0  # avg_logprob below this fails a window
    no_speech_threshold: float | None = 0.6  # no_speech_prob above this + a failed logprob test: silence, skipped
    condition_on_previous_text: bool = True  # previous windows' tokens prompt the next window
    initial_prompt: str | None = None  # text prompting the first window (names, spelling, style)
    language: str | None = None  # language code; None: "en" (English-only) or detected on the first 30 s
    task: str = "transcribe"  # "transcribe" or "translate"
    top_p: float = 1.0  # nucleus mass kept when sampling (1.0: openai's plain sampling)
    max_initial_timestamp: float | None = MAX_INITIAL_TIMESTAMP  # seconds: latest first timestamp of a window; None: no limit
    timestamps: bool = True  # predict timestamp tokens (segments); False: one segment per window
    skip_silence: bool = True  # windows without signal (audio.is_silent) are skipped undecoded; False: openai's way
    word_timestamps: bool = False  # openai's word_timestamps: each segment gets its words (longform/timing.py)
    prepend_punctuations: str = "\"'“¿([{-"  # with word timestamps: merged into the following word
    append_punctuations: str = "\"'.。,，!！?？:：”)]}、"  # with word timestamps: merged into the preceding word
    hallucination_silence_threshold: float | None = None  # seconds; with word timestamps: skip silence before a likely hallucination

    def __post_init__(self):
        temps = self.temperature
        temps = (temps,) if isinstance(temps, (int, float)) else tuple(temps)
        if not temps:
            raise ValueError("temperature needs at least one value")
        for t in temps:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t < float("inf"):
                raise ValueError(f"temperatures must be finite numbers >= 0, got {self.temperature!r}")
        object.__setattr__(self, "temperature", tuple(float(t) for t in temps))
        if self.task not in ("transcribe", "translate"):
            raise ValueError(f"task must be 'transcribe' or 'translate', got {self.task!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_initial_timestamp is not None and not 0.0 <= self.max_initial_timestamp <= 30.0:
            raise ValueError(f"max_initial_timestamp must be in [0, 30] seconds or None, got {self.max_initial_timestamp}")
        if self.no_speech_threshold is not None and not 0.0 <= self.no_speech_threshold <= 1.0:
            raise ValueError(f"no_speech_threshold must be a probability in [0, 1] or None, got {self.no_speech_threshold}")
        if self.compression_ratio_threshold is not None and not self.compression_ratio_threshold > 0.0:
            raise ValueError(f"compression_ratio_threshold must be > 0 or None, got {self.compression_ratio_threshold}")
        if self.logprob_threshold is not None and self.logprob_threshold != self.logprob_threshold:
            raise ValueError("logprob_threshold must be a number or None")
        threshold = self.hallucination_silence_threshold
        if threshold is not None:
            if not self.word_timestamps:
                raise ValueError("hallucination_silence_threshold needs word_timestamps=True")
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < threshold < float("inf"):
                raise ValueError(f"hallucination_silence_threshold must be a number of seconds > 0 or None, got {threshold!r}")
        for name in ("prepend_punctuations", "append_punctuations"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")

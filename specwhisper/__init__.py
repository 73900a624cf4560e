"""specwhisper: exact speculative decoding for Whisper."""
from .audio import load_audio, log_mel_spectrogram
from .engine.engine import Engine
from .results import Segment, Stats, Transcription

__all__ = ["Engine", "Transcription", "Segment", "Stats", "load_audio", "log_mel_spectrogram"]
__version__ = "0.1.0"

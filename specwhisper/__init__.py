"""specwhisper: exact speculative decoding for Whisper."""
from .audio import load_audio, log_mel_spectrogram
from .engine import Engine, Stats, Transcription

__all__ = ["Engine", "Transcription", "Stats", "load_audio", "log_mel_spectrogram"]
__version__ = "0.1.0"

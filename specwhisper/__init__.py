"""specwhisper: exact speculative decoding for Whisper."""
import os as _os
import sys as _sys

if "torch" not in _sys.modules:
    # PyTorch's CPU allocator reads this once, when torch starts: its buffers of 2 MB and more are
    # then advised into 2 MB transparent huge pages, where Linux enables them ("madvise" or
    # "always"). The buffers a decode step streams get their own aligned huge-page mappings
    # (`model.memory.huge_zeros`, README "Huge pages"), which THP_MEM_ALLOC_ENABLE=0 also turns
    # off. Importing torch before specwhisper leaves torch's setting alone.
    _os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from .audio import load_audio, log_mel_spectrogram
from .engine.engine import Engine
from .results import Segment, Stats, Transcription

__all__ = ["Engine", "Transcription", "Segment", "Stats", "load_audio", "log_mel_spectrogram"]
__version__ = "0.1.0"

"""specwhisper: exact speculative decoding for Whisper."""
import os as _os
import sys as _sys

if "torch" not in _sys.modules:
    # PyTorch's CPU allocator reads this once, when torch starts: buffers of 2 MB and more (a
    # decoder's weights, the screened head, the KV caches) are then advised into 2 MB transparent
    # huge pages, where Linux enables them ("madvise" or "always"). A decode step streams ~150 MB
    # (base); in 4 KB pages that is ~37,000 TLB misses a step. Same values, fewer page walks: a
    # step 5-8% faster (README, "Huge pages"). THP_MEM_ALLOC_ENABLE=0 opts out; importing torch
    # before specwhisper leaves torch's choice alone.
    _os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from .audio import load_audio, log_mel_spectrogram
from .engine.engine import Engine
from .results import Segment, Stats, Transcription

__all__ = ["Engine", "Transcription", "Segment", "Stats", "load_audio", "log_mel_spectrogram"]
__version__ = "0.1.0"

"""Whisper's geometry and the engine's fixed limits: the one home of these numbers."""
from __future__ import annotations

SAMPLE_RATE = 16000  # audio samples per second
N_FFT = 400  # STFT window (25 ms)
HOP_LENGTH = 160  # samples between mel frames (10 ms)
CHUNK_SECONDS = 30  # one window of audio
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480000 samples in a window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 mel frames in a window
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100 mel frames per second
N_AUDIO_CTX = 1500  # encoder positions per window (stride-2 conv over the frames)
N_TEXT_CTX = 448  # decoder positions (prompt + generated tokens)
TIME_PRECISION = (N_FRAMES // N_AUDIO_CTX) * HOP_LENGTH / SAMPLE_RATE  # seconds per timestamp step: 0.02
MAX_INITIAL_TIMESTAMP = 1.0  # seconds: openai's latest first timestamp of a window

MAX_DRAFT_TOKENS = 16  # the most draft tokens one verify pass checks (a row's k)
MAX_ADAPTIVE_K = 8  # the largest k adaptive drafting chooses
CROSS_POOL = 2  # audio positions a compact CPU draft's cross-attention K/V average (`DraftSide`)

NO_PROPOSAL = -1  # a proposal slot without a usable draft token
NO_LIMIT = -1  # max_initial_timestamp index: no limit

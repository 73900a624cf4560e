"""Bundled speech samples: short English utterances synthesized by `make_samples.sh` (flite and
espeak-ng voices, 16 kHz mono 16-bit WAV) with their reference transcripts, and the ≈ 2 minute
recording of `specwhisper demo` (`make_demo.sh`: four flite voices in turns, FLAC)."""
from __future__ import annotations

import json
from pathlib import Path

SAMPLES_DIR = Path(__file__).parent


def references() -> dict[str, str]:
    """WAV file name -> the text that was synthesized, in `references.json` order."""
    entries = json.loads((SAMPLES_DIR / "references.json").read_text(encoding="utf-8"))
    return {entry["file"]: entry["text"] for entry in entries}


def sample_paths() -> list[Path]:
    """Paths of the bundled WAV files, in `references.json` order."""
    return [SAMPLES_DIR / name for name in references()]


def demo_recording() -> tuple[Path, str]:
    """(path of demo.flac, its reference transcript)."""
    entry = json.loads((SAMPLES_DIR / "demo.json").read_text(encoding="utf-8"))
    return SAMPLES_DIR / entry["file"], entry["text"]

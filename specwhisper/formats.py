"""Transcripts as files and API bodies: txt, srt, vtt, json, verbose_json (OpenAI's shapes)."""
from __future__ import annotations

import json

from .languages import LANGUAGES
from .results import Transcription

FORMATS = ("txt", "srt", "vtt", "json", "verbose_json")


def language_name(code: str | None) -> str | None:
    """'en' -> 'english' (OpenAI's verbose_json names languages in full)."""
    if code is None:
        return None
    return LANGUAGES.get(code, code)


def timestamp(seconds: float, decimal: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


def to_text(result: Transcription) -> str:
    return result.text + "\n"


def to_srt(result: Transcription) -> str:
    blocks = [f"{i}\n{timestamp(s.start, ',')} --> {timestamp(s.end, ',')}\n{s.text.strip()}\n"
              for i, s in enumerate(result.segments, start=1)]
    return "\n".join(blocks)


def to_vtt(result: Transcription) -> str:
    blocks = [f"{timestamp(s.start, '.')} --> {timestamp(s.end, '.')}\n{s.text.strip()}\n"
              for s in result.segments]
    return "WEBVTT\n\n" + "\n".join(blocks)


def to_verbose_json(result: Transcription, task: str = "transcribe") -> dict:
    return {"task": task, "language": language_name(result.language), "duration": result.duration,
            "text": result.text, "segments": [s.to_dict() for s in result.segments]}


def to_json(result: Transcription) -> dict:
    return {"text": result.text}


def render(result: Transcription, fmt: str, task: str = "transcribe") -> str:
    """The transcript in `fmt` (one of FORMATS) as a string."""
    if fmt == "txt":
        return to_text(result)
    if fmt == "srt":
        return to_srt(result)
    if fmt == "vtt":
        return to_vtt(result)
    if fmt == "json":
        return json.dumps(to_json(result), ensure_ascii=False) + "\n"
    if fmt == "verbose_json":
        return json.dumps(to_verbose_json(result, task), ensure_ascii=False, indent=2) + "\n"
    raise ValueError(f"unknown output format {fmt!r}; expected one of {FORMATS}")

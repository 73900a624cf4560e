"""Transcripts as files and API bodies: txt, srt, vtt, json, verbose_json (OpenAI's shapes)."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator

from .languages import LANGUAGES
from .results import Transcription

FORMATS = ("txt", "srt", "vtt", "json", "verbose_json")


def language_name(code: str | None) -> str | None:
    """'en' -> 'english' (OpenAI's verbose_json names languages in full)."""
    if code is None:
        return None
    return LANGUAGES.get(code, code)


def format_timestamp(seconds: float, always_include_hours: bool = False, decimal_marker: str = ".") -> str:
    """openai-whisper's subtitle timestamp: [hh:]mm:ss.mmm (hours when asked for or non-zero)."""
    if seconds < 0:
        raise ValueError(f"non-negative timestamp expected, got {seconds}")
    milliseconds = round(seconds * 1000.0)
    hours, milliseconds = divmod(milliseconds, 3_600_000)
    minutes, milliseconds = divmod(milliseconds, 60_000)
    seconds, milliseconds = divmod(milliseconds, 1_000)
    hours_marker = f"{hours:02d}:" if always_include_hours or hours > 0 else ""
    return f"{hours_marker}{minutes:02d}:{seconds:02d}{decimal_marker}{milliseconds:03d}"


def subtitle_words(result: Transcription, max_line_width: int | None, max_line_count: int | None,
                   max_words_per_line: int | None) -> Iterator[list[dict]]:
    """openai-whisper's subtitles from words: lines filled to `max_line_width` characters, at
    most `max_line_count` lines (or a pause over 3 s) per subtitle, else one subtitle per
    segment of at most `max_words_per_line` words per line. Yields lists of word dicts
    (word, start, end), a line break written into a word as a leading newline."""
    preserve_segments = max_line_count is None or max_line_width is None
    max_line_width = max_line_width or 1000
    max_words_per_line = max_words_per_line or 1000
    line_len, line_count = 0, 1
    subtitle: list[dict] = []
    last = next((w.start for s in result.segments for w in s.words), result.segments[0].start) or 0.0
    for segment in result.segments:
        chunk_index, words_count = 0, max_words_per_line
        while chunk_index < len(segment.words):
            remaining_words = len(segment.words) - chunk_index
            if max_words_per_line > remaining_words:
                words_count = remaining_words
            for i, original in enumerate(segment.words[chunk_index:chunk_index + words_count]):
                timing = {"word": original.word, "start": original.start, "end": original.end}
                long_pause = not preserve_segments and timing["start"] - last > 3.0
                has_room = line_len + len(timing["word"]) <= max_line_width
                seg_break = i == 0 and len(subtitle) > 0 and preserve_segments
                if line_len > 0 and has_room and not long_pause and not seg_break:
                    line_len += len(timing["word"])  # line continuation
                else:  # new line
                    timing["word"] = timing["word"].strip()
                    if (len(subtitle) > 0 and max_line_count is not None
                            and (long_pause or line_count >= max_line_count) or seg_break):
                        yield subtitle  # subtitle break
                        subtitle, line_count = [], 1
                    elif line_len > 0:
                        line_count += 1  # line break
                        timing["word"] = "\n" + timing["word"]
                    line_len = len(timing["word"].strip())
                subtitle.append(timing)
                last = timing["start"]
            chunk_index += max_words_per_line
    if len(subtitle) > 0:
        yield subtitle


def subtitles(result: Transcription, always_include_hours: bool, decimal_marker: str, *,
              max_line_width: int | None = None, max_line_count: int | None = None,
              highlight_words: bool = False, max_words_per_line: int | None = None) -> Iterator[tuple[str, str, str]]:
    """(start, end, text) cues as openai-whisper's srt/vtt writers make them: one per segment,
    or, when the segments have words, from `subtitle_words` (with `highlight_words`, one cue per
    word, the word underlined)."""
    def ts(seconds: float) -> str:
        return format_timestamp(seconds, always_include_hours, decimal_marker)

    if result.segments and result.segments[0].words is not None:
        for subtitle in subtitle_words(result, max_line_width, max_line_count, max_words_per_line):
            subtitle_start, subtitle_end = ts(subtitle[0]["start"]), ts(subtitle[-1]["end"])
            subtitle_text = "".join(word["word"] for word in subtitle)
            if not highlight_words:
                yield subtitle_start, subtitle_end, subtitle_text
                continue
            last = subtitle_start
            all_words = [timing["word"] for timing in subtitle]
            for i, this_word in enumerate(subtitle):
                start, end = ts(this_word["start"]), ts(this_word["end"])
                if last != start:
                    yield last, start, subtitle_text
                yield start, end, "".join(re.sub(r"^(\s*)(.*)$", r"\1<u>\2</u>", word) if j == i else word
                                          for j, word in enumerate(all_words))
                last = end
    else:
        for segment in result.segments:
            yield ts(segment.start), ts(segment.end), segment.text.strip().replace("-->", "->")


def to_text(result: Transcription) -> str:
    return result.text + "\n"


def to_srt(result: Transcription, **word_options) -> str:
    """SubRip, as openai-whisper's writer (`word_options`: see `subtitles`)."""
    return "".join(f"{i}\n{start} --> {end}\n{text}\n\n"
                   for i, (start, end, text) in enumerate(subtitles(result, True, ",", **word_options), start=1))


def to_vtt(result: Transcription, **word_options) -> str:
    """WebVTT, as openai-whisper's writer (`word_options`: see `subtitles`)."""
    return "WEBVTT\n\n" + "".join(f"{start} --> {end}\n{text}\n\n"
                                   for start, end, text in subtitles(result, False, ".", **word_options))


def to_verbose_json(result: Transcription, task: str = "transcribe", segments: bool = True,
                    words: bool | None = None) -> dict:
    """OpenAI's verbose_json: `segments` (with their words when word timestamps were asked for)
    and, with `words` (None: when the segments have words), the top-level `words` OpenAI's API
    returns for timestamp_granularities[]=word: [{word, start, end}], each word's text without
    its surrounding spaces and the punctuation word timestamps merged into it (as OpenAI's API
    lists words; a word of punctuation only is left out)."""
    from .longform.timing import PUNCTUATION

    out = {"task": task, "language": language_name(result.language), "duration": result.duration, "text": result.text}
    if segments:
        out["segments"] = [s.to_dict() for s in result.segments]
    if words is None:
        words = any(s.words is not None for s in result.segments)
    if words:
        out["words"] = [{"word": w.word.strip().strip(PUNCTUATION), "start": float(w.start), "end": float(w.end)}
                        for s in result.segments for w in (s.words or []) if w.word.strip().strip(PUNCTUATION)]
    return out


def to_json(result: Transcription) -> dict:
    return {"text": result.text}


def render(result: Transcription, fmt: str, task: str = "transcribe", **word_options) -> str:
    """The transcript in `fmt` (one of FORMATS) as a string; `word_options` (srt, vtt): see
    `subtitles`."""
    if fmt == "txt":
        return to_text(result)
    if fmt == "srt":
        return to_srt(result, **word_options)
    if fmt == "vtt":
        return to_vtt(result, **word_options)
    if fmt == "json":
        return json.dumps(to_json(result), ensure_ascii=False) + "\n"
    if fmt == "verbose_json":
        return json.dumps(to_verbose_json(result, task), ensure_ascii=False, indent=2) + "\n"
    raise ValueError(f"unknown output format {fmt!r}; expected one of {FORMATS}")

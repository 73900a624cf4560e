"""Word-level timestamps: openai-whisper's `word_timestamps=True` (whisper/timing.py), followed.

One teacher-forced target pass over a kept window's text tokens (`alignment.py`) gives the
cross-attention logits of the model's *alignment heads* [heads, tokens, 1500] and the text tokens'
probabilities. From them, as openai does: softmax over the window's audio frames, normalisation
over the tokens, a median filter (width 7) along time, the mean over heads, dynamic time warping
(DTW) of the tokens against the frames, the tokens split into words (at spaces, or at every whole
character for languages written without spaces), punctuation merged into its neighbour, and the
word times adjusted to the segments (`add_word_timestamps`). The long-form adjustments that use
the words (seek after the last word, skipping silence before hallucinations) are in transcribe.py.

Names follow openai's: alignment_heads, median_filter, dtw, find_alignment, split_to_word_tokens,
merge_punctuations, add_word_timestamps, word_anomaly_score, is_segment_anomaly.
"""
from __future__ import annotations

import base64
import gzip
import string
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..results import Segment, Word

TOKENS_PER_SECOND = 50  # encoder positions per second of audio (one per 20 ms)
MEDFILT_WIDTH = 7
PREPEND_PUNCTUATIONS = "\"'“¿([{-"  # merged into the following word
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"  # merged into the preceding word
PUNCTUATION = PREPEND_PUNCTUATIONS + APPEND_PUNCTUATIONS
SENTENCE_END_MARKS = ".。!！?？"
UNICODE_SPLIT_LANGUAGES = {"zh", "ja", "th", "lo", "my", "yue"}  # written without spaces between words

# ---------------------------------------------------------------- alignment heads
# openai-whisper's table (whisper/__init__.py `_ALIGNMENT_HEADS`): per model, a base85-encoded,
# gzipped (decoder layers, heads) boolean array of the cross-attention heads that follow the
# alignment between text and audio.
OPENAI_ALIGNMENT_HEADS = {
    "tiny.en": b"ABzY8J1N>@0{>%R00Bk>$p{7v037`oCl~+#00",
    "tiny": b"ABzY8bu8Lr0{>%RKn9Fp%m@SkK7Kt=7ytkO",
    "base.en": b"ABzY8;40c<0{>%RzzG;p*o+Vo09|#PsxSZm00",
    "base": b"ABzY8KQ!870{>%RzyTQH3`Q^yNP!>##QT-<FaQ7m",
    "small.en": b"ABzY8>?_)10{>%RpeA61k&I|OI3I$65C{;;pbCHh0B{qLQ;+}v00",
    "small": b"ABzY8DmU6=0{>%Rpa?J`kvJ6qF(V^F86#Xh7JUGMK}P<N0000",
    "medium.en": b"ABzY8usPae0{>%R7<zz_OvQ{)4kMa0BMw6u5rT}kRKX;$NfYBv00*Hl@qhsU00",
    "medium": b"ABzY8B0Jh+0{>%R7}kK1fFL7w6%<-Pf*t^=N)Qr&0RR9",
    "large-v1": b"ABzY8r9j$a0{>%R7#4sLmoOs{s)o3~84-RPdcFk!JR<kSfC2yj",
    "large-v2": b"ABzY8zd+h!0{>%R7=D0pU<_bnWW*tkYAhobTNnu$jnkEkXqp)j;w1Tzk)UH3X%SZd&fFZ2fC2yj",
    "large-v3": b"ABzY8gWO1E0{>%R7(9S+Kn!D~%ngiGaR?*L!iJG9p-nab0JQ=-{D1-g00",
    "large-v3-turbo": b"ABzY8j^C+e0{>%RARaKHP%t(lGR*)0g!tONPyhe`",
}

# openai's models by geometry: (vocab_size, num_mel_bins, d_model, encoder_layers, decoder_layers)
OPENAI_GEOMETRIES = {
    (51864, 80, 384, 4, 4): ("tiny.en",), (51865, 80, 384, 4, 4): ("tiny",),
    (51864, 80, 512, 6, 6): ("base.en",), (51865, 80, 512, 6, 6): ("base",),
    (51864, 80, 768, 12, 12): ("small.en",), (51865, 80, 768, 12, 12): ("small",),
    (51864, 80, 1024, 24, 24): ("medium.en",), (51865, 80, 1024, 24, 24): ("medium",),
    (51865, 80, 1280, 32, 32): ("large-v1", "large-v2"),  # one geometry, two tables
    (51866, 128, 1280, 32, 32): ("large-v3",), (51866, 128, 1280, 32, 4): ("large-v3-turbo",),
}


def decode_alignment_heads(dump: bytes, n_layers: int, n_heads: int) -> list[tuple[int, int]]:
    """openai's base85 + gzip boolean array -> [(layer, head)], in layer-major order."""
    mask = np.frombuffer(gzip.decompress(base64.b85decode(dump)), dtype=bool).reshape(n_layers, n_heads)
    return [(int(layer), int(head)) for layer, head in np.argwhere(mask)]


def alignment_heads(config, generation_config: dict) -> list[tuple[int, int]]:
    """The (layer, head) pairs whose cross-attention word timestamps read, sorted: the
    checkpoint's generation_config `alignment_heads` when it has them, else openai's table for
    the openai model of the same geometry. Raises ValueError when neither decides."""
    n_layers, n_heads = config.decoder_layers, config.decoder_attention_heads
    listed = generation_config.get("alignment_heads")
    if listed:
        heads = sorted({(int(layer), int(head)) for layer, head in listed})
        bad = [(layer, head) for layer, head in heads if not (0 <= layer < n_layers and 0 <= head < n_heads)]
        if bad:
            raise ValueError(f"generation_config alignment_heads {bad} are outside the decoder's "
                             f"{n_layers} layers x {n_heads} heads")
        return heads
    geometry = (config.vocab_size, config.num_mel_bins, config.d_model, config.encoder_layers, config.decoder_layers)
    names = OPENAI_GEOMETRIES.get(geometry, ())
    if len(names) == 1:
        return decode_alignment_heads(OPENAI_ALIGNMENT_HEADS[names[0]], n_layers, n_heads)
    why = (f"its geometry is shared by {' and '.join(names)}, whose alignment heads differ" if names else
           "its geometry is none of openai's models")
    raise ValueError(f"word timestamps need the model's alignment heads: the checkpoint's generation_config.json "
                     f"has no `alignment_heads` and {why}; add `alignment_heads` ([[layer, head], ...]) to it")


# ---------------------------------------------------------------- median filter, DTW
def median_filter(x: torch.Tensor, filter_width: int) -> torch.Tensor:
    """Median of each window of `filter_width` (odd) along the last dimension, reflect-padded
    (inputs no longer than half the width come back unchanged, as openai's)."""
    pad_width = filter_width // 2
    if x.shape[-1] <= pad_width:
        return x
    if filter_width <= 0 or filter_width % 2 != 1:
        raise ValueError(f"filter_width must be a positive odd number, got {filter_width}")
    ndim = x.ndim
    if ndim <= 2:  # reflect padding needs a 3-D or 4-D input
        x = x[None, None, :]
    x = F.pad(x, (pad_width, pad_width, 0, 0), mode="reflect")
    result = x.unfold(-1, filter_width, 1).sort()[0][..., pad_width]
    return result[0, 0] if ndim <= 2 else result


def dtw(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dynamic time warping through the cost matrix x [N, M] -> (row indices, column indices)
    of the cheapest monotone path from (0, 0) to (N-1, M-1).

    The cumulative costs are openai's (`dtw_cpu`: float32 sums of float64 costs, ties broken
    towards a step along the columns), computed one anti-diagonal at a time: every cell of
    diagonal i + j depends only on the two diagonals before it."""
    x = np.asarray(x, dtype=np.float64)
    N, M = x.shape
    D = N + M + 1  # diagonals d = i + j of the (N + 1) x (M + 1) table
    cost = np.full((D, N + 1), np.inf, dtype=np.float32)  # cost[d, i] = table[i, d - i]
    trace = np.full((D, N + 1), -1, dtype=np.int8)
    cost[0, 0] = 0
    for d in range(2, D):
        lo, hi = max(1, d - M), min(N, d - 1)
        if lo > hi:
            continue
        c0 = cost[d - 2, lo - 1:hi]  # table[i - 1, j - 1]
        c1 = cost[d - 1, lo - 1:hi]  # table[i - 1, j]
        c2 = cost[d - 1, lo:hi + 1]  # table[i, j - 1]
        diagonal = c0 < c1
        diagonal &= c0 < c2
        down = (c1 < c0) & (c1 < c2) & ~diagonal
        t = np.where(diagonal, 0, np.where(down, 1, 2)).astype(np.int8)
        c = np.where(diagonal, c0, np.where(down, c1, c2))
        i = np.arange(lo, hi + 1)
        cost[d, lo:hi + 1] = x[i - 1, d - i - 1] + c.astype(np.float64)
        trace[d, lo:hi + 1] = t
    return backtrace(trace, N, M)


def backtrace(trace: np.ndarray, N: int, M: int) -> tuple[np.ndarray, np.ndarray]:
    """The path through DTW's trace (skewed: trace[i + j, i]), from (N, M) back to (0, 0)."""
    i, j = N, M
    path = []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        t = 2 if i == 0 else 1 if j == 0 else int(trace[i + j, i])
        if t == 0:
            i, j = i - 1, j - 1
        elif t == 1:
            i -= 1
        elif t == 2:
            j -= 1
        else:
            raise ValueError("unexpected DTW trace")
    path = np.array(path[::-1])
    return path[:, 0], path[:, 1]


# ---------------------------------------------------------------- words
@dataclass
class WordTiming:
    """One word of a window's alignment, times relative to the window's start."""

    word: str
    tokens: list[int]
    start: float
    end: float
    probability: float


@dataclass(frozen=True)
class AlignmentRequest:
    """The target pass one kept window needs: `tokens` = sot sequence, <|notimestamps|>, the
    window's text tokens, <|endoftext|>."""

    tokens: list[int]  # the whole teacher-forced sequence
    n_prefix: int  # len(sot sequence): the first row whose attention is aligned (<|notimestamps|>)
    text_tokens: list[int] = field(default_factory=list)  # the window's text tokens (all its segments')
    num_frames: int = 0  # mel frames of audio in the window (its attention is read up to num_frames // 2)


def decode_with_timestamps(tokenizer, tokens) -> str:
    """openai's `decode_with_timestamps`: every token spelled, special ones included."""
    return tokenizer.backend.decode(list(tokens), skip_special_tokens=False)


def split_tokens_on_unicode(tokenizer, tokens: list[int]) -> tuple[list[str], list[list[int]]]:
    """Split wherever the tokens so far decode to whole characters."""
    decoded_full = decode_with_timestamps(tokenizer, tokens)
    replacement_char = "\ufffd"
    words, word_tokens, current_tokens = [], [], []
    unicode_offset = 0
    for token in tokens:
        current_tokens.append(token)
        decoded = decode_with_timestamps(tokenizer, current_tokens)
        if (replacement_char not in decoded
                or decoded_full[unicode_offset + decoded.index(replacement_char)] == replacement_char):
            words.append(decoded)
            word_tokens.append(current_tokens)
            current_tokens = []
            unicode_offset += len(decoded)
    return words, word_tokens


def split_tokens_on_spaces(tokenizer, tokens: list[int]) -> tuple[list[str], list[list[int]]]:
    """Whole-character pieces joined into words: a new word starts at a special token, a space,
    or punctuation."""
    subwords, subword_tokens_list = split_tokens_on_unicode(tokenizer, tokens)
    words, word_tokens = [], []
    for subword, subword_tokens in zip(subwords, subword_tokens_list):
        special = subword_tokens[0] >= tokenizer.eot
        with_space = subword.startswith(" ")
        punctuation = subword.strip() in string.punctuation
        if special or with_space or punctuation or len(words) == 0:
            words.append(subword)
            word_tokens.append(subword_tokens)
        else:
            words[-1] = words[-1] + subword
            word_tokens[-1].extend(subword_tokens)
    return words, word_tokens


def split_to_word_tokens(tokenizer, tokens: list[int], language: str | None) -> tuple[list[str], list[list[int]]]:
    if language in UNICODE_SPLIT_LANGUAGES:
        return split_tokens_on_unicode(tokenizer, tokens)
    return split_tokens_on_spaces(tokenizer, tokens)


def find_alignment(tokenizer, language: str | None, request: AlignmentRequest, weights: torch.Tensor,
                   text_token_probs: list[float], medfilt_width: int = MEDFILT_WIDTH) -> list[WordTiming]:
    """openai's `find_alignment` from the pass's output: `weights` [heads, len(tokens), frames]
    the alignment heads' cross-attention logits (layer-major head order), `text_token_probs`
    each text token's probability among the text tokens."""
    text_tokens = request.text_tokens
    if not text_tokens:
        return []
    weights = weights[:, :, :request.num_frames // 2].float()
    weights = weights.softmax(dim=-1)
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = (weights - mean) / std
    weights = median_filter(weights, medfilt_width)
    matrix = weights.mean(axis=0)
    matrix = matrix[request.n_prefix:-1]
    text_indices, time_indices = dtw(-matrix.double().cpu().numpy())

    words, word_tokens = split_to_word_tokens(tokenizer, text_tokens + [tokenizer.eot], language)
    if len(word_tokens) <= 1:
        return []  # only <|endoftext|>
    word_boundaries = np.pad(np.cumsum([len(t) for t in word_tokens[:-1]]), (1, 0))
    jumps = np.pad(np.diff(text_indices), (1, 0), constant_values=1).astype(bool)
    jump_times = time_indices[jumps] / TOKENS_PER_SECOND  # float64
    start_times = jump_times[word_boundaries[:-1]]
    end_times = jump_times[word_boundaries[1:]]
    word_probabilities = [np.mean(text_token_probs[i:j]) for i, j in zip(word_boundaries[:-1], word_boundaries[1:])]
    return [WordTiming(word, tokens, start, end, probability) for word, tokens, start, end, probability
            in zip(words, word_tokens, start_times, end_times, word_probabilities)]


def merge_punctuations(alignment: list[WordTiming], prepended: str, appended: str) -> None:
    """Merge prepended punctuation (a spaced word that is one of `prepended`) into the following
    word, and appended punctuation into the preceding word, in place (emptied words remain)."""
    i, j = len(alignment) - 2, len(alignment) - 1
    while i >= 0:
        previous, following = alignment[i], alignment[j]
        if previous.word.startswith(" ") and previous.word.strip() in prepended:
            following.word = previous.word + following.word
            following.tokens = previous.tokens + following.tokens
            previous.word, previous.tokens = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(alignment):
        previous, following = alignment[i], alignment[j]
        if not previous.word.endswith(" ") and following.word in appended:
            previous.word = previous.word + following.word
            previous.tokens = previous.tokens + following.tokens
            following.word, following.tokens = "", []
        else:
            i = j
        j += 1


def add_word_timestamps(segments: list[Segment], alignment: list[WordTiming], tokenizer, *,
                        prepend_punctuations: str = PREPEND_PUNCTUATIONS,
                        append_punctuations: str = APPEND_PUNCTUATIONS,
                        last_speech_timestamp: float) -> None:
    """openai's `add_word_timestamps` after `find_alignment`: clip implausibly long words at
    sentence boundaries and after pauses, merge punctuation, give each of the window's
    `segments` its `words` (absolute times rounded to 0.01 s) and move a segment's start/end to
    its words' unless they look too long. `alignment`: the words of all `segments`' text tokens."""
    if not segments:
        return
    text_tokens_per_segment = [[t for t in segment.tokens if t < tokenizer.eot] for segment in segments]
    word_durations = np.array([t.end - t.start for t in alignment])
    word_durations = word_durations[word_durations.nonzero()]
    median_duration = np.median(word_durations) if len(word_durations) > 0 else 0.0
    median_duration = min(0.7, float(median_duration))
    max_duration = median_duration * 2

    # truncate long words at sentence boundaries
    if len(word_durations) > 0:
        for i in range(1, len(alignment)):
            if alignment[i].end - alignment[i].start > max_duration:
                if alignment[i].word in SENTENCE_END_MARKS:
                    alignment[i].end = alignment[i].start + max_duration
                elif alignment[i - 1].word in SENTENCE_END_MARKS:
                    alignment[i].start = alignment[i].end - max_duration

    merge_punctuations(alignment, prepend_punctuations, append_punctuations)

    time_offset = segments[0].seek * 160 / 16000  # HOP_LENGTH / SAMPLE_RATE
    word_index = 0
    for segment, text_tokens in zip(segments, text_tokens_per_segment):
        saved_tokens = 0
        words: list[Word] = []
        while word_index < len(alignment) and saved_tokens < len(text_tokens):
            timing = alignment[word_index]
            if timing.word:
                # numpy's rounding (the times are numpy floats in openai's code too)
                words.append(Word(timing.word, float(np.round(time_offset + timing.start, 2)),
                                  float(np.round(time_offset + timing.end, 2)), float(timing.probability)))
            saved_tokens += len(timing.tokens)
            word_index += 1

        if len(words) > 0:
            # the first and second word after a pause: at most twice the median word duration
            if words[0].end - last_speech_timestamp > median_duration * 4 and (
                    words[0].end - words[0].start > max_duration
                    or (len(words) > 1 and words[1].end - words[0].start > max_duration * 2)):
                if len(words) > 1 and words[1].end - words[1].start > max_duration:
                    boundary = max(words[1].end / 2, words[1].end - max_duration)
                    words[0].end = words[1].start = boundary
                words[0].start = max(0, words[0].end - max_duration)

            # prefer the segment-level start timestamp if the first word is too long
            if segment.start < words[0].end and segment.start - 0.5 > words[0].start:
                words[0].start = max(0, min(words[0].end - median_duration, segment.start))
            else:
                segment.start = words[0].start

            # prefer the segment-level end timestamp if the last word is too long
            if segment.end > words[-1].start and segment.end + 0.5 < words[-1].end:
                words[-1].end = max(words[-1].start + median_duration, segment.end)
            else:
                segment.end = words[-1].end

            last_speech_timestamp = segment.end
        segment.words = words


# ---------------------------------------------------------------- hallucination checks
def word_anomaly_score(word: Word) -> float:
    """How anomalous a word looks: improbable, very short, or very long."""
    probability = word.probability
    duration = word.end - word.start
    score = 0.0
    if probability < 0.15:
        score += 1.0
    if duration < 0.133:
        score += (0.133 - duration) * 15
    if duration > 2.0:
        score += duration - 2.0
    return score


def is_segment_anomaly(segment: Segment | None) -> bool:
    """A segment whose first 8 words (punctuation aside) look like a hallucination."""
    if segment is None or not segment.words:
        return False
    words = [w for w in segment.words if w.word not in PUNCTUATION][:8]
    score = sum(word_anomaly_score(w) for w in words)
    return score >= 3 or score + 0.01 >= len(words)


def next_words_segment(segments: list[Segment]) -> Segment | None:
    return next((s for s in segments if s.words), None)


def get_end(segments: list[Segment]) -> float | None:
    """The end of the last word, else the last segment's end (None: no segments)."""
    return next((w.end for s in reversed(segments) for w in reversed(s.words or [])),
                segments[-1].end if segments else None)

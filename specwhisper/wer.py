"""Word error rate on Whisper-normalized English text.

`normalize` is Whisper's `EnglishTextNormalizer` as shipped by `transformers` (or, without it,
openai-whisper's, which includes the spelling table below): lower case, no
punctuation, contractions and titles expanded ("it's" -> "it is", "mr." -> "mister"), spelled-out
numbers turned into digits ("seventy-two" -> "72"), currencies and percentages standardized.

Its last stage maps British to American spellings with a table that Hugging Face ships as
`normalizer.json` in the Whisper hub repositories (the same table as openai-whisper's
`normalizers/english.json`); the `transformers` wheel itself does not contain it. Without that file
the normalizer is built with an empty table, so "colour" and "color" count as different words.
Pass `spelling_mapping=` (a path to such a `normalizer.json`) to `english_normalizer` to include it.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=4)
def english_normalizer(spelling_mapping: str | Path | None = None):
    """Whisper's English normalizer; `spelling_mapping` is an optional `normalizer.json`
    (British -> American spellings); None builds it with an empty table (works offline)."""
    try:
        from transformers.models.whisper.english_normalizer import EnglishTextNormalizer
    except ImportError:
        try:  # openai-whisper ships the same normalizer (with its spelling table built in)
            from whisper.normalizers import EnglishTextNormalizer as OpenAINormalizer
        except ImportError:
            raise ImportError("word error rates need Whisper's English normalizer, from `transformers` or "
                              "`openai-whisper`: pip install 'specwhisper[bench]'") from None
        return OpenAINormalizer()
    mapping = {}
    if spelling_mapping is not None:
        mapping = json.loads(Path(spelling_mapping).read_text(encoding="utf-8"))
    return EnglishTextNormalizer(mapping)


def normalize(text: str) -> str:
    """Whisper-normalized English text: "With a high of seventy-two degrees." -> "with a high of 72 degrees"."""
    return english_normalizer()(text)


def _jiwer():
    try:
        import jiwer
    except ImportError:
        raise ImportError("specwhisper.wer needs `jiwer`; install it with the `bench` or `test` extra: "
                          "pip install 'specwhisper[bench]' (or pip install jiwer)") from None
    return jiwer


def wer(references: list[str], hypotheses: list[str]) -> float:
    """Corpus word error rate (substitutions + deletions + insertions) / reference words, on
    normalized text. A reference that normalizes to nothing counts its hypothesis words as insertions."""
    if isinstance(references, str) or isinstance(hypotheses, str):
        raise TypeError("wer takes lists of strings (one per utterance), not a single string")
    if len(references) != len(hypotheses):
        raise ValueError(f"got {len(references)} references but {len(hypotheses)} hypotheses")
    refs = [normalize(r) for r in references]
    hyps = [normalize(h) for h in hypotheses]
    words = sum(len(r.split()) for r in refs)
    if words == 0:
        raise ValueError("the references contain no words after normalization")
    pairs = [(r, h) for r, h in zip(refs, hyps) if r]
    insertions = sum(len(h.split()) for r, h in zip(refs, hyps) if not r)
    out = _jiwer().process_words([r for r, _ in pairs], [h for _, h in pairs])
    return (out.substitutions + out.deletions + out.insertions + insertions) / words

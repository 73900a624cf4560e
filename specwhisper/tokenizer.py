"""Whisper tokenizer: special tokens looked up by string, prompts, suppression lists, decoding.

Special-token ids differ between English-only (51864), multilingual (51865) and v3 (51866)
vocabularies, so nothing here hard-codes an id.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from .config import read_json

LANGUAGE_TOKEN = re.compile(r"^<\|([a-z]{2,3})\|>$")
TASKS = ("transcribe", "translate")


@dataclass(frozen=True)
class Tokenizer:
    backend: HFTokenizer  # the `tokenizers` tokenizer read from tokenizer.json
    eot: int  # <|endoftext|>
    sot: int  # <|startoftranscript|>
    no_timestamps: int  # <|notimestamps|>
    task_ids: dict  # task name -> id
    languages: dict  # language code -> token id, in vocabulary order
    suppress_tokens: tuple  # suppressed at every step (generation_config.json)
    begin_suppress_tokens: tuple  # suppressed at the first generated position only
    multilingual: bool  # has language and task tokens in the prompt

    @classmethod
    def from_folder(cls, folder: str | Path, vocab_size: int) -> "Tokenizer":
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception
            raise ValueError(f"{path} is not a valid tokenizer.json: {exc}") from None

        def special(name: str) -> int:
            tid = backend.token_to_id(name)
            if tid is None:
                raise ValueError(f"{path} lacks the Whisper special token {name}")
            return tid

        languages = {}
        for token, tid in sorted(backend.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1]):
            m = LANGUAGE_TOKEN.match(token)
            if m:
                languages[m.group(1)] = tid
        gen_path = folder / "generation_config.json"
        gen = read_json(gen_path, "generation config") if gen_path.is_file() else {}
        return cls(
            backend=backend, eot=special("<|endoftext|>"), sot=special("<|startoftranscript|>"),
            no_timestamps=special("<|notimestamps|>"),
            task_ids={t: special(f"<|{t}|>") for t in TASKS}, languages=languages,
            suppress_tokens=tuple(gen.get("suppress_tokens") or ()),
            begin_suppress_tokens=tuple(gen.get("begin_suppress_tokens") or ()),
            multilingual=vocab_size >= 51865)

    def language_id(self, language: str) -> int:
        code = language.lower()
        if code not in self.languages:
            raise ValueError(f"unknown language code {language!r}; known: {', '.join(self.languages)}")
        return self.languages[code]

    def prompt(self, language: str | None, task: str) -> list[int]:
        """`<|startoftranscript|>[<|lang|><|task|>]<|notimestamps|>`; English-only models get no
        language or task token. A multilingual prompt needs `language` (detect it first)."""
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
        if not self.multilingual:
            if language not in (None, "en"):
                raise ValueError(f"English-only model cannot transcribe language {language!r}")
            if task != "transcribe":
                raise ValueError("English-only model cannot translate")
            return [self.sot, self.no_timestamps]
        if language is None:
            raise ValueError("a multilingual prompt needs a language")
        return [self.sot, self.language_id(language), self.task_ids[task], self.no_timestamps]

    def language_code(self, token_id: int) -> str:
        return next(code for code, tid in self.languages.items() if tid == token_id)

    def decode(self, tokens) -> str:
        return self.backend.decode([t for t in tokens if t < self.eot], skip_special_tokens=True).strip()

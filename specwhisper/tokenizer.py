"""Whisper tokenizer: special tokens looked up by string, prompts, suppression lists, decoding.

Special-token ids differ between English-only (51864), multilingual (51865) and v3 (51866)
vocabularies, so nothing here hard-codes an id.
"""
from __future__ import annotations

import functools
import hashlib
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from .config import read_json

LANGUAGE_TOKEN = re.compile(r"^<\|([a-z]{2,3})\|>$")
TASKS = ("transcribe", "translate")


_PARSED: dict[str, tuple[HFTokenizer, dict]] = {}  # tokenizer.json's digest -> (tokenizer, languages)
_PARSED_LOCK = threading.Lock()


def _parsed(content: bytes, path: Path) -> tuple[HFTokenizer, dict, str]:
    """(the `tokenizers` tokenizer, language code -> token id in vocabulary order, the content's
    digest) of a
    tokenizer.json's `content`, parsed once per distinct content: 0.25-0.45 s a parse of Whisper's,
    which every Engine paid for its target and again for a draft with the same vocabulary (a
    distilled draft's folder holds a copy). The tokenizer is only read (encode, decode, lookups),
    never configured, so engines share it."""
    digest = hashlib.blake2b(content, digest_size=20).hexdigest()
    with _PARSED_LOCK:
        found = _PARSED.get(digest)
    if found is not None:
        return (*found, digest)
    try:
        backend = HFTokenizer.from_str(content.decode("utf-8"))
    except Exception as exc:  # the tokenizers library raises a bare Exception (bad UTF-8 too)
        raise ValueError(f"{path} is not a valid tokenizer.json: {exc}") from None
    # the language tokens follow <|startoftranscript|> in every Whisper vocabulary, as openai-whisper
    # reads them (sot + 1 + i): read there, not by scanning the whole vocabulary in Python (0.15 s)
    languages, tid = {}, backend.token_to_id("<|startoftranscript|>")
    while tid is not None and (m := LANGUAGE_TOKEN.match(backend.id_to_token(tid + 1) or "")):
        tid += 1
        languages[m.group(1)] = tid
    with _PARSED_LOCK:
        if len(_PARSED) >= 8:  # a handful of vocabularies per process
            _PARSED.pop(next(iter(_PARSED)))
        return (*_PARSED.setdefault(digest, (backend, languages)), digest)


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
    digest: str  # of tokenizer.json's bytes (`engine.vocab.vocab_tables` keeps tables by it)

    @classmethod
    def from_folder(cls, folder: str | Path, vocab_size: int) -> "Tokenizer":
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        backend, languages, digest = _parsed(path.read_bytes(), path)

        def special(name: str) -> int:
            tid = backend.token_to_id(name)
            if tid is None:
                raise ValueError(f"{path} lacks the Whisper special token {name}")
            return tid

        gen_path = folder / "generation_config.json"
        gen = read_json(gen_path, "generation config") if gen_path.is_file() else {}
        return cls(
            backend=backend, eot=special("<|endoftext|>"), sot=special("<|startoftranscript|>"),
            no_timestamps=special("<|notimestamps|>"),
            task_ids={t: special(f"<|{t}|>") for t in TASKS}, languages=dict(languages),
            suppress_tokens=tuple(gen.get("suppress_tokens") or ()),
            begin_suppress_tokens=tuple(gen.get("begin_suppress_tokens") or ()),
            multilingual=vocab_size >= 51865, digest=digest)

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

    # ------------------------------------------------------------ timestamps, prompts, segments
    # (openai-whisper's tokenizer concepts; long-form decoding builds on these)
    def _special(self, *names: str) -> int | None:
        return next((t for t in map(self.backend.token_to_id, names) if t is not None), None)

    @functools.cached_property
    def timestamp_begin(self) -> int:
        """<|0.00|>: timestamps are this id + index, 0.02 s apart. They follow <|notimestamps|>
        in every Whisper vocabulary (some tokenizer.json files, e.g. converted English-only
        ones, do not spell them out)."""
        tid = self._special("<|0.00|>")
        return tid if tid is not None else self.no_timestamps + 1

    @functools.cached_property
    def sot_prev(self) -> int:
        return self._special("<|startofprev|>")

    @functools.cached_property
    def sot_lm(self) -> int | None:
        return self._special("<|startoflm|>")

    @functools.cached_property
    def no_speech(self) -> int | None:
        """<|nospeech|> (v3) or <|nocaptions|>; its probability at the <|startoftranscript|>
        position is `no_speech_prob`."""
        return self._special("<|nospeech|>", "<|nocaptions|>")

    def encode(self, text: str) -> list[int]:
        """Text -> BPE token ids, no special tokens added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode_text(self, tokens) -> str:
        """openai-whisper's `decode`: timestamps and special tokens dropped, nothing stripped."""
        return self.backend.decode([t for t in tokens if t < self.eot], skip_special_tokens=False)

    def sot_sequence(self, language: str | None, task: str) -> list[int]:
        """`<|startoftranscript|>[<|lang|><|task|>]`: the prompt that lets timestamps be predicted."""
        return self.prompt(language, task)[:-1]

    def window_prompt(self, previous: list[int], language: str | None, task: str, timestamps: bool,
                      max_previous: int = 223) -> list[int]:
        """The decoder prefix of one long-form window, as openai's `DecodingTask` builds it:
        `<|startofprev|>` + the last `max_previous` (n_text_ctx // 2 - 1) previous tokens when
        there are any, then the sot sequence (+ <|notimestamps|> without timestamps)."""
        sot = self.sot_sequence(language, task) if timestamps else self.prompt(language, task)
        if not previous:
            return sot
        return [self.sot_prev, *previous[-max_previous:], *sot]

    def openai_suppress_tokens(self) -> tuple[int, ...]:
        """openai-whisper's `suppress_tokens="-1"`: non-speech symbols (speaker tags, music
        notes, brackets) plus the task, sot, sot_prev, sot_lm and no-speech tokens."""
        symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
        symbols += "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
        miscellaneous = set("♩♪♫♬♭♮♯")  # multi-token on some vocabularies: their first token
        result = {self.encode(" -")[0], self.encode(" '")[0]}
        for symbol in symbols + sorted(miscellaneous):
            for tokens in (self.encode(symbol), self.encode(" " + symbol)):
                if len(tokens) == 1 or symbol in miscellaneous:
                    result.add(tokens[0])
        result |= {*self.task_ids.values(), self.sot, self.sot_prev}
        result |= {t for t in (self.sot_lm, self.no_speech) if t is not None}
        return tuple(sorted(result))


def split_at_timestamps(tokens: list[int], timestamp_begin: int) -> tuple[list[tuple[int, int]], bool]:
    """openai-whisper's segment split of one window's tokens: `(slices, single_timestamp_ending)`.

    slices: [start, end) ranges of `tokens`, one per segment, cut after each pair of consecutive
    timestamps (and at the end when the window ends in a single timestamp); empty when no two
    timestamps are consecutive. single_timestamp_ending: the tokens end text, timestamp."""
    is_ts = [t >= timestamp_begin for t in tokens]
    single_timestamp_ending = is_ts[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]
    if not cuts:
        return [], single_timestamp_ending
    if single_timestamp_ending:
        cuts.append(len(tokens))
    starts = [0] + cuts[:-1]
    return list(zip(starts, cuts)), single_timestamp_ending

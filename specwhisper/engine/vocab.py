"""Token mapping between a draft and a target vocabulary, by token string.

Whisper tiny (51865) and large-v3 (51866) share text ids but shift every special token after the
language list; English-only models (51864) use GPT-2 BPE ids. Both tokenizers are byte-level BPE
over the same byte alphabet, so a token string means the same bytes in either vocabulary:
- draft -> target: the target id of the same string, or -1 (the draft run stops there);
- target -> draft: the draft id of the same string, else the draft BPE's segmentation of that
  string (several draft tokens; the draft then keeps its own positions).
Identical vocabularies map by identity with no work per step.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import tokenizers
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

MIN_SHARED_TEXT = 0.25  # refuse pairs where fewer target text tokens have a draft equivalent
N_TIMESTAMPS = 1501  # <|0.00|> ... <|30.00|>, 0.02 s apart, in every Whisper vocabulary


def token_strings(tok) -> dict:
    """Token string -> id over the model's whole vocabulary: the tokenizer.json entries, plus the
    timestamp tokens that some tokenizer.json files (converted English-only ones) do not spell
    out, though the model has them (they follow <|notimestamps|>)."""
    vocab = dict(tok.backend.get_vocab(with_added_tokens=True))
    for i in range(N_TIMESTAMPS):
        vocab.setdefault(f"<|{i * 0.02:.2f}|>", tok.timestamp_begin + i)
    return vocab


@dataclass(frozen=True)
class VocabMap:
    identity: bool  # same vocabulary: no mapping at all
    draft_to_target: torch.Tensor | None  # [V_draft] target id or -1
    target_to_draft: dict | None  # target id -> list of draft ids (computed lazily per id)
    draft_backend: object | None  # the draft's tokenizers.Tokenizer, for segmentation
    target_strings: list | None  # target id -> token string
    draft_vocab: dict | None  # draft token string -> id
    shared_text: float  # fraction of target text tokens with a single-token draft equivalent
    # (spellings [N, W], lengths [N]) of target ids 0..N-1, as `spelling_table(N)` returns them: a
    # map read back from disk (`vocab_tables`) holds them instead of the strings
    spellings: tuple | None = None

    @classmethod
    def build(cls, draft_tok, target_tok, draft_name="draft", target_name="target") -> "VocabMap":
        if draft_tok.backend is target_tok.backend:
            # one parse of equal tokenizer.json files (`tokenizer._parsed`): the same strings, the
            # same timestamp ids (`timestamp_begin` is read from the tokenizer alone)
            return cls(True, None, None, None, None, None, 1.0)
        dv, tv = token_strings(draft_tok), token_strings(target_tok)
        if dv == tv:
            return cls(True, None, None, None, None, None, 1.0)
        text = [s for s, i in tv.items() if i < target_tok.eot]
        shared = sum(1 for s in text if s in dv) / max(len(text), 1)
        if shared < MIN_SHARED_TEXT or "<|endoftext|>" not in dv:
            raise ValueError(
                f"draft {draft_name} cannot serve target {target_name}: comparing the token strings "
                f"of their tokenizer.json files, only {shared:.1%} of the target's {len(text)} text "
                f"tokens exist in the draft vocabulary (need >= {MIN_SHARED_TEXT:.0%})")
        d2t = [-1] * (max(dv.values()) + 1)  # a list, then one tensor (item by item: 0.1 s for tiny.en)
        for s, i in dv.items():
            d2t[i] = tv.get(s, -1)
        d2t = torch.tensor(d2t, dtype=torch.long)
        strings = [""] * (max(tv.values()) + 1)
        for s, i in tv.items():
            strings[i] = s
        return cls(False, d2t, {}, draft_tok.backend, strings, dv, shared)

    def all_to_draft(self, n: int) -> list[list[int]]:
        """`to_draft` of target ids 0..n-1 (each cached), in one loop: 51865 calls' overhead was a
        third of `Engine(base, tiny.en)`'s vocabulary work."""
        if self.identity:
            return [[t] for t in range(n)]
        if self.spellings is not None:
            return [self.to_draft(t) for t in range(n)]
        cache, spell = self.target_to_draft, self._spell
        return [cache[t] if t in cache else cache.setdefault(t, spell(t)) for t in range(n)]

    def _spell(self, target_id: int) -> list[int]:
        """The draft ids of target token `target_id`'s string (uncached)."""
        s = self.target_strings[target_id] if target_id < len(self.target_strings) else ""
        d = self.draft_vocab.get(s)
        if d is not None:
            return [d]
        if not s or s.startswith("<|"):
            return []  # a special token the draft does not have (or no token at all)
        return [t.id for t in self.draft_backend.model.tokenize(s)]

    def to_draft(self, target_id: int) -> list[int]:
        """Draft ids that spell target token `target_id` (empty if it has no spelling)."""
        if self.identity:
            return [target_id]
        cached = self.target_to_draft.get(target_id)
        if cached is None:
            if self.spellings is not None:
                rows, lengths = self.spellings
                n = int(lengths[target_id]) if target_id < len(lengths) else 0
                cached = self.target_to_draft[target_id] = rows[target_id, :n].tolist() if n else []
            else:
                cached = self.target_to_draft[target_id] = self._spell(target_id)
        return cached

    def spelling_table(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`padded_spellings` of target ids 0..n-1."""
        if self.spellings is not None and len(self.spellings[1]) == n:
            return self.spellings
        return padded_spellings(self.all_to_draft(n))


def padded_spellings(spellings: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Spellings (lists of draft ids) -> (rows [N, W] zero-padded to the longest, W >= 1; lengths
    [N]): the spellings side by side, then scattered into their rows (a nested list of 51865 padded
    rows took torch 0.07-0.46 s)."""
    lengths = torch.tensor([len(sp) for sp in spellings], dtype=torch.long)
    flat = torch.tensor([d for sp in spellings for d in sp], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(spellings)), lengths)
    cols = torch.arange(len(flat)) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    padded = torch.zeros(len(spellings), max(1, int(lengths.max()) if len(spellings) else 1), dtype=torch.long)
    padded[rows, cols] = flat
    return padded, lengths


VOCAB_FORMAT = 1  # what a kept file holds; a change makes every kept file stale


def vocab_folder() -> Path | None:
    """Where `vocab_tables` keeps a pair's tables: $SPECWHISPER_VOCAB_DIR, else
    ~/.cache/specwhisper/vocab ($XDG_CACHE_HOME respected); SPECWHISPER_VOCAB_DIR=off (or 0) keeps
    none."""
    from ..backends.ops import kept_folder

    return kept_folder("SPECWHISPER_VOCAB_DIR", "vocab")


def vocab_tables(draft_tok, target_tok, n: int, draft_name="draft", target_name="target") -> VocabMap:
    """`VocabMap.build`, with its `spelling_table(n)`, kept on disk per pair of tokenizer.json
    contents (`vocab_folder`): tiny.en drafting base spent 0.8 s of its `Engine()` on them (the
    strings of both vocabularies compared in Python, 20876 target tokens segmented by the draft's
    BPE). Read back, the map holds the tables (and `to_draft` reads them), not the strings; built
    again when either file, `n`, this module or the tokenizers library changes, or the kept file
    cannot be read or does not hold tables of the right shapes and ranges."""
    folder = vocab_folder()
    if draft_tok.backend is target_tok.backend or folder is None:
        return VocabMap.build(draft_tok, target_tok, draft_name, target_name)
    key = dict(format=VOCAB_FORMAT, draft=draft_tok.digest, target=target_tok.digest, n=n,
               tokenizers=tokenizers.__version__,
               code=hashlib.blake2b(Path(__file__).read_bytes(), digest_size=12).hexdigest())
    path = folder / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".safetensors")
    kept = read_tables(path, key, n)
    if kept is not None:
        return kept
    vmap = VocabMap.build(draft_tok, target_tok, draft_name, target_name)
    if vmap.identity:
        return vmap
    rows, lengths = vmap.spelling_table(n)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        save_file({"draft_to_target": vmap.draft_to_target, "spellings": rows.contiguous(), "lengths": lengths},
                  str(partial), metadata={"key": json.dumps(key, sort_keys=True), "shared_text": repr(vmap.shared_text)})
        os.replace(partial, path)  # whole or not at all, for another process reading it
    except (OSError, SafetensorError):
        pass  # a read-only cache: built again next time
    return replace(vmap, spellings=(rows, lengths))


def read_tables(path: Path, key: dict, n: int) -> VocabMap | None:
    """The VocabMap kept at `path` under `key` (None: absent, another key, or not well formed)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("key") != json.dumps(key, sort_keys=True):
                return None
            d2t, rows, lengths = (f.get_tensor(k) for k in ("draft_to_target", "spellings", "lengths"))
        shared = float(meta["shared_text"])
    except (OSError, SafetensorError, KeyError, ValueError):
        return None
    ok = (d2t.dtype == rows.dtype == lengths.dtype == torch.long and d2t.dim() == 1 and rows.dim() == 2
          and lengths.shape == (n,) and rows.shape[0] == n and rows.shape[1] >= 1 and 0 <= shared <= 1
          and bool((d2t >= -1).all()) and bool((d2t < n).all()) and bool((rows >= 0).all())
          and bool((rows < len(d2t)).all()) and bool((lengths >= 0).all())
          and bool((lengths <= rows.shape[1]).all()))
    return VocabMap(False, d2t, {}, None, None, None, shared, (rows, lengths)) if ok else None

"""A loaded checkpoint and how tokens are picked from its decoder output (greedy or sampled,
with Whisper's suppression rules)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import sampling
from ..backends import Backend, backend_for
from ..config import WhisperConfig, read_json
from ..model.head import ScreenedHead
from ..model.whisper import Whisper
from ..tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """One Whisper checkpoint with what decoding needs from its folder."""

    model: Whisper
    tokenizer: Tokenizer
    path: Path
    suppress: torch.Tensor  # [V] bool: suppressed at every step
    begin_suppress: torch.Tensor  # [V] bool: suppressed at the first generated position
    screened: bool  # greedy reads the exact int8 screen of the head (`head`; float32 models on a CPU)
    backend: Backend  # the device's decisions (backends/)

    @property
    def config(self) -> WhisperConfig:
        return self.model.config

    @functools.cached_property
    def head(self) -> ScreenedHead | None:
        """The exact screened head greedy decoding reads (None: full logits), built at its first
        use (base's: 0.5 s): a draft that proposes through another head (the target's, a 4-bit
        copy) never builds its own. Assigning another head replaces it."""
        return ScreenedHead(self.model.decoder.embed_tokens.weight) if self.screened else None

    @classmethod
    def load(cls, path, device, dtype) -> "LoadedModel":
        backend = backend_for(device)
        path = resolve_model_path(path)
        model = backend.load_whisper(path, dtype)
        tok = Tokenizer.from_folder(path, model.config.vocab_size)
        vocab = model.config.vocab_size
        suppress = torch.zeros(vocab, dtype=torch.bool, device=device)
        suppress[[t for t in tok.suppress_tokens if t < vocab]] = True
        begin = suppress.clone()
        begin[[t for t in tok.begin_suppress_tokens if t < vocab]] = True
        # greedy reads an int8 copy of the head, exactly, where the backend says so (see model/head.py)
        return cls(model, tok, path, suppress, begin, backend.screens_head(dtype), backend)

    @functools.cached_property
    def alignment_heads(self) -> list[tuple[int, int]]:
        """The (layer, head) pairs of cross-attention that word timestamps read: the folder's
        generation_config `alignment_heads`, else openai's table (`timing.alignment_heads`;
        ValueError when neither knows the model)."""
        from ..longform.timing import alignment_heads

        path = self.path / "generation_config.json"
        return alignment_heads(self.config, read_json(path, "generation config") if path.is_file() else {})

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Decoder hidden states [B, T, d] -> float32 logits [B, T, V] (no suppression)."""
        return self.model.decoder.logits(hidden)

    def greedy(self, hidden: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
        """Greedy tokens [B, T] from hidden [B, T, d], never a `banned` token ([B, T, V] or [V]
        bool): exactly `logits(hidden).masked_fill(banned, -inf).argmax(-1)`, ties to the lowest id."""
        B, T, d = hidden.shape
        if self.head is not None:
            rows_banned = banned if banned.ndim == 1 else banned.reshape(B * T, -1)
            return self.head.argmax(hidden.reshape(B * T, d), rows_banned).view(B, T)
        return self.logits(hidden).masked_fill_(banned, -float("inf")).argmax(dim=-1)

    def pick(self, hidden: torch.Tensor, first: bool, temperature: float, top_p: float, generator):
        """Tokens [B, T] from decoder hidden states [B, T, d]; also the suppressed float32 logits
        [B, T, V] when sampling (None when greedy: the screened head never forms them)."""
        banned = self.begin_suppress if first else self.suppress
        B, T, d = hidden.shape
        if temperature == 0.0:
            return self.greedy(hidden, banned), None
        logits = self.logits(hidden).masked_fill_(banned, -float("inf"))
        flat = logits.reshape(B * T, -1)
        return sampling.sample(flat, temperature, top_p, generator).view(B, T), logits


def resolve_model_path(path) -> Path:
    """A local folder as is; any other string is a Hugging Face hub id fetched with
    `huggingface_hub` (safetensors and json files only)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    if p.exists() or str(path).startswith((".", "/", "~")) or str(path).count("/") != 1:
        raise FileNotFoundError(f"model folder {path} does not exist (expected a folder with "
                                "config.json and model.safetensors, or a hub id like openai/whisper-base)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:
        raise FileNotFoundError(
            f"could not fetch {path!r} from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            "Pass a local folder holding config.json, model.safetensors and tokenizer.json instead "
            "(for example one made by `specwhisper fetch base` or `specwhisper convert`).") from None

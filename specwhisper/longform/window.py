"""One 30 s window of long-form decoding: the request, the result, and a reference decoder.

`decode_window_reference` is openai-whisper's `DecodingTask` for one window (greedy or sampled at
one temperature, no beams, no best-of): a plain token-by-token loop over our model with the full
logits and `rules.apply_rules`. It is the spec the engine's runner (speculative, batched) must
reproduce; long-form decoding (`transcribe.py`) only sees `WindowRequest -> WindowResult`.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from .. import sampling
from ..audio import N_FRAMES, pad_or_trim
from ..engine.decoding import LoadedModel
from ..engine.rules import RuleTables, apply_rules, row_state
from ..model.whisper import DecoderCache

SAMPLE_LEN = 224  # openai's sample_len: at most n_text_ctx // 2 tokens sampled per window


@dataclass(frozen=True)
class WindowRequest:
    """Decode one window: what openai's `DecodingOptions` + mel segment say, fully resolved."""

    mel: torch.Tensor  # [n_mels, 3000] log-mel of the window (zero-padded past the audio's end)
    prompt: tuple[int, ...]  # decoder prefix: [<|startofprev|> previous...] + sot sequence
    temperature: float = 0.0  # 0: greedy; > 0: sampled from softmax(logits / temperature)
    top_p: float = 1.0  # nucleus mass kept when sampling
    seed: int = 0  # sampling seed of this attempt (the same request decodes the same tokens)
    max_new_tokens: int = SAMPLE_LEN  # openai's sample_len (the 448-position limit also applies)
    timestamps: bool = True  # apply the timestamp rules (the prompt has no <|notimestamps|>)
    max_initial_timestamp: int = 50  # index of the latest first timestamp (50 = 1.0 s); -1: no limit
    language: str | None = None  # language code of the prompt (None: English-only model)
    task: str = "transcribe"  # "transcribe" or "translate"
    seek: int = 0  # mel frame where the window starts (bookkeeping for the caller)

    def __post_init__(self):
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        if self.mel.ndim != 2 or self.mel.shape[1] != N_FRAMES:
            raise ValueError(f"a window's mel must be [n_mels, {N_FRAMES}], got {tuple(self.mel.shape)}")
        if not self.prompt:
            raise ValueError("a window needs a prompt (at least <|startoftranscript|>)")
        if not (0.0 <= self.temperature < math.inf) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"bad sampling parameters: temperature={self.temperature}, top_p={self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class WindowResult:
    """openai's `DecodingResult` for one window (text and compression ratio are the caller's)."""

    tokens: list[int]  # sampled tokens, timestamps included, EOT excluded
    sum_logprob: float  # sum of the sampled tokens' log-probabilities (EOT's included), float32
    avg_logprob: float  # sum_logprob / (len(tokens) + 1), as openai defines it
    no_speech_prob: float  # P(<|nospeech|>) at the <|startoftranscript|> position of the prompt
    temperature: float  # temperature of this decode
    language: str | None  # language code of the prompt


_TABLES: "weakref.WeakKeyDictionary[torch.nn.Module, RuleTables]" = weakref.WeakKeyDictionary()


def rule_tables(model: LoadedModel) -> RuleTables:
    """The model's RuleTables, built once."""
    if model.model not in _TABLES:
        _TABLES[model.model] = RuleTables.build(model.tokenizer, model.config.vocab_size, model_device(model))
    return _TABLES[model.model]


def model_device(model: LoadedModel) -> torch.device:
    return model.model.decoder.embed_tokens.weight.device


@torch.inference_mode()
def encode_window(model: LoadedModel, mel: torch.Tensor) -> torch.Tensor:
    """mel [n_mels, 3000] -> encoder output [1, 1500, d_model]."""
    weight = model.model.decoder.embed_tokens.weight
    return model.model.encoder(mel[None].to(weight.device, weight.dtype))


@torch.inference_mode()
def detect_language_reference(model: LoadedModel, mel: torch.Tensor) -> str:
    """openai's `detect_language` on the first 30 s of `mel` [n_mels, frames]: the most likely
    language token after <|startoftranscript|>."""
    tok = model.tokenizer
    if not tok.multilingual:
        return "en"
    features = encode_window(model, pad_or_trim(mel, N_FRAMES))
    dev = model_device(model)
    cache = DecoderCache.allocate(model.config, 1, dev, features.dtype)
    model.model.decoder.fill_cross(cache, features)
    sot = torch.tensor([[tok.sot]], device=dev)
    logits = model.model.decoder(sot, torch.zeros_like(sot), cache, kv_len=1)[0, 0].float()
    lang_ids = torch.tensor(list(tok.languages.values()), device=dev)
    return tok.language_code(int(lang_ids[logits[lang_ids].argmax()]))


@torch.inference_mode()
def decode_window_reference(model: LoadedModel, request: WindowRequest,
                            features: torch.Tensor | None = None) -> WindowResult:
    """Decode one window token by token (see the module docstring). `features` [1, 1500, d]:
    the window's encoder output when the caller has it (fallback retries of the same window)."""
    tok, cfg, dec = model.tokenizer, model.config, model.model.decoder
    tables, dev = rule_tables(model), model_device(model)
    if features is None:
        features = encode_window(model, request.mel)
    cache = DecoderCache.allocate(cfg, 1, dev, features.dtype)
    dec.fill_cross(cache, features)

    P = len(request.prompt)
    # openai stops at sample_len tokens, or once the sequence is longer than n_text_ctx (448)
    limit = min(request.max_new_tokens, cfg.max_target_positions + 1 - P)
    if limit < 1:
        raise ValueError(f"a {P}-token prompt leaves no room in the {cfg.max_target_positions}-position decoder")
    prompt = torch.tensor([request.prompt], device=dev)
    prompt_logits = dec(prompt, torch.arange(P, device=dev)[None], cache, kv_len=P)[0].float()  # [P, V]
    no_speech_prob = math.nan
    if tok.no_speech is not None:
        sot_index = request.prompt.index(tok.sot)
        no_speech_prob = float(prompt_logits[sot_index].softmax(-1)[tok.no_speech])

    generator = None
    if request.temperature > 0:
        generator = torch.Generator(device=dev).manual_seed(request.seed)
    t = lambda x: torch.tensor([x], device=dev)  # noqa: E731
    timestamps, max_initial = t(request.timestamps), t(request.max_initial_timestamp)
    logits = prompt_logits[-1:]  # [1, V]
    tokens: list[int] = []
    sum_logprob = torch.zeros(1, dtype=torch.float32)  # openai accumulates in float32
    while True:
        n, last, penultimate, last_timestamp = row_state(tokens, tables.timestamp_begin)
        apply_rules(logits, tables, t(n == 0), timestamps, t(n), t(last), t(penultimate), t(last_timestamp),
                    max_initial)
        if request.temperature == 0.0:
            token = int(logits.argmax(dim=-1))
        else:
            token = int(sampling.sample(logits, request.temperature, request.top_p, generator))
        sum_logprob += torch.log_softmax(logits, dim=-1)[0, token].cpu()
        tokens.append(token)
        if token == tok.eot or len(tokens) >= limit:
            break
        pos = P + len(tokens) - 1
        logits = dec(t([token]), t([pos]), cache, kv_len=pos + 1)[0].float()
    if tokens[-1] == tok.eot:
        tokens.pop()
    total = float(sum_logprob[0])
    avg = float(sum_logprob[0] / (len(tokens) + 1))
    return WindowResult(tokens, total, avg, no_speech_prob, request.temperature, request.language)


class ReferenceWindowDecoder:
    """`decode_window_reference` as a `WindowRequest -> WindowResult` callable that keeps the
    last window's encoder output: fallback retries of a window (the same `mel` tensor) skip the
    encoder."""

    def __init__(self, model: LoadedModel):
        self.model = model
        self._mel: torch.Tensor | None = None
        self._features: torch.Tensor | None = None

    def __call__(self, request: WindowRequest) -> WindowResult:
        if request.mel is not self._mel:
            self._mel, self._features = request.mel, encode_window(self.model, request.mel)
        return decode_window_reference(self.model, request, self._features)

    @torch.inference_mode()
    def align(self, request):
        """The alignment pass (word timestamps) of the last window decoded: `timing.AlignmentRequest`
        -> (alignment heads' cross-attention logits, text token probabilities)."""
        from .alignment import alignment_pass

        cache = DecoderCache.allocate(self.model.config, 1, model_device(self.model), self._features.dtype)
        self.model.model.decoder.fill_cross(cache, self._features)
        [out] = alignment_pass(self.model.model.decoder, [request], cache.cross_k, cache.cross_v,
                               self.model.alignment_heads, self.model.tokenizer.eot)
        return out

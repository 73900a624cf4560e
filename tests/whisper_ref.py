"""Test helpers for parity with openai-whisper: our HF-layout checkpoint loaded into
`whisper.model.Whisper`, and long synthesized recordings (flite sentences, several voices, pauses)."""
from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from specwhisper.config import WhisperConfig

_LAYER = {"self_attn": "attn", "encoder_attn": "cross_attn", "self_attn_layer_norm": "attn_ln",
          "encoder_attn_layer_norm": "cross_attn_ln", "final_layer_norm": "mlp_ln", "fc1": "mlp.0", "fc2": "mlp.2"}
_PROJ = {"q_proj": "query", "k_proj": "key", "v_proj": "value", "out_proj": "out"}


def openai_name(key: str) -> str:
    """model.decoder.layers.3.encoder_attn.q_proj.weight -> decoder.blocks.3.cross_attn.query.weight"""
    key = key.removeprefix("model.")
    part, rest = key.split(".", 1)
    m = re.match(r"layers\.(\d+)\.(\w+)\.(.+)$", rest)
    if m:
        index, module, tail = m.groups()
        head, _, leaf = tail.rpartition(".")
        tail = f"{_PROJ.get(head, head)}.{leaf}" if head else leaf
        return f"{part}.blocks.{index}.{_LAYER[module]}.{tail}"
    top = {"embed_positions.weight": "positional_embedding", "embed_tokens.weight": "token_embedding.weight",
           "layer_norm.weight": "ln_post.weight" if part == "encoder" else "ln.weight",
           "layer_norm.bias": "ln_post.bias" if part == "encoder" else "ln.bias"}
    return f"{part}.{top.get(rest, rest)}"


_TRANSCRIBED: dict = {}


@functools.lru_cache(maxsize=2)
def openai_reference_model(folder: str):
    """`openai_whisper(folder)` with openai's alignment heads for its name (word timestamps), built
    once per session."""
    import whisper

    model = openai_whisper(Path(folder))
    heads = whisper._ALIGNMENT_HEADS.get(Path(folder).name)
    if heads is not None:
        model.set_alignment_heads(heads)
    return model


def openai_transcribe(folder: Path, audio: np.ndarray, **options) -> dict:
    """`whisper.transcribe(openai_reference_model(folder), audio, fp16=False, **options)`, computed
    once per session for the same weights, audio bytes and options (a fresh deep copy each call):
    the long-form and engine modules compare against the same references, each an openai-whisper
    run of ≈ 10 s on base. The runs are deterministic: greedy, and a fallback's sampling (which
    draws from torch's global generator) is asserted absent where it matters."""
    import copy
    import hashlib

    import whisper

    key = (str(folder), hashlib.sha256(np.ascontiguousarray(audio).tobytes()).hexdigest(),
           repr(sorted(options.items())))
    if key not in _TRANSCRIBED:
        _TRANSCRIBED[key] = whisper.transcribe(openai_reference_model(str(folder)), audio, fp16=False, **options)
    return copy.deepcopy(_TRANSCRIBED[key])


def openai_whisper(folder: Path, dtype=torch.float32):
    """`whisper.model.Whisper` holding the weights of our checkpoint folder."""
    from whisper.model import ModelDimensions, Whisper

    cfg = WhisperConfig.from_hf(folder)
    dims = ModelDimensions(n_mels=cfg.num_mel_bins, n_audio_ctx=cfg.max_source_positions, n_audio_state=cfg.d_model,
                           n_audio_head=cfg.encoder_attention_heads, n_audio_layer=cfg.encoder_layers,
                           n_vocab=cfg.vocab_size, n_text_ctx=cfg.max_target_positions, n_text_state=cfg.d_model,
                           n_text_head=cfg.decoder_attention_heads, n_text_layer=cfg.decoder_layers)
    state = {openai_name(k): v.to(dtype) for k, v in load_file(str(folder / "model.safetensors")).items()
             if k != "proj_out.weight"}  # the tied head, if stored
    model = Whisper(dims)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # alignment_heads is a buffer openai fills from its own checkpoint table (word timestamps only)
    if set(missing) - {"alignment_heads"} or unexpected:
        raise AssertionError(f"state-dict mapping is incomplete: missing {missing}, unexpected {unexpected}")
    return model.to(dtype).eval()


SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "She sells sea shells by the sea shore every summer morning.",
    "A journey of a thousand miles begins with a single step.",
    "The committee will meet again next Tuesday to discuss the budget.",
    "Please remember to bring your umbrella because it might rain later today.",
    "Scientists have discovered a new species of frog in the rain forest.",
    "The train to Boston leaves from platform nine at half past seven.",
    "He opened the old wooden box and found a bundle of letters inside.",
    "Our new library offers free classes in painting, music and cooking.",
    "The weather forecast predicts strong winds along the northern coast tonight.",
    "My grandmother grows tomatoes, peppers and beans in her small garden.",
    "The museum will be closed on Monday for repairs to the roof.",
    "Children learn languages faster when they hear them spoken at home.",
    "The pilot announced that we would land twenty minutes ahead of schedule.",
    "Fresh bread from the bakery on the corner sells out before noon.",
    "The orchestra played a beautiful symphony to a full concert hall.",
    "Engineers are testing a bridge design that can survive earthquakes.",
    "After dinner we walked along the beach and watched the sunset.",
    "The company reported higher profits for the third quarter in a row.",
    "Remember to save your work often so that nothing is lost.",
]
VOICES = ("kal16", "slt", "rms", "awb")


def flite_recording(folder: Path, seconds: float, seed: int = 0, sentences=SENTENCES) -> tuple[np.ndarray, str]:
    """(16 kHz float32 samples, reference text): flite sentences in rotating voices separated by
    0.3-1.5 s pauses, until `seconds` of audio. Deterministic for a seed."""
    from specwhisper.audio import load_audio

    if shutil.which("flite") is None:
        raise RuntimeError("flite is not installed")
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    pieces, texts, total, i = [], [], 0.0, 0
    while total < seconds:
        text, voice = sentences[(i + seed) % len(sentences)], VOICES[i % len(VOICES)]
        wav = folder / f"s{seed}_{i}.wav"
        subprocess.run(["flite", "-voice", voice, "-t", text, "-o", str(wav)], check=True, capture_output=True)
        speech = load_audio(wav)
        pause = np.zeros(int(16000 * rng.uniform(0.3, 1.5)), np.float32)
        pieces += [speech, pause]
        texts.append(text)
        total += (len(speech) + len(pause)) / 16000
        i += 1
    return np.concatenate(pieces), " ".join(texts)


def flite_audio_or_skip(tmp_path_factory, name: str, seconds: float, seed: int) -> np.ndarray:
    """`flite_recording`'s audio in a fresh temporary folder; the test skips where flite is missing."""
    import pytest

    try:
        audio, _ = flite_recording(tmp_path_factory.mktemp(name), seconds, seed=seed)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    return audio

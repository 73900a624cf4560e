"""Tiny random Whisper checkpoints written with `transformers` (real safetensors, real config,
a synthetic byte-level BPE tokenizer.json with Whisper's special tokens at their real ids)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

# transformers is imported where a checkpoint is made (4 s): conftest imports this module, and a
# pytest run that makes none (the GPU suite's smoke run on CPU) should not pay for it


def languages() -> dict:
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return LANGUAGES


TEXT_TOKENS = {51864: 50256, 51865: 50257, 51866: 50257}


def special_tokens(vocab_size: int) -> list[str]:
    langs = [c for c in languages() if vocab_size == 51866 or c != "yue"]
    no_speech = "<|nospeech|>" if vocab_size == 51866 else "<|nocaptions|>"
    return (["<|endoftext|>", "<|startoftranscript|>"] + [f"<|{c}|>" for c in langs]
            + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", no_speech,
               "<|notimestamps|>"] + [f"<|{i * 0.02:.2f}|>" for i in range(1501)])


def write_tokenizer(folder: Path, vocab_size: int, word_offset: int = 0) -> None:
    """Byte-level BPE: 256 byte tokens, then filler words, then the special tokens.
    `word_offset` shifts the filler words, so two vocabularies can share only part of them."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    n_text, i = TEXT_TOKENS[vocab_size], word_offset
    while len(vocab) < n_text:
        vocab.setdefault(f"Ġw{i}", len(vocab))
        i += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(special_tokens(vocab_size))
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    tok.save(str(folder / "tokenizer.json"))


def make_checkpoint(folder: Path, vocab_size: int = 51865, n_mels: int = 80, d_model: int = 64,
                    encoder_layers: int = 2, decoder_layers: int = 2, heads: int = 4,
                    seed: int = 0, init_std: float = 0.2, word_offset: int = 0,
                    encoder_from: Path | None = None, ffn_dim: int | None = None, float16: bool = False) -> Path:
    """Save a random WhisperForConditionalGeneration + tokenizer + generation config (`float16`:
    its tensors stored in float16, as Whisper's own checkpoints are)."""
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specials = special_tokens(vocab_size)
    ids = {s: TEXT_TOKENS[vocab_size] + i for i, s in enumerate(specials)}
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    cfg = WhisperConfig(
        vocab_size=vocab_size, num_mel_bins=n_mels, d_model=d_model,
        encoder_layers=encoder_layers, decoder_layers=decoder_layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads,
        encoder_ffn_dim=ffn_dim or 2 * d_model, decoder_ffn_dim=ffn_dim or 2 * d_model,
        max_source_positions=1500, max_target_positions=448, init_std=init_std,
        pad_token_id=eot, bos_token_id=eot, eos_token_id=eot, decoder_start_token_id=sot)
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(cfg).eval()
    if encoder_from is not None:
        donor = WhisperForConditionalGeneration.from_pretrained(encoder_from)
        model.model.encoder.load_state_dict(donor.model.encoder.state_dict())
    if float16:
        model = model.to(torch.float16)
    model.save_pretrained(folder)
    write_tokenizer(folder, vocab_size, word_offset)

    multilingual = vocab_size >= 51865
    langs = {s: i for s, i in ids.items() if s[2:-2] in languages()}
    suppress = sorted({1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31, 58, 59, 60, 61, 62, 63, 90, 91,
                       92, 93, 359, 503, 522, 542, 873, 893, 902, 918, 922, 931, 1350, 1853}
                      | {ids[s] for s in ("<|translate|>", "<|transcribe|>", "<|startoflm|>",
                                          "<|startofprev|>", specials[len(langs) + 6])}
                      # timestamps: `transformers` splits its output at them even without timestamps
                      | set(range(ids["<|0.00|>"], vocab_size)))
    gen = GenerationConfig(
        decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot, bos_token_id=eot,
        max_length=448, suppress_tokens=suppress, begin_suppress_tokens=[220, eot],
        no_timestamps_token_id=ids["<|notimestamps|>"], is_multilingual=multilingual,
        # openai's default when its table has no entry: every head of the second half of the layers
        alignment_heads=[[layer, head] for layer in range(decoder_layers // 2, decoder_layers) for head in range(heads)],
        **(dict(lang_to_id=langs, task_to_id={t: ids[f"<|{t}|>"] for t in ("translate", "transcribe")})
           if multilingual else {}))
    gen.save_pretrained(folder)
    return folder


def hf_generate(folder: Path, mel: torch.Tensor, language: str | None, max_new_tokens: int) -> list[list[int]]:
    """Greedy token ids from `transformers` generate (generated tokens only, no EOT)."""
    from transformers import WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    eot = model.generation_config.eos_token_id
    kwargs = dict(language=language, task="transcribe") if model.generation_config.is_multilingual else {}
    with torch.no_grad():
        out = model.generate(mel, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                             return_timestamps=False, **kwargs)
    rows = []
    for row in out.tolist():
        row = [t for t in row if t != eot]
        rows.append(row)
    return rows


def read_config(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())

"""Random-weight Whisper checkpoints at the real shapes of large-v3 (target), tiny and
distil-large-v3 (drafts), generated from literal configs: nothing is downloaded.

    python bench/gpu_models.py OUT_DIR [--device cuda] [--dtype float16] [--quick]

writes OUT_DIR/{large-v3,tiny,distil-large-v3}/ (config.json, model.safetensors, tokenizer.json,
generation_config.json), loadable by `specwhisper.Engine` and by `transformers`. Weights are
N(0, 0.02) (LayerNorms 1/0, biases 0), drawn on `--device` from a fixed seed. distil-large-v3
carries large-v3's encoder tensors exactly (so the engine shares the encoder). The EOT row of the
token embedding (= the tied head row) is zero, so greedy decoding on random weights never stops
early: every run generates exactly max_new_tokens. `--quick` writes the same three roles at toy
sizes (seconds on a CPU) for the smoke test. A folder already holding the same spec is reused.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.models.whisper.tokenization_whisper import LANGUAGES

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # checkpoints.py: the synthetic Whisper tokenizer

from checkpoints import TEXT_TOKENS, special_tokens, write_tokenizer  # noqa: E402
from specwhisper.config import WhisperConfig  # noqa: E402
from specwhisper.model.weights import load_whisper  # noqa: E402
from specwhisper.model.whisper import Whisper  # noqa: E402

LARGE_V3 = dict(d_model=1280, encoder_layers=32, decoder_layers=32, encoder_attention_heads=20,
                decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120,
                num_mel_bins=128, vocab_size=51866)
TINY = dict(d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
            decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536,
            num_mel_bins=80, vocab_size=51865)
DISTIL_LARGE_V3 = dict(LARGE_V3, decoder_layers=2)  # large-v3's encoder, 2 decoder layers

# --quick: the same roles (128 vs 80 mels, 51866 vs 51865 vocab, shared encoder) at toy sizes
QUICK_TARGET = dict(d_model=64, encoder_layers=1, decoder_layers=4, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                    num_mel_bins=128, vocab_size=51866)
QUICK_TINY = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                  decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                  num_mel_bins=80, vocab_size=51865)
QUICK_DISTIL = dict(QUICK_TARGET, decoder_layers=2)

INIT_STD = 0.02


def specs(quick: bool) -> dict[str, tuple[dict, str | None]]:
    """name -> (config fields, name of the model whose encoder it shares or None)."""
    if quick:
        return {"large-v3": (QUICK_TARGET, None), "tiny": (QUICK_TINY, None),
                "distil-large-v3": (QUICK_DISTIL, "large-v3")}
    return {"large-v3": (LARGE_V3, None), "tiny": (TINY, None),
            "distil-large-v3": (DISTIL_LARGE_V3, "large-v3")}


@torch.no_grad()
def random_whisper(spec: dict, device, dtype: torch.dtype, seed: int) -> Whisper:
    """`Whisper` with N(0, INIT_STD) weights (LayerNorm 1/0, biases 0) and a zero EOT embedding."""
    cfg = WhisperConfig(**spec)
    with torch.device("meta"):
        model = Whisper(cfg).to(dtype)
    model = model.to_empty(device=device).eval().requires_grad_(False)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            p.normal_(0.0, INIT_STD, generator=g)
        elif "layer_norm" in name and name.endswith("weight"):
            p.fill_(1.0)
        else:
            p.zero_()
    model.decoder.embed_tokens.weight[TEXT_TOKENS[cfg.vocab_size]] = 0  # EOT never wins greedily
    return model


def hf_config(spec: dict, dtype: torch.dtype) -> dict:
    eot, sot = TEXT_TOKENS[spec["vocab_size"]], TEXT_TOKENS[spec["vocab_size"]] + 1
    return dict(spec, model_type="whisper", architectures=["WhisperForConditionalGeneration"],
                activation_function="gelu", scale_embedding=False, max_source_positions=1500,
                max_target_positions=448, num_hidden_layers=spec["encoder_layers"],
                pad_token_id=eot, bos_token_id=eot, eos_token_id=eot, decoder_start_token_id=sot,
                begin_suppress_tokens=[220, eot], tie_word_embeddings=True, use_cache=True,
                init_std=INIT_STD, torch_dtype=str(dtype).removeprefix("torch."))


def generation_config(vocab_size: int) -> dict:
    """Whisper's generation settings with the special ids of this vocabulary (greedy, no
    timestamps; every timestamp token suppressed, as `transformers` splits output at them)."""
    specials = special_tokens(vocab_size)
    ids = {s: TEXT_TOKENS[vocab_size] + i for i, s in enumerate(specials)}
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    langs = {s: i for s, i in ids.items() if s[2:-2] in LANGUAGES}
    suppress = sorted({1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31, 58, 59, 60, 61, 62, 63}
                      | {ids[s] for s in ("<|translate|>", "<|transcribe|>", "<|startoflm|>",
                                          "<|startofprev|>")}
                      | set(range(ids["<|0.00|>"], vocab_size)))
    return dict(decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot, bos_token_id=eot,
                max_length=448, suppress_tokens=suppress, begin_suppress_tokens=[220, eot],
                no_timestamps_token_id=ids["<|notimestamps|>"], is_multilingual=vocab_size >= 51865,
                lang_to_id=langs, task_to_id={t: ids[f"<|{t}|>"] for t in ("translate", "transcribe")})


def save(model: Whisper, folder: Path, spec: dict, dtype: torch.dtype, seed: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    state = {f"model.{k}": v.to(dtype).cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(spec, dtype), indent=1))
    (folder / "generation_config.json").write_text(json.dumps(generation_config(spec["vocab_size"]), indent=1))
    write_tokenizer(folder, spec["vocab_size"])
    (folder / "spec.json").write_text(json.dumps(dict(spec=spec, dtype=str(dtype), seed=seed)))


def make_models(out_dir: Path, device="cuda", dtype=torch.float16, quick: bool = False,
                seed: int = 0) -> dict[str, Path]:
    """Write the three checkpoints under out_dir (reusing folders with the same spec) -> folders."""
    out_dir = Path(out_dir)
    folders, made = {}, {}
    for i, (name, (spec, encoder_of)) in enumerate(specs(quick).items()):
        folder = folders[name] = out_dir / name
        marker = folder / "spec.json"
        want = dict(spec=spec, dtype=str(dtype), seed=seed + i)
        fresh_donor = encoder_of in made  # a regenerated donor invalidates the copy of its encoder
        if marker.is_file() and json.loads(marker.read_text()) == want and not fresh_donor:
            continue
        model = random_whisper(spec, device, dtype, seed + i)
        if encoder_of is not None:
            donor = made.get(encoder_of) or load_whisper(folders[encoder_of], device=device, dtype=dtype)
            model.encoder.load_state_dict(donor.encoder.state_dict())
        save(model, folder, spec, dtype, seed + i)
        made[name] = model
    return folders


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--quick", action="store_true", help="toy sizes (CPU smoke test)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    folders = make_models(args.out_dir, args.device, getattr(torch, args.dtype), args.quick)
    sizes = {n: round((f / "model.safetensors").stat().st_size / 1e9, 3) for n, f in folders.items()}
    print(json.dumps(dict(folders={n: str(f) for n, f in folders.items()}, gigabytes=sizes,
                          seconds=round(time.perf_counter() - start, 1))))


if __name__ == "__main__":
    main()

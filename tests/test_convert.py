"""specwhisper.tools.convert: CTranslate2 Whisper model.bin → HF folder (exact weights, splits, corrupt
files), and on the real fetched checkpoints: transformers greedy == CTranslate2 greedy."""
import json
import os
import struct
import wave

import numpy as np
import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, models

from specwhisper.tools import fetch
from specwhisper.tools.convert import convert_ct2

transformers = pytest.importorskip("transformers")

VOCAB = 51865
LANGS = [f"<|{code}|>" for code in list(transformers.models.whisper.tokenization_whisper.LANGUAGES)[:99]]
CODES = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2, np.dtype(np.float16): 4}
CT2_CONFIG = {"alignment_heads": [[1, 0], [1, 1]], "lang_ids": list(range(50259, 50358)),
              "suppress_ids": [1, 2, 7, 50358, 50359], "suppress_ids_begin": [220, 50257]}


def _string(s: str) -> bytes:
    raw = s.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def write_ct2(path, variables, aliases, *, version=6, spec="WhisperSpec", codes=(), byte_counts=()):
    """Mirror of CTranslate2's model.bin writer; `codes`/`byte_counts` override per-variable headers."""
    codes, byte_counts = dict(codes), dict(byte_counts)
    out = [struct.pack("<I", version), _string(spec), struct.pack("<II", 3, len(variables))]
    for name, a in sorted(variables.items()):
        data = np.ascontiguousarray(a).tobytes()
        out += [_string(name), struct.pack("<B", a.ndim), struct.pack(f"<{a.ndim}I", *a.shape),
                struct.pack("<BI", codes.get(name, CODES[a.dtype]), byte_counts.get(name, len(data))), data]
    out.append(struct.pack("<I", len(aliases)))
    out += [_string(s) for pair in aliases.items() for s in pair]
    path.write_bytes(b"".join(out))


def ct2_variables(sd: dict[str, np.ndarray], n_layers: int, heads: int) -> dict[str, np.ndarray]:
    """HF Whisper state dict (numpy) → CTranslate2 WhisperSpec variables (fused QKV / KV)."""
    v = {"decoder/activation": np.array(3, np.int8), "decoder/alibi": np.array(0, np.int8),
         "decoder/alibi_use_positive_positions": np.array(0, np.int8),
         "decoder/scale_alibi": np.array(0, np.int8), "decoder/pre_norm": np.array(1, np.int8),
         "decoder/scale_embeddings": np.array(0, np.int8),
         "decoder/start_from_zero_embedding": np.array(0, np.int8),
         "decoder/alignment_heads": np.array(1, np.int16), "decoder/alignment_layer": np.array(-1, np.int16),
         "encoder/num_heads": np.array(heads, np.int16), "decoder/num_heads": np.array(heads, np.int16)}

    def lin(dst, src):
        v[f"{dst}/weight"], v[f"{dst}/bias"] = sd[f"{src}.weight"], sd[f"{src}.bias"]

    def norm(dst, src):
        v[f"{dst}/gamma"], v[f"{dst}/beta"] = sd[f"{src}.weight"], sd[f"{src}.bias"]

    def fused(dst, src, projs):
        v[f"{dst}/weight"] = np.concatenate([sd[f"{src}.{p}.weight"] for p in projs])
        v[f"{dst}/bias"] = np.concatenate([sd[f"{src}.{p}.bias"] if p != "k_proj"
                                           else np.zeros_like(sd[f"{src}.q_proj.bias"]) for p in projs])

    lin("encoder/conv1", "model.encoder.conv1")
    lin("encoder/conv2", "model.encoder.conv2")
    v["encoder/position_encodings/encodings"] = sd["model.encoder.embed_positions.weight"]
    v["decoder/embeddings/weight"] = sd["model.decoder.embed_tokens.weight"]
    v["decoder/position_encodings/encodings"] = sd["model.decoder.embed_positions.weight"]
    for side in ("encoder", "decoder"):
        for i in range(n_layers):
            dst, src = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
            norm(f"{dst}/self_attention/layer_norm", f"{src}.self_attn_layer_norm")
            fused(f"{dst}/self_attention/linear_0", f"{src}.self_attn", ("q_proj", "k_proj", "v_proj"))
            lin(f"{dst}/self_attention/linear_1", f"{src}.self_attn.out_proj")
            if side == "decoder":
                norm(f"{dst}/attention/layer_norm", f"{src}.encoder_attn_layer_norm")
                lin(f"{dst}/attention/linear_0", f"{src}.encoder_attn.q_proj")
                fused(f"{dst}/attention/linear_1", f"{src}.encoder_attn", ("k_proj", "v_proj"))
                lin(f"{dst}/attention/linear_2", f"{src}.encoder_attn.out_proj")
            norm(f"{dst}/ffn/layer_norm", f"{src}.final_layer_norm")
            lin(f"{dst}/ffn/linear_0", f"{src}.fc1")
            lin(f"{dst}/ffn/linear_1", f"{src}.fc2")
        norm(f"{side}/layer_norm", f"model.{side}.layer_norm")
    return v


ALIASES = {"decoder/projection/weight": "decoder/embeddings/weight"}


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    """A multilingual-layout tokenizer: 50257 text tokens, then Whisper's specials in order."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(50257)}, unk_token="t0"))
    specials = ["<|endoftext|>", "<|startoftranscript|>", *LANGS, "<|translate|>", "<|transcribe|>",
                "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
    tok.add_special_tokens(specials + [f"<|{i * 0.02:.2f}|>" for i in range(1501)])
    assert tok.get_vocab_size() == VOCAB
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80)
    return transformers.WhisperForConditionalGeneration(config).eval()


def make_ct2(folder, tiny_model, tokenizer_json, dtype=np.float16, edit=None, **write_kw):
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.numpy().astype(dtype) for k, v in tiny_model.state_dict().items()}
    variables = ct2_variables(sd, 2, 4)
    if edit:
        edit(variables)
    write_ct2(folder / "model.bin", variables, ALIASES, **write_kw)
    (folder / "config.json").write_text(json.dumps(CT2_CONFIG))
    (folder / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    return folder


def read_safetensors(folder):
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_convert_is_exact(tmp_path, tiny_model, tokenizer_json, dtype):
    ct2 = make_ct2(tmp_path / "ct2", tiny_model, tokenizer_json, dtype)
    out = convert_ct2(ct2, tmp_path / "hf")
    torch_dtype = torch.float16 if dtype == np.float16 else torch.float32
    original = tiny_model.state_dict()
    stored = read_safetensors(out)
    assert set(stored) == set(original) - {"proj_out.weight"}
    assert {t.dtype for t in stored.values()} == {torch_dtype}

    model, info = transformers.WhisperForConditionalGeneration.from_pretrained(
        out, dtype=torch_dtype, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    for key, value in model.state_dict().items():
        assert torch.equal(value, original[key].to(torch_dtype)), key

    config = transformers.WhisperConfig.from_pretrained(out)
    for field in ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
                  "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "num_mel_bins",
                  "max_source_positions", "max_target_positions"):
        assert getattr(config, field) == getattr(tiny_model.config, field), field
    assert (config.decoder_start_token_id, config.eos_token_id, config.pad_token_id) == (50258, 50257, 50257)
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert gen.suppress_tokens == CT2_CONFIG["suppress_ids"]
    assert gen.begin_suppress_tokens == CT2_CONFIG["suppress_ids_begin"]
    assert gen.lang_to_id["<|en|>"] == 50259 and gen.lang_to_id["<|su|>"] == 50357 and len(gen.lang_to_id) == 99
    assert gen.task_to_id == {"transcribe": 50359, "translate": 50358}
    assert (gen.no_timestamps_token_id, gen.prev_sot_token_id, gen.max_length) == (50363, 50361, 448)
    assert gen.is_multilingual and gen.alignment_heads == CT2_CONFIG["alignment_heads"]
    assert transformers.WhisperFeatureExtractor.from_pretrained(out).feature_size == 80
    assert (out / "tokenizer.json").read_bytes() == tokenizer_json.read_bytes()


def test_split_checkpoint_converts_identically(tmp_path, tiny_model, tokenizer_json):
    ct2 = make_ct2(tmp_path / "ct2", tiny_model, tokenizer_json)
    whole = read_safetensors(convert_ct2(ct2, tmp_path / "hf_whole"))
    blob = (ct2 / "model.bin").read_bytes()
    (ct2 / "model.bin").unlink()
    # 11 parts so that lexical order (part1, part10, part11, part2, …) would be wrong; cuts land
    # inside headers, names and tensors alike.
    cuts = [0, 1, 3, 17, 100, 1001, 4099, len(blob) // 3 + 7, len(blob) // 2, len(blob) - 50, len(blob) - 3,
            len(blob)]
    for i, (a, b) in enumerate(zip(cuts, cuts[1:]), start=1):
        (ct2 / f"model.bin.part{i}").write_bytes(blob[a:b])
    split = read_safetensors(convert_ct2(ct2, tmp_path / "hf_split"))
    assert split.keys() == whole.keys()
    for key in whole:
        assert torch.equal(split[key], whole[key]), key


def _nonzero_key_bias(v):
    name = "decoder/layer_1/self_attention/linear_0/bias"
    bias = v[name].copy()
    bias[64 + 5] = 1.0
    v[name] = bias


CORRUPT = {
    "bad version": (dict(version=5), None, "unsupported model.bin version 5"),
    "wrong spec": (dict(spec="TransformerSpec"), None, "not a Whisper checkpoint"),
    "unknown dtype": (dict(codes={"encoder/conv1/bias": 9}), None, "unknown dtype code 9"),
    "byte count": (dict(byte_counts={"encoder/conv1/bias": 130}), None, "byte count mismatch"),
    "nonzero key bias": ({}, _nonzero_key_bias, "nonzero key bias"),
    "missing variable": ({}, lambda v: v.pop("decoder/layer_norm/gamma"), "missing variable"),
    "unknown variable": ({}, lambda v: v.update({"decoder/extra/weight": np.zeros(3, np.float16)}),
                         "unexpected variables"),
    "quantized": ({}, lambda v: v.update({"encoder/conv1/bias": np.zeros(64, np.int8)}), "non-float dtype"),
    "bad flag": ({}, lambda v: v.update({"decoder/pre_norm": np.array(0, np.int8)}), "pre_norm"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_checkpoints_are_rejected(tmp_path, tiny_model, tokenizer_json, case):
    write_kw, edit, message = CORRUPT[case]
    ct2 = make_ct2(tmp_path / "ct2", tiny_model, tokenizer_json, edit=edit, **write_kw)
    with pytest.raises(ValueError, match=message) as err:
        convert_ct2(ct2, tmp_path / "hf")
    assert "model.bin" in str(err.value)
    assert not (tmp_path / "hf" / "model.safetensors").exists()


@pytest.mark.parametrize("how", ["truncated", "trailing"])
def test_truncated_or_padded_file_is_rejected(tmp_path, tiny_model, tokenizer_json, how):
    ct2 = make_ct2(tmp_path / "ct2", tiny_model, tokenizer_json)
    blob = (ct2 / "model.bin").read_bytes()
    (ct2 / "model.bin").write_bytes(blob[:len(blob) // 2] if how == "truncated" else blob + b"\0\0")
    with pytest.raises(ValueError, match="truncated file" if how == "truncated" else "trailing bytes"):
        convert_ct2(ct2, tmp_path / "hf")


def test_missing_config_or_parts_are_rejected(tmp_path, tiny_model, tokenizer_json):
    ct2 = make_ct2(tmp_path / "ct2", tiny_model, tokenizer_json)
    (ct2 / "config.json").unlink()
    with pytest.raises(ValueError, match="missing config.json"):
        convert_ct2(ct2, tmp_path / "hf")
    (ct2 / "model.bin").rename(ct2 / "model.bin.part2")
    with pytest.raises(ValueError, match="not numbered"):
        convert_ct2(ct2, tmp_path / "hf")


# --- real checkpoints (populated by `specwhisper.tools.fetch.fetch`) ---------------------------

PROMPTS = {"base": ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"],
           "tiny.en": ["<|startoftranscript|>", "<|notimestamps|>"]}
CLIPS = ["flite_slt_01.wav", "espeak_en-us_01.wav"]


def real_folders(name):
    if fetch.is_fetched(name):
        return fetch.fetch(name), fetch.ct2_dir(name)
    if os.environ.get("SPECWHISPER_REQUIRE_REAL") == "1":
        pytest.fail(f"{name} is not in the specwhisper cache {fetch.cache_root()}; run fetch({name!r})")
    pytest.skip(f"{name} is not fetched (specwhisper.tools.fetch.fetch({name!r}))")


def read_wav16k(path):
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2), path
        return np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    from specwhisper.samples import SAMPLES_DIR
    paths = [SAMPLES_DIR / c for c in CLIPS if (SAMPLES_DIR / c).exists()]
    if not paths:
        import shutil
        import subprocess
        if shutil.which("flite") is None:
            pytest.skip("no bundled samples and no flite")
        path = tmp_path_factory.mktemp("clip") / "clip.wav"
        subprocess.run(["flite", "-voice", "slt", "-t", "The quick brown fox jumps over the lazy dog.",
                        "-o", str(path)], check=True)
        paths = [path]
    return [read_wav16k(p) for p in paths]


@pytest.mark.real
@pytest.mark.parametrize("name", ["base", "tiny.en"])
def test_real_checkpoint_greedy_matches_ctranslate2(name, clips):
    ctranslate2 = pytest.importorskip("ctranslate2")
    hf_dir, ct2_path = real_folders(name)
    model, info = transformers.WhisperForConditionalGeneration.from_pretrained(
        hf_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert json.loads((hf_dir / "config.json").read_text())["dtype"] == "float16"
    features = transformers.WhisperFeatureExtractor.from_pretrained(hf_dir)
    ct2_model = ctranslate2.models.Whisper(str(ct2_path), device="cpu", compute_type="float32")
    kwargs = {"language": "en", "task": "transcribe"} if name == "base" else {}
    eot = model.generation_config.eos_token_id
    for audio in clips:
        feats = features(audio, sampling_rate=16000, return_tensors="np").input_features  # [1, 80, 3000]
        with torch.inference_mode():
            hf_tokens = model.generate(torch.from_numpy(feats), **kwargs)[0].tolist()
        ct2_tokens = ct2_model.generate(ctranslate2.StorageView.from_array(feats), [PROMPTS[name]],
                                        beam_size=1, max_length=448)[0].sequences_ids[0]
        hf_tokens = [t for t in hf_tokens if t != eot]
        if hf_tokens[:1] == [model.generation_config.decoder_start_token_id]:  # prompt returned too
            hf_tokens = hf_tokens[len(PROMPTS[name]):]
        assert len(ct2_tokens) > 3
        assert hf_tokens == ct2_tokens

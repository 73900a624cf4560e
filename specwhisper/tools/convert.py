"""CTranslate2 Whisper checkpoint (faster-whisper's `model.bin`) → Hugging Face Whisper folder.

The `model.bin` layout (CTranslate2 `models.Model._serialize`, version 6), little-endian:
    uint32 version | str spec_name | uint32 revision | uint32 n_variables
    n_variables × (str name | uint8 rank | uint32 dims[rank] | uint8 dtype | uint32 n_bytes | data)
    uint32 n_aliases | n_aliases × (str alias | str target)
where `str` is a uint16 byte length (trailing NUL included) followed by the bytes.
"""

from __future__ import annotations

import bisect
import json
import mmap
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

CT2_VERSION = 6
# CTranslate2 DataType enum; bfloat16 is read as raw uint16 and viewed as torch.bfloat16.
DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: np.uint16}
FLOAT_CODES = {0: torch.float32, 4: torch.float16, 5: torch.bfloat16}
# Scalar flags CTranslate2 stores for a Whisper decoder and the values a Whisper model must have;
# None: any value (informational), missing optional ones are fine (older converters omit them).
SCALARS = {"decoder/activation": 3, "decoder/alibi": 0, "decoder/pre_norm": 1,
           "decoder/scale_embeddings": 0, "decoder/start_from_zero_embedding": 0,
           "decoder/alignment_heads": None, "decoder/alignment_layer": None}
OPTIONAL_SCALARS = {"decoder/alibi_use_positive_positions": 0, "decoder/scale_alibi": 0}
ALIASES = {"decoder/projection/weight": "decoder/embeddings/weight"}
MULTILINGUAL_VOCAB = 51865  # multilingual Whisper vocabularies have ≥ 51865 tokens
MAX_INITIAL_TIMESTAMP_INDEX = 50


class _Concat:
    """Byte stream over one or more files read through mmaps, without joining them."""

    def __init__(self, paths: list[Path]):
        self.label, self.maps, self.starts, self.size, self.pos = str(paths[0]), [], [], 0, 0
        for path in paths:
            with open(path, "rb") as f:
                n = path.stat().st_size
                if n:  # copy-on-write map: writable arrays for torch, nothing copied unless written
                    self.maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
                    self.starts.append(self.size)
                    self.size += n

    def take(self, n: int, what: str) -> np.ndarray:
        """The next n bytes as a uint8 array (zero-copy unless they straddle two files)."""
        if self.pos + n > self.size:
            raise ValueError(f"{self.label}: truncated file: {what} needs {n} bytes at offset "
                             f"{self.pos}, only {self.size - self.pos} left")
        pieces, pos, end = [], self.pos, self.pos + n
        while pos < end:
            i = bisect.bisect_right(self.starts, pos) - 1
            off = pos - self.starts[i]
            k = min(end - pos, len(self.maps[i]) - off)
            pieces.append(np.frombuffer(self.maps[i], np.uint8, k, off))
            pos += k
        self.pos = end
        if not pieces:
            return np.empty(0, np.uint8)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def uint(self, fmt: str, what: str) -> int:
        return int(self.take(np.dtype(fmt).itemsize, what).view(fmt)[0])

    def string(self, what: str) -> str:
        raw = self.take(self.uint("<u2", what), what).tobytes()
        if not raw.endswith(b"\0"):
            raise ValueError(f"{self.label}: {what} string is not NUL-terminated at offset {self.pos}")
        return raw[:-1].decode("utf-8")


def read_ct2(paths: list[Path]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse a (possibly split) CTranslate2 Whisper model.bin → ({name: array}, {alias: target})."""
    s = _Concat(paths)
    version = s.uint("<u4", "version")
    if version != CT2_VERSION:
        raise ValueError(f"{s.label}: unsupported model.bin version {version} (expected {CT2_VERSION})")
    spec = s.string("spec name")
    if spec != "WhisperSpec":
        raise ValueError(f"{s.label}: not a Whisper checkpoint: spec name {spec!r} (expected 'WhisperSpec')")
    s.uint("<u4", "revision")
    variables = {}
    for _ in range(s.uint("<u4", "variable count")):
        name = s.string("variable name")
        dims = [s.uint("<u4", f"{name} dims") for _ in range(s.uint("<u1", f"{name} rank"))]
        code = s.uint("<u1", f"{name} dtype")
        if code not in DTYPES:
            raise ValueError(f"{s.label}: unknown dtype code {code} for variable {name!r}")
        dtype = np.dtype(DTYPES[code])
        n_bytes = s.uint("<u4", f"{name} byte count")
        if n_bytes != int(np.prod(dims, dtype=np.int64)) * dtype.itemsize:
            raise ValueError(f"{s.label}: byte count mismatch for {name!r}: {n_bytes} bytes for dims "
                             f"{dims} of {dtype.name}")
        data = s.take(n_bytes, f"data of {name!r}").view(dtype).reshape(dims)
        variables[name] = (data, code)
    aliases = {}
    for _ in range(s.uint("<u4", "alias count")):
        alias = s.string("alias")
        aliases[alias] = s.string("alias target")
    if s.pos != s.size:
        raise ValueError(f"{s.label}: {s.size - s.pos} unexpected trailing bytes after the aliases")
    return variables, aliases


def _hf_state_dict(variables: dict, aliases: dict, label: str) -> tuple[dict[str, torch.Tensor], dict]:
    """CTranslate2 Whisper variables → HF `WhisperForConditionalGeneration` state dict + shape facts."""
    if aliases != ALIASES:
        raise ValueError(f"{label}: unexpected aliases {aliases} (expected {ALIASES})")
    left = dict(variables)

    def pop(name):
        if name not in left:
            raise ValueError(f"{label}: missing variable {name!r}")
        return left.pop(name)

    def tensor(name):
        data, code = pop(name)
        if code not in FLOAT_CODES:
            raise ValueError(f"{label}: variable {name!r} has non-float dtype code {code} "
                             "(quantized checkpoints are not supported)")
        return torch.from_numpy(data).view(FLOAT_CODES[code])  # view: bfloat16 arrives as uint16

    def split(name, parts):
        t = tensor(name)
        if t.shape[0] % parts:
            raise ValueError(f"{label}: {name!r} with {t.shape[0]} rows cannot be split in {parts}")
        return t.chunk(parts, dim=0)

    def linear(dst, src, out):
        out[f"{dst}.weight"], out[f"{dst}.bias"] = tensor(f"{src}/weight"), tensor(f"{src}/bias")

    def norm(dst, src, out):
        out[f"{dst}.weight"], out[f"{dst}.bias"] = tensor(f"{src}/gamma"), tensor(f"{src}/beta")

    def fused(dst, src, names, out):  # names: projections fused along rows, "k_proj" has no bias
        for proj, w, b in zip(names, split(f"{src}/weight", len(names)), split(f"{src}/bias", len(names))):
            out[f"{dst}.{proj}.weight"] = w
            if proj == "k_proj":
                if torch.any(b != 0):
                    raise ValueError(f"{label}: {src}/bias has a nonzero key bias slice; "
                                     "Whisper has no key bias")
            else:
                out[f"{dst}.{proj}.bias"] = b

    def scalar(name):
        return int(pop(name)[0])

    for name, want in {**SCALARS, **{k: v for k, v in OPTIONAL_SCALARS.items() if k in left}}.items():
        got = scalar(name)
        if want is not None and got != want:
            raise ValueError(f"{label}: {name} = {got}, a Whisper checkpoint has {want}")
    heads = {side: scalar(f"{side}/num_heads") for side in ("encoder", "decoder")}
    sd = {}
    for i in (1, 2):
        linear(f"model.encoder.conv{i}", f"encoder/conv{i}", sd)
    sd["model.encoder.embed_positions.weight"] = tensor("encoder/position_encodings/encodings")
    sd["model.decoder.embed_tokens.weight"] = tensor("decoder/embeddings/weight")
    sd["model.decoder.embed_positions.weight"] = tensor("decoder/position_encodings/encodings")
    layers = {}
    for side in ("encoder", "decoder"):
        layers[side] = len({m.group(1) for n in left if (m := re.match(rf"{side}/layer_(\d+)/", n))})
        for i in range(layers[side]):
            src, dst = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
            norm(f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm", sd)
            fused(f"{dst}.self_attn", f"{src}/self_attention/linear_0", ("q_proj", "k_proj", "v_proj"), sd)
            linear(f"{dst}.self_attn.out_proj", f"{src}/self_attention/linear_1", sd)
            if side == "decoder":
                norm(f"{dst}.encoder_attn_layer_norm", f"{src}/attention/layer_norm", sd)
                linear(f"{dst}.encoder_attn.q_proj", f"{src}/attention/linear_0", sd)
                fused(f"{dst}.encoder_attn", f"{src}/attention/linear_1", ("k_proj", "v_proj"), sd)
                linear(f"{dst}.encoder_attn.out_proj", f"{src}/attention/linear_2", sd)
            norm(f"{dst}.final_layer_norm", f"{src}/ffn/layer_norm", sd)
            linear(f"{dst}.fc1", f"{src}/ffn/linear_0", sd)
            linear(f"{dst}.fc2", f"{src}/ffn/linear_1", sd)
        norm(f"model.{side}.layer_norm", f"{side}/layer_norm", sd)
    if left:
        raise ValueError(f"{label}: unexpected variables {sorted(left)[:8]}")
    dtypes = {t.dtype for t in sd.values()}
    if len(dtypes) != 1:
        raise ValueError(f"{label}: mixed weight dtypes {sorted(map(str, dtypes))}")
    vocab, d_model = sd["model.decoder.embed_tokens.weight"].shape
    shape = dict(vocab_size=vocab, d_model=d_model, encoder_layers=layers["encoder"],
                 decoder_layers=layers["decoder"], encoder_attention_heads=heads["encoder"],
                 decoder_attention_heads=heads["decoder"],
                 encoder_ffn_dim=sd["model.encoder.layers.0.fc1.weight"].shape[0],
                 decoder_ffn_dim=sd["model.decoder.layers.0.fc1.weight"].shape[0],
                 num_mel_bins=sd["model.encoder.conv1.weight"].shape[1],
                 max_source_positions=sd["model.encoder.embed_positions.weight"].shape[0],
                 max_target_positions=sd["model.decoder.embed_positions.weight"].shape[0],
                 dtype=str(dtypes.pop()).removeprefix("torch."))
    for side in ("encoder", "decoder"):
        if d_model % shape[f"{side}_attention_heads"]:
            raise ValueError(f"{label}: d_model {d_model} not divisible by {side} heads")
    return sd, shape


def _special_ids(tokenizer_path: Path) -> dict[str, int]:
    tok = json.loads(tokenizer_path.read_text(encoding="utf-8"))
    ids = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    need = ["<|endoftext|>", "<|startoftranscript|>", "<|translate|>", "<|transcribe|>",
            "<|startofprev|>", "<|notimestamps|>"]
    if missing := [t for t in need if t not in ids]:
        raise ValueError(f"{tokenizer_path}: missing special tokens {missing}")
    return ids


def _configs(shape: dict, ct2_config: dict, ids: dict[str, int], label: str) -> tuple[dict, dict]:
    for key in ("suppress_ids", "suppress_ids_begin", "lang_ids", "alignment_heads"):
        if key not in ct2_config:
            raise ValueError(f"{label}: config.json has no {key!r}")
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    multilingual = shape["vocab_size"] >= MULTILINGUAL_VOCAB
    special = dict(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, decoder_start_token_id=sot)
    suppress = dict(suppress_tokens=list(ct2_config["suppress_ids"]),
                    begin_suppress_tokens=list(ct2_config["suppress_ids_begin"]))
    for key, values in suppress.items():
        if any(not 0 <= t < shape["vocab_size"] for t in values):
            raise ValueError(f"{label}: config.json {key} has ids outside the vocabulary")
    config = dict(architectures=["WhisperForConditionalGeneration"], model_type="whisper",
                  activation_function="gelu", scale_embedding=False, tie_word_embeddings=True,
                  is_encoder_decoder=True, use_cache=True, median_filter_width=7,
                  **shape, **special, **suppress)
    generation = dict(**special, **suppress, max_length=shape["max_target_positions"],
                      is_multilingual=multilingual, return_timestamps=False,
                      no_timestamps_token_id=ids["<|notimestamps|>"],
                      prev_sot_token_id=ids["<|startofprev|>"],
                      max_initial_timestamp_index=MAX_INITIAL_TIMESTAMP_INDEX,
                      alignment_heads=[list(pair) for pair in ct2_config["alignment_heads"]])
    if multilingual:  # English-only: no lang_to_id, else transformers would run language detection
        by_id = {i: t for t, i in ids.items()}
        langs = {by_id.get(i): i for i in ct2_config["lang_ids"]}
        if any(t is None or not re.fullmatch(r"<\|[a-z]{2,3}\|>", t) for t in langs):
            raise ValueError(f"{label}: config.json lang_ids are not language tokens in tokenizer.json")
        generation["lang_to_id"] = langs
        generation["task_to_id"] = {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]}
    return config, generation


def _preprocessor(ct2_dir: Path, n_mels: int) -> dict:
    path = ct2_dir / "preprocessor_config.json"
    if path.exists():
        pre = json.loads(path.read_text())
        if pre.get("feature_size", n_mels) != n_mels:
            raise ValueError(f"{path}: feature_size {pre['feature_size']} != {n_mels} mel bins of the model")
        return pre
    return dict(feature_extractor_type="WhisperFeatureExtractor", processor_class="WhisperProcessor",
                feature_size=n_mels, sampling_rate=16000, hop_length=160, n_fft=400, chunk_length=30,
                n_samples=480000, nb_max_frames=3000, padding_side="right", padding_value=0.0,
                return_attention_mask=False)


def model_files(ct2_dir: str | Path) -> list[Path]:
    """`model.bin`, or `model.bin.part1`, `.part2`, … in numeric order."""
    ct2_dir = Path(ct2_dir)
    if (ct2_dir / "model.bin").exists():
        return [ct2_dir / "model.bin"]
    parts = {int(m.group(1)): p for p in ct2_dir.glob("model.bin.part*")
             if (m := re.fullmatch(r"model\.bin\.part(\d+)", p.name))}
    if not parts:
        raise ValueError(f"{ct2_dir}: no model.bin or model.bin.part1, .part2, …")
    if sorted(parts) != list(range(1, len(parts) + 1)):
        raise ValueError(f"{ct2_dir}: model.bin parts {sorted(parts)} are not numbered 1..{len(parts)}")
    return [parts[i] for i in sorted(parts)]


def convert_ct2(ct2_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert a CTranslate2 Whisper folder into an HF Whisper folder (weights keep their dtype)."""
    ct2_dir, out_dir = Path(ct2_dir), Path(out_dir)
    paths = model_files(ct2_dir)
    for name in ("config.json", "tokenizer.json"):
        if not (ct2_dir / name).exists():
            raise ValueError(f"{ct2_dir}: missing {name}")
    sd, shape = _hf_state_dict(*read_ct2(paths), label=str(paths[0]))
    config, generation = _configs(shape, json.loads((ct2_dir / "config.json").read_text()),
                                  _special_ids(ct2_dir / "tokenizer.json"), str(ct2_dir / "config.json"))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(sd, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)  # safetensors creates it owner-only
    for name, data in (("config.json", config), ("generation_config.json", generation),
                       ("preprocessor_config.json", _preprocessor(ct2_dir, shape["num_mel_bins"]))):
        (out_dir / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(ct2_dir / "tokenizer.json", out_dir / "tokenizer.json")
    return out_dir

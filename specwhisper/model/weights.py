"""Load a Hugging Face Whisper folder (config.json + safetensors, single or sharded) into `Whisper`.

The model is built on the `meta` device and the checkpoint tensors are assigned into it with
`load_state_dict(strict=True, assign=True)`: no random initialisation, no second copy. Only
safetensors are read (never pickle).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..config import WhisperConfig, read_json
from .whisper import Whisper

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
HF_PREFIX = "model."  # HF keys are `model.encoder...`; our top module is that `model`
TIED_HEAD = "proj_out.weight"


def checkpoint_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    if (folder / INDEX).is_file():
        weight_map = read_json(folder / INDEX, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{folder / INDEX} has no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shards listed in {INDEX} are missing: {missing}")
        return files
    found = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = f" (found {found}: pickle checkpoints are not loaded; convert them to safetensors)" if found else ""
    raise FileNotFoundError(f"{folder} holds neither {SINGLE} nor {INDEX}{hint}")


def read_state_dict(folder: Path, device, dtype) -> dict[str, torch.Tensor]:
    state = {}
    for path in checkpoint_files(folder):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    state[key] = f.get_tensor(key).to(device=device, dtype=dtype)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ValueError(f"corrupt or truncated safetensors file {path}: {exc}") from None
    return state


def load_whisper(folder: str | Path, device="cpu", dtype=torch.float32) -> Whisper:
    """Build `Whisper` from a HF folder on `device` in `dtype`, checking every key and shape."""
    folder = Path(folder)
    cfg = WhisperConfig.from_hf(folder)
    state = read_state_dict(folder, device, dtype)
    head = state.pop(TIED_HEAD, None)
    state = {k.removeprefix(HF_PREFIX): v for k, v in state.items()}
    if head is not None and not torch.equal(head, state.get("decoder.embed_tokens.weight", head)):
        raise ValueError(f"{folder}: {TIED_HEAD} differs from the token embedding; Whisper ties them")

    with torch.device("meta"):
        model = Whisper(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{folder}: checkpoint keys do not match the Whisper config; "
                         f"missing {missing[:20]}{' …' if len(missing) > 20 else ''}, "
                         f"unexpected {unexpected[:20]}{' …' if len(unexpected) > 20 else ''}")
    bad = [f"{k}: checkpoint {tuple(state[k].shape)} vs config {tuple(v.shape)}"
           for k, v in expected.items() if state[k].shape != v.shape]
    if bad:
        raise ValueError(f"{folder}: tensor shapes do not match config.json: {bad[:10]}")
    model.load_state_dict(state, strict=True, assign=True)
    model.eval().requires_grad_(False)
    model.fuse()
    return model

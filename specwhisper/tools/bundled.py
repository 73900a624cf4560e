"""Drafts that ship with the package (`specwhisper/drafts/`): a draft made by `specwhisper distill`
is stored as only the tensors its training changed and rebuilt beside its fetched target as a
Hugging Face folder (`specwhisper fetch base-2l`).

A distilled draft keeps the target's encoder, token embedding (the tied output head) and each
layer's cross-attention key/value projections (copied from a target layer, frozen while training):
all of that is the target's and is taken from the fetched target when the folder is assembled, so
the bundle holds the 2 trained decoder blocks' other weights, the position embedding and the final
layer norm (≈ 16 MB for base). The blocks' linear layers are stored in bfloat16, which loses
nothing the CPU engine keeps: it runs a draft's linear layers in bfloat16 (`Whisper.compact_decoder`);
layer norms and the position embedding stay float32.

    export(draft_folder, target_folder, out_file, info)   # a distill folder -> a bundle file
    assemble(bundle_file, target_folder, out_folder)     # a bundle + its target -> a draft folder
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..model.weights import read_state_dict
from .distill import TOKENIZER_FILES

DRAFTS_DIR = Path(__file__).resolve().parent.parent / "drafts"
ENCODER, DECODER = "model.encoder.", "model.decoder."
EMBEDDING = "model.decoder.embed_tokens.weight"
CROSS_KV = re.compile(r"model\.decoder\.layers\.(\d+)\.encoder_attn\.([kv]_proj\..*)")
# the decoder blocks' linear layers: the tensors a compact draft keeps in bfloat16 on the CPU
LINEAR = re.compile(r"model\.decoder\.layers\.\d+\.(self_attn\.\w+_proj|encoder_attn\.\w+_proj|fc1|fc2)"
                    r"\.(weight|bias)")


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors folder, in its stored dtype."""
    return read_state_dict(Path(folder), "cpu", None)


def export(draft_folder: str | Path, target_folder: str | Path, out_file: str | Path, info: dict) -> dict:
    """Write the tensors of `draft_folder` (a `specwhisper distill` output) that are not the
    target's to `out_file`, its blocks' linear layers in bfloat16 (as a compact draft runs them)
    and the rest (layer norms, position embedding) in float32, with the metadata `assemble` needs
    (its config, which target layer each draft layer's cross K/V projections are, `info` as JSON).
    Refuses a draft whose encoder or token embedding is not the target's. Returns the metadata."""
    draft, target = read_tensors(draft_folder), read_tensors(target_folder)
    for key, value in draft.items():
        if (key.startswith(ENCODER) or key == EMBEDDING) and not torch.equal(value.float(), target[key].float()):
            raise ValueError(f"{draft_folder}: {key} is not the target's; only a draft that shares the "
                             "target's encoder and embedding (specwhisper distill) can be bundled")
    config = json.loads((Path(draft_folder) / "config.json").read_text())
    target_layers = json.loads((Path(target_folder) / "config.json").read_text())["decoder_layers"]
    sources = []
    for i in range(config["decoder_layers"]):
        mine = {m.group(2): v for k, v in draft.items() if (m := CROSS_KV.fullmatch(k)) and int(m.group(1)) == i}
        found = [j for j in range(target_layers)
                 if all(torch.equal(v.float(), target[f"model.decoder.layers.{j}.encoder_attn.{name}"].float())
                        for name, v in mine.items())]
        if not mine or not found:
            raise ValueError(f"{draft_folder}: layer {i}'s cross-attention K/V projections are no target layer's")
        sources.append(found[0])
    trained = {k: v.to(torch.bfloat16 if LINEAR.fullmatch(k) else torch.float32).contiguous()
               for k, v in draft.items() if k.startswith(DECODER) and k != EMBEDDING and not CROSS_KV.fullmatch(k)}
    meta = {"config": json.dumps(config), "cross_sources": json.dumps(sources), "info": json.dumps(info)}
    save_file(trained, str(out_file), metadata=meta)
    return meta


def assemble(bundle_file: str | Path, target_folder: str | Path, out_folder: str | Path) -> Path:
    """Rebuild a bundled draft's Hugging Face folder in `out_folder` from `bundle_file` and its
    fetched target: the target's encoder, token embedding and cross K/V projections (stored as the
    target stores them), the bundle's tensors in float32 (exactly their stored values), its
    config, the target's tokenizer files."""
    target_folder, out_folder = Path(target_folder), Path(out_folder)
    target = read_tensors(target_folder)
    with safe_open(str(bundle_file), framework="pt", device="cpu") as f:
        meta = f.metadata()
        state = {k: f.get_tensor(k).float() for k in f.keys()}
    state.update({k: v for k, v in target.items() if k.startswith(ENCODER) or k == EMBEDDING})
    for i, j in enumerate(json.loads(meta["cross_sources"])):
        prefix = f"model.decoder.layers.{j}.encoder_attn."
        state.update({f"model.decoder.layers.{i}.encoder_attn.{k[len(prefix):]}": v for k, v in target.items()
                      if CROSS_KV.fullmatch(k) and k.startswith(prefix)})
    out_folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_folder / "model.safetensors"), metadata={"format": "pt"})
    (out_folder / "config.json").write_text(json.dumps(json.loads(meta["config"]), indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (target_folder / name).is_file():
            shutil.copyfile(target_folder / name, out_folder / name)
    return out_folder


def info(bundle_file: str | Path) -> dict:
    """The `info` a bundle was exported with (how it was trained, what it measured)."""
    with safe_open(str(bundle_file), framework="pt", device="cpu") as f:
        return json.loads(f.metadata()["info"])

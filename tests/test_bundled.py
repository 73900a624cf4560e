"""specwhisper.tools.bundled and the bundled draft base-2l: a distilled draft stored as its trained
tensors (linear layers in bfloat16) and assembled beside its target gives back the draft, shares the target's
encoder, and decodes exactly; fetch refuses a damaged bundle. The real base-2l is checked on the
real base (its decoding on every option is in test_real_pairs)."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from specwhisper import Engine
from specwhisper.samples import sample_paths
from specwhisper.tools import bundled, fetch
from specwhisper.tools.distill import DistillOptions, distill, layer_choice

OPTS = DistillOptions(steps=3, batch_size=2, lr=1e-3, warmup=0, language="en", max_new_tokens=16,
                      progress=False, device="cpu", pack=False, longform=False)


@pytest.fixture(scope="module")
def distilled(multilingual, tmp_path_factory):
    clips = tmp_path_factory.mktemp("clips")
    for path in sample_paths()[:3]:
        shutil.copy(path, clips / path.name)
    out = tmp_path_factory.mktemp("draft")
    distill(multilingual, clips, out, replace(OPTS, steps=4))
    return out


def test_export_then_assemble_gives_back_the_draft(multilingual, distilled, tmp_path):
    bundle = tmp_path / "draft.safetensors"
    meta = bundled.export(distilled, multilingual, bundle, {"recipe": "four steps"})
    layers = json.loads((multilingual / "config.json").read_text())["decoder_layers"]
    assert json.loads(meta["cross_sources"]) == layer_choice(layers, 2)
    assert bundled.info(bundle) == {"recipe": "four steps"}
    stored = load_file(str(bundle))
    assert stored and all(k.startswith("model.decoder.") for k in stored)
    in_bf16 = {k for k, v in stored.items() if v.dtype == torch.bfloat16}
    assert in_bf16 == {k for k in stored if bundled.LINEAR.fullmatch(k)}
    assert any(k.endswith("fc1.weight") for k in in_bf16)
    assert stored["model.decoder.layer_norm.weight"].dtype == torch.float32
    assert bundled.EMBEDDING not in stored and not any(bundled.CROSS_KV.fullmatch(k) for k in stored)

    folder = bundled.assemble(bundle, multilingual, tmp_path / "assembled")
    got, want = bundled.read_tensors(folder), bundled.read_tensors(distilled)
    assert got.keys() == want.keys()
    for key, value in want.items():
        expected = value.to(stored[key].dtype).float() if key in stored else value.float()
        assert torch.equal(got[key].float(), expected), key
    assert json.loads((folder / "config.json").read_text()) == json.loads((distilled / "config.json").read_text())
    assert (folder / "tokenizer.json").read_bytes() == (multilingual / "tokenizer.json").read_bytes()

    engine, plain = Engine(multilingual, draft=folder, device="cpu"), Engine(multilingual, device="cpu")
    assert engine.drafter.shared_encoder and engine.drafter.cross_sources == layer_choice(layers, 2)
    for path in sample_paths()[:2]:
        want = plain.transcribe(path, language="en", max_new_tokens=24)
        got = engine.transcribe(path, language="en", max_new_tokens=24, num_draft_tokens=3)
        assert got.tokens == want.tokens and got.stats.drafted > 0


def test_export_refuses_a_draft_with_another_encoder(multilingual, distilled, tmp_path):
    from safetensors.torch import save_file

    moved = tmp_path / "moved"
    shutil.copytree(distilled, moved)
    state = load_file(str(moved / "model.safetensors"))
    key = next(k for k in state if k.startswith("model.encoder."))
    state[key] = state[key] + 1
    save_file(state, str(moved / "model.safetensors"))
    with pytest.raises(ValueError, match="shares the target's encoder"):
        bundled.export(moved, multilingual, tmp_path / "x.safetensors", {})


def test_fetch_refuses_a_damaged_bundle(multilingual, distilled, tmp_path, monkeypatch):
    drafts = tmp_path / "drafts"
    drafts.mkdir()
    bundle = drafts / "mini.safetensors"
    bundled.export(distilled, multilingual, bundle, {})
    sha = fetch._file_sha256(bundle)
    monkeypatch.setattr(bundled, "DRAFTS_DIR", drafts)
    monkeypatch.setattr(fetch, "DRAFTS", {"mini": ("base", sha)})
    monkeypatch.setattr(fetch, "NAMES", ("mini",))
    monkeypatch.setattr(fetch, "fetch_model", lambda name, cache_dir=None: multilingual)
    cache = tmp_path / "cache"
    cache.mkdir()
    folder = fetch.fetch("mini", cache)
    assert folder == cache / "mini" and (folder / "model.safetensors").is_file()
    assert fetch.fetch("mini", cache) == folder  # valid: not assembled again
    with pytest.raises(ValueError, match="no CTranslate2 original"):
        fetch.ct2_dir("mini", cache)

    shutil.rmtree(folder)
    bundle.write_bytes(bundle.read_bytes()[:-10])  # a truncated file
    with pytest.raises(RuntimeError, match="sha256"):
        fetch.fetch("mini", cache)
    assert not (cache / "mini").exists()


@pytest.mark.real
def test_bundled_base_2l_is_a_trained_draft_for_base():
    """The bundle matches its recorded sha256, shares base's encoder and copies its cross K/V from
    base layers 0 and 5, and proposes what base decodes: most greedy proposals on the bundled
    clips are accepted (a random or mismatched decoder gets almost none), output identical."""
    from conftest import real_folder

    base, draft = real_folder("base"), real_folder("base-2l")
    info = bundled.info(bundled.DRAFTS_DIR / "base-2l.safetensors")
    assert info["target"] == "base" and info["agreement"] > 0.7
    engine, plain = Engine(base, draft=draft), Engine(base)
    assert engine.drafter.shared_encoder and engine.drafter.cross_sources == [0, 5]
    drafted = accepted = 0
    for path in sample_paths():
        want = plain.transcribe(path, language="en")
        got = engine.transcribe(path, language="en", num_draft_tokens=3)
        assert got.tokens == want.tokens
        drafted, accepted = drafted + got.stats.drafted, accepted + got.stats.accepted
    assert drafted > 0 and accepted / drafted > 0.6, (accepted, drafted)

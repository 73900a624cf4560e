"""Bad input gets a clear exception naming the problem."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from specwhisper import Engine


@pytest.fixture(scope="module")
def engine(multilingual):
    return Engine(multilingual)


@pytest.mark.parametrize("mel, exc, words", [
    (torch.zeros(0), ValueError, "empty"),
    (torch.zeros(1, 1, 80, 3000), ValueError, "shape"),
    (torch.zeros(64, 3000), ValueError, "n_mels=80"),
    (torch.zeros(1, 80, 3001), ValueError, "3001 frames"),  # a batch of windows; one long mel is long-form
    (torch.zeros(80, 3000, dtype=torch.long), TypeError, "dtype"),
    ([[0.0] * 3000] * 80, TypeError, "torch.Tensor"),
    (torch.full((80, 3000), float("nan")), ValueError, "NaN"),
    (torch.full((80, 3000), float("nan")).expand(4, -1, -1), ValueError, "NaN"),  # one clip as a batch
    (torch.stack([torch.zeros(80, 3000), torch.zeros(80, 3000).index_fill_(1, torch.tensor([2999]), float("inf"))]),
     ValueError, "infinite"),
    (torch.zeros(0, 80, 3000), ValueError, "empty"),
])
def test_bad_mel(engine, mel, exc, words):
    with pytest.raises(exc, match=words):
        engine.transcribe(mel)


def test_waveform_is_accepted(engine):
    """A 1-D tensor is 16 kHz audio: the same tokens as its log-mel."""
    from specwhisper import load_audio, log_mel_spectrogram
    from specwhisper.samples import sample_paths

    audio = load_audio(sample_paths()[0])
    by_mel = engine.transcribe(log_mel_spectrogram(audio, n_mels=80)[:, :-(-len(audio) // 160)],
                               language="en", max_new_tokens=6)
    by_wave = engine.transcribe(audio, language="en", max_new_tokens=6)
    by_path = engine.transcribe(str(sample_paths()[0]), language="en", max_new_tokens=6)
    assert by_mel.tokens == by_wave.tokens == by_path.tokens
    assert by_wave.duration == pytest.approx(len(audio) / 16000, abs=0.01)
    assert by_wave.segments[0].text == by_wave.text


def test_numpy_mel_is_accepted(engine):
    out = engine.transcribe(np.zeros((80, 3000), dtype=np.float32), language="en", max_new_tokens=2)
    assert len(out.tokens) <= 2


@pytest.mark.parametrize("kwargs, words", [
    (dict(language="xx"), "unknown language code 'xx'"),
    (dict(task="summarize"), "task"),
    (dict(max_new_tokens=446), "exceeds the decoder cache of 448"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(num_draft_tokens=0), "num_draft_tokens"),
])
def test_bad_options(engine, kwargs, words):
    with pytest.raises(ValueError, match=words):
        engine.transcribe(torch.zeros(80, 3000), **{"language": "en", **kwargs})


def test_english_only_refuses_other_languages(english):
    with pytest.raises(ValueError, match="English-only"):
        Engine(english).transcribe(torch.zeros(80, 3000), language="de")


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine(tmp_path / "nope")


def test_hub_id_offline_says_how_to_pass_a_folder(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="local folder"):
        Engine("openai/whisper-large-v3")


def copy(folder, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(folder, dst)
    return dst


def test_missing_weights(multilingual, tmp_path):
    folder = copy(multilingual, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        Engine(folder)


def test_truncated_weights(multilingual, tmp_path):
    folder = copy(multilingual, tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        Engine(folder)


def test_missing_and_unexpected_keys_are_listed(multilingual, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy(multilingual, tmp_path)
    state = load_file(folder / "model.safetensors")
    del state["model.decoder.layers.1.fc1.weight"]
    state["model.decoder.extra.weight"] = torch.zeros(2)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['decoder.layers.1.fc1.weight'\].*unexpected \['decoder.extra.weight'\]"):
        Engine(folder)


def test_shape_mismatch_is_named(multilingual, tmp_path):
    folder = copy(multilingual, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["decoder_ffn_dim"] = 100
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="fc1.weight: checkpoint"):
        Engine(folder)


def test_sharded_checkpoint_loads(multilingual, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy(multilingual, tmp_path)
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for name, ks in shards.items():
        save_file({k: state[k] for k in ks}, folder / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in ks})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    mel = torch.randn(80, 3000)
    got = Engine(folder).transcribe(mel, language="en", max_new_tokens=6).tokens
    assert got == Engine(multilingual).transcribe(mel, language="en", max_new_tokens=6).tokens
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="shards .* missing"):
        Engine(folder)


def test_pickle_checkpoints_are_refused(multilingual, tmp_path):
    folder = copy(multilingual, tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pickle"):
        Engine(folder)


def test_bad_dtype_and_config(multilingual, tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        Engine(multilingual, dtype=torch.int8)
    folder = copy(multilingual, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["vocab_size"] = 1000
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocab_size 1000"):
        Engine(folder)

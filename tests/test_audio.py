"""specwhisper.audio: parity with transformers' WhisperFeatureExtractor, decoding, errors."""
import contextlib
import io
import shutil
import subprocess
import warnings

import numpy as np
import pytest
soundfile = pytest.importorskip("soundfile")  # absent on GPU images with their own packages
import torch

from specwhisper.audio import (
    N_FRAMES, N_SAMPLES, SAMPLE_RATE, load_audio, log_mel_spectrogram, mel_filter_bank, pad_or_trim,
    resample,
)
from specwhisper.samples import references, sample_paths

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max-abs, in log-mel units
SAMPLES = sample_paths()
needs_ffmpeg = pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg is not installed")


@pytest.fixture(scope="module")
def feature_extractors():
    return {n: transformers.WhisperFeatureExtractor(feature_size=n) for n in (80, 128)}


@pytest.fixture(scope="module")
def speech():
    return load_audio(SAMPLES[0])


def hf_features(extractor, audio):
    return extractor(audio, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]


def assert_parity(extractor, audio, n_mels):
    ours = log_mel_spectrogram(audio, n_mels=n_mels)
    assert ours.shape == (n_mels, N_FRAMES) and ours.dtype == torch.float32
    assert np.abs(ours.numpy() - hf_features(extractor, audio)).max() < TOLERANCE


def correlation(a, b):
    n = min(len(a), len(b))
    return np.corrcoef(a[:n], b[:n])[0, 1]


def encode_with_ffmpeg(src, dst, *args):
    cmd = ["ffmpeg", "-nostdin", "-loglevel", "error", "-y", "-i", str(src), *args, str(dst)]
    subprocess.run(cmd, check=True)


# --- features ---------------------------------------------------------------------------------

def test_samples_are_bundled():
    assert len(SAMPLES) >= 8 and all(path.is_file() for path in SAMPLES)
    assert set(references()) == {path.name for path in SAMPLES}
    assert all(text.strip() for text in references().values())


@pytest.mark.parametrize("n_mels", [80, 128])
def test_filterbank_matches_transformers(n_mels):
    from transformers.audio_utils import mel_filter_bank as hf_mel_filter_bank

    expected = hf_mel_filter_bank(num_frequency_bins=201, num_mel_filters=n_mels, min_frequency=0,
                                  max_frequency=8000, sampling_rate=16000, norm="slaney",
                                  mel_scale="slaney")
    np.testing.assert_allclose(mel_filter_bank(n_mels).numpy(), expected.T, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("path", SAMPLES, ids=lambda path: path.stem)
def test_parity_on_bundled_speech(feature_extractors, path, n_mels):
    assert_parity(feature_extractors[n_mels], load_audio(path), n_mels)


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("case", ["long_35s", "short_0.1s", "silence", "empty"])
def test_parity_on_edge_lengths(feature_extractors, n_mels, case):
    if case == "long_35s":  # truncated to the first 30 s
        speech = np.concatenate([load_audio(path) for path in SAMPLES])
        audio = np.resize(speech, 35 * SAMPLE_RATE)
    else:
        seconds = {"short_0.1s": 0.1, "silence": 5.0, "empty": 0.0}[case]
        audio = load_audio(SAMPLES[1])[: int(seconds * SAMPLE_RATE)]
        if case == "silence":
            audio = np.zeros_like(audio)
    cut = pytest.warns(UserWarning, match=r"35\.0 s long and only its first 30 s are kept")
    with cut if case == "long_35s" else contextlib.nullcontext():
        assert_parity(feature_extractors[n_mels], audio, n_mels)


def test_cutting_long_audio_warns_only_when_implicit(speech):
    """Over 30 s without whole=True: a UserWarning (the rest would be silently dropped); a
    window's worth, pad_or_trim first, whole=True, or zero padding past 30 s: no warning."""
    long = np.resize(speech, 31 * SAMPLE_RATE)
    with pytest.warns(UserWarning, match="whole=True"):
        cut = log_mel_spectrogram(long)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(log_mel_spectrogram(pad_or_trim(long)), cut)
        assert log_mel_spectrogram(long, whole=True).shape == (80, 31 * SAMPLE_RATE // 160)
        log_mel_spectrogram(long[:N_SAMPLES])
        log_mel_spectrogram(speech, padding=N_SAMPLES)


def test_input_kinds_agree(speech):
    expected = log_mel_spectrogram(speech)
    assert torch.equal(log_mel_spectrogram(torch.from_numpy(speech)), expected)
    assert torch.allclose(log_mel_spectrogram(speech.astype(np.float64)), expected, atol=1e-6)
    assert torch.equal(log_mel_spectrogram(speech[::-1]), log_mel_spectrogram(speech[::-1].copy()))
    assert torch.equal(log_mel_spectrogram(speech, padding=SAMPLE_RATE), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_features_on_cuda_match_cpu(speech):
    cuda = log_mel_spectrogram(torch.from_numpy(speech).cuda(), n_mels=128)
    assert cuda.device.type == "cuda"
    assert (cuda.cpu() - log_mel_spectrogram(speech, n_mels=128)).abs().max() < TOLERANCE
    assert log_mel_spectrogram(speech, device="cuda").device.type == "cuda"


def test_pad_or_trim():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert pad_or_trim(x, 5).tolist() == [[0, 1, 2, 0, 0], [3, 4, 5, 0, 0]]
    assert pad_or_trim(x, 1, axis=0).tolist() == [[0, 1, 2]]
    assert pad_or_trim(torch.from_numpy(x), 3, axis=0).tolist() == [[0, 1, 2], [3, 4, 5], [0] * 3]
    assert pad_or_trim(torch.from_numpy(x), 2).tolist() == [[0, 1], [3, 4]]
    assert pad_or_trim(torch.zeros(N_SAMPLES + 7)).shape == (N_SAMPLES,)


# --- decoding and resampling ------------------------------------------------------------------

def test_load_audio_from_path_bytes_and_file(speech):
    path = SAMPLES[0]
    assert speech.dtype == np.float32 and speech.ndim == 1
    expected, rate = soundfile.read(path, dtype="float32")
    assert rate == SAMPLE_RATE and np.array_equal(speech, expected)
    assert np.array_equal(load_audio(str(path)), speech)
    assert np.array_equal(load_audio(path.read_bytes()), speech)
    with open(path, "rb") as f:
        assert np.array_equal(load_audio(f), speech)


def test_load_flac(tmp_path, speech):
    flac = tmp_path / "speech.flac"
    soundfile.write(flac, speech, SAMPLE_RATE, subtype="PCM_16")
    np.testing.assert_allclose(load_audio(flac), speech, atol=1 / 32768)


def test_resample_44k_stereo_wav(speech):
    import scipy.signal

    upsampled = scipy.signal.resample_poly(speech, 441, 160)  # 16 kHz -> 44.1 kHz
    stereo = np.stack([upsampled, 0.5 * upsampled], axis=1)
    buffer = io.BytesIO()
    soundfile.write(buffer, stereo, 44100, format="WAV", subtype="PCM_16")
    loaded = load_audio(buffer.getvalue())
    assert abs(len(loaded) - len(speech)) <= 1
    assert correlation(loaded, speech) > 0.999
    np.testing.assert_allclose(loaded[: len(speech)], 0.75 * speech, atol=5e-3)  # mean of channels


@pytest.mark.parametrize("orig_sr, new_sr", [(44100, 16000), (48000, 16000), (8000, 16000),
                                             (22050, 16000)])
def test_resample_sine(orig_sr, new_sr):
    t = np.arange(2 * orig_sr) / orig_sr
    sine = torch.from_numpy(np.sin(2 * np.pi * 440 * t).astype(np.float32))
    out = resample(sine, orig_sr, new_sr)
    assert out.shape == (2 * new_sr,) and out.dtype == torch.float32
    expected = np.sin(2 * np.pi * 440 * np.arange(2 * new_sr) / new_sr)
    margin = new_sr // 10  # edges see the zero padding
    assert np.abs(out.numpy() - expected)[margin:-margin].max() < 1e-4


@needs_ffmpeg
@pytest.mark.parametrize("ext", ["mp3", "ogg", "m4a"])
def test_load_compressed_audio(tmp_path, speech, ext):
    encoded = tmp_path / f"speech.{ext}"
    encode_with_ffmpeg(SAMPLES[0], encoded, "-ar", "44100", "-ac", "2")
    for source in (encoded, encoded.read_bytes()):  # m4a goes through ffmpeg (libsndfile lacks it)
        loaded = load_audio(source)
        assert loaded.dtype == np.float32 and abs(len(loaded) - len(speech)) < SAMPLE_RATE // 10
        assert correlation(loaded, speech) > 0.99


@needs_ffmpeg
def test_without_soundfile_every_format_goes_to_ffmpeg(monkeypatch, speech):
    import sys
    monkeypatch.setitem(sys.modules, "soundfile", None)  # `import soundfile` raises ImportError
    loaded = load_audio(SAMPLES[0])
    np.testing.assert_allclose(loaded, speech, atol=1 / 32768)


# --- errors -----------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="audio file not found.*nope.wav"):
        load_audio(tmp_path / "nope.wav")


@needs_ffmpeg
def test_ffmpeg_missing(tmp_path, monkeypatch):
    encoded = tmp_path / "speech.m4a"
    encode_with_ffmpeg(SAMPLES[0], encoded)
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing called ffmpeg on PATH
    with pytest.raises(RuntimeError, match="needs ffmpeg, which is not installed"):
        load_audio(encoded)


@needs_ffmpeg
def test_undecodable_bytes():
    with pytest.raises(RuntimeError, match="ffmpeg failed to decode"):
        load_audio(b"not audio at all" * 64)


@pytest.mark.parametrize("audio, n_mels, message", [
    (np.zeros((2, 1600), np.float32), 80, "1-D mono samples, got shape \\(2, 1600\\)"),
    (np.float32(0.5), 80, "1-D mono samples, got shape \\(\\)"),
    (np.array([0.0, np.nan, 0.1], np.float32), 80, "non-finite samples"),
    (torch.tensor([0.0, float("inf")]), 128, "non-finite samples"),
    (np.zeros(1600, np.int16), 80, "float samples.*int16"),
    (np.zeros(1600, np.float32), 64, "n_mels must be one of \\(80, 128\\), got 64"),
])
def test_bad_features_input(audio, n_mels, message):
    with pytest.raises(ValueError, match=message):
        log_mel_spectrogram(audio, n_mels=n_mels)

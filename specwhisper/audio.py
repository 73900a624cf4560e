"""Audio in, log-mel features out: `load_audio` and `log_mel_spectrogram`.

`log_mel_spectrogram` reproduces `transformers.WhisperFeatureExtractor` (its torch path):
zero-pad or truncate to 30 s, centred STFT (reflect padding, periodic Hann window, n_fft 400,
hop 160), power spectrum without the last frame, Slaney mel filterbank, log10, clamp to 8 below
the maximum, scale.
"""
from __future__ import annotations

import functools
import io
import math
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
import torch.nn.functional as F

from .constants import CHUNK_SECONDS, HOP_LENGTH, N_FFT, N_FRAMES, N_SAMPLES, SAMPLE_RATE  # noqa: F401 (re-exported)

SUPPORTED_N_MELS = (80, 128)  # 128 for large-v3 and its descendants, 80 for every other Whisper

AudioSource = str | os.PathLike | bytes | BinaryIO


def load_audio(source: AudioSource, sr: int = SAMPLE_RATE) -> np.ndarray:
    """Decode a file path, encoded bytes or a binary file object to float32 mono samples at `sr`.

    Formats libsndfile reads (WAV, FLAC, OGG, MP3, ...) are decoded in process and resampled if
    needed; anything else (m4a, webm, video containers, ...) is decoded by an `ffmpeg` subprocess.
    """
    if isinstance(source, (str, os.PathLike)):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"audio file not found: {os.fspath(source)!r}")
    elif isinstance(source, (bytes, bytearray, memoryview)):
        source = bytes(source)
    else:
        source = bytes(source.read())  # a binary file object
    decoded = _read_with_soundfile(source)
    if decoded is None:
        return _load_with_ffmpeg(source, sr)
    samples, file_sr = decoded
    samples = samples.mean(axis=1)  # [frames, channels] -> mono
    if file_sr != sr:
        samples = resample(torch.from_numpy(samples), file_sr, sr).numpy()
    return np.ascontiguousarray(samples, dtype=np.float32)


def _read_with_soundfile(source: str | os.PathLike | bytes) -> tuple[np.ndarray, int] | None:
    """`([frames, channels] float32, sample rate)`, or None when libsndfile cannot read it.

    soundfile is imported here, not with the module, so that the engine imports on machines that
    lack it (a GPU image with its own packages); there every format goes to ffmpeg.
    """
    try:
        import soundfile
    except ImportError:
        return None
    try:
        return soundfile.read(io.BytesIO(source) if isinstance(source, bytes) else source,
                              dtype="float32", always_2d=True)
    except soundfile.LibsndfileError:
        return None


def _load_with_ffmpeg(source: str | os.PathLike | bytes, sr: int) -> np.ndarray:
    if shutil.which("ffmpeg") is None:
        raise RuntimeError(
            "decoding this audio format needs ffmpeg, which is not installed (not found on PATH); "
            "install ffmpeg or convert the audio to WAV/FLAC first"
        )
    if isinstance(source, bytes):
        # a file, not a pipe: containers such as mp4/m4a need a seekable input
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "audio"
            path.write_bytes(source)
            return _load_with_ffmpeg(path, sr)
    cmd = ["ffmpeg", "-nostdin", "-threads", "0", "-i", os.fspath(source),
           "-f", "s16le", "-ac", "1", "-acodec", "pcm_s16le", "-ar", str(sr), "-"]
    result = subprocess.run(cmd, capture_output=True)
    if result.returncode != 0:
        reason = result.stderr.decode(errors="replace").strip().splitlines()[-1:]
        raise RuntimeError(f"ffmpeg failed to decode the audio: {' '.join(reason)}")
    return np.frombuffer(result.stdout, np.int16).astype(np.float32) / 32768.0


def resample(samples: torch.Tensor, orig_sr: int, new_sr: int) -> torch.Tensor:
    """Band-limited polyphase resampling of the last axis with a Kaiser-windowed sinc.

    Same scheme as torchaudio's `resample` ("kaiser_best" parameters): the rate ratio is reduced
    to `orig:new` by their gcd, each of the `new` output phases gets its own FIR kernel, and one
    strided `conv1d` applies all phases at once.
    """
    gcd = math.gcd(orig_sr, new_sr)
    orig, new = orig_sr // gcd, new_sr // gcd
    if orig == new:
        return samples
    kernels, width = _sinc_kernels(orig, new, samples.device)
    shape = samples.shape
    x = samples.reshape(-1, 1, shape[-1]).to(torch.float32)  # [batch, 1, time]
    x = F.pad(x, (width, width + orig))
    y = F.conv1d(x, kernels, stride=orig)  # [batch, new, time / orig]
    y = y.transpose(1, 2).reshape(x.shape[0], -1)  # interleave the phases
    n_out = math.ceil(new * shape[-1] / orig)
    return y[:, :n_out].reshape(*shape[:-1], n_out).to(samples.dtype)


@functools.lru_cache(maxsize=8)
def _sinc_kernels(orig: int, new: int, device: torch.device,
                  zero_crossings: int = 64, rolloff: float = 0.9475937167399596,
                  beta: float = 14.769656459379492) -> tuple[torch.Tensor, int]:
    cutoff = min(orig, new) * rolloff  # low-pass below the lower Nyquist, in units of the gcd rate
    width = math.ceil(zero_crossings * orig / cutoff)  # one-sided kernel support, input samples
    taps = torch.arange(-width, width + orig, dtype=torch.float64) / orig
    t = (torch.arange(0, -new, -1, dtype=torch.float64)[:, None] / new + taps) * cutoff
    t = t.clamp(-zero_crossings, zero_crossings)  # [new, 2 * width + orig]
    window = torch.i0(beta * (1 - (t / zero_crossings) ** 2).sqrt()) / torch.i0(torch.tensor(beta))
    kernels = torch.special.sinc(t) * window * (cutoff / orig)
    return kernels[:, None].to(device, torch.float32), width  # [new, 1, taps]


def pad_or_trim(array: torch.Tensor | np.ndarray, length: int = N_SAMPLES, axis: int = -1):
    """Zero-pad or truncate `array` along `axis` to exactly `length` (torch or numpy)."""
    size = array.shape[axis]
    if isinstance(array, torch.Tensor):
        if size > length:
            return array.narrow(axis, 0, length)
        pad = [0, 0] * (array.ndim - 1 - axis % array.ndim) + [0, length - size]
        return F.pad(array, pad) if size < length else array
    if size > length:
        return array.take(np.arange(length), axis=axis)
    pad = [(0, 0)] * array.ndim
    pad[axis] = (0, length - size)
    return np.pad(array, pad) if size < length else array


def log_mel_spectrogram(audio: torch.Tensor | np.ndarray, n_mels: int = 80, padding: int = 0,
                        device: torch.device | str | None = None, whole: bool = False) -> torch.Tensor:
    """Whisper log-mel features `[n_mels, 3000]` (float32) of 16 kHz mono samples.

    `audio` is a 1-D float numpy array or tensor; the result lives on `device`, else on the
    tensor's device (cpu for numpy). `padding` zero samples are appended before the 30 s window
    is taken (openai-whisper's argument; the window is zero-padded anyway, so features are
    identical to those of the unpadded audio).

    `whole=True`: the features of the whole recording, `[n_mels, len(audio) // 160]`, for
    long-form decoding, computed as openai-whisper's `transcribe()` does: 30 s of zeros appended
    (`padding=N_SAMPLES`), one STFT and one normalization (max - 8 floor) over all of it, then
    the frames of the recording itself kept.

    Audio longer than one window without `whole=True` keeps its first 30 s only, with a
    `UserWarning` saying so (`Engine.transcribe` given that mel would decode those 30 s alone);
    trim first with `pad_or_trim(audio)` to keep one window on purpose, without the warning.
    """
    if n_mels not in SUPPORTED_N_MELS:
        raise ValueError(f"n_mels must be one of {SUPPORTED_N_MELS}, got {n_mels}")
    if padding < 0:
        raise ValueError(f"padding must be >= 0 samples, got {padding}")
    if np.ndim(audio) != 1:
        raise ValueError(f"audio must be 1-D mono samples, got shape {tuple(np.shape(audio))}")
    if isinstance(audio, np.ndarray):
        audio = np.ascontiguousarray(audio)  # torch cannot view negative strides
    audio = torch.as_tensor(audio, device=device)
    if not audio.is_floating_point():
        raise ValueError(f"audio must hold float samples in [-1, 1], got dtype {audio.dtype}")
    if not torch.isfinite(audio).all():
        raise ValueError("audio contains non-finite samples (NaN or inf)")
    n_frames = audio.shape[0] // HOP_LENGTH
    if whole:
        audio = F.pad(audio.to(torch.float32), (0, N_SAMPLES))
    else:
        if audio.shape[0] > N_SAMPLES:
            warnings.warn(f"log_mel_spectrogram: the audio is {audio.shape[0] / SAMPLE_RATE:.1f} s long and only "
                          f"its first {N_SAMPLES // SAMPLE_RATE} s are kept; pass whole=True for the whole recording "
                          "(long-form decoding), or give Engine.transcribe the audio itself", UserWarning, stacklevel=2)
        audio = pad_or_trim(F.pad(audio.to(torch.float32), (0, padding)), N_SAMPLES)
    window, mel_filters = _stft_constants(n_mels, audio.device)
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=window, return_complex=True)  # [201, frames + 1]
    power = stft[:, :-1].abs() ** 2  # [201, frames]
    log_spec = (mel_filters @ power).clamp(min=1e-10).log10()  # [n_mels, frames]
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    log_spec = (log_spec + 4.0) / 4.0
    return log_spec[:, :n_frames] if whole else log_spec


# Normalized log-mel ((log10 power + 4) / 4) of power 1e-7: louder than digital silence and than
# 16-bit dither (±1 LSB reaches 10^-7.7), quieter than any audible sound (-60 dBFS noise: 10^-4.5).
SILENT_LOG_MEL = -0.75


def is_silent(mel: torch.Tensor, floor: float | None = None) -> bool:
    """Whether log-mel frames `[n_mels, frames]` (from `log_mel_spectrogram`) hold no signal:
    every value below `SILENT_LOG_MEL` (digital silence, dither) or at most `floor`, the
    recording's clamp level (`mel_full.max() - 2`: nothing within 80 dB of its loudest sound)."""
    level = SILENT_LOG_MEL if floor is None else max(SILENT_LOG_MEL, floor + 1e-4)
    return mel.numel() == 0 or float(mel.max()) <= level


@functools.lru_cache(maxsize=8)
def _stft_constants(n_mels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Periodic Hann window `[400]` and Slaney mel filterbank `[n_mels, 201]` on `device`."""
    window = torch.hann_window(N_FFT, device=device)
    return window, mel_filter_bank(n_mels).to(device, torch.float32)


def mel_filter_bank(n_mels: int, n_fft: int = N_FFT, sr: int = SAMPLE_RATE) -> torch.Tensor:
    """Slaney-scale, Slaney-normalised triangular filters `[n_mels, n_fft // 2 + 1]` (float64)
    from 0 Hz to `sr / 2`, as `librosa.filters.mel(norm="slaney")` and `transformers`' builder."""
    mel_max = _hz_to_mel(torch.tensor(sr / 2, dtype=torch.float64))
    band_edges = _mel_to_hz(torch.linspace(0.0, float(mel_max), n_mels + 2, dtype=torch.float64))
    fft_freqs = torch.linspace(0, sr // 2, n_fft // 2 + 1, dtype=torch.float64)
    slopes = band_edges[:, None] - fft_freqs[None, :]  # [n_mels + 2, n_freqs]
    widths = band_edges.diff()[:, None]  # [n_mels + 1, 1]
    rising = -slopes[:-2] / widths[:-1]
    falling = slopes[2:] / widths[1:]
    triangles = torch.minimum(rising, falling).clamp(min=0.0)
    return triangles * (2.0 / (band_edges[2:] - band_edges[:-2]))[:, None]  # equal area per band


# Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above.
_MIN_LOG_HZ, _MIN_LOG_MEL, _LOG_STEP = 1000.0, 15.0, math.log(6.4) / 27.0


def _hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    log_part = _MIN_LOG_MEL + torch.log(hz.clamp(min=_MIN_LOG_HZ) / _MIN_LOG_HZ) / _LOG_STEP
    return torch.where(hz >= _MIN_LOG_HZ, log_part, 3.0 * hz / 200.0)


def _mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    log_part = _MIN_LOG_HZ * torch.exp(_LOG_STEP * (mel - _MIN_LOG_MEL))
    return torch.where(mel >= _MIN_LOG_MEL, log_part, 200.0 * mel / 3.0)


MAX_CHANNELS = 32  # uploads with more channels are refused before decoding
MAX_SAMPLE_RATE = 384_000  # Hz; higher declared rates are refused before decoding


def declared_seconds(container, stream) -> float | None:
    """The audio's duration as its container declares it (stream, else container header), or
    None when it declares none (raw streams, some live formats)."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        import av

        return container.duration / av.time_base
    return None


def decode_audio_bytes(data: bytes | BinaryIO, sr: int = SAMPLE_RATE, max_seconds: float | None = None) -> np.ndarray:
    """Decode an uploaded file (its bytes, or a seekable binary file object) with PyAV to float32
    mono samples at `sr`, in any container/codec FFmpeg knows, as faster-whisper does. Channels are
    averaged after resampling, as `load_audio` and the `ffmpeg -ac 1` CLI do (PyAV's own mono
    downmix keeps 0.707 of each).

    Raises ValueError naming the problem for empty, truncated, corrupt or non-audio data, for
    more than `MAX_CHANNELS` channels or a sample rate above `MAX_SAMPLE_RATE`, and for audio
    longer than `max_seconds`: refused from the container's declared duration before any
    decoding, and, for files that declare none or too little, as soon as the decoded audio passes
    the limit. Decoding streams into one preallocated 16 kHz mono buffer (sized from the declared
    duration, grown if the file says less than it holds), so a request holds about its decoded
    size, never the whole file at its source rate. Blocking and CPU-bound: servers call it off
    their event loop.
    """
    import av  # the server extra; imported here so the core package does not need it

    if isinstance(data, (bytes, bytearray, memoryview)):
        if not len(data):
            raise ValueError("the audio file is empty (0 bytes)")
        data = io.BytesIO(data)
    else:
        data.seek(0, io.SEEK_END)
        if data.tell() == 0:
            raise ValueError("the audio file is empty (0 bytes)")
        data.seek(0)
    limit = None if max_seconds is None else int(max_seconds * sr)
    buffer, n = np.empty(0, np.float32), 0

    def append(frame_out) -> None:
        nonlocal buffer, n
        planes = frame_out.to_ndarray()  # [channels, samples] float32 (planar)
        m = planes.shape[1]
        if n + m > buffer.size:
            grown = max(n + m, int(buffer.size * 1.5), sr)
            buffer = np.resize(buffer, grown if limit is None else min(grown, limit + m))
        np.mean(planes, axis=0, out=buffer[n:n + m])
        n += m
        if limit is not None and n > limit:
            raise ValueError(f"the audio is longer than the limit of {max_seconds:g} s")

    try:
        with av.open(data, mode="r", metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise ValueError(f"the file ({container.format.name}) contains no audio stream")
            stream = container.streams.audio[0]
            channels, rate = stream.codec_context.channels, stream.codec_context.sample_rate
            if channels > MAX_CHANNELS:
                raise ValueError(f"the audio has {channels} channels; at most {MAX_CHANNELS} are accepted")
            if rate > MAX_SAMPLE_RATE:
                raise ValueError(f"the audio's sample rate {rate} Hz is above the limit of {MAX_SAMPLE_RATE} Hz")
            seconds = declared_seconds(container, stream)
            if seconds is not None and max_seconds is not None and seconds > max_seconds:
                raise ValueError(f"the audio is {seconds:.1f} s long, longer than the limit of {max_seconds:g} s")
            if seconds is not None and seconds > 0:
                expected = int(seconds * sr) + sr // 10  # the resampler's delay line adds a few samples
                buffer = np.empty(expected if limit is None else min(expected, limit + 1), np.float32)
            resampler = av.AudioResampler(format="fltp", rate=sr)  # planar, channels kept
            for packet in container.demux(stream):
                for frame in packet.decode():  # the demuxer's last, empty packet flushes the decoder
                    for out in resampler.resample(frame):
                        append(out)
            for out in resampler.resample(None):  # flush the resampler's delay line
                append(out)
    except av.error.FFmpegError as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ValueError(f"could not decode the audio (not an audio file, or truncated/corrupt): {reason}") from None
    except (UnicodeDecodeError, OverflowError, MemoryError) as exc:  # odd metadata or sizes PyAV trips on
        raise ValueError(f"could not decode the audio: {type(exc).__name__}: {exc}") from None
    if n == 0:
        raise ValueError("the file contains no decodable audio samples (empty or truncated)")
    samples = buffer[:n] if n > 0.9 * buffer.size else buffer[:n].copy()  # no large unused tail kept
    if not np.isfinite(samples).all():
        raise ValueError("the decoded audio contains non-finite samples (NaN or inf)")
    return samples

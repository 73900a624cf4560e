"""CTranslate2 Whisper over a whole recording, in its own process (for `specwhisper demo`).

CTranslate2 ships its own OpenMP runtime; in a process that also runs PyTorch the two thread pools
contend for the cores (≈ 40% slower on 2 cores), so it runs here, reading the recording's log-mel
from a .npy file, and never imports torch.

The windows are walked as openai-whisper's `transcribe()` seeks (greedy, timestamps predicted,
seek to the last complete segment's end, or past the window when it ends on a single timestamp),
without its previous-text prompt or temperature fallback: a plain greedy long-form pass.

    python -m specwhisper.tools.ct2_longform CT2_DIR MEL.npy THREADS COMPUTE_TYPE PROMPT_IDS_JSON TIMESTAMP_BEGIN EOT

prints one JSON line {"tokens": [text tokens of every kept segment], "seconds": wall time after
the model was loaded, "windows": windows decoded}.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

N_FRAMES, INPUT_STRIDE = 3000, 2  # mel frames per window; mel frames per timestamp step


def window_tokens(ids: list[int], timestamp_begin: int, frames: int) -> tuple[list[int], int]:
    """One window's generated ids -> (the kept text tokens, frames to advance `seek`), by
    openai-whisper's rules: segments end at consecutive timestamps; a window that ends on a single
    timestamp is complete; otherwise the text after the last consecutive pair is decoded again."""
    is_ts = [t >= timestamp_begin for t in ids]
    single_timestamp_ending = is_ts[-2:] == [False, True]
    consecutive = [i for i in range(1, len(ids)) if is_ts[i] and is_ts[i - 1]]
    if consecutive and not single_timestamp_ending:
        last_slice = consecutive[-1]
        kept = ids[:last_slice]
        advance = (ids[last_slice - 1] - timestamp_begin) * INPUT_STRIDE
    else:
        kept, advance = ids, frames
    return [t for t in kept if t < timestamp_begin], max(advance, 1)


def transcribe(model, ctranslate2, mel: np.ndarray, prompt: list[int], timestamp_begin: int, eot: int):
    seek, tokens, windows = 0, [], 0
    while seek < mel.shape[1]:
        segment = mel[:, seek:seek + N_FRAMES]
        frames = segment.shape[1]
        segment = np.pad(segment, ((0, 0), (0, N_FRAMES - frames)))
        view = ctranslate2.StorageView.from_array(np.ascontiguousarray(segment[None], dtype=np.float32))
        ids = list(model.generate(view, [prompt], beam_size=1, max_length=448)[0].sequences_ids[0])
        ids = [t for t in ids if t != eot]
        kept, advance = window_tokens(ids, timestamp_begin, frames)
        tokens += kept
        seek += min(advance, frames)
        windows += 1
    return tokens, windows


def main() -> None:
    import ctranslate2

    folder, mel_path, threads, compute_type = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    prompt, timestamp_begin, eot = json.loads(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
    mel = np.load(mel_path)
    model = ctranslate2.models.Whisper(folder, device="cpu", compute_type=compute_type, intra_threads=threads)
    start = time.perf_counter()
    tokens, windows = transcribe(model, ctranslate2, mel, prompt, timestamp_begin, eot)
    print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - start, "windows": windows}), flush=True)


if __name__ == "__main__":
    main()

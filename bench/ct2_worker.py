"""CTranslate2 Whisper in its own process, for benchmarks that time it beside specwhisper.

CTranslate2 ships its own OpenMP runtime; loaded into a process that also runs PyTorch, the two
thread pools contend for the cores (on 2 cores both systems ran ≈ 40% slower after CTranslate2
had run once in the process). bench/cpu.py therefore starts this worker and times its calls from
the outside (a pipe round trip, well under a millisecond, is included).

Protocol (one JSON object per line on stdin / stdout): {"op": "generate" | "encode", "mel":
index into the windows of MELS} -> {"tokens": [...]} (generate) or {} (encode); EOF ends it.

    python bench/ct2_worker.py CT2_DIR MELS.npy THREADS PROMPT_IDS_JSON [COMPUTE_TYPE (float32)]
"""
from __future__ import annotations

import json
import sys

import ctranslate2
import numpy as np


def main() -> None:
    folder, mels_path, threads, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    compute_type = sys.argv[5] if len(sys.argv) > 5 else "float32"
    mels = np.load(mels_path)
    model = ctranslate2.models.Whisper(folder, device="cpu", compute_type=compute_type, intra_threads=threads)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        view = ctranslate2.StorageView.from_array(np.ascontiguousarray(mels[req["mel"]][None]))
        if req["op"] == "generate":
            out = {"tokens": list(model.generate(view, [prompt], beam_size=1)[0].sequences_ids[0])}
        else:
            model.encode(view, to_cpu=True)
            out = {}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

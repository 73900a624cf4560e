"""What `specwhisper bulk` checks on the driver before Ray starts, so that errors the user can act
on come as one line with an exit code (`BulkError`), not as a Ray traceback: the results folder
can be written, the model folders load."""
from __future__ import annotations

import uuid
from pathlib import Path

# `specwhisper bulk` exit codes (0: every file transcribed or already done)
EXIT_FILES_FAILED = 1  # the job ran; some files could not be transcribed (records with an error)
EXIT_BAD_INPUT = 2  # no such input, or an invalid option (argparse uses 2 as well)
EXIT_OUTPUT = 3  # the results folder cannot be created or written
EXIT_MODEL = 4  # a model folder is missing or does not load
EXIT_CLUSTER = 5  # Ray could not start, connect or run the pipeline


class BulkError(RuntimeError):
    """A job that cannot run as asked: a one-line message for the user and `exit_code`."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def check_model_folder(folder: str, role: str) -> None:
    """BulkError(EXIT_MODEL) unless `folder` holds a Whisper checkpoint that loads: config,
    tokenizer, and safetensors whose keys and shapes match the config (headers only: no weights
    are read on the driver). A local folder only (the workers read URIs)."""
    import torch
    from safetensors import safe_open

    from ..config import WhisperConfig
    from ..model.weights import HF_PREFIX, TIED_HEAD, checkpoint_files
    from ..model.whisper import Whisper
    from ..tokenizer import Tokenizer

    try:
        path = Path(folder)
        config = WhisperConfig.from_hf(path)
        Tokenizer.from_folder(path, config.vocab_size)
        shapes = {}
        for file in checkpoint_files(path):
            with safe_open(file, framework="pt") as f:
                shapes.update({k.removeprefix(HF_PREFIX): tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        shapes.pop(TIED_HEAD, None)
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in Whisper(config).state_dict().items()}
        if shapes != expected:
            wrong = sorted(set(shapes) ^ set(expected)) or sorted(k for k in shapes if shapes[k] != expected[k])
            raise ValueError(f"its weights do not match its config.json (first: {wrong[0]})")
    except Exception as e:  # whatever the folder lacks, said in one line
        raise BulkError(f"{role} model folder {folder!r} does not load: {e}", EXIT_MODEL) from None


def check_output(out: str, fs, root: str) -> None:
    """BulkError(EXIT_OUTPUT) unless the results folder can be created and written (a probe file
    is written and removed), so an unwritable folder fails before any transcription."""
    try:
        fs.create_dir(root, recursive=True)
        probe = f"{root}/.write-probe-{uuid.uuid4().hex[:12]}"
        with fs.open_output_stream(probe) as f:
            f.write(b"")
        fs.delete_file(probe)
    except Exception as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise BulkError(f"cannot write results to {out!r}: {reason}", EXIT_OUTPUT) from None

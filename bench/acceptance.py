"""How many tokens each draft brings per target pass on the CPU benchmark's windows.

Question answered: on `bench/cpu.py`'s ≈ 25 s flite windows (more of them than the timed
benchmark uses), what share of a draft's proposals does the target accept, and how many tokens
does one target pass yield, at each fixed k? These counts are deterministic (greedy decoding), so
unlike timings they can be compared between runs, machines and busy moments: use it to compare
drafts (for example two `specwhisper distill` recipes) before timing the better one.

    python bench/acceptance.py --draft ~/drafts/base-2l --draft tiny.en --windows 8 --k 3 4
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.cpu import synthesize_windows  # noqa: E402
from specwhisper import Engine  # noqa: E402
from specwhisper.tools.cli import model_folder  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="base")
    p.add_argument("--draft", action="append", required=True, help="draft folder or name (repeatable)")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--k", type=int, nargs="+", default=[3, 4])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        audios = [torch.from_numpy(audio) for audio, _ in synthesize_windows(args.windows, Path(tmp))]
    target = model_folder(args.target)
    print("| draft | k | acceptance | tokens per target pass | tokens |\n|---|---|---|---|---|")
    for draft in args.draft:
        engine = Engine(target, model_folder(draft), background=False)
        for k in args.k:
            drafted = accepted = passes = tokens = 0
            for audio in audios:
                result = engine.transcribe(audio, language="en", num_draft_tokens=k)
                drafted += result.stats.drafted
                accepted += result.stats.accepted
                passes += result.stats.target_passes
                tokens += len(result.tokens) + 1  # with EOT
            print(f"| {draft} | {k} | {accepted / max(drafted, 1):.3f} | {tokens / passes:.3f} | {tokens} |",
                  flush=True)


if __name__ == "__main__":
    main()

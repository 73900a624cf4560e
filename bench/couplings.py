"""Acceptance of the two exact couplings for speculative sampling on a real pair.

Question: how often is a drafted token accepted under rejection sampling (Leviathan et al. 2023)
versus the race coupling (shared counter-based noise: the draft proposes argmax q / E, the target
emits argmax p / E, accepted while equal), for the target `base` drafted by `tiny.en` through the
string-mapped vocabulary? The race coupling makes seeded output independent of k, batch and draft;
this measures what that costs in acceptance.

Teacher-forced: both models read base's greedy transcript of each bundled sample, so every
position has the target's distribution p and the draft's q (mapped into target ids, the mass of
draft tokens the target cannot spell in one extra column). Per temperature (top_p = 1):
- rejection: E[accept] = sum_v min(p(v), q(v)), exact per position;
- race: P(argmax_v p(v) / E(v) == argmax_v q(v) / E(v)), Monte Carlo over --seeds seeds with
  `ops.exp_noise` keyed by (seed, output position, target id); the draft's columns are keyed by
  their mapped target ids (V_target + draft id when unspellable), as the runner keys them.
  Tokens with p(v) < 3.5e-9 max p can never win a race (E lies in [6e-8, 16.7]), so the race
  runs on the others: the same winner as over the whole vocabulary.
Writes JSON + a markdown table (acceptance numbers do not depend on machine load).

    python bench/couplings.py [--seeds 1000] [--out bench/results/couplings]
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from specwhisper import Engine, load_audio, log_mel_spectrogram
from specwhisper import sampling as S
from specwhisper.backends import ops
from specwhisper.engine.decoding import LoadedModel
from specwhisper.engine.vocab import VocabMap
from specwhisper.model.whisper import DecoderCache
from specwhisper.samples import sample_paths
from specwhisper.tools.fetch import cache_root

TEMPERATURES = (0.2, 0.6, 1.0)
NEVER_WINS = 3.5e-9  # below min(E) / max(E) = 2^-24 / 16.64 of the row's best probability


def teacher_forced_logits(model: LoadedModel, mel: torch.Tensor, prompt: list[int],
                          tokens: list[int]) -> torch.Tensor:
    """Suppressed float32 logits [len(tokens), V]: row j is the model's next-token distribution
    after prompt + tokens[:j] (Whisper's begin-suppression at j = 0)."""
    cfg, dec = model.config, model.model.decoder
    cache = DecoderCache.allocate(cfg, 1, "cpu", torch.float32)
    dec.fill_cross(cache, model.model.encoder(mel[None]), slice(0, 1))
    seq = torch.tensor([prompt + tokens[:-1]])
    pos = torch.arange(seq.shape[1])[None]
    logits = dec(seq, pos, cache, kv_len=seq.shape[1])[0, len(prompt) - 1:].float()
    logits[0].masked_fill_(model.begin_suppress, -torch.inf)
    logits[1:].masked_fill_(model.suppress, -torch.inf)
    return logits


def race_winners(probs: torch.Tensor, noise_ids: torch.Tensor, seeds: torch.Tensor,
                 position: int) -> torch.Tensor:
    """argmax_v probs(v) / exp_noise(seed, position, noise_ids(v)) for each seed -> column [S]."""
    candidates = (probs >= probs.max() * NEVER_WINS).nonzero().squeeze(-1)
    noise = ops.exp_noise(seeds, torch.full_like(seeds, position), noise_ids[candidates])
    return candidates[(probs[candidates] / noise.double()).argmax(-1)]


def measure(n_seeds: int) -> dict:
    base, tiny_en = cache_root() / "base", cache_root() / "tiny.en"
    target = LoadedModel.load(base, "cpu", torch.float32)
    draft = LoadedModel.load(tiny_en, "cpu", torch.float32)
    vocab = VocabMap.build(draft.tokenizer, target.tokenizer, "tiny.en", "base")
    V, V_draft = target.config.vocab_size, draft.config.vocab_size
    draft_to_target = torch.full((V_draft,), -1, dtype=torch.int64)  # timestamps: unspellable
    draft_to_target[: vocab.draft_to_target.shape[0]] = vocab.draft_to_target[:V_draft]
    draft_ids = torch.where(draft_to_target >= 0, draft_to_target, V + torch.arange(V_draft))
    engine = Engine(base)
    seeds = torch.arange(n_seeds, dtype=torch.int64)
    sums = {T: {"rejection": 0.0, "race": 0.0} for T in TEMPERATURES}
    positions = skipped = 0
    race_seconds = 0.0
    for path in sample_paths():
        mel = log_mel_spectrogram(load_audio(path), n_mels=target.config.num_mel_bins)  # 30 s
        tokens = engine.transcribe(mel, language="en").tokens + [target.tokenizer.eot]
        t_prompt = target.tokenizer.prompt("en", "transcribe")
        d_prompt = draft.tokenizer.prompt("en", "transcribe")
        d_tokens, d_rows = [], []  # the transcript in draft tokens; draft row of each target token
        for t in tokens:
            d_rows.append(len(d_tokens))
            d_tokens.extend(vocab.to_draft(t))
        with torch.inference_mode():
            p_logits = teacher_forced_logits(target, mel, t_prompt, tokens)
            q_logits = teacher_forced_logits(draft, mel, d_prompt, d_tokens)
        for j, t in enumerate(tokens):
            if not vocab.to_draft(t):
                skipped += 1  # the draft cannot follow this transcript further
                break
            positions += 1
            position = len(t_prompt) + j  # the output position both models key their noise by
            for T in TEMPERATURES:
                rows = (torch.tensor([T], dtype=torch.float32), torch.ones(1))
                p = S.probs64(p_logits[j: j + 1], *rows)[0]
                q_draft = S.probs64(q_logits[d_rows[j]: d_rows[j] + 1], *rows)[0]
                q = S.permute_probs(q_draft, draft_to_target, V)
                sums[T]["rejection"] += torch.minimum(torch.nn.functional.pad(p, (0, 1)), q).sum().item()
                tic = time.perf_counter()
                target_won = race_winners(p, torch.arange(V), seeds, position)
                draft_won = draft_to_target[race_winners(q_draft, draft_ids, seeds, position)]
                sums[T]["race"] += (target_won == draft_won).double().mean().item()
                race_seconds += time.perf_counter() - tic
        print(f"{path.name}: {positions} positions so far", flush=True)
    rows = []
    for T in TEMPERATURES:
        race = sums[T]["race"] / positions
        rows.append({"temperature": T, "rejection": sums[T]["rejection"] / positions, "race": race,
                     "race_stderr": (race * (1 - race) / (positions * n_seeds)) ** 0.5})
    return {"target": "base", "draft": "tiny.en (string-mapped)", "positions": positions,
            "transcripts_cut_at_unspellable": skipped, "seeds": n_seeds, "top_p": 1.0,
            "samples": [p.name for p in sample_paths()], "results": rows,
            "race_seconds": race_seconds,
            "machine": platform.platform(), "torch": torch.__version__}


def markdown(report: dict) -> str:
    lines = [f"Acceptance per drafted token, {report['target']} drafted by {report['draft']}, "
             f"teacher-forced on {report['positions']} positions of base's greedy transcripts "
             f"(race: {report['seeds']} seeds per position), top_p = 1.", "",
             "| T | rejection sampling Σ min(p, q) | race coupling P(same winner) |",
             "|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['temperature']} | {r['rejection']:.3f} | {r['race']:.3f} "
                     f"± {r['race_stderr']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--out", default="bench/results/couplings")
    args = parser.parse_args()
    start = time.time()
    report = measure(args.seeds)
    report["seconds"] = time.time() - start
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()

"""Train a small draft decoder that shares the target's encoder, from the target's own greedy
transcripts of the user's audio (self-distillation: no labels needed).

1. *Teacher pass*: every audio window is transcribed greedily by `Engine(target)`: long files are
   cut into 30 s windows and consecutive short ones joined into windows of up to 30 s (`pack`, as
   long-form transcription decodes full windows); the encoder output of that call is kept. Each
   window gives an `Example` (audio features [1500, d_model], prompt, generated tokens, and the
   target's `top` most likely tokens with their log-probabilities at every generated position,
   from one teacher-forced pass), cached one file per window under OUT/.distill_cache, so a rerun
   skips the pass. With `longform` (the default), the same audio is also transcribed as long
   recordings (up to `RECORDING_WINDOWS` consecutive windows joined) with openai-whisper's long-form
   algorithm, as `transcribe(timestamps=True)`, the CLI on long files and `specwhisper demo` decode:
   every window it decodes greedily gives an Example too, its prompt carrying the previous windows'
   text (`<|startofprev|>`) and its tokens the timestamp tokens. A draft trained on short-form
   transcripts alone has never seen either, and its proposals are rejected there. A seeded share
   of the recordings (`holdout`; each window its own recording without `longform`) is kept out of
   training to measure the draft's *agreement*: how often its argmax equals the target's token
   under teacher forcing, i.e. its expected greedy acceptance rate per proposal, before and during
   training.
2. *Training*: a decoder of `layers` blocks, initialized from target blocks spread over its depth
   (first and last for 2; or, with `init`, an earlier draft's decoder, to train it further on more
   audio), with the target's token/position embeddings and final layer norm, learns to predict the
   target's tokens (teacher forcing over the generated positions and EOT, prompt positions excluded)
   with AdamW. Its inputs are the prompts the engine gives a draft: a window's previous text cut to
   the last `prev_tokens` (`Drafter.PREV_TOKENS`, as `Drafter.prompt` cuts it), where the target
   decoded its labels after all of it. The loss is the cross-entropy against the target's token plus
   `kd` times the cross-entropy against the target's distribution over its `top` tokens
   (renormalized): the near-misses teach more per window than the argmax alone. Frozen: the token
   embedding, which is also the tied output head (the draft scores tokens with the target's own
   head), and the cross-attention key/value projections, whose output for each window is then
   computed once. The draft is a moving average of the trained weights (`ema`); every `eval_every`
   steps its held-out agreement is measured, and the best draft seen is the one saved (a few hundred
   windows are soon learned by heart: agreement peaks, then falls).
3. *Saving*: OUT becomes a Hugging Face Whisper folder (config.json with `decoder_layers`,
   model.safetensors with the target's encoder tensors copied unchanged plus the new decoder,
   tokenizer and generation config copied), which `Engine(target, draft=OUT)` recognizes as sharing
   the target's encoder (`draft.shares_encoder`), so the encoder runs once per window.

Resumable (OUT/.distill_state.pt holds weights, optimizer and step; a rerun continues) and
deterministic: the batch at step s depends only on (seed, s), so the same seed gives the same
weights, with or without an interruption.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from ..engine.draft import Drafter
from ..model.whisper import Decoder, Whisper

AUDIO_SUFFIXES = {".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac", ".webm", ".mp4"}
STATE_FILE = ".distill_state.pt"
CACHE_DIR = ".distill_cache"
WINDOW_SAMPLES = 30 * 16000  # one Whisper window of 16 kHz audio
PACK_GAP = 8000  # silence between files joined into one window (0.5 s)
EOT_MARK = -1  # stands for EOT in `Example.labels` (the id is the tokenizer's)
CACHE_VERSION = 2  # bump when the cached Example content changes
RECORDING_WINDOWS = 8  # windows joined into one recording for the long-form teacher pass (4 minutes)
TOKENIZER_FILES = ("tokenizer.json", "generation_config.json", "preprocessor_config.json", "tokenizer_config.json",
                   "vocab.json", "merges.txt", "normalizer.json", "added_tokens.json", "special_tokens_map.json")


@dataclass(frozen=True)
class DistillOptions:
    layers: int = 2  # decoder blocks of the draft
    steps: int = 1000  # optimizer steps in all (a resumed run continues up to this)
    minutes: float | None = None  # wall-time bound of the training phase of this run (None: no bound)
    batch_size: int = 8  # windows per optimizer step
    lr: float = 1e-4  # AdamW learning rate (after a linear warm-up)
    warmup: int = 20  # warm-up steps
    weight_decay: float = 0.01  # AdamW weight decay
    checkpoint_every: int = 50  # steps between saves of OUT/.distill_state.pt
    seed: int = 0  # batch order (the only randomness)
    language: str | None = None  # teacher's language; None: the target detects it per window
    max_new_tokens: int | None = None  # cap on the teacher's transcript per window (None: Whisper's)
    bf16: bool = False  # bfloat16 autocast for the training forward/backward
    device: str | None = None  # None: cuda if available, else cpu
    progress: bool = True  # tqdm progress bars
    kd: float = 1.0  # weight of the soft (teacher-distribution) cross-entropy; 0: hard labels only
    top: int = 16  # teacher tokens kept per position for the soft targets
    holdout: float = 0.1  # share of recordings kept out of training to measure agreement (>= 10 recordings)
    pack: bool = True  # join files shorter than a window into full windows (see `windows_of`)
    eval_every: int = 50  # steps between held-out agreement checks; the best draft seen is saved (0: last)
    ema: float = 0.99  # the draft is this exponential moving average of the trained weights (0: the weights)
    longform: bool = True  # also learn from long-form decoding: timestamps and previous-text prompts (see above)
    init: str | None = None  # a draft folder (a distilled draft of this target) to start from, not target blocks
    # previous-text tokens the draft's prompts keep in training and in the held-out check: the last
    # ones, as the engine's drafts are prompted (`Drafter.PREV_TOKENS`; None: all the target's)
    prev_tokens: int | None = Drafter.PREV_TOKENS

    def __post_init__(self):
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        if self.steps < 0 or self.batch_size < 1 or self.checkpoint_every < 1 or self.warmup < 0 \
                or self.eval_every < 0:
            raise ValueError("steps must be >= 0; batch_size and checkpoint_every >= 1; warmup and eval_every >= 0")
        if self.minutes is not None and not self.minutes > 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.kd < 0 or self.top < 1 or not 0 <= self.holdout < 1:
            raise ValueError(f"kd must be >= 0, top >= 1 and holdout in [0, 1); got {self.kd}, {self.top}, "
                             f"{self.holdout}")
        if not 0 <= self.ema < 1:
            raise ValueError(f"ema must be in [0, 1), got {self.ema}")
        if self.prev_tokens is not None and self.prev_tokens < 0:
            raise ValueError(f"prev_tokens must be >= 0 or None, got {self.prev_tokens}")

    def fingerprint(self) -> dict:
        """What a resumed run must share with the saved one (steps and minutes may change)."""
        return {k: v for k, v in asdict(self).items() if k in ("layers", "batch_size", "lr", "warmup",
                                                                 "weight_decay", "seed", "bf16", "kd", "top",
                                                                 "holdout", "pack", "ema", "longform", "init",
                                                                 "prev_tokens")}


@dataclass
class Example:
    """One audio window as the teacher saw it."""

    features: torch.Tensor  # [1500, d_model] float32: the target encoder's output
    prompt: list[int]  # the decoder prompt the target used
    tokens: list[int]  # the target's greedy tokens after the prompt, without EOT
    ended: bool = True  # the target emitted EOT after `tokens` (False: cut at the length limit)
    soft_ids: torch.Tensor | None = None  # [n, top] int: the target's top tokens at each labelled position
    soft_logp: torch.Tensor | None = None  # [n, top] float16: their log-probabilities (n = labels)
    recording: int = 0  # the recording the window belongs to: held out together (see `split_holdout`)
    longform: bool = False  # decoded by the long-form algorithm (timestamps, previous-text prompt)

    @property
    def labels(self) -> list[int]:
        """What the positions from the last prompt token on must predict: tokens, then EOT if emitted."""
        return self.tokens + ([EOT_MARK] if self.ended else [])


@dataclass
class DistillReport:
    out: Path  # the saved draft folder
    examples: int  # training windows
    longform: int = 0  # of them, windows decoded by the long-form algorithm
    skipped: list[str] = field(default_factory=list)  # files or windows not used, with the reason
    held_out: int = 0  # windows kept out of training (agreement is measured on them)
    agreement_start: float | None = None  # held-out agreement of the initial draft
    agreement: float | None = None  # held-out agreement of the saved draft
    step: int = 0  # optimizer steps done in all (resumed runs included)
    best_step: int = 0  # the step whose weights were saved: the best held-out agreement seen
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out agreement) of this run
    losses: list[float] = field(default_factory=list)  # per step of this run
    teacher_seconds: float = 0.0  # teacher pass of this run
    train_seconds: float = 0.0  # training phase of this run


# ---------------------------------------------------------------- data
def audio_files(folder: str | Path) -> list[Path]:
    """Audio files under `folder` (recursively), sorted; clear errors for unusable folders."""
    folder = Path(folder)
    if not folder.exists():
        raise FileNotFoundError(f"audio folder {folder} does not exist")
    if not folder.is_dir():
        raise NotADirectoryError(f"audio folder {folder} is not a folder")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in AUDIO_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    if not files:
        raise ValueError(f"audio folder {folder} holds no audio files ({', '.join(sorted(AUDIO_SUFFIXES))})")
    return files


def _cache_key(target_id: str, paths: list[Path], window: int, opts: DistillOptions) -> str:
    files = [x for p in paths for x in (str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns)]
    text = json.dumps([CACHE_VERSION, target_id, *files, window, opts.language, opts.max_new_tokens, opts.top])
    return hashlib.sha1(text.encode()).hexdigest()


def windows_of(files: list[Path], pack: bool, skipped: list[str]):
    """The training windows of `files` -> (files, index, audio) for each: a file longer than a
    window is cut into 30 s windows (index 0, 1, ...); with `pack`, consecutive shorter files are
    joined, PACK_GAP of silence between them, into windows of up to 30 s (index 0). Long-form
    transcription decodes full windows, so a draft trained on short clips alone would never see
    the later positions of a window. Undecodable and empty files are appended to `skipped`."""
    from ..audio import load_audio

    group: list[tuple[Path, object]] = []

    def joined():
        gap = np.zeros(PACK_GAP, dtype=np.float32)
        parts = [part for _, audio in group for part in (gap, audio)][1:]
        return [path for path, _ in group], 0, np.concatenate(parts)

    for path in files:
        try:
            audio = load_audio(path)
        except Exception as exc:  # any decoder failure: the file is unusable, not the run
            skipped.append(f"{path}: cannot decode ({type(exc).__name__}: {exc})")
            continue
        if audio.size == 0:
            skipped.append(f"{path}: no samples")
            continue
        if not pack or audio.size > WINDOW_SAMPLES:
            for w, start in enumerate(range(0, audio.size, WINDOW_SAMPLES)):
                yield [path], w, audio[start:start + WINDOW_SAMPLES]
            continue
        if group and sum(a.size + PACK_GAP for _, a in group) + audio.size > WINDOW_SAMPLES:
            yield joined()
            group = []
        group.append((path, audio))
    if group:
        yield joined()


def _target_id(folder: Path) -> str:
    return json.dumps([str(folder.resolve())] + [(p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                                 for p in sorted(folder.glob("*.safetensors"))])


def recordings_of(windows, longform: bool):
    """Consecutive windows (from `windows_of`) grouped into recordings of up to RECORDING_WINDOWS
    (with `longform`; else one window each)."""
    group = []
    for window in windows:
        group.append(window)
        if not longform or len(group) == RECORDING_WINDOWS:
            yield group
            group = []
    if group:
        yield group


def joined_audio(group) -> np.ndarray:
    """A recording's windows as one audio: a window that continues the previous one's file follows
    it directly, any other after PACK_GAP of silence."""
    parts = []
    for i, (paths, w, audio) in enumerate(group):
        if i and not (w > 0 and paths == group[i - 1][0]):
            parts.append(np.zeros(PACK_GAP, dtype=np.float32))
        parts.append(audio)
    return np.concatenate(parts)


def _load(entry: Path) -> Example:
    saved = torch.load(entry, weights_only=True)
    return Example(saved["features"], saved["prompt"], saved["tokens"], saved["ended"], saved["soft_ids"],
                   saved["soft_logp"])


def _save(example: Example, entry: Path) -> None:
    tmp = entry.with_suffix(".tmp")  # a reader never sees half a file
    torch.save({"features": example.features, "prompt": example.prompt, "tokens": example.tokens,
                "ended": example.ended, "soft_ids": example.soft_ids, "soft_logp": example.soft_logp}, tmp)
    tmp.replace(entry)


def longform_examples(engine, audio: np.ndarray, opts: DistillOptions) -> list[Example]:
    """The windows openai-whisper's long-form algorithm decodes greedily (temperature 0; fallback
    retries sample) in `audio` with the target -> Examples without soft targets."""
    from ..config import TranscribeOptions
    from ..longform.window import SAMPLE_LEN

    decoded = []

    def on_window(request, output, features):
        if request.temperature == 0:
            decoded.append((features.float().cpu().numpy().copy(), list(request.prompt), list(output.tokens),
                            output.generated > len(output.tokens)))

    engine.transcribe_long(torch.from_numpy(audio), TranscribeOptions(language=opts.language), seed=0,
                           on_window=on_window,
                           max_new_tokens=None if opts.max_new_tokens is None else min(opts.max_new_tokens, SAMPLE_LEN))
    # from NumPy: normal tensors, not inference ones (they are training inputs)
    return [Example(torch.from_numpy(f), prompt, tokens, ended, longform=True) for f, prompt, tokens, ended in decoded]


def teacher_examples(engine, files: list[Path], cache: Path, opts: DistillOptions,
                     skipped: list[str]) -> list[Example]:
    """Transcribe every window of `files` (see `windows_of`) with `engine` (greedy), and with
    `opts.longform` every recording of them (see `recordings_of`, `longform_examples`) ->
    Examples, cached in `cache`. Undecodable files and windows the target transcribes to nothing
    are appended to `skipped`."""
    from tqdm import tqdm

    target = engine.target
    tok, target_id = target.tokenizer, _target_id(target.path)
    cache.mkdir(parents=True, exist_ok=True)
    captured: list[torch.Tensor] = []
    hook = target.model.encoder.register_forward_hook(lambda module, args, output: captured.append(output))
    examples = []

    def teach(example: Example, entry: Path) -> None:
        """The soft targets of a window the target transcribed to something, then its cache entry."""
        if example.tokens:
            example.soft_ids, example.soft_logp = teacher_soft(target, example, opts.top)
        _save(example, entry)

    def keep(example: Example, name: str, recording: int) -> None:
        if not example.tokens:
            skipped.append(f"{name}: the target transcribes it to nothing")
            return
        example.recording = recording
        examples.append(example)

    bar = tqdm(desc="teacher pass", unit="window", disable=not opts.progress)
    try:
        windows = windows_of(files, opts.pack, skipped)
        for recording, group in enumerate(recordings_of(windows, opts.longform)):
            for paths, w, audio in group:
                name = f"{paths[0]}" + (f" (+{len(paths) - 1} joined)" if len(paths) > 1 else f" (window {w})")
                entry = cache / f"{_cache_key(target_id, paths, w, opts)}.pt"
                if entry.is_file():
                    example = _load(entry)
                else:
                    captured.clear()
                    result = engine.transcribe(torch.from_numpy(audio),
                                               language=opts.language, max_new_tokens=opts.max_new_tokens)
                    if len(captured) != 1:
                        raise RuntimeError(f"expected one encoder call per window, saw {len(captured)}")
                    features = captured[0][0].float().cpu().clone()  # a normal tensor, not an inference one
                    prompt = tok.prompt(result.language if tok.multilingual else None, "transcribe")
                    limit = opts.max_new_tokens or target.config.max_target_positions - len(prompt)
                    example = Example(features, prompt, list(result.tokens), ended=len(result.tokens) < limit)
                    teach(example, entry)
                keep(example, name, recording)
                bar.update(1)
            if not opts.longform:
                continue
            paths = [p for paths, _, _ in group for p in paths]
            key = _cache_key(target_id, paths, f"longform {[w for _, w, _ in group]}", opts)
            if (cache / f"{key}.done").is_file():  # written after the recording's windows
                decoded = [replace(_load(entry), longform=True) for entry in sorted(cache.glob(f"{key}-*.pt"))]
            else:
                decoded = longform_examples(engine, joined_audio(group), opts)
                for i, example in enumerate(decoded):
                    teach(example, cache / f"{key}-{i:04d}.pt")
                (cache / f"{key}.done").touch()
            for i, example in enumerate(decoded):
                keep(example, f"{paths[0]} (+{len(paths) - 1} joined, long-form window {i})", recording)
            bar.update(len(decoded))
    finally:
        hook.remove()
        bar.close()
    if not examples:
        detail = "; ".join(skipped[:5]) + (" …" if len(skipped) > 5 else "")
        raise ValueError(f"no usable audio among {len(files)} files: {detail}")
    return examples


@torch.no_grad()  # not inference mode: the results are training inputs
def teacher_soft(target, example: Example, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's `top` most likely tokens and their log-probabilities [n, top] at each labelled
    position of `example` (teacher forcing over its own transcript; suppressed tokens excluded)."""
    dec, eot = target.model.decoder, target.tokenizer.eot
    seq = example.prompt + [eot if t == EOT_MARK else t for t in example.labels]
    param = next(dec.parameters())
    features = example.features[None].to(param.device, param.dtype)
    k, v = cross_kv(dec, features)
    hidden = teacher_forced_hidden(dec, k, v, torch.tensor([seq[:-1]], device=param.device))
    logits = dec.logits(hidden[0, len(example.prompt) - 1:]).float()
    logp = logits.masked_fill(target.suppress.to(logits.device), -float("inf")).log_softmax(-1)
    values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
    return ids.to(torch.int32).cpu(), values.clamp(min=-1e4).half().cpu()


def draft_prompt(prompt: list[int], sot_prev: int, sot: int, keep: int | None) -> list[int]:
    """The prompt a draft decodes with in the engine where the target decodes with `prompt`: the
    previous text (between `sot_prev` and `sot`) cut to its last `keep` tokens, as `Drafter.prompt`
    cuts it (None: all kept). A prompt without previous text is returned as it is."""
    if keep is None or not prompt or prompt[0] != sot_prev or sot not in prompt:
        return prompt
    at = prompt.index(sot)
    return [sot_prev] + prompt[max(1, at - keep):at] + prompt[at:]


def split_holdout(examples: list[Example], opts: DistillOptions) -> tuple[list[Example], list[Example]]:
    """(training, held-out) windows: a seeded `holdout` share (at least one) of the recordings is
    held out, all their windows (short- and long-form) together, when there are 10 recordings or
    more."""
    recordings = sorted({e.recording for e in examples})
    n = len(recordings)
    held = max(1, round(n * opts.holdout)) if opts.holdout > 0 and n >= 10 else 0
    order = torch.randperm(n, generator=torch.Generator().manual_seed(opts.seed * 7_919 + 17)).tolist()
    out = {recordings[i] for i in order[:held]}
    return [e for e in examples if e.recording not in out], [e for e in examples if e.recording in out]


@torch.no_grad()
def agreement(decoder: Decoder, examples: list[Example], eot: int, suppress: torch.Tensor | None = None,
              batch_size: int = 8, cross: dict | None = None) -> float:
    """Share of the teacher's labels (tokens, and EOT where emitted) that the draft's argmax
    predicts under teacher forcing: its expected greedy acceptance rate per proposal. `cross`, when
    given, keeps each batch's cross K/V for the next call on the same examples (their projections
    are frozen while training)."""
    param = next(decoder.parameters())
    hits = total = 0
    for at in range(0, len(examples), batch_size):
        chunk = examples[at:at + batch_size]
        if cross is None or at not in cross:
            features = torch.stack([e.features for e in chunk]).to(param.device, param.dtype)
            k, v = cross_kv(decoder, features)
            if cross is not None:
                cross[at] = k, v
        else:
            k, v = cross[at]
        seqs = [e.prompt + [eot if t == EOT_MARK else t for t in e.labels] for e in chunk]
        T = max(len(s) for s in seqs) - 1
        inputs = torch.full((len(chunk), T), eot, dtype=torch.long)
        for b, s in enumerate(seqs):
            inputs[b, :len(s) - 1] = torch.tensor(s[:-1])
        hidden = teacher_forced_hidden(decoder, k, v, inputs.to(param.device))
        for b, (e, s) in enumerate(zip(chunk, seqs)):
            p = len(e.prompt) - 1
            logits = decoder.logits(hidden[b, p:len(s) - 1]).float()
            if suppress is not None:
                logits.masked_fill_(suppress.to(logits.device), -float("inf"))
            want = torch.tensor(s[p + 1:], device=logits.device)
            hits += int((logits.argmax(-1) == want).sum())
            total += len(want)
    return hits / max(total, 1)


def batch_of(examples: list[Example], step: int, opts: DistillOptions, eot: int, device):
    """The batch for optimizer step `step`: a walk through seeded per-epoch permutations, so the
    batch depends only on (seed, step). -> example indices [B], inputs [B, T], labels [B, T]
    (-100 where no loss: prompt positions and padding), and the soft targets (ids, log-probs)
    [N, top] of the labelled positions in row-major order (None when an example has none). EOT is a
    label only where the target emitted it."""
    n, bs = len(examples), opts.batch_size
    picks = []
    for i in range(step * bs, (step + 1) * bs):
        epoch, at = divmod(i, n)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(opts.seed * 1_000_003 + epoch))
        picks.append(int(order[at]))
    seqs, starts = [], []
    for ex in (examples[i] for i in picks):
        seqs.append(ex.prompt + ex.tokens + ([eot] if ex.ended else []))
        starts.append(len(ex.prompt) - 1)  # the last prompt position predicts the first token
    T = max(len(s) for s in seqs) - 1
    inputs = torch.full((bs, T), eot, dtype=torch.long)
    labels = torch.full((bs, T), -100, dtype=torch.long)
    for b, (s, p) in enumerate(zip(seqs, starts)):
        inputs[b, :len(s) - 1] = torch.tensor(s[:-1])
        labels[b, p:len(s) - 1] = torch.tensor(s[p + 1:])
    chosen = [examples[i] for i in picks]
    soft = None
    if all(ex.soft_ids is not None for ex in chosen):
        soft = (torch.cat([ex.soft_ids for ex in chosen]).long().to(device),
                torch.cat([ex.soft_logp for ex in chosen]).float().to(device))
    return picks, inputs.to(device), labels.to(device), soft


# ---------------------------------------------------------------- model
def layer_choice(n_target: int, n_draft: int) -> list[int]:
    """Target blocks the draft's blocks start from: spread over the depth, first and last kept."""
    if not 1 <= n_draft <= n_target:
        raise ValueError(f"the draft's layers must be in 1..{n_target} (the target's), got {n_draft}")
    if n_draft == 1:
        return [n_target - 1]
    return [round(i * (n_target - 1) / (n_draft - 1)) for i in range(n_draft)]


def load_draft_decoder(decoder: Decoder, folder: Path) -> None:
    """Load a saved draft's decoder tensors (`save_draft`'s folder) into `decoder`: `distill`'s
    start from an earlier draft (more audio, another domain) instead of the target's blocks. The
    frozen tensors must equal the target's (a draft of another target is refused)."""
    from ..model.weights import read_state_dict

    state = {k[len("model.decoder."):]: v for k, v in read_state_dict(folder, "cpu", torch.float32).items()
             if k.startswith("model.decoder.")}
    own = decoder.state_dict()
    if set(state) != set(own) or any(state[k].shape != own[k].shape for k in own):
        raise ValueError(f"{folder} is not a {len(decoder.layers)}-layer draft of this target's shape "
                         f"(its decoder tensors differ in names or shapes)")
    frozen = [k for k, p in decoder.named_parameters() if not p.requires_grad]
    if any(not torch.equal(state[k], own[k].float()) for k in frozen):
        raise ValueError(f"{folder} is not a draft of this target: its frozen tensors (token embedding, "
                         f"cross-attention keys and values) differ from the target's")
    decoder.load_state_dict(state, strict=True)


def init_draft_decoder(target: Whisper, layers: int) -> Decoder:
    """A fresh `Decoder` of `layers` blocks copied from the target's (see `layer_choice`), with the
    target's embeddings and final layer norm. Frozen: the token embedding (the tied head) and the
    cross-attention key/value projections (their output for the training audio is computed once;
    the queries adapt)."""
    cfg = replace(target.config, decoder_layers=layers)
    src = target.decoder.state_dict()
    state = {k: v for k, v in src.items() if not k.startswith("layers.")}
    for i, j in enumerate(layer_choice(target.config.decoder_layers, layers)):
        state.update({f"layers.{i}.{k[len(f'layers.{j}.'):]}": v for k, v in src.items()
                      if k.startswith(f"layers.{j}.")})
    decoder = Decoder(cfg)
    decoder.load_state_dict({k: v.detach().float().cpu().clone() for k, v in state.items()}, strict=True)
    decoder.embed_tokens.weight.requires_grad_(False)
    for layer in decoder.layers:  # frozen cross K/V: computed once per window (see `cross_kv`)
        layer.encoder_attn.k_proj.requires_grad_(False)
        layer.encoder_attn.v_proj.requires_grad_(False)
    return decoder


@torch.no_grad()
def cross_kv(decoder: Decoder, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-attention keys and values of every block for features [B, 1500, d] -> (k, v), each
    [B, layers, heads, 1500, head_dim]. Their projections are frozen, so they are computed once
    per window."""
    kv = [layer.encoder_attn.project(features, ("k", "v")) for layer in decoder.layers]
    return torch.stack([k for k, _ in kv], dim=1), torch.stack([v for _, v in kv], dim=1)


def teacher_forced_hidden(decoder: Decoder, cross_k: torch.Tensor, cross_v: torch.Tensor,
                          inputs: torch.Tensor) -> torch.Tensor:
    """Training forward of `decoder`: inputs [B, T] at positions 0..T-1, causal self-attention, cross
    attention to cross_k/cross_v [B, layers, heads, 1500, head_dim] -> hidden [B, T, d]. The same
    blocks and arithmetic as `Decoder.hidden` with a cache (right padding never affects earlier
    positions)."""
    T = inputs.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=inputs.device).tril()
    x = decoder.embed_tokens(inputs) + decoder.embed_positions.weight[:T]
    for i, layer in enumerate(decoder.layers):
        q, k, v = layer.self_attn.project(layer.self_attn_layer_norm(x), ("q", "k", "v"))
        x = x + layer.self_attn.attend_q(q, k, v, causal)
        x = x + layer.encoder_attn.attend(layer.encoder_attn_layer_norm(x), cross_k[:, i], cross_v[:, i])
        x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
    return decoder.layer_norm(x)


def distill_loss(decoder: Decoder, cross_k, cross_v, inputs, labels, soft=None, kd: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of the draft against the teacher's tokens over the labelled positions
    (the head runs only there), plus `kd` times its cross-entropy against the teacher's
    distribution over the `soft` = (ids, log-probs) [N, top] tokens, renormalized."""
    hidden = teacher_forced_hidden(decoder, cross_k, cross_v, inputs)
    keep = labels >= 0
    logits = decoder.logits(hidden[keep]).float()  # [N, V]
    loss = F.cross_entropy(logits, labels[keep])
    if soft is not None and kd > 0:
        ids, logp = soft
        loss = loss - kd * (logp.softmax(-1) * logits.log_softmax(-1).gather(1, ids)).sum(-1).mean()
    return loss


def learning_rate(step: int, opts: DistillOptions) -> float:
    """Linear warm-up, then constant: the rate at a step does not depend on how long the run will
    be, so a run bounded by `minutes`, extended with more `steps` or resumed trains the same way."""
    return opts.lr * min(1.0, (step + 1) / opts.warmup) if opts.warmup else opts.lr


# ---------------------------------------------------------------- saving
def save_draft(decoder: Decoder, target_folder: Path, out: Path) -> None:
    """Write OUT as a HF Whisper folder: the target's encoder tensors copied unchanged (their stored
    dtype), the draft decoder, config.json with decoder_layers, the target's tokenizer files."""
    from ..model.weights import checkpoint_files

    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for path in checkpoint_files(target_folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.startswith("model.encoder."):
                    state[key] = f.get_tensor(key)
    state.update({f"model.decoder.{k}": v.detach().cpu().contiguous().clone()
                  for k, v in decoder.state_dict().items()})
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    config = json.loads((target_folder / "config.json").read_text())
    config["decoder_layers"] = len(decoder.layers)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (target_folder / name).is_file():
            shutil.copyfile(target_folder / name, out / name)


# ---------------------------------------------------------------- the run
def distill(target, audio, out, opts: DistillOptions = DistillOptions()) -> DistillReport:
    """Train and save a shared-encoder draft for `target` (a folder or hub id) from the audio files
    under `audio` into the folder `out`; resumes a run saved there with the same settings."""
    from tqdm import tqdm

    from ..engine.decoding import resolve_model_path
    from ..engine.engine import Engine

    files = audio_files(audio)
    target_folder = resolve_model_path(target)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = DistillReport(out=out, examples=0)

    engine = Engine(target_folder, device=opts.device)
    device = engine.device
    eot = engine.target.tokenizer.eot
    t0 = time.perf_counter()
    examples = teacher_examples(engine, files, out / CACHE_DIR, opts, report.skipped)
    report.teacher_seconds = time.perf_counter() - t0
    examples, held = split_holdout(examples, opts)
    # the draft learns (and is checked) under the prompts the engine gives it; the soft targets were
    # taken under the target's own
    tok = engine.target.tokenizer
    examples, held = ([replace(e, prompt=draft_prompt(e.prompt, tok.sot_prev, tok.sot, opts.prev_tokens))
                       for e in part] for part in (examples, held))
    report.examples, report.held_out = len(examples), len(held)
    report.longform = sum(e.longform for e in examples)
    suppress = engine.target.suppress.to(device)

    decoder = init_draft_decoder(engine.target.model, opts.layers)
    if opts.init is not None:
        load_draft_decoder(decoder, resolve_model_path(opts.init))
    del engine  # the teacher's decoder and caches are no longer needed
    decoder.to(device)
    held_cross = {}  # the held-out windows' cross K/V, computed at the first check
    if held:
        report.agreement_start = agreement(decoder, held, eot, suppress, cross=held_cross)
    decoder.train()
    params = [p for p in decoder.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.98), eps=1e-6,
                                  weight_decay=opts.weight_decay)
    state_path = out / STATE_FILE
    step = 0
    trained = [name for name, p in decoder.named_parameters() if p.requires_grad]

    def weights():  # the trained tensors (the frozen ones are the target's)
        state = decoder.state_dict()
        return {name: state[name].detach().clone() for name in trained}

    # the best held-out agreement seen: (agreement, step, weights); a draft trained past its best
    # (a few hundred windows are learned by heart) is not the one saved
    best = (report.agreement_start, 0, weights()) if held else None
    # with a constant rate the weights wander around a minimum (held-out agreement moves by ± 0.05
    # between checks); their moving average sits nearer to it
    average = weights() if opts.ema else None
    if state_path.is_file():
        saved = torch.load(state_path, map_location=device, weights_only=True)
        if saved["options"] != opts.fingerprint() or saved["target"] != str(target_folder.resolve()):
            raise ValueError(f"{state_path} belongs to a run with other settings ({saved['options']}, "
                             f"target {saved['target']}); use another --out or delete that file to start over")
        decoder.load_state_dict(saved["decoder"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
        if held and saved.get("best") is not None:
            best = (saved["best"]["agreement"], saved["best"]["step"], saved["best"]["decoder"])
        if average is not None:
            average = saved["average"]

    def draft():  # the weights the draft would be saved with now
        return {name: t.clone() for name, t in average.items()} if average is not None else weights()

    def evaluate():
        nonlocal best
        trained_now, candidate = weights(), draft()
        decoder.load_state_dict(candidate, strict=False)
        decoder.eval()
        score = agreement(decoder, held, eot, suppress, cross=held_cross)
        decoder.train()
        decoder.load_state_dict(trained_now, strict=False)
        report.curve.append((step, score))
        if score > best[0]:
            best = (score, step, candidate)

    def checkpoint():
        tmp = state_path.with_suffix(".tmp")
        kept = None if best is None else {"agreement": best[0], "step": best[1], "decoder": best[2]}
        torch.save({"step": step, "decoder": decoder.state_dict(), "optimizer": optimizer.state_dict(),
                    "options": opts.fingerprint(), "target": str(target_folder.resolve()), "best": kept,
                    "average": average}, tmp)
        tmp.replace(state_path)

    t0 = time.perf_counter()
    deadline = None if opts.minutes is None else t0 + 60 * opts.minutes
    bar = tqdm(total=opts.steps, initial=step, desc="distill", unit="step", disable=not opts.progress)
    smooth, cross = None, {}
    try:
        while step < opts.steps and (deadline is None or time.perf_counter() < deadline):
            picks, inputs, labels, soft = batch_of(examples, step, opts, eot, device)
            for i in picks:
                if i not in cross:  # float16 in memory: half of 2·layers·1500·d floats per window
                    k, v = cross_kv(decoder, examples[i].features[None].to(device))
                    cross[i] = (k[0].half(), v[0].half())
                    examples[i].features = None
            cross_k = torch.stack([cross[i][0] for i in picks]).float()
            cross_v = torch.stack([cross[i][1] for i in picks]).float()
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, opts)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=opts.bf16):
                loss = distill_loss(decoder, cross_k, cross_v, inputs, labels, soft, opts.kd)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            if average is not None:  # the usual warm-up of the decay: early weights do not linger
                decay = min(opts.ema, (1 + step) / (10 + step))
                state = decoder.state_dict()
                with torch.no_grad():
                    for name, t in average.items():
                        t.lerp_(state[name], 1 - decay)
            report.losses.append(loss.item())
            smooth = report.losses[-1] if smooth is None else 0.9 * smooth + 0.1 * report.losses[-1]
            bar.update(1)
            if held and opts.eval_every and step % opts.eval_every == 0:
                evaluate()
            bar.set_postfix(loss=f"{smooth:.3f}", **({"agree": f"{report.curve[-1][1]:.3f}"} if report.curve else {}),
                            **({"best": f"{best[0]:.3f}@{best[1]}"} if best else {}))
            if step % opts.checkpoint_every == 0:
                checkpoint()
    finally:  # an interruption keeps what was learned
        bar.close()
        report.train_seconds = time.perf_counter() - t0
        report.step = report.best_step = step
        if held and (not report.curve or report.curve[-1][0] != step):
            evaluate()
        checkpoint()
        # the best seen on the held-out windows, else the draft as it is now
        decoder.load_state_dict(best[2] if best is not None else draft(), strict=False)
        report.best_step = best[1] if best is not None else step
        decoder.eval()
        save_draft(decoder, target_folder, out)
    if held:
        report.agreement = best[0]
    return report

"""The draft model of speculative decoding: a draft paired with its target (vocabulary tables,
greedy head, its own prompt, the costs it measures). Its steps over the runner's slots are
drafting.py's (the glossary is in runner.py); the adaptive choice of k from those costs is
draft_length.py's `DraftLength`."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from ..constants import MAX_ADAPTIVE_K as MAX_K
from ..backends import cpu_ops
from ..backends.ops import csrc_dir, kept_folder
from ..model.encoder_cpu import pool_rows
from ..model.head import Q2_CHUNK, Q4_CHUNK, Q2Head, Q4Head, SubsetHead
from ..model.whisper import DecoderCache
from .draft_length import DraftLength
from .vocab import vocab_tables

DRAFT_RUN = 3  # draft steps in a row when calibrating their cost (a typical k)
CONTENT_BLOCK = 300  # mel frames (3 s): a draft's own encoder runs whole blocks of its attention


def content_frames(mel: torch.Tensor, block: int = CONTENT_BLOCK) -> int:
    """The mel frames of a window [n_mels, T] up to the end of its audio, rounded up to whole
    blocks: trailing columns whose every bin sits at the log-mel floor (the padding after a
    clip's end, or digital silence) are left out; at least one block (a host read, once a window)."""
    at_floor = (mel == mel.amin()).all(dim=0)  # [T]
    filled = (~at_floor).nonzero()
    n = int(filled[-1]) + 1 if filled.numel() else 0
    return min(mel.shape[-1], max(block, -(-n // block) * block))


class Drafter:
    """A loaded draft model paired with the target it serves: its vocabulary tables, its greedy
    head, and how it builds its own prompt. It owns no cache (the runner does) and never changes
    the model it was given."""

    def __init__(self, draft, target, shared_encoder: bool | None = None, head_tokens: int | None = None):
        self.draft, self.target = draft, target
        dcfg, tcfg = draft.config, target.config
        same_encoder = shares_encoder(draft.model, target.model)
        if shared_encoder is None:
            shared_encoder = same_encoder
        elif shared_encoder and not same_encoder:
            raise ValueError(f"draft {draft.path} does not share the encoder of target {target.path} "
                             "(encoder configs or weights differ); pass shared_encoder=None or False")
        self.shared_encoder = shared_encoder  # the target's encoder output serves both
        # own-encoder passes run (`encode`): the first packs the encoder's weights (`Speculation`
        # does not charge it as a window's setup)
        self.encodes = 0
        # a draft with its own encoder and another mel front end (tiny's 80 bins drafting
        # large-v3's 128) reads log-mels of its own, made from the same audio (`Engine`): its
        # proposals only ever change the speed, never the output
        self.own_mels = dcfg.num_mel_bins if not shared_encoder and dcfg.num_mel_bins != tcfg.num_mel_bins else None
        self.vocab = vocab_tables(draft.tokenizer, target.tokenizer, tcfg.vocab_size, draft.path, target.path)
        self.pruned = head_tokens is not None  # greedy proposals among a subset of the vocabulary
        self.head_tokens = head_tokens
        if same_head(draft, target):
            # a draft whose output head is the target's (a distilled draft reuses the target's
            # embedding; a self draft is the target): one int8 copy serves both, so the bytes a
            # draft step reads are the ones the verify pass just read (in cache), and vice versa
            self.head = target.head
        if head_tokens is not None:
            weight = draft.model.decoder.embed_tokens.weight
            self.head = SubsetHead(weight, self.head_ids(head_tokens), draft.backend.screens_head(weight.dtype))
        # the target layer whose cross-attention K/V each draft layer would compute (None: none
        # does); taken before a compact draft's weights are rounded to bfloat16
        self.cross_sources = cross_sources(draft.model, target.model) if shared_encoder else None
        self.draft_to_target, self.target_to_draft, self.target_to_draft_len = self._tables()
        v_target = tcfg.vocab_size
        ids = torch.arange(dcfg.vocab_size)
        # the noise a draft column is raced with: its target id's, so both models see the same
        # noise for the same token; tokens the target cannot spell get noise of their own
        self.noise_ids = torch.where(self.draft_to_target >= 0, self.draft_to_target, v_target + ids)
        self.length = DraftLength(None)  # running estimates for num_draft_tokens=None, kept across calls

    def _tables(self):
        """draft -> target ids [V_draft] (-1: none); target -> draft spelling [V_target, W] and its
        length [V_target] (0: the draft cannot spell it)."""
        v_draft, v_target = self.draft.config.vocab_size, self.target.config.vocab_size
        if self.vocab.identity:
            return torch.arange(v_draft), torch.arange(v_target)[:, None], torch.ones(v_target, dtype=torch.long)
        d2t = torch.full((v_draft,), -1, dtype=torch.long)
        n = min(v_draft, len(self.vocab.draft_to_target))
        d2t[:n] = self.vocab.draft_to_target[:n]
        return (d2t, *self.vocab.spelling_table(v_target))

    @functools.cached_property
    def head(self):
        """The draft's greedy head: the target's screened head where the two are equal, a pruned
        head (`head_tokens`), a compact draft's 2- or 4-bit head (`compact_head`), else the draft's own
        (built here, at its first use, only where none of those replaced it)."""
        return self.draft.head

    def compact_head(self) -> None:
        """A compact draft proposes through `compact_draft_head` unless a pruned head was asked for."""
        head = None if self.pruned else compact_draft_head(self.draft.model, two_bit=self.shared_encoder)
        if head is not None:
            self.head = head

    def cross_pool(self, dtype: torch.dtype) -> int:
        """The audio positions each of the draft's cross K/V averages (`pool_positions`): the
        backend's choice for a draft sharing the target's encoder, 1 for one with its own
        (`compact_draft_head` says why) or where it does not divide the positions."""
        pool = self.draft.backend.draft_cross_pool(self.draft.model.decoder, dtype) if self.shared_encoder else 1
        return pool if self.draft.config.max_source_positions % pool == 0 else 1

    def cross_positions(self, dtype: torch.dtype) -> int:
        """The audio positions of the draft's cross K/V: the encoder's 1500 over `cross_pool`, or
        over its own encoder's pooling (`Whisper.pool_encoder`)."""
        pool = self.cross_pool(dtype) if self.shared_encoder else self.draft.model.encoder.pool_positions
        return self.draft.config.max_source_positions // pool

    def head_ids(self, n: int) -> torch.Tensor:
        """The draft's `n` lowest text ids the target can spell (BPE ids follow merge order, not
        English frequency: 12% of bench/cpu.py's tokens lie above 8192), plus EOT: what a pruned
        draft head may propose (greedy only)."""
        eot = self.draft.tokenizer.eot
        ids = torch.arange(eot)
        if not self.vocab.identity:
            ids = ids[self.vocab.draft_to_target[:eot] >= 0]
        return torch.cat([ids[:n], torch.tensor([eot])]).to(self.draft.suppress.device)

    def stands_aside(self, language: str | None, task: str) -> str | None:
        """Why the draft cannot follow a request in `language` / `task` (None: it can). A draft's
        limits never refuse a request: the target then decodes that request alone."""
        tok = self.draft.tokenizer
        if not tok.multilingual:
            if language not in (None, "en"):
                return f"English-only draft cannot follow language {language!r}"
            if task != "transcribe":
                return "English-only draft cannot translate"
        elif language is not None and language not in tok.languages:
            return f"draft has no language token for {language!r}"
        return None

    # previous-text tokens a draft's prompt keeps (the last ones). A draft only proposes, and its
    # prompt pass over up to 224 previous tokens is a cost speculation adds to every window. The
    # demo recording (adaptive k, Zen 4 EPYC, whole previous text against the last 64 tokens,
    # alternated in one process): base-2l 1.087x -> 1.118x of target-only natively (acceptance
    # 0.70 -> 0.66), 1.070x -> 1.107x held to AVX2 (0.65 -> 0.67); tiny.en 1.086x -> 1.052x natively
    # (0.89 -> 0.86), held to AVX2 kept off with it and drafting at 1.060x without
    PREV_TOKENS = 64

    def prompt(self, spec) -> list[int]:
        """The draft's own prompt for a target sequence `spec`: the last PREV_TOKENS of the
        previous text spelled in draft ids, then the draft's start-of-transcript sequence for the
        same language and task."""
        tok = self.draft.tokenizer
        sot_index = spec.sot_index
        prev = []
        if sot_index > 0:  # <|startofprev|> + previous text
            sot_prev = tok.backend.token_to_id("<|startofprev|>")
            prev = [d for t in spec.prompt[1:sot_index] for d in self.vocab.to_draft(t)]
            prev = [sot_prev] + prev[max(0, len(prev) - self.PREV_TOKENS):]
            if sot_prev is None:
                prev = []
        language = spec.language if tok.multilingual else None
        if tok.multilingual and language is None:
            language = "en"  # an English-only target: its speech is English
        sot_seq = tok.prompt(language, spec.task)[:-1]  # without <|notimestamps|>
        return prev + sot_seq + ([] if spec.timestamps else [tok.no_timestamps])

    fused_greedy = True  # False: the greedy draft steps one call each (`greedy_fused`'s spec)

    def greedy_fused(self) -> bool:
        """Greedy proposals run as one C++ call for all k steps (`cpu_ops.draft_greedy`): a compact
        draft's 2- or 4-bit head and a decoder whose steps are one C++ call each."""
        return (self.fused_greedy and isinstance(self.head, Q4Head) and cpu_ops.active(self.head.weight)
                and self.draft.model.decoder.cpu_fused())

    def leads_known(self) -> bool:
        """The draft's greedy head tells how far its choice leads (`Q4Head.argmax`'s margins)."""
        return isinstance(self.head, Q4Head)

    def greedy(self, hidden: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
        """Draft greedy proposals [B, T] from hidden [B, T, d]."""
        return greedy_tokens(self.draft, self.head, hidden, banned)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits [B, T, V] sampled rows draft from: a compact draft's 4-bit copy's
        (`Q4Head.logits`, also `Q2Head`'s: an eighth of the float32 head's bytes, the race's likely winners exact),
        else the draft's own float32 head."""
        if isinstance(self.head, Q4Head):
            return self.head.logits(hidden)
        return self.draft.model.decoder.logits(hidden)

    @torch.inference_mode()
    def encode(self, mel: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A draft with its own encoder: (features [1, T/2p, d] of one window's mel [n_mels, T], p
        its encoder's pooling (`Whisper.pool_encoder`), the positions computed), its encoder run
        over the window's audio only (`content_frames`), zero features after it
        (`Decoder.fill_cross(frames=...)` projects them once). A 7 s clip's 30 s window then costs
        a quarter of the pass, the last 23 s window of a recording four fifths. The proposals
        change a little (its attention blocks at the end of the audio no longer see padding; the
        padding positions' keys are zero), the output does not: the target verifies every
        proposal. tiny.en drafting base, k = 3, whole calls alternated in one process (6 rounds,
        bench/cpu.py's windows), against the whole-window pass: held to AVX2, three 23 s windows
        0.948x -> 0.990x of target-only, their first 7 s 0.826x -> 0.924x; natively 0.975x ->
        0.958x (noise: a 20% shorter pass of ≈ 60 ms) and 0.903x -> 0.952x; acceptance unchanged
        (936/1176 -> 942/1158, 318/324 -> 312/342)."""
        n = content_frames(mel)
        encoder = self.draft.model.encoder
        self.encodes += 1
        features = encoder(mel[None, :, :n])
        frames = features.shape[1]
        if n < mel.shape[-1]:
            full = features.new_zeros(1, mel.shape[-1] // 2 // encoder.pool_positions, features.shape[-1])
            full[:, :frames] = features
            features = full
        return features, frames

    @torch.inference_mode()
    def warm(self, device, dtype) -> None:
        """Run a draft's own encoder and cross K/V projections once, on one block of silence into a
        scratch cache, before its first window (`Speculation.choose_k`, with the calibration): the
        first pass packs their weights (oneDNN's int8 layout) and takes a window's setup several
        times over (tiny.en: 365 against 75-86 ms on an AVX2-only Zen 3), so the engine left it
        uncharged, and the adaptive k judged the next windows' setup by the calibration's whole
        30 s pass: with the first window's tokens still near the prior (`DraftLength.window_done`)
        tiny.en read ≈ 1.02 after an engine's first window and stayed off for the four windows of a
        retrial (`python bench/replay.py --draft tiny.en`). Warm, every start is timed and charged.
        Nothing for a draft that shares the target's encoder, or one whose encoder has run."""
        if self.shared_encoder or self.encodes:
            return
        silence = torch.zeros(self.draft.config.num_mel_bins, 2 * self.draft.config.max_source_positions,
                              device=device, dtype=dtype)
        features, frames = self.encode(silence)  # one block of it (`content_frames`)
        self.draft.model.decoder.fill_cross(self.scratch_cache(device, dtype), features, frames=frames)

    def scratch_cache(self, device, dtype) -> DecoderCache:
        """A one-row draft cache laid out as the runner's (its cross K/V dtype and positions), for
        passes whose values are not kept (`measure_costs`, `warm`)."""
        ddec = self.draft.model.decoder
        return DecoderCache.allocate(self.draft.config, 1, device, dtype,
                                     self.draft.backend.draft_cross_dtype(ddec, dtype), self.cross_positions(dtype))

    def costs(self, device, dtype) -> dict:
        """`measure_costs`, kept on disk per machine and pair (`costs_folder`): a one-shot
        `specwhisper transcribe --draft` measured them in every process, before its first decision
        (base drafted by base-2l 0.52 s, by tiny.en 1.28 s, on a 2-minute recording whose warm call
        takes 5.6-6.5 s here). Read back, they are where the adaptive k starts; the iterations refine
        them as before (the first timed plain pass replaces the plain pass's time). Measured anew when
        anything in `costs_key` changes (the checkpoints' files, the CPU, the threads, the
        versions, the kernels' instruction sets held by the environment) or the file cannot be read."""
        folder = costs_folder()
        key = self.costs_key(device, dtype) if folder is not None else None
        if key is None:
            return self.measure_costs(device, dtype)
        path = folder / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json")
        try:
            saved = json.loads(path.read_text())
            if saved.get("key") == key and valid_costs(saved.get("costs")):
                return saved["costs"]
        except (OSError, ValueError, AttributeError):
            pass  # absent, or not ours: measured and written again
        costs = self.measure_costs(device, dtype)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps({"key": key, "costs": costs}, indent=1))
            os.replace(partial, path)  # whole or not at all, for another process reading it
        except OSError:
            pass  # a read-only cache: measured again next time
        return costs

    def costs_key(self, device, dtype) -> dict | None:
        """What the measured costs depend on (None: a pair not loaded from folders, never kept)."""
        if torch.device(device).type != "cpu":
            return None
        models = [model_files(self.target.path), model_files(self.draft.path)]
        if None in models:
            return None
        from .. import __version__

        return dict(format=COSTS_FORMAT, specwhisper=__version__, code=code_digest(), torch=torch.__version__,
                    cpu=cpu_ops.cpu_model(),
                    capability=torch.backends.cpu.get_cpu_capability(), vector_level=cpu_ops.current_vector_level(),
                    threads=torch.get_num_threads(), dtype=str(dtype), target=models[0], draft=models[1],
                    compact=bool(self.draft.model.decoder.compact), shared_encoder=self.shared_encoder,
                    head_tokens=self.head_tokens, cross_pool=self.cross_pool(dtype),
                    native_bf16=cpu_ops.native_bf16(), draft_encoder=self.encoder_arrangement(),
                    holds=cpu_ops.kernel_holds())

    def encoder_arrangement(self) -> dict | None:
        """How a draft's own encoder runs (None: it shares the target's): the setup cost kept with
        the costs depends on it, and an engine built another way (SPECWHISPER_NO_BF16, a draft
        compacted or not) must not read another arrangement's."""
        if self.shared_encoder:
            return None
        enc = self.draft.model.encoder
        return dict(dtype=str(enc.conv1.weight.dtype), int8=bool(enc.int8_linears), block=enc.attention_block,
                    local_last=bool(enc.local_last), pool=enc.pool_positions)

    @torch.inference_mode()
    def measure_costs(self, device, dtype, position: int = 64, rounds: int = 3) -> dict:
        """What an iteration costs here, timed on scratch one-row caches at `position` (the
        arithmetic does not depend on the cached values): a plain target pass (seconds), target
        passes over r = 1..MAX_K+1 rows (as ratios to it), a draft step (ratio: the mean of a run
        of DRAFT_RUN steps right after a verify pass of DRAFT_RUN + 1 rows, as an iteration runs
        them: the first step reads weights that pass evicted from cache, the next ones less so.
        Timed alone after a 9-row pass, tiny.en's step held to AVX2 cost 0.40 of a plain pass
        against 0.23 in real iterations (2.9 against 1.6 ms), enough to keep it from being tried)
        and, for a draft with its own encoder, its encoder pass over a whole 30 s window (seconds;
        shorter audio costs less, and `charge` measures each start). The least of `rounds` interleaved
        timings (other work on a shared machine only ever adds time). The `DraftLength.calibrate`
        arguments."""
        tdec, ddec = self.target.model.decoder, self.draft.model.decoder
        tcache = DecoderCache.allocate(self.target.config, 1, device, dtype)
        dcache = self.scratch_cache(device, dtype)
        token = torch.full((1, 1), self.target.tokenizer.eot, device=device)

        def target_pass(rows):
            pos = torch.arange(position, position + rows, device=device)[None]
            hidden = tdec.hidden(token.expand(1, rows), pos, tcache, kv_len=position + rows)
            self.target.greedy(hidden, self.target.suppress)

        def draft_steps():  # a run of DRAFT_RUN steps right after a target pass, as an iteration drafts
            if self.greedy_fused():  # as `DraftSide.propose` runs them
                pos = torch.tensor([[position]], device=device)
                cpu_ops.draft_greedy(ddec, token, pos, dcache, position + DRAFT_RUN, self.head, self.draft.suppress,
                                     pos[0] + 1, DRAFT_RUN)
                return
            for i in range(DRAFT_RUN):
                pos = torch.tensor([[position + i]], device=device)
                self.greedy(ddec.hidden(token, pos, dcache, kv_len=position + i + 1), self.draft.suppress)

        mel = torch.zeros(1, self.draft.config.num_mel_bins, 3000, device=device, dtype=dtype)
        runs = {r: (lambda r=r: target_pass(r)) for r in range(1, DRAFT_RUN + 2)}
        runs["draft"] = draft_steps  # after a verify pass of DRAFT_RUN + 1 rows, as in an iteration
        runs.update({r: (lambda r=r: target_pass(r)) for r in range(DRAFT_RUN + 2, MAX_K + 2)})
        times = {name: [] for name in runs}
        for _ in range(rounds + 1):  # interleaved rounds; the first warms up
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        # each ratio from passes timed side by side (the median of its rounds): a busy spell of a
        # shared machine slows neighbours alike; the plain pass itself: the least time
        ratio = {name: statistics.median(t / p for t, p in zip(times[name][1:], times[1][1:])) for name in runs}
        verify, widest = [1.0, 1.0], 1.0
        for r in range(2, MAX_K + 2):  # more rows never cost less: a nondecreasing v(r) >= 1
            widest = max(widest, ratio[r])
            verify.append(widest)
        cost_ratio = ratio["draft"] / DRAFT_RUN
        dcfg, tcfg = self.draft.config, self.target.config
        if not ddec.compact and dcfg.decoder_layers >= tcfg.decoder_layers and dcfg.d_model >= tcfg.d_model:
            cost_ratio = max(cost_ratio, 1.0)  # a draft as large as the target (a self draft) is no cheaper
        setup = 0.0
        if not self.shared_encoder:
            # timed warm: the first pass also packs the encoder's weights and creates its GEMM
            # primitives (tiny.en: 3x a pass here), a cost paid once, not once per window. The
            # least of two passes: one timing alone read 13 and 19 plain passes in two runs on a
            # shared machine, enough to decide whether tiny.en drafts at all
            ddec.fill_cross(dcache, self.draft.model.encoder(mel))  # every position (`cross_pool`)
            setup = float("inf")
            for _ in range(2):
                self.draft.backend.synchronize()
                start = time.perf_counter()
                ddec.fill_cross(dcache, self.draft.model.encoder(mel))
                self.draft.backend.synchronize()
                setup = min(setup, time.perf_counter() - start)
        return dict(plain_seconds=min(times[1][1:]), verify_ratio=verify, cost_ratio=cost_ratio, setup_seconds=setup)


COSTS_FORMAT = 1  # what `measure_costs` returns; a change makes every kept file stale


@functools.cache
def code_digest() -> str:
    """A digest of the code the costs depend on (the package's Python files and the C++ sources):
    costs kept from other kernels are measured again (a version number does not move with every
    change: a draft encoder 40% faster kept its old setup cost and stayed switched off)."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    sources = sorted(package.rglob("*.py")) + sorted(Path(str(csrc_dir())).glob("*.[ch]*"))
    for path in sources:
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def costs_folder() -> Path | None:
    """Where `Drafter.costs` keeps measured pass costs: $SPECWHISPER_COSTS_DIR, else
    ~/.cache/specwhisper/costs ($XDG_CACHE_HOME respected); SPECWHISPER_COSTS_DIR=off (or 0) keeps
    none (every engine measures its own, as the tests do)."""
    return kept_folder("SPECWHISPER_COSTS_DIR", "costs")


def model_files(path) -> list | None:
    """A checkpoint folder's identity for `Drafter.costs_key`: its resolved path and the size and
    modification time of each of its files (None: no such folder)."""
    if path is None or not Path(path).is_dir():
        return None
    folder = Path(path).resolve()
    return [str(folder)] + [[f.name, f.stat().st_size, f.stat().st_mtime_ns]
                            for f in sorted(folder.iterdir()) if f.is_file()]


def valid_costs(costs) -> bool:
    """Whether `costs` has `measure_costs`'s fields with usable values (a file read back)."""
    try:
        ratios = costs["verify_ratio"]
        return (costs["plain_seconds"] > 0 and costs["cost_ratio"] > 0 and costs["setup_seconds"] >= 0
                and len(ratios) == MAX_K + 2 and all(r >= 1.0 for r in ratios)
                and set(costs) == {"plain_seconds", "verify_ratio", "cost_ratio", "setup_seconds"})
    except (TypeError, KeyError):
        return False


def pool_positions(kv: torch.Tensor, pool: int) -> torch.Tensor:
    """Cross K/V [L, B, H, T, D] -> [L, B, H, T / pool, D]: the mean (in float32) of each run of
    `pool` adjacent positions (`pool` 1: `kv` itself). A compact CPU draft attends over these
    (`Backend.draft_cross_pool`, `constants.CROSS_POOL` = 2: each 40 ms of audio one key and one
    value): its step reads half the cross K/V bytes, and only its proposals change. The demo
    recording, 2 threads of a Zen 3 EPYC, pool 1 / 2 / 3: base-2l's acceptance at k = 3 0.714 /
    0.701 / 0.709, sampled (T = 0.5, seed 1) 0.715 / 0.722 / 0.692, (seed 3) 0.748 / 0.728 / 0.681;
    tiny.en's 0.857 / 0.849 / 0.835 and 0.807 / 0.805 / 0.785. Whole calls with base-2l alternated
    in one process, pool 2 against 1 (paired medians): k = 3 0.954x (6 rounds), adaptive 0.946x
    (4), sampled 0.952x (4); pool 3 greedy 0.950x but sampled 1.049x (acceptance 0.748 -> 0.681).
    A draft with its own encoder (tiny.en) keeps every position (`Drafter.cross_pool`)."""
    if pool == 1:
        return kv
    return pool_rows(kv.float(), pool)  # positions are the second-to-last dimension


def compact_draft_head(model, two_bit: bool = True) -> Q4Head | None:
    """A compact draft's greedy head where the C++ ops run it (float32 CPU weights): a 2-bit copy
    of its output head (`Q2Head`, features a multiple of 64: a quarter of the int8 screen's bytes;
    `two_bit`: drafts sharing the target's encoder. With its own encoder tiny.en's cheaper steps
    had the controller probe it more, each probe paying that encoder: the demo 0.90-0.94x of
    target-only where with the 4-bit head it stayed off at 1.02-1.04x), else a 4-bit one
    (`Q4Head`, a multiple of 32); the best 16 approximate logits rechecked in
    float32. None elsewhere. Base's distilled draft, 2 threads of a Zen 4 EPYC: its head 1.1 ->
    0.54 ms in 4 bits, about half of its step; 2 threads of a Zen 3 EPYC, right after a verify
    pass, 60 alternated rounds: 4 -> 2 bits 1.05 -> 0.74 ms for one row (paired 0.72x), 0.96x for
    four."""
    weight = model.decoder.embed_tokens.weight
    if (not cpu_ops.available() or weight.device.type != "cpu" or weight.dtype != torch.float32
            or weight.shape[1] % Q4_CHUNK):
        return None
    return Q2Head(weight.detach()) if two_bit and weight.shape[1] % Q2_CHUNK == 0 else Q4Head(weight.detach())


def greedy_tokens(model, head, hidden: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """Greedy argmax [B, T] of a model's logits with `banned` ([V] or [B, T, V]) tokens excluded,
    through `head` when it has one (screened or pruned head), else full logits."""
    B, T, d = hidden.shape
    flat_banned = banned if banned.ndim == 1 else banned.reshape(B * T, -1)
    if head is not None:
        return head.argmax(hidden.reshape(B * T, d), flat_banned).view(B, T)
    logits = model.model.decoder.logits(hidden).float().reshape(B * T, -1).masked_fill_(flat_banned, -float("inf"))
    return logits.argmax(-1).view(B, T)


def same_head(a, b) -> bool:
    """Whether loaded models a and b have the same screened output head (equal embeddings)."""
    if not (a.screened and b.screened):
        return False
    wa, wb = a.model.decoder.embed_tokens.weight, b.model.decoder.embed_tokens.weight
    return wa.shape == wb.shape and wa.dtype == wb.dtype and bool(torch.equal(wa, wb))


def cross_sources(draft, target) -> list[int] | None:
    """For each of draft's decoder layers, a target layer with equal cross-attention key and value
    projections (weights and biases), or None unless every draft layer has one. `specwhisper
    distill` freezes them (a draft layer keeps its target layer's), so with a shared encoder a
    draft's cross K/V for a window are the target's for those layers: copied, not recomputed."""
    if draft.config.decoder_attention_heads != target.config.decoder_attention_heads:
        return None  # the same projections split into other heads: another cache layout
    sources = []
    for layer in draft.decoder.layers:
        mine = layer.encoder_attn
        found = [j for j, theirs in enumerate(t.encoder_attn for t in target.decoder.layers)
                 if same_weights(mine.k_proj, theirs.k_proj) and same_weights(mine.v_proj, theirs.v_proj)]
        if not found:
            return None
        sources.append(found[0])
    return sources


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two modules hold the same tensors: names, shapes, dtypes and values."""
    pa, pb = a.state_dict(), b.state_dict()
    return pa.keys() == pb.keys() and all(pa[k].shape == pb[k].shape and pa[k].dtype == pb[k].dtype
                                          and torch.equal(pa[k], pb[k]) for k in pa)


def shares_encoder(a, b) -> bool:
    if a.config.d_model != b.config.d_model or a.config.encoder_layers != b.config.encoder_layers \
            or a.config.num_mel_bins != b.config.num_mel_bins:
        return False
    return same_weights(a.encoder, b.encoder)

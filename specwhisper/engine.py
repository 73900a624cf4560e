"""The decoding engine: encode once, prefill, then draft -> verify -> accept until every row ends.

Glossary (one iteration of speculative decoding, per batch row):
- *pending token*: the last emitted token; it is not yet in any cache and is fed first.
- *drafted* tokens: the k tokens the draft proposes after the pending token (k draft steps).
- *verify pass*: one target forward over [pending, drafted...] (k + 1 positions).
- *accepted* tokens: the longest prefix of the drafted tokens equal to the target's own choice
  at that position; the first drafted token that differs is *rejected*.
- *correction* token: the target's own token at the first rejected position.
- *bonus* token: the target's token after the last drafted one, when all k were accepted.
Each iteration emits the accepted tokens plus one correction or bonus token, so a verify pass
yields 1..k+1 tokens, and the output is exactly what the target alone would produce. Caches are
rolled back to the accepted length by changing a length; stale slots are masked and overwritten.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from .config import DecodeOptions, TranscribeOptions, WhisperConfig
from .decoding import LoadedModel
from .model import DecoderCache
from . import sampling
from .draft import DraftLength, Drafter
from .results import Segment, Stats, Transcription  # noqa: F401 (re-exported)

N_FRAMES = 3000
FRAMES_PER_SECOND = 100  # mel frames per second of audio


class Engine:
    """Exact Whisper decoding, speculative when a draft is given.

    Thread-safe: calls on one engine serialize on its lock; all state lives in the instance.
    """

    def __init__(self, target, draft=None, device=None, dtype=None, shared_encoder: bool | None = None,
                 draft_head_tokens: int | None = None):
        """`shared_encoder`: None detects a draft whose encoder equals the target's (it then
        runs once); `draft_head_tokens`: greedy drafts propose only among that many of their
        most frequent target-spellable tokens (a cheaper draft head; output stays exact)."""
        self.device = torch.device(device if device is not None else
                                   ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        self.dtype = dtype
        self.target = LoadedModel.load(target, self.device, dtype)
        self.drafter = None
        if draft is not None:
            self.drafter = Drafter(LoadedModel.load(draft, self.device, dtype), self.target, shared_encoder,
                                   draft_head_tokens)
        self._caches: dict[tuple[str, int], DecoderCache] = {}
        self._lock = threading.Lock()
        self._executor = None

    @property
    def n_mels(self) -> int:
        return self.target.config.num_mel_bins

    # ---------------------------------------------------------------- input checks
    def _check_mel(self, mel) -> torch.Tensor:
        if isinstance(mel, np.ndarray):
            mel = torch.from_numpy(mel)
        if not isinstance(mel, torch.Tensor):
            raise TypeError(f"mel must be a torch.Tensor or numpy array, got {type(mel).__name__}")
        if not mel.is_floating_point():
            raise TypeError(f"mel must be a floating-point log-mel spectrogram, got dtype {mel.dtype}")
        if mel.ndim not in (2, 3):
            raise ValueError(f"mel must be [n_mels, frames] or [batch, n_mels, frames], got shape {tuple(mel.shape)}")
        batch = mel if mel.ndim == 3 else mel[None]
        if batch.shape[0] == 0:
            raise ValueError("mel batch is empty")
        if batch.shape[1] != self.n_mels:
            raise ValueError(f"mel has {batch.shape[1]} mel bins but the target expects n_mels={self.n_mels} "
                             f"(shape {tuple(mel.shape)})")
        frames = batch.shape[2]
        if not 0 < frames <= N_FRAMES:
            raise ValueError(f"mel has {frames} frames; 1..{N_FRAMES} (30 s) are supported per utterance")
        batch = batch.to(self.device, torch.float32)
        if not torch.isfinite(batch).all():
            raise ValueError("mel contains NaN or infinite values")
        if frames < N_FRAMES:
            # Whisper pads audio with silence; in normalized log-mel space silence sits at the
            # per-utterance floor max - 2 (the extractor clamps at max - 8 before (x + 4) / 4).
            floor = (batch.amax(dim=(1, 2), keepdim=True) - 2.0).clamp(min=-1.5)
            batch = torch.cat([batch, floor.expand(-1, batch.shape[1], N_FRAMES - frames)], dim=2)
        return batch

    def _cache(self, role: str, cfg: WhisperConfig, batch: int) -> DecoderCache:
        """Static caches, allocated once per (model, batch bucket) and reused for every call."""
        bucket = 1 << (batch - 1).bit_length()
        key = (role, bucket)
        if key not in self._caches:
            self._caches[key] = DecoderCache.allocate(cfg, bucket, self.device, self.dtype)
        return self._caches[key]

    # ---------------------------------------------------------------- public API
    def transcribe(self, mel, language: str | None = None, task: str = "transcribe",
                   temperature: float = 0.0, top_p: float = 1.0, num_draft_tokens: int | None = None,
                   max_new_tokens: int | None = None, seed: int | None = None):
        """Decode `mel` [n_mels, frames] -> Transcription, or [batch, n_mels, frames] -> a list."""
        single, mel = self._as_mel(mel)
        if single and mel.shape[-1] > N_FRAMES:  # longer than 30 s: openai-whisper's long-form algorithm
            if max_new_tokens is not None:
                raise ValueError("max_new_tokens applies to one 30 s window; long-form input decodes every window")
            return self.transcribe_long(mel, TranscribeOptions(temperature, language=language, task=task,
                                                               top_p=top_p), seed)
        opts = DecodeOptions(language, task, temperature, top_p, num_draft_tokens, max_new_tokens, seed)
        batch = self._check_mel(mel)
        if language is not None:
            self.target.tokenizer.prompt(language, task)  # validates the code before any work
        with self._lock, torch.inference_mode():
            results = self._decode(batch, opts)
        duration = min(mel.shape[-1], N_FRAMES) / FRAMES_PER_SECOND
        for r in results:
            r.duration = duration
            r.segments = [Segment(0, 0, 0.0, duration, r.text, r.tokens)]
        return results[0] if single else results

    def submit(self, x, **options) -> Future:
        """`transcribe(x, **options)` in the engine's background worker -> a Future of its result."""
        if self._executor is None:
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix="specwhisper")
        return self._executor.submit(self.transcribe, x, **options)

    def _as_mel(self, x) -> tuple[bool, torch.Tensor]:
        """Any accepted input -> (single?, mel [n_mels, frames] or [batch, n_mels, frames]).
        Audio (a path, encoded bytes, or a 1-D 16 kHz waveform) is turned into a log-mel here."""
        from .audio import HOP_LENGTH, load_audio, log_mel_spectrogram

        if isinstance(x, (str, bytes, bytearray, memoryview)) or hasattr(x, "__fspath__"):
            x = load_audio(x)
        if isinstance(x, np.ndarray):
            x = torch.from_numpy(x)
        if isinstance(x, torch.Tensor) and x.ndim == 1:
            if x.numel() == 0:
                raise ValueError("audio is empty (0 samples)")
            if x.numel() > N_FRAMES * HOP_LENGTH:  # the whole recording's log-mel, for long-form
                return True, log_mel_spectrogram(x.float(), n_mels=self.n_mels, whole=True)
            frames = -(-x.numel() // HOP_LENGTH)
            return True, log_mel_spectrogram(x.float(), n_mels=self.n_mels)[:, :frames]
        return getattr(x, "ndim", None) == 2, x

    # ---------------------------------------------------------------- decoding
    def _accept(self, choice, target_logits, proposals, draft_logits, opts, generator):
        """Accept step over a verify pass -> (tokens [B, k+1], n_emitted [B]). Greedy needs only
        the target's choices [B, k+1]; sampling needs both models' suppressed logits.

        With another draft vocabulary, sampling runs over the target's ids plus one extra id for
        "a draft token the target cannot spell": the draft's mass there is always rejected
        (the target gives it probability 0), which keeps the output distribution exact."""
        if opts.temperature == 0.0:
            return sampling.greedy_accept_choices(choice, proposals)
        vocab = self.drafter.vocab
        if vocab.identity:
            return sampling.speculative_sample(target_logits, draft_logits, proposals,
                                               opts.temperature, opts.top_p, generator)
        target_probs = sampling.processed_probs(target_logits, opts.temperature, opts.top_p)
        draft_probs = sampling.processed_probs(draft_logits, opts.temperature, opts.top_p)
        B, k, V = target_logits.shape[0], proposals.shape[1], target_logits.shape[-1]
        mapped = vocab.draft_to_target.to(self.device)
        ok = mapped >= 0
        q = torch.zeros(B, k, V + 1, device=self.device)
        q[..., mapped[ok]] = draft_probs[..., ok]
        q[..., V] = draft_probs[..., ~ok].sum(-1)
        p = torch.nn.functional.pad(target_probs, (0, 1))
        unspellable = torch.where(proposals >= 0, proposals, V)
        return sampling.speculative_sample(p.log(), q.log(), unspellable, 1.0, 1.0, generator)

    def _detect_language(self, tcache: DecoderCache, batch: int) -> list[str]:
        tok, dec = self.target.tokenizer, self.target.model.decoder
        sot = torch.full((batch, 1), tok.sot, device=self.device)
        logits = dec(sot, torch.zeros_like(sot), tcache, kv_len=1)[:, 0].float()
        lang_ids = torch.tensor(list(tok.languages.values()), device=self.device)
        best = lang_ids[logits[:, lang_ids].argmax(dim=-1)]
        return [tok.language_code(int(t)) for t in best.tolist()]

    def _decode(self, mel: torch.Tensor, opts: DecodeOptions) -> list[Transcription]:
        start = time.perf_counter()
        B = mel.shape[0]
        target, tok = self.target, self.target.tokenizer
        cfg, dec = target.config, target.model.decoder
        generator = None
        if opts.temperature > 0.0:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(opts.seed if opts.seed is not None else int(torch.randint(2**62, ()).item()))

        features = target.model.encoder(mel.to(self.dtype))
        tcache = self._cache("target", cfg, B)
        dec.fill_cross(tcache, features, slice(0, B))

        if not tok.multilingual:
            languages = [None] * B
            tok.prompt(opts.language, opts.task)  # refuses a non-English language
        elif opts.language is None:
            languages = self._detect_language(tcache, B)
        else:
            languages = [opts.language.lower()] * B
        prompts = [tok.prompt(lang if tok.multilingual else opts.language, opts.task) for lang in languages]
        P = len(prompts[0])
        max_new = opts.max_new_tokens if opts.max_new_tokens is not None else cfg.max_target_positions - P
        if P + max_new > cfg.max_target_positions:
            raise ValueError(f"max_new_tokens={max_new} plus the {P}-token prompt exceeds the decoder "
                             f"cache of {cfg.max_target_positions} positions")

        pick = lambda model, hidden, first=False: model.pick(  # noqa: E731
            hidden, first, opts.temperature, opts.top_p, generator)
        stats = [Stats() for _ in range(B)]
        passes = 0  # target passes; one batched pass serves every row

        # Prefill: the whole prompt; its last position predicts the first generated token.
        prompt = torch.tensor(prompts, device=self.device)
        pos = torch.arange(P, device=self.device).expand(B, P)
        first = pick(target, dec.hidden(prompt, pos, tcache, kv_len=P)[:, -1:], first=True)[0][:, 0].tolist()
        passes += 1

        out = [[t] for t in first]
        done = [t == tok.eot or max_new == 1 for t in first]
        n = [P] * B  # position of each row's pending token (= tokens in the target cache)
        spec, can_draft = None, self.drafter is not None
        k_rule = DraftLength(opts.num_draft_tokens)
        if can_draft and opts.num_draft_tokens is None:
            k_rule = self.drafter.length  # running estimates carry over between calls

        while not all(done):
            remaining = [max_new - len(o) for o in out]
            k = 0
            if can_draft and k_rule.k > 0 and spec is None:
                # the draft starts (encoder, cross K/V, catch-up) only once drafting is wanted
                setup = time.perf_counter()
                spec = self.drafter.start(self, mel, features, prompts, out, opts, generator)
                k_rule.charge(time.perf_counter() - setup)
                can_draft = spec is not None
            if spec is not None and k_rule.k > 0:
                k = min(k_rule.k, max(remaining[b] - 1 for b in range(B) if not done[b]), spec.room(done))
            t0 = time.perf_counter()
            if k > 0:
                proposals, draft_logits = spec.propose(k, done, pick)  # [B, k] target ids (-1: none)
            t1 = time.perf_counter()
            feed = torch.tensor([[o[-1]] for o in out], device=self.device)
            if k > 0:
                feed = torch.cat([feed, proposals.clamp(min=0)], dim=1)
            limit = cfg.max_target_positions - 1
            pos = (torch.tensor(n, device=self.device)[:, None] + torch.arange(k + 1, device=self.device)).clamp(max=limit)
            kv_len = min(max(n) + k + 1, cfg.max_target_positions)
            choice, logits = pick(target, dec.hidden(feed, pos, tcache, kv_len=kv_len))  # [B, k+1]
            passes += 1
            if k > 0:
                tokens, n_emitted = self._accept(choice, logits, proposals, draft_logits, opts, generator)
            else:
                tokens, n_emitted = choice, torch.ones(B, dtype=torch.long)
            t2 = time.perf_counter()
            tokens, n_emitted = tokens.tolist(), n_emitted.tolist()
            accepted = []
            for b in range(B):
                if done[b]:
                    accepted.append(-1)
                    continue
                new = tokens[b][: min(n_emitted[b], remaining[b])]
                if tok.eot in new:
                    new = new[: new.index(tok.eot) + 1]
                # draft tokens among the emitted ones (an EOT or the length limit may cut the
                # run before its correction/bonus token)
                accepted.append(min(n_emitted[b] - 1, len(new)))
                n[b] += len(new)
                out[b].extend(new)
                done[b] = new[-1] == tok.eot or len(out[b]) >= max_new
                if k > 0:  # proposals past the row's end were never needed: not counted
                    stats[b].drafted += min(spec.valid[b], len(new)) if done[b] else spec.valid[b]
                    stats[b].accepted += accepted[-1]
            if spec is not None:
                spec.commit(accepted, out, done)  # with k == 0 too: the draft keeps following
            k_rule.update(k, accepted, done, draft_seconds=t1 - t0, verify_seconds=t2 - t1)
        seconds = time.perf_counter() - start
        results = []
        for b in range(B):
            s = stats[b]
            s.target_passes, s.draft_passes = passes, spec.passes if spec is not None else 0
            s.acceptance_rate = s.accepted / s.drafted if s.drafted else 1.0
            s.tokens_per_pass = len(out[b]) / passes
            s.seconds = seconds
            tokens = out[b][:-1] if out[b][-1] == tok.eot else out[b]
            results.append(Transcription(tok.decode(tokens), tokens, languages[b], s))
        return results

    # ---------------------------------------------------------------- long-form
    def transcribe_long(self, audio, options: TranscribeOptions, seed: int | None = None,
                        progress=None) -> Transcription:
        """openai-whisper's long-form `transcribe()` on a recording of any length: `audio` is a
        1-D 16 kHz waveform, a path, bytes, or the whole recording's log-mel [n_mels, frames]
        (`log_mel_spectrogram(..., whole=True)`). `progress(seek, frames)` follows the windows.
        Windows are decoded by the reference window decoder (target only)."""
        from .audio import load_audio, log_mel_spectrogram
        from .longform import LongformJob, run_job
        from .window import ReferenceWindowDecoder, detect_language_reference

        if isinstance(audio, (str, bytes, bytearray, memoryview)) or hasattr(audio, "__fspath__"):
            audio = load_audio(audio)
        mel = torch.as_tensor(audio)
        if mel.ndim == 1:
            if mel.numel() == 0:
                raise ValueError("audio is empty (0 samples)")
            mel = log_mel_spectrogram(mel.float(), n_mels=self.n_mels, whole=True)
        if mel.ndim != 2 or mel.shape[0] != self.n_mels or mel.shape[1] == 0:
            raise ValueError(f"long-form input must be audio or a log-mel [{self.n_mels}, frames], "
                             f"got shape {tuple(mel.shape)}")
        mel = mel.to(self.device, torch.float32)
        if not torch.isfinite(mel).all():
            raise ValueError("mel contains NaN or infinite values")
        with self._lock, torch.inference_mode():
            if options.language is None and self.target.tokenizer.multilingual:
                from dataclasses import replace

                options = replace(options, language=detect_language_reference(self.target, mel))
            job = LongformJob(mel, self.target.tokenizer, options, seed)
            return run_job(job, ReferenceWindowDecoder(self.target), progress)

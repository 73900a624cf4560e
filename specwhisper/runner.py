"""The runner: a pool of decoder slots, static buffers, and the step functions of one iteration.

One *slot* holds one sequence being decoded (one 30 s window of one request): its target (and
draft) KV caches, cross-attention K/V filled at admission, and its loop state as device tensors.
Active sequences occupy slots 0..n_active-1 (the scheduler compacts after a sequence leaves), so a
step runs over a prefix of the pool.

Glossary (one iteration, per row):
- *pending token*: the last emitted token; it is not yet in the target cache and is fed first.
- *drafted* tokens: the k tokens the draft proposes after the pending token (`draft(k)`).
- *verify pass*: one target forward over [pending, drafted...] (k + 1 positions).
- *choice*: the target's own token at each of those positions (its greedy argmax, or the winner
  of its seeded exponential race when sampling), under Whisper's logit rules for that prefix.
- *accepted* tokens: the longest prefix of the drafted tokens equal to the target's choices; the
  first drafted token that differs is *rejected*, and the target's choice there is the
  *correction* token; when all k are accepted the choice after them is the *bonus* token.
Each iteration emits accepted + 1 tokens (cut at EOT and the row's budget), exactly the target's
own output. Rollback is a length: stale cache slots are masked and overwritten.

State layout (S slots, L = 448 positions + room for the widest write past the end):
tokens [S, L] target ids (prompt, then generated); n_tokens [S] (the pending token is
tokens[n_tokens - 1], at position n_tokens - 1, and the cache holds positions < n_tokens - 1);
prompt_len, budget (max n_tokens), done; per-row options (temperature, top_p, seed, timestamps);
draft side: dtokens [S, L] draft ids, dn [S], dcached [S] (leading draft tokens in its cache).
The host reads one small tensor per iteration (`progress`): done flags, lengths, acceptances.

Graph-shaped path (`graphs` given; CUDA graphs on a GPU, the same code eagerly on a CPU): `draft(k)`
and `verify_accept_commit(k)` run over a power-of-two *bucket* of rows, the live rows then inert
padding rows (done, no draft: they append nothing), with fixed shapes (the full cache width, the
fixed catch-up width), inputs and outputs in static buffers, and no host read inside; one graph per
(step, bucket, k, modes). Without `graphs` (the CPU default) the steps run over exactly the live
rows and trim the attended width to the longest row (host mirrors of the lengths).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import ops, rules, sampling
from .constants import MAX_DRAFT_TOKENS as MAX_K, NO_LIMIT, NO_PROPOSAL
from .rejection import accept_by_rejection
from .draft import Drafter, greedy_tokens
from .graphs import StepGraphs
from .model import DecoderCache



@dataclass
class SeqSpec:
    """One sequence to decode in a slot: a window's prompt and per-row options."""

    prompt: list[int]  # full decoder prefix (previous text, then the start-of-transcript sequence)
    language: str | None  # language of the prompt (the draft builds its own prompt from it)
    task: str  # "transcribe" or "translate"
    max_new_tokens: int  # generated tokens incl. EOT
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0  # noise key of sampled rows (counter-based: tokens do not depend on k or batch)
    timestamps: bool = False  # apply the timestamp rules
    max_initial_timestamp: int = NO_LIMIT  # last allowed initial timestamp index
    num_draft_tokens: int | None = None  # fixed k for this row; None: adaptive
    use_draft: bool = True  # False: the draft stands aside for this row
    sot_index: int = 0  # index of <|startoftranscript|> in `prompt` (no-speech probability)
    need_logprobs: bool = False  # accumulate the log-probabilities of the generated tokens

    @property
    def plain(self) -> bool:
        """Plain greedy: the exact (screened) greedy head, no full logits needed."""
        return self.temperature == 0 and not self.timestamps and not self.need_logprobs


class Modes(NamedTuple):
    """Which token-choosing paths an iteration needs (from the host's copy of the rows' options)."""

    any_plain: bool  # a plain-greedy row: the screened head
    any_full: bool  # a row that needs full logits (sampled, timestamps, log-probabilities)
    any_timestamps: bool  # a row under the timestamp rules
    any_sampled: bool  # a row sampled at a temperature above 0


class Progress(NamedTuple):
    """The host's one read per iteration, per live row."""

    done: list[bool]
    n_tokens: list[int]
    accepted: list[int]  # accepted drafts this iteration (-1: none proposed)
    draft_len: list[int]  # the draft's sequence length (n_tokens without a draft)


@dataclass
class SeqOutput:
    tokens: list[int]  # generated ids without EOT
    generated: int  # generated tokens including EOT
    sum_logprob: float  # sum of log-probabilities of the generated tokens incl. EOT
    no_speech_prob: float  # probability of no-speech at the start-of-transcript position
    drafted: int
    accepted: int
    target_passes: int
    draft_passes: int


ENCODER_BUCKET = 4  # windows per encoder call on the graph-shaped path (always this shape, padded)


def bucket_size(rows: int) -> int:
    """The power-of-two batch bucket that holds `rows` live rows."""
    return 1 << max(0, rows - 1).bit_length()


class Runner:
    def __init__(self, target, drafter: Drafter | None, max_batch: int, device, dtype,
                 graphs: StepGraphs | None = None, sampling_rule: str = "race"):
        """`graphs`: run the steps on the graph-shaped path through it (see the module docstring);
        None: the unpadded eager path. `sampling_rule`: how sampled rows accept proposals, "race"
        (a proposal equal to the target's seeded race winner) or "rejection" (rejection.py)."""
        if sampling_rule not in ("race", "rejection"):
            raise ValueError(f"sampling must be 'race' or 'rejection', got {sampling_rule!r}")
        self.sampling_rule = sampling_rule
        self.target, self.drafter = target, drafter
        self.device, self.dtype, self.max_batch = device, dtype, max_batch
        self.graphs = graphs
        cfg = target.config
        self.max_pos = cfg.max_target_positions  # 448
        S, L = (bucket_size(max_batch) if graphs is not None else max_batch), self.max_pos + 2 * MAX_K + 8
        self.cache = DecoderCache.allocate(cfg, S, device, dtype)
        z = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.tokens, self.n_tokens, self.prompt_len, self.budget = z(S, L), z(S), z(S), z(S)
        self.done = z(S, dtype=torch.bool)
        self.temperature, self.top_p = z(S, dtype=torch.float32), z(S, dtype=torch.float32)
        self.seed, self.row_k = z(S), z(S)
        self.timestamps, self.max_initial_ts = z(S, dtype=torch.bool), z(S)
        self.plain = z(S, dtype=torch.bool)  # plain greedy rows (see SeqSpec.plain)
        self.sum_logprob = z(S, dtype=torch.float64)
        self.drafted, self.accepted_total = z(S), z(S)
        self.target_passes, self.draft_passes = z(S), z(S)
        self.accepted_now = z(S)  # accepted drafts in the last iteration (-1: none proposed)
        self.no_speech = z(S, dtype=torch.float32)
        self.suppress = target.suppress  # [V] bool
        self.begin_suppress = target.begin_suppress
        tok = target.tokenizer
        self.eot = tok.eot
        self.no_speech_id = next((i for i in (tok.backend.token_to_id("<|nospeech|>"),
                                              tok.backend.token_to_id("<|nocaptions|>")) if i is not None), None)
        self.n_tokens.fill_(1)  # a free slot is inert: done, one (pending) token, nothing to append
        self.done.fill_(True)
        self.host_options = [None] * S  # SeqSpec per slot (host copy, for mode decisions)
        # attend only up to the longest row, feed only the uncached draft tokens (host reads;
        # CPU: measurably faster); the graph-shaped path keeps fixed shapes instead
        self.trim = device.type == "cpu" and graphs is None
        self.rule_tables = rules.RuleTables.build(target.tokenizer, cfg.vocab_size, device)
        self._host_n_max = self._host_dn_max = self.max_pos  # host mirrors, refreshed by progress()
        self.host_n = [0] * S  # n_tokens per slot as of the last progress() read
        self.host_budget = [0] * S  # budget per slot (known on the host from the spec)
        if drafter is not None:
            d = drafter
            # a compact draft reads its cross-attention K/V in bfloat16 too (half the bytes per step)
            compact = d.draft.model.decoder.compact and dtype == torch.float32 and device.type == "cpu"
            self.dcache = DecoderCache.allocate(d.draft.config, S, device, dtype,
                                                torch.bfloat16 if compact else None)
            self.dtokens, self.dn, self.dcached = z(S, L), z(S), z(S)
            self.draft_on = z(S, dtype=torch.bool)  # the row's draft has started (and may propose)
            self.draft_pending = [None] * S  # (spec, features, draft mel) of rows whose draft starts later
            self.t2d, self.t2d_len = d.target_to_draft.to(device), d.target_to_draft_len.to(device)
            self.d2t = d.draft_to_target.to(device)
            self.noise_ids = d.noise_ids.to(device)
            self.catchup = 1 + self.t2d.shape[1]  # fixed catch-up width: the last draft + a spelling
            self.draft_synced = True  # every row's uncached draft tokens fit the catch-up width
            self.raw = z(S, MAX_K)  # last proposals in draft ids
            self.proposals = z(S, MAX_K)  # last proposals in target ids (-1: none), read by verify
            if sampling_rule == "rejection":  # the logits each proposal was raced from (its q)
                self.draft_logits = z(S, MAX_K, d.draft.config.vocab_size, dtype=torch.float32)

    # ---------------------------------------------------------------- slots
    def cache_rows(self, cache: DecoderCache, s: int) -> DecoderCache:
        return DecoderCache(*(t[:, s:s + 1] for t in cache.buffers()))

    def move(self, src: int, dst: int) -> None:
        """Copy slot `src` into slot `dst` (compaction after `dst` was freed)."""
        tensors = [self.tokens, self.n_tokens, self.prompt_len, self.budget, self.done, self.temperature,
                   self.top_p, self.seed, self.row_k, self.timestamps, self.plain, self.max_initial_ts, self.sum_logprob,
                   self.drafted, self.accepted_total, self.target_passes, self.draft_passes,
                   self.accepted_now, self.no_speech]
        caches = [self.cache]
        if self.drafter is not None:
            tensors += [self.dtokens, self.dn, self.dcached, self.draft_on]
            caches.append(self.dcache)
        for t in tensors:
            t[dst] = t[src]
        for c in caches:
            for t in c.buffers():
                t[:, dst] = t[:, src]
        hosts = [self.host_options, self.host_n, self.host_budget]
        if self.drafter is not None:
            hosts.append(self.draft_pending)  # a row whose draft has not started yet keeps it
        for host in hosts:
            host[dst] = host[src]
        self.host_options[src] = None
        if self.drafter is not None:
            self.draft_pending[src] = None

    def pad_rows(self, B: int) -> int:
        """The bucket of B live rows (graph-shaped path); rows B.. of it are made inert (done, no
        draft): they append nothing, and whatever they compute is never read."""
        R = bucket_size(B)
        if R > B:
            self.done[B:R] = True
            if self.drafter is not None:
                self.draft_on[B:R] = False
        return R

    def step_state(self) -> list[torch.Tensor]:
        """The per-slot tensors a step changes (besides cache entries at positions it rewrites
        from these): what `rewind` saves before a graph's warm-up calls."""
        state = [self.tokens, self.n_tokens, self.done, self.sum_logprob, self.drafted, self.accepted_total,
                 self.target_passes, self.draft_passes, self.accepted_now]
        if self.drafter is not None:
            state += [self.dtokens, self.dn, self.dcached, self.raw, self.proposals]
        return state

    def rewind(self):
        """Save the step state -> a function restoring it (`StepGraphs.run`'s `rewind`)."""
        saved = [t.clone() for t in self.step_state()]

        def restore() -> None:
            for t, s in zip(self.step_state(), saved):
                t.copy_(s)
        return restore

    # ---------------------------------------------------------------- admission
    @torch.inference_mode()
    def encode(self, mels: torch.Tensor) -> torch.Tensor:
        """mel [B, n_mels, 3000] -> target encoder output [B, 1500, d]."""
        return self.target.model.encoder(mels.to(self.device, self.dtype))

    def encode_windows(self, mels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Encoder outputs [1500, d] of windows' mels [n_mels, 3000], each independent of the
        others: a batched GEMM may round a row differently beside other rows, so the CPU path
        encodes one window at a time (compute-bound there: batching gains nothing), and a GPU
        always encodes ENCODER_BUCKET windows at once (zero-padded): one shape, so a window's
        features never depend on its neighbours either."""
        if self.device.type != "cuda":
            return [self.encode(m[None])[0] for m in mels]
        out = []
        for i in range(0, len(mels), ENCODER_BUCKET):
            chunk = mels[i:i + ENCODER_BUCKET]
            batch = torch.zeros(ENCODER_BUCKET, *chunk[0].shape, device=self.device, dtype=self.dtype)
            for j, m in enumerate(chunk):
                batch[j] = m
            out += list(self.encode(batch)[:len(chunk)])
        return out

    @torch.inference_mode()
    def detect_language(self, features: torch.Tensor) -> list[str]:
        """Language codes from the target's logits after <|startoftranscript|> (slot 0 of a
        scratch cache is not needed: cross K/V are computed on the fly for the rows given)."""
        tok, dec = self.target.tokenizer, self.target.model.decoder
        B = features.shape[0]
        cache = DecoderCache.allocate(self.target.config, B, self.device, self.dtype)
        dec.fill_cross(cache, features)
        sot = torch.full((B, 1), tok.sot, device=self.device)
        logits = dec(sot, torch.zeros_like(sot), cache, kv_len=1)[:, 0].float()
        lang_ids = torch.tensor(list(tok.languages.values()), device=self.device)
        best = lang_ids[logits[:, lang_ids].argmax(dim=-1)]
        return [tok.language_code(int(t)) for t in best.tolist()]

    @torch.inference_mode()
    def admit(self, s: int, spec: SeqSpec, features: torch.Tensor, draft_mel: torch.Tensor | None) -> None:
        """Fill slot `s`: cross K/V, prompt prefill, the first generated token, the draft's start."""
        dec = self.target.model.decoder
        rows = self.cache_rows(self.cache, s)
        dec.fill_cross(rows, features[None])
        P = len(spec.prompt)
        prompt = torch.tensor([spec.prompt], device=self.device)
        hidden = dec.hidden(prompt, torch.arange(P, device=self.device)[None], rows, kv_len=P)
        self.host_options[s] = spec
        self.tokens[s, :P] = prompt[0]
        self.n_tokens[s], self.prompt_len[s] = P, P
        self.budget[s] = P + spec.max_new_tokens
        self.host_budget[s] = P + spec.max_new_tokens
        self.done[s] = False
        self.temperature[s], self.top_p[s], self.seed[s] = spec.temperature, spec.top_p, spec.seed
        self.timestamps[s], self.max_initial_ts[s] = spec.timestamps, spec.max_initial_timestamp
        self.plain[s] = spec.plain
        self.row_k[s] = spec.num_draft_tokens or 0
        for t in (self.sum_logprob, self.drafted, self.accepted_total, self.draft_passes):
            t[s] = 0
        self.target_passes[s] = 1
        if self.no_speech_id is not None:
            sot_logits = dec.logits(hidden[0, spec.sot_index]).float()
            self.no_speech[s] = sot_logits.softmax(-1)[self.no_speech_id]
        # the first token: the prompt's last position, as if it were a one-position verify pass
        slot = torch.tensor([s], device=self.device)
        first, logits = self.choose(hidden[:, -1:], slot, self.n_tokens[slot] - 1,
                                    Modes(spec.plain, not spec.plain, spec.timestamps,
                                          spec.temperature > 0), first=True)
        self.commit_target(slot, first, torch.ones(1, dtype=torch.long, device=self.device), logits)
        if self.drafter is not None:
            # the draft starts at the row's first drafting iteration (`start_drafts`): while the
            # adaptive k keeps speculation off, a draft with its own encoder costs nothing
            self.draft_on[s] = False
            self.dn[s] = self.dcached[s] = 0
            self.draft_pending[s] = (spec, features, draft_mel) if spec.use_draft else None

    def drafts_pending(self, B: int) -> bool:
        """Whether a row among the first B has a draft still to start."""
        return any(self.draft_pending[s] is not None for s in range(B))

    def start_drafts(self, B: int) -> int:
        """Start the draft of every row among the first B whose draft is pending -> how many
        started."""
        pending = [s for s in range(B) if self.draft_pending[s] is not None]
        for s in pending:
            self.start_draft(s, *self.draft_pending[s])
            self.draft_pending[s] = None
        return len(pending)

    @torch.inference_mode()
    def start_draft(self, s: int, spec: SeqSpec, features, draft_mel) -> None:
        """The draft's cross K/V (its own encoder pass unless it shares the target's), its prompt,
        and every token the target has emitted so far, spelled in draft ids (left uncached: the
        next draft call feeds them)."""
        d = self.drafter
        ddec = d.draft.model.decoder
        rows = self.cache_rows(self.dcache, s)
        dfeat = features[None] if d.shared_encoder else d.draft.model.encoder(draft_mel[None].to(self.device, self.dtype))
        ddec.fill_cross(rows, dfeat)
        dprompt = d.prompt(spec)
        P = len(dprompt)
        ddec.hidden(torch.tensor([dprompt], device=self.device), torch.arange(P, device=self.device)[None],
                    rows, kv_len=P)
        self.draft_passes[s] = 1
        self.dtokens[s, :P] = torch.tensor(dprompt, device=self.device)
        n = int(self.n_tokens[s])
        at = P
        for tok in self.tokens[s, int(self.prompt_len[s]):n].tolist():
            self.dtokens[s, at:at + self.t2d.shape[1]] = self.t2d[tok]
            at += int(self.t2d_len[tok])
        self.dn[s], self.dcached[s] = at, P
        self._host_dn_max = max(self._host_dn_max, at)  # the host's bound on draft lengths (kv_len)
        self.draft_on[s] = True
        self.draft_synced = False  # more than the catch-up width may be uncached

    # ---------------------------------------------------------------- choosing tokens
    def modes(self, B: int) -> Modes:
        """The paths the first B slots need (from the host's copy of the options: no device read)."""
        specs = [sp for sp in self.host_options[:B] if sp is not None]
        return Modes(any(sp.plain for sp in specs), any(not sp.plain for sp in specs),
                     any(sp.timestamps for sp in specs), any(sp.temperature > 0 for sp in specs))

    def choose(self, hidden: torch.Tensor, slots: torch.Tensor, index: torch.Tensor,
               modes: Modes, proposals: torch.Tensor | None = None, first: bool = False):
        """The target's choices [B, T] from hidden [B, T, d] of rows `slots` [B]; position t of row
        b predicts the token at index `index[b] + 1 + t` (`index` is the pending token's index).
        Also returns the logits [B, T, V] under Whisper's rules that full rows chose from (None
        when no row is full).

        A row's choice depends only on its own options, never on its batch neighbours: plain
        greedy rows use the exact screened head; the others the full logits under Whisper's
        rules, then the seeded race (temperature 0: the argmax). `first`: the pass may predict a
        row's first generated token (admission); a verify pass never does (each row's first token
        is chosen at admission), so its banned tokens are the same [V] at every position (no
        [B, T, V] mask: three vocabulary-wide ops a step, multithreaded on tiny data)."""
        B, T, _ = hidden.shape
        predicted = index[:, None] + 1 + torch.arange(T, device=self.device)  # [B, T]
        at_begin = predicted == self.prompt_len[slots][:, None]
        banned = self.suppress | (at_begin[..., None] & self.begin_suppress) if first else self.suppress
        logits = None
        choice = greedy_tokens(self.target, self.target.head, hidden, banned) if modes.any_plain else None
        if modes.any_full:
            raw = self.target.model.decoder.logits(hidden).float()
            logits = raw.masked_fill(banned, -float("inf"))
            rows = slots[:, None].expand(B, T).reshape(-1)
            if modes.any_timestamps:
                ruled = self.timestamp_rules(raw, slots, predicted, at_begin, proposals)
                logits = torch.where(self.timestamps[slots][:, None, None], ruled, logits)
            raced = sampling_race(logits.reshape(B * T, -1), self.temperature[rows], self.top_p[rows],
                                  self.seed[rows], predicted.reshape(-1), None).view(B, T)
            choice = raced if choice is None else torch.where(self.plain[slots][:, None], choice, raced)
        return choice, logits

    def timestamp_rules(self, logits, slots, predicted, at_begin, proposals) -> torch.Tensor:
        """Whisper's timestamp rules at every position [B, T] of a pass, each position given its
        own prefix: the row's tokens, then the proposals before it. Returns new logits."""
        B, T, V = logits.shape
        seq = self.tokens[slots]  # [B, L] (a copy)
        if proposals is not None and proposals.shape[1]:
            k = proposals.shape[1]
            at = self.n_tokens[slots][:, None] + torch.arange(k, device=self.device)
            seq.scatter_(1, at, proposals.clamp(min=0))
        tb = self.rule_tables.timestamp_begin
        start = self.prompt_len[slots][:, None]
        j = torch.arange(seq.shape[1], device=self.device)
        stamps = torch.where((seq >= tb) & (j[None] >= start), seq, -1).cummax(dim=1).values
        before = (predicted - 1).clamp(min=0)
        n_sampled = predicted - start
        last = seq.gather(1, before)
        penultimate = seq.gather(1, (predicted - 2).clamp(min=0))
        last_timestamp = torch.where(n_sampled > 0, stamps.gather(1, before), -1)
        rows = slots[:, None].expand(B, T)
        flat = lambda t: t.reshape(B * T)  # noqa: E731
        ruled = rules.apply_rules(logits.reshape(B * T, V).clone(), self.rule_tables, flat(at_begin),
                                  flat(self.timestamps[rows]), flat(n_sampled), flat(last), flat(penultimate),
                                  flat(last_timestamp), flat(self.max_initial_ts[rows]))
        return ruled.view(B, T, V)

    # ---------------------------------------------------------------- one iteration
    @torch.inference_mode()
    def draft(self, B: int, k: int, modes: Modes) -> None:
        """k proposals per row into `self.proposals[:B, :k]`, in target ids (-1: no usable proposal
        from there on)."""
        if not self.draft_synced:
            self.catch_up(B)
        if self.graphs is None:
            # the widest row's uncached tokens (a host read costs nothing on a CPU): a draft with
            # another vocabulary has a catch-up width of its longest spelling (17 for tiny.en
            # drafting base), almost always 1 or 2 tokens are uncached
            self.draft_step(B, k, modes, self.uncached_width(B) if self.trim else self.catchup)
            return
        R = self.pad_rows(B)
        self.graphs.run(("draft", R, k, modes), lambda: self.draft_step(R, k, modes, self.catchup), self.rewind)

    def draft_step(self, B: int, k: int, modes: Modes, width: int) -> torch.Tensor:
        """`draft` over the first B slots, feeding `width` draft positions first (graph-safe when
        `self.trim` is off) -> the proposals [B, k]."""
        d = self.drafter
        ddec = d.draft.model.decoder
        slots = torch.arange(B, device=self.device)
        dn = self.dn[:B]
        src = self.uncached_positions(B, width)  # [B, width]
        feed = self.dtokens[:B].gather(1, src)
        kv_len = min(int(self._host_dn_max) + k + 1, self.max_pos + 1) if self.trim else None
        hidden = ddec.hidden(feed, src, self.dcache_view(B), kv_len=kv_len)[:, -1:]
        raws = []
        for step in range(k):
            x = self.draft_choose(hidden, slots, self.n_tokens[:B] - 1 + step, modes, raws)  # [B]
            raws.append(x)
            if step + 1 < k:
                pos = (dn + step)[:, None]
                hidden = ddec.hidden(x[:, None], pos, self.dcache_view(B), kv_len=kv_len)
        self.draft_passes[:B] += k * self.draft_on[:B].long()
        raw = torch.stack(raws, dim=1)  # [B, k] draft ids
        self.raw[:B, :k] = raw
        self.dcached[:B] = dn + k - 1
        mapped = self.d2t[raw]
        usable = (mapped >= 0) & self.draft_on[:B, None] & (dn[:, None] + k <= self.max_pos)
        # a row with a fixed smaller k proposes only that many
        limit = torch.where(self.row_k[:B] > 0, self.row_k[:B], k)
        usable &= j_range(k, self.device)[None] < limit[:, None]
        usable = usable.long().cumprod(dim=1).bool()
        self.proposals[:B, :k] = torch.where(usable, mapped, NO_PROPOSAL)
        return self.proposals[:B, :k]

    def uncached_positions(self, B: int, width: int) -> torch.Tensor:
        """Draft positions [B, width] to feed: each row's uncached tokens, right-aligned; shorter
        rows repeat their first uncached position on the left (rewriting one slot with the same
        values), and a row with nothing uncached re-feeds its last token, whose output predicts
        the next one."""
        dn, start = self.dn[:B], self.uncached_start(B)
        j = torch.arange(width, device=self.device)
        return start[:, None] + (j[None] - (width - (dn - start)[:, None])).clamp(min=0)

    def uncached_start(self, B: int) -> torch.Tensor:
        """Each row's first draft position to feed [B] (a row without a draft, dn = 0, re-feeds slot 0)."""
        return torch.minimum(self.dcached[:B], self.dn[:B] - 1).clamp(min=0)

    def uncached_width(self, B: int) -> int:
        """The widest row's number of positions to feed (a host read; at least 1)."""
        return max(1, int((self.dn[:B] - self.uncached_start(B)).max()))

    def dcache_view(self, B: int) -> DecoderCache:
        return DecoderCache(*(t[:, :B] for t in self.dcache.buffers()))

    def draft_choose(self, hidden, slots, index, modes, raws) -> torch.Tensor:
        """The draft's proposal [B] from hidden [B, 1, d]: its greedy argmax, or its race winner
        under the target's noise (keyed by target ids) for sampled rows. A draft with the
        target's vocabulary follows the timestamp rules too, given its own proposals `raws` so
        far (another vocabulary only suppresses: its proposals are verified all the same)."""
        d = self.drafter
        banned = d.draft.suppress
        if not modes.any_sampled and not (modes.any_timestamps and d.vocab.identity):
            # every row greedy and no rules to follow (a plain row, or a long-form row at
            # temperature 0 drafted by another vocabulary, which only suppresses): the race at
            # temperature 0 is the argmax, which the draft's screened head gives without
            # computing its full logits (tiny.en's: 80 MB of float32 a step)
            return d.greedy(hidden, banned)[:, 0]
        raw = d.draft.model.decoder.logits(hidden[:, 0]).float()
        logits = raw.masked_fill(banned, -float("inf"))
        if modes.any_timestamps and d.vocab.identity:
            predicted = (index + 1)[:, None]
            at_begin = predicted == self.prompt_len[slots][:, None]
            prefix = torch.stack(raws, dim=1) if raws else None
            ruled = self.timestamp_rules(raw[:, None], slots, predicted, at_begin, prefix)[:, 0]
            logits = torch.where(self.timestamps[slots][:, None], ruled, logits)
        if self.sampling_rule == "rejection":
            self.draft_logits[:hidden.shape[0], len(raws)] = logits
        return sampling_race(logits, self.temperature[slots], self.top_p[slots], self.seed[slots],
                             index + 1, self.noise_ids)

    def catch_up(self, B: int) -> None:
        """Feed every row's uncached draft tokens (after iterations without drafting)."""
        ddec = self.drafter.draft.model.decoder
        dn, dc = self.dn[:B], self.dcached[:B]
        src = self.uncached_positions(B, self.uncached_width(B))
        ddec.hidden(self.dtokens[:B].gather(1, src), src, self.dcache_view(B))
        self.dcached[:B] = torch.maximum(dn - 1, dc)
        self.draft_passes[:B] += self.draft_on[:B].long()  # rows whose draft runs
        self.draft_synced = True

    @torch.inference_mode()
    def verify_accept_commit(self, B: int, k: int, modes: Modes) -> None:
        """One target pass over each row's pending token and its k proposals (`draft`), the
        accepted prefix and the correction or bonus token appended, the draft's state kept in step."""
        shared = self.shared_sampling(B) if k > 0 and modes.any_full and self.sampling_rule == "rejection" else None
        if self.graphs is None:
            self.verify_step(B, k, modes, shared)
        else:
            R = self.pad_rows(B)
            self.graphs.run(("verify", R, k, modes, shared), lambda: self.verify_step(R, k, modes, shared),
                            self.rewind)
        if k == 0 and self.drafter is not None:
            self.draft_synced = False  # the draft did not follow this pass's token

    def shared_sampling(self, B: int) -> tuple[float, float] | None:
        """(temperature, top_p) as float32 values when every sampled row among the first B has
        them (rejection sampling then runs the fused kernels), else None (host copy of options)."""
        params = {(sampling.f32(sp.temperature), sampling.f32(sp.top_p)) for sp in self.host_options[:B]
                  if sp is not None and sp.temperature > 0}
        return params.pop() if len(params) == 1 else None

    def verify_step(self, B: int, k: int, modes: Modes,
                    shared: tuple[float, float] | None = None) -> torch.Tensor:
        """`verify_accept_commit` over the first B slots -> the new lengths [B]. `shared`: see
        `shared_sampling` (rejection mode)."""
        dec = self.target.model.decoder
        proposals = self.proposals[:B, :k] if k > 0 else None
        slots = torch.arange(B, device=self.device)
        n = self.n_tokens[:B]
        pending = self.tokens[:B].gather(1, (n - 1)[:, None])  # [B, 1]
        feed = pending if k == 0 else torch.cat([pending, proposals.clamp(min=0)], dim=1)
        pos = (n - 1)[:, None] + torch.arange(k + 1, device=self.device)
        kv_len = min(int(self._host_n_max) + k + 1, self.max_pos + 1) if self.trim else None
        hidden = dec.hidden(feed, pos, DecoderCache(*(t[:, :B] for t in self.cache.buffers())), kv_len=kv_len)
        choice, logits = self.choose(hidden, slots, n - 1, modes, proposals)  # [B, k+1]
        self.target_passes[:B] += 1
        if k == 0:
            n_acc = torch.zeros(B, dtype=torch.long, device=self.device)
        else:
            n_acc = (proposals == choice[:, :k]).long().cumprod(dim=1).sum(dim=1)
            if self.sampling_rule == "rejection" and modes.any_full:
                d2t = None if self.drafter.vocab.identity else self.d2t
                emitted, accepted = accept_by_rejection(
                    logits, self.draft_logits[:B, :k], proposals, choice, d2t, self.temperature[:B],
                    self.top_p[:B], self.seed[:B], n - 1, shared)
                sampled = self.temperature[:B] > 0  # greedy rows keep their argmax choices
                choice = torch.where(sampled[:, None], emitted, choice)
                n_acc = torch.where(sampled, accepted, n_acc)
            valid = (proposals >= 0).sum(dim=1)
            live = ~self.done[:B]
        emitted = self.commit_target(slots, choice, n_acc + 1, logits)
        if k > 0:
            # proposals past a row's end (EOT or budget) were never needed: not counted
            self.drafted[:B] += torch.where(live, torch.where(self.done[:B], torch.minimum(valid, emitted), valid), 0)
            accepted = torch.minimum(n_acc, emitted)
            self.accepted_total[:B] += torch.where(live, accepted, 0)
            self.accepted_now[:B] = torch.where(live, accepted, -1)
        else:
            self.accepted_now[:B] = torch.where(~self.done[:B], 0, -1)
        if self.drafter is not None:
            self.commit_draft(B, k, n_acc)
        return self.n_tokens[:B]

    def commit_target(self, slots, choice: torch.Tensor, n_emit: torch.Tensor,
                      logits: torch.Tensor | None) -> torch.Tensor:
        """Append the first `n_emit` choices of each row (cut at EOT and the budget) -> the number
        appended [B]; their log-probabilities under `logits` [B, T, V] (full rows; None: none)
        add to the rows' sums. Done rows append nothing."""
        B, T = choice.shape
        n = self.n_tokens[slots]
        t = torch.arange(T, device=self.device)
        is_eot = (choice == self.eot) & (t[None] < n_emit[:, None])
        first_eot = torch.where(is_eot.any(1), is_eot.long().argmax(1) + 1, T + 1)
        m = torch.minimum(torch.minimum(n_emit, first_eot), self.budget[slots] - n)
        m = torch.where(self.done[slots], 0, m.clamp(min=0))
        keep = t[None] < m[:, None]
        idx = n[:, None] + t[None]
        old = self.tokens[slots].gather(1, idx)
        self.tokens[slots[:, None], idx] = torch.where(keep, choice, old)
        if logits is not None:
            lp = torch.log_softmax(logits, dim=-1).gather(2, choice[..., None]).squeeze(2).double()  # [B, T]
            self.sum_logprob[slots] += torch.where(keep, lp, 0.0).sum(1)
        n_new = n + m
        self.n_tokens[slots] = n_new
        last = self.tokens[slots].gather(1, (n_new - 1)[:, None])[:, 0]
        self.done[slots] |= (last == self.eot) | (n_new >= self.budget[slots])
        return m

    def commit_draft(self, B: int, k: int, n_acc: torch.Tensor) -> None:
        """Keep the accepted drafts' cache entries, append the correction/bonus token spelled in
        draft ids, drop the rest by shortening the length."""
        dn = self.dn[:B]
        rows = torch.arange(B, device=self.device)[:, None]
        if k > 0:
            self.dtokens[rows, dn[:, None] + j_range(k, self.device)] = self.raw[:B, :k]
            self.dcached[:B] = torch.minimum(self.dcached[:B], dn + n_acc)
        last = self.tokens[:B].gather(1, (self.n_tokens[:B] - 1)[:, None])[:, 0]
        W = self.t2d.shape[1]
        base = dn + n_acc
        self.dtokens[rows, base[:, None] + j_range(W, self.device)] = self.t2d[last]
        new_dn = base + self.t2d_len[last]
        self.dn[:B] = torch.where(self.done[:B] | ~self.draft_on[:B], dn, new_dn)

    @torch.inference_mode()
    def align(self, slots: list[int], requests: list) -> list[tuple[torch.Tensor, list[float]]]:
        """The alignment pass (word timestamps) of the windows in `slots`, one batch over the
        cross-attention K/V they hold -> per window (the alignment heads' cross-attention logits,
        its text tokens' probabilities); see alignment.py."""
        from .alignment import alignment_pass

        idx = torch.tensor(slots, device=self.device)
        return alignment_pass(self.target.model.decoder, requests, self.cache.cross_k[:, idx],
                              self.cache.cross_v[:, idx], self.target.alignment_heads, self.eot)

    # ---------------------------------------------------------------- host view
    def progress(self, B: int) -> Progress:
        """The one small read the host makes per iteration (one [4, B] tensor)."""
        dn = self.dn[:B] if self.drafter is not None else self.n_tokens[:B]
        done, n, accepted, draft_len = torch.stack([self.done[:B].long(), self.n_tokens[:B],
                                                    self.accepted_now[:B], dn]).tolist()
        if B:
            self._host_n_max, self._host_dn_max = max(n), max(draft_len)
            self.host_n[:B] = n
        return Progress([bool(d) for d in done], n, accepted, draft_len)

    def output(self, s: int) -> SeqOutput:
        n, P = int(self.n_tokens[s]), int(self.prompt_len[s])
        tokens = self.tokens[s, P:n].tolist()
        if tokens and tokens[-1] == self.eot:
            tokens = tokens[:-1]
        return SeqOutput(tokens, n - P, float(self.sum_logprob[s]), float(self.no_speech[s]), int(self.drafted[s]),
                         int(self.accepted_total[s]), int(self.target_passes[s]), int(self.draft_passes[s]))


def j_range(n: int, device) -> torch.Tensor:
    return torch.arange(n, device=device)


def sampling_race(logits, temperature, top_p, seed, position, noise_ids):
    """Per row: the argmax at temperature 0, else the winner of the exponential race
    argmax(p / E) with E keyed by (seed, position, token id) (`ops.race_sample`)."""
    return ops.race_sample(logits, temperature, top_p, seed, position, noise_ids)

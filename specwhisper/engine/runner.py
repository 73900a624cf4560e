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

Where things are: the per-slot state is declared once in slots.py (`SlotState`: tokens [S, L]
target ids, prompt then generated; n_tokens [S], the pending token being tokens[n_tokens - 1] at
position n_tokens - 1 with the cache holding positions < n_tokens - 1; budget, done, per-row
options, statistics; the draft's dtokens, dn, dcached; `HostSlot`: the host's record of a slot).
Choosing a token under Whisper's rules is choosing.py (`choose_tokens`, shared with the draft);
the draft's half of an iteration is drafting.py (`DraftSide`); what depends on the device
(trimming, encoder batches, cache dtypes) is the backend's (backends/). This module keeps the
slots' lifecycle (admission, moving a row, the output), the target's verify-accept-commit step,
the orchestration of the draft step, and the host's one small read per iteration (`progress`:
done flags, lengths, acceptances).

Graph-shaped path (`graphs` given; CUDA graphs on a GPU, the same code eagerly on a CPU): `draft(k)`
and `verify_accept_commit(k)` run over a power-of-two *bucket* of rows, the live rows then inert
padding rows (done, no draft: they append nothing), with fixed shapes (the full cache width, the
fixed catch-up width), inputs and outputs in static buffers, and no host read inside; one graph per
(step, bucket, k, modes), its warm-up rewound by `SlotState.rewind`. Without `graphs` (the CPU
default) the steps run over exactly the live rows and, where the backend says so, trim the attended
width to the longest row (host mirrors of the lengths).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import sampling
from ..backends import backend_for, cpu_ops
from ..constants import MAX_DRAFT_TOKENS as MAX_K
from ..model.head import ScreenedHead
from ..model.whisper import DecoderCache
from . import rules
from .choosing import Modes, Rows, choose_ruled_greedy, choose_tokens, kept_logprob
from .draft import Drafter, greedy_tokens
from .drafting import DraftSide
from .graphs import StepGraphs
from .rejection import accept_by_rejection
from .slots import HostSlot, SeqOutput, SeqSpec, SlotState


class Progress(NamedTuple):
    """The host's one read per iteration, per live row."""

    done: list[bool]
    n_tokens: list[int]
    accepted: list[int]  # accepted drafts this iteration (-1: none proposed)
    draft_len: list[int]  # the draft's sequence length (n_tokens without a draft)



def same_window(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two windows' mels hold the same values: the same memory, or equal elements (zeros of
    the same sign)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return bool(torch.equal(a, b)) and bool(torch.equal(a.signbit(), b.signbit()))


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
        self.backend = backend_for(device)
        self.graphs = graphs
        cfg = target.config
        self.max_pos = cfg.max_target_positions  # 448
        S, L = (bucket_size(max_batch) if graphs is not None else max_batch), self.max_pos + 2 * MAX_K + 8
        self.cache = DecoderCache.allocate(cfg, S, device, dtype)
        self.caches = [self.cache]  # per-slot KV caches (the draft's too), moved with their rows
        sides = set() if drafter is None else {"draft"} | ({"rejection"} if sampling_rule == "rejection" else set())
        sizes = {"L": L, "K": MAX_K, "V": drafter.draft.config.vocab_size if drafter else 0, "D": cfg.d_model}
        self.state = SlotState.allocate(S, sizes, sides, device)
        self.slot_ids = torch.arange(max(S, MAX_K + 1), device=device)  # slices of it: slots 0..B-1, offsets 0..k
        self.hosts = [HostSlot() for _ in range(S)]
        self.suppress = target.suppress  # [V] bool
        self.begin_suppress = target.begin_suppress
        tok = target.tokenizer
        self.eot = tok.eot
        self.no_speech_id = next((i for i in (tok.backend.token_to_id("<|nospeech|>"),
                                              tok.backend.token_to_id("<|nocaptions|>")) if i is not None), None)
        # attend only up to the longest row, feed only the uncached draft tokens (host reads;
        # CPU: measurably faster); the graph-shaped path keeps fixed shapes instead
        self.trim = self.backend.trim_width and graphs is None
        self.rule_tables = rules.RuleTables.build(target.tokenizer, cfg.vocab_size, device)
        self._host_n_max = self.max_pos  # host mirror of the longest row, refreshed by progress()
        self.draft_side: DraftSide | None = None
        if drafter is not None:
            self.draft_side = DraftSide(drafter, self.state, S, device, dtype, self.backend, self.rule_tables,
                                        sampling_rule, self.trim, self.cache)
            self.caches.append(self.draft_side.cache)

    # ---------------------------------------------------------------- slots
    def move(self, src: int, dst: int) -> None:
        """Copy slot `src` into slot `dst` (compaction after `dst` was freed)."""
        self.state.move(src, dst)
        for cache in self.caches:
            for t in cache.buffers():
                t[:, dst] = t[:, src]
        self.hosts[dst], self.hosts[src] = self.hosts[src], HostSlot()

    def pad_rows(self, B: int) -> int:
        """The bucket of B live rows (graph-shaped path); rows B.. of it are made inert (done, no
        draft): they append nothing, and whatever they compute is never read."""
        R = bucket_size(B)
        if R > B:
            self.state.done[B:R] = True
            if self.drafter is not None:
                self.state.draft_on[B:R] = False
        return R

    # ---------------------------------------------------------------- admission
    @torch.inference_mode()
    def encode(self, mels: torch.Tensor) -> torch.Tensor:
        """mel [B, n_mels, 3000] -> target encoder output [B, 1500, d]."""
        return self.target.model.encoder(mels.to(self.device, self.dtype))

    def encode_windows(self, mels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Encoder outputs [1500, d] of windows' mels [n_mels, 3000], each independent of the
        others: a batched GEMM may round a row differently beside other rows, so windows are
        encoded in calls of always the backend's `encoder_batch` windows (zero-padded; one at a
        time on the CPU, where the encoder is compute-bound and batching gains nothing). So a
        window equal to one before it in the same call (one clip sampled several times, as a
        batch of the same mel) is encoded once: its output is that window's, bit for bit."""
        unique, index = [], []
        for m in mels:
            j = next((i for i, u in enumerate(unique) if same_window(u, m)), len(unique))
            if j == len(unique):
                unique.append(m)
            index.append(j)
        n = self.backend.encoder_batch
        out = []
        for i in range(0, len(unique), n):
            chunk = unique[i:i + n]
            batch = torch.zeros(n, *chunk[0].shape, device=self.device, dtype=self.dtype)
            for j, m in enumerate(chunk):
                batch[j] = m
            out += list(self.encode(batch)[:len(chunk)])
        return [out[j] for j in index]

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

    def admits_together(self) -> bool:
        """Whether windows whose prompts are the same length can be admitted in one prefill: only
        where the decoder's rows are computed independently of each other (the C++ decode ops, the
        GPU decode ops), so a row's bits never depend on the rows admitted beside it. Elsewhere
        (torch's ops: a GEMM's rounding may depend on its shape) one window at a time."""
        return self.admit_together and self.target.model.decoder.rows_independent()

    admit_together = True  # False: always one window at a time (the reference, for tests)

    @torch.inference_mode()
    def admit(self, s: int, specs: list[SeqSpec], features: list[torch.Tensor],
              draft_mels: list[torch.Tensor | None]) -> None:
        """Fill slots s, s + 1, ... with windows whose prompts are all one length: cross K/V (one
        window at a time), one prompt prefill for them all, their first generated tokens, their
        drafts' start. One prefill instead of one a window: on a GPU an eager pass of large-v3 is
        ≈ 800 kernel launches (17 ms) whatever its rows, 30% of 64 concurrent long-form requests'
        time admitted one by one (bench/measured/gpu-h200.md); on a CPU the weights stream once."""
        n, P = len(specs), len(specs[0].prompt)
        if any(len(sp.prompt) != P for sp in specs) or not len(features) == len(draft_mels) == n:
            raise ValueError("admit: one spec, features and draft mel a window, every prompt one length")
        if n > 1 and not self.admits_together():
            raise ValueError("admit: this decoder does not compute its rows independently; admit one window at a time")
        dec = self.target.model.decoder
        rows = DecoderCache(*(t[:, s:s + n] for t in self.cache.buffers()))
        dec.fill_cross(rows, torch.stack(features))
        prompt = torch.tensor([sp.prompt for sp in specs], device=self.device)
        # only the positions from the start-of-transcript token on are read (its no-speech
        # probability, the first token): the last layer skips the previous text's rest
        keep = max(P - sp.sot_index for sp in specs) if self.no_speech_id is not None else 1
        positions = torch.arange(P, device=self.device)[None].repeat(n, 1)
        hidden = dec.hidden(prompt, positions, rows, kv_len=P, keep=keep)
        st = self.state
        for i, sp in enumerate(specs):
            st.admit(s + i, sp, P)
            # the draft starts at the row's first drafting iteration (`start_drafts`): while the
            # adaptive k keeps speculation off, a draft with its own encoder costs nothing
            pending = (sp, features[i], draft_mels[i]) if self.drafter is not None and sp.use_draft else None
            self.hosts[s + i] = HostSlot(sp, P, P + sp.max_new_tokens, pending)
        st.tokens[s:s + n, :P] = prompt
        if self.no_speech_id is not None:
            at = torch.tensor([sp.sot_index - (P - hidden.shape[1]) for sp in specs], device=self.device)
            sot_logits = dec.logits(hidden[torch.arange(n, device=self.device), at]).float()
            st.no_speech[s:s + n] = sot_logits.softmax(-1)[:, self.no_speech_id]
        # the first tokens: the prompts' last position, as if it were a one-position verify pass
        slots = torch.arange(s, s + n, device=self.device)
        first, logits = self.choose(hidden[:, -1:], slots, st.n_tokens[slots] - 1, self.modes_of(specs), first=True)
        self.commit_target(slots, first, torch.ones(n, dtype=torch.long, device=self.device), logits, hidden[:, -1:])

    def pending_generated(self, B: int) -> float | None:
        """Tokens generated so far by the rows among the first B whose draft is still to start
        (their mean; None: no such row)."""
        rows = [h.n - len(h.spec.prompt) for h in self.hosts[:B] if h.draft_pending is not None]
        return sum(rows) / len(rows) if rows else None

    def draft_in_step(self, B: int, k: int) -> bool:
        """Whether a pass over the first B slots with k proposals commits to the draft's state too
        (`DraftSide.commit`): a plain pass keeps running drafts in step; while no row's draft has
        started (the adaptive k keeps speculation off), there is nothing to keep: a dozen small ops
        a token saved (≈ 0.1 ms, ≈ 2% of base's step; a captured step keeps them all)."""
        return self.draft_side is not None and (k > 0 or self.graphs is not None or self.drafts_running(B))

    def drafts_running(self, B: int) -> bool:
        """Whether a live row among the first B has started its draft (the host's copy)."""
        return any(h.spec is not None and h.spec.use_draft and h.draft_pending is None for h in self.hosts[:B])

    def start_drafts(self, B: int) -> int:
        """Start the draft of every row among the first B whose draft is pending -> how many
        started."""
        pending = [s for s in range(B) if self.hosts[s].draft_pending is not None]
        for s in pending:
            self.draft_side.start(s, *self.hosts[s].draft_pending)
            self.hosts[s].draft_pending = None
        return len(pending)

    # ---------------------------------------------------------------- choosing tokens
    def specs(self, B: int) -> list[SeqSpec]:
        """The options of the sequences in the first B slots (the host's copy)."""
        return [h.spec for h in self.hosts[:B] if h.spec is not None]

    def modes(self, B: int) -> Modes:
        """The paths the first B slots need (from the host's copy of the options: no device read)."""
        return self.modes_of(self.specs(B))

    def modes_of(self, specs: list[SeqSpec]) -> Modes:
        """Greedy rows under the timestamp rules choose through the screened head when the target
        has one (`choose_ruled_greedy`), else from full logits like sampled rows."""
        screened = self.target.head is not None
        return Modes(any(sp.plain for sp in specs),
                     any(sp.temperature > 0 or (sp.ruled_greedy and not screened) for sp in specs),
                     any(sp.timestamps for sp in specs), any(sp.temperature > 0 for sp in specs),
                     screened and any(sp.ruled_greedy for sp in specs),
                     any(sp.need_logprobs and sp.temperature == 0 for sp in specs))

    def choose(self, hidden: torch.Tensor, slots: torch.Tensor, index: torch.Tensor,
               modes: Modes, proposals: torch.Tensor | None = None, first: bool = False):
        """The target's choices [B, T] from hidden [B, T, d] of rows `slots` [B]; position t of row
        b predicts the token at index `index[b] + 1 + t` (`index` is the pending token's index).
        Also returns the logits [B, T, V] under Whisper's rules that full rows chose from (None
        when no row is full).

        A row's choice depends only on its own options, never on its batch neighbours: plain
        greedy rows use the exact screened head, greedy rows under the timestamp rules the
        screened head's `timestamp_argmax` (`choose_ruled_greedy`, when the target has a screened
        head); the others `choose_tokens` (the full logits under Whisper's rules, then the seeded
        race; temperature 0: the argmax). `first`: the
        pass may predict a row's first generated token (admission); a verify pass never does
        (each row's first token is chosen at admission), so its banned tokens are the same [V] at
        every position (no [B, T, V] mask: three vocabulary-wide ops a step, multithreaded on
        tiny data)."""
        T = hidden.shape[1]
        if not first and modes.any_plain and not (modes.any_ruled or modes.any_full):  # every row plain greedy
            return greedy_tokens(self.target, self.target.head, hidden, self.suppress), None
        rows = Rows(self.state, slots, index[:, None] + 1 + torch.arange(T, device=self.device), proposals)
        logits_fn = self.target.model.decoder.logits
        if modes.any_ruled and not (modes.any_plain or modes.any_full):  # every row ruled greedy (a long-form step)
            return choose_ruled_greedy(self.target.head, logits_fn, hidden, rows, self.rule_tables), None
        banned = rows.banned_first(self.suppress, self.begin_suppress) if first else self.suppress
        greedy, timestamps = self.state.temperature[slots] == 0, self.state.timestamps[slots]
        choice = greedy_tokens(self.target, self.target.head, hidden, banned) if modes.any_plain else None
        if modes.any_ruled:
            ruled = greedy & timestamps
            if choice is None and bool(ruled.all()):
                choice = choose_ruled_greedy(self.target.head, logits_fn, hidden, rows, self.rule_tables)
            else:
                sel = ruled.nonzero()[:, 0]
                picked = choose_ruled_greedy(self.target.head, logits_fn, hidden[sel], rows.subset(sel), self.rule_tables)
                choice = torch.zeros(hidden.shape[:2], dtype=torch.long, device=self.device) if choice is None else choice
                choice[sel] = picked
        if not modes.any_full:
            return choice, None
        raced, logits = choose_tokens(logits_fn, hidden, banned, rows, self.rule_tables, modes.any_timestamps)
        if choice is None:
            return raced, logits
        screened = greedy & (~timestamps | modes.any_ruled)  # SeqSpec.plain, or ruled_greedy when screened
        return torch.where(screened[:, None], choice, raced), logits

    # ---------------------------------------------------------------- one iteration
    @torch.inference_mode()
    def sync_draft(self, B: int) -> None:
        """Feed the draft the tokens it has not seen (after iterations without drafting)."""
        if not self.draft_side.synced:
            self.draft_side.catch_up(B)

    @torch.inference_mode()
    def draft(self, B: int, k: int, modes: Modes) -> int:
        """Up to k proposals per row into `state.proposals[:B, :k]`, in target ids (-1: no usable
        proposal from there on): `DraftSide.propose`, eagerly over the live rows or graph-shaped
        -> the proposals' columns the verify pass needs (eager: the draft steps run; an adaptive
        row's draft may stop early, `DraftSide.stop_margin`; graph-shaped: k)."""
        side = self.draft_side
        self.sync_draft(B)  # done already by `Speculation.begin`, outside the iteration's clock
        if self.graphs is None:
            # the widest row's uncached tokens (a host read costs nothing on a CPU): a draft with
            # another vocabulary has a catch-up width of its longest spelling (17 for tiny.en
            # drafting base), almost always 1 or 2 tokens are uncached
            return side.propose(B, k, modes, None if self.trim else side.catchup)
        R = self.pad_rows(B)

        def step() -> torch.Tensor:  # a graph's outputs are tensors: the proposals (every k drafted)
            side.propose(R, k, modes, side.catchup)
            return self.state.proposals[:R, :k]
        self.graphs.run(("draft", R, k, modes), step, self.state.rewind)
        return k

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
                            self.state.rewind)
        if k == 0 and self.draft_side is not None:
            self.draft_side.synced = False  # the draft did not follow this pass's token

    def shared_sampling(self, B: int) -> tuple[float, float] | None:
        """(temperature, top_p) as float32 values when every sampled row among the first B has
        them (rejection sampling then runs the fused kernels), else None (host copy of options)."""
        params = {(sampling.f32(sp.temperature), sampling.f32(sp.top_p)) for sp in self.specs(B)
                  if sp.temperature > 0}
        return params.pop() if len(params) == 1 else None

    def verify_step(self, B: int, k: int, modes: Modes,
                    shared: tuple[float, float] | None = None) -> torch.Tensor:
        """`verify_accept_commit` over the first B slots -> the new lengths [B]. `shared`: see
        `shared_sampling` (rejection mode)."""
        dec = self.target.model.decoder
        kv_len = min(int(self._host_n_max) + k + 1, self.max_pos + 1) if self.trim else None
        cache = DecoderCache(*(t[:, :B] for t in self.cache.buffers()))
        if self.trim and shared is None and self.greedy_fused(modes):
            # all of the below for plain greedy rows in one C++ call: the same tokens and state
            cpu_ops.verify_greedy(dec, self.target.head, self.suppress, cache, dec.slots(kv_len), self.state, B, k,
                                  self.eot, self.draft_side if self.draft_in_step(B, k) else None)
            return self.state.n_tokens[:B]
        proposals = self.state.proposals[:B, :k] if k > 0 else None
        slots = self.slot_ids[:B]
        last = (self.state.n_tokens[:B] - 1)[:, None]  # [B, 1] the pending token's index and position
        pending = self.state.tokens[:B].gather(1, last)  # [B, 1]
        feed = pending if k == 0 else torch.cat([pending, proposals.clamp(min=0)], dim=1)
        pos = last if k == 0 else last + self.slot_ids[:k + 1]
        hidden = dec.hidden(feed, pos, cache, kv_len=kv_len, check=False)  # checked at the windows' start
        choice, logits = self.choose(hidden, slots, last[:, 0], modes, proposals)  # [B, k+1]
        if logits is None and self.trim and self.fused_greedy and cpu_ops.active(choice):
            # greedy rows (the timestamp rules' too): the rest below in one C++ call, the same state
            cpu_ops.accept_greedy(self.state, choice, hidden if modes.keep_hidden else None, k, self.eot,
                                  self.draft_side if self.draft_in_step(B, k) else None)
            return self.state.n_tokens[:B]
        self.state.target_passes[:B] += 1
        if k == 0:
            n_acc = torch.zeros(B, dtype=torch.long, device=self.device)
        else:
            n_acc = (proposals == choice[:, :k]).long().cumprod(dim=1).sum(dim=1)
            if self.sampling_rule == "rejection" and modes.any_full:
                d2t = None if self.drafter.vocab.identity else self.draft_side.d2t
                emitted, accepted = accept_by_rejection(
                    logits, self.state.draft_logits[:B, :k], proposals, choice, d2t, self.state.temperature[:B],
                    self.state.top_p[:B], self.state.seed[:B], last[:, 0], shared)
                sampled = self.state.temperature[:B] > 0  # greedy rows keep their argmax choices
                choice = torch.where(sampled[:, None], emitted, choice)
                n_acc = torch.where(sampled, accepted, n_acc)
            valid = (proposals >= 0).sum(dim=1)
            live = ~self.state.done[:B]
        emitted = self.commit_target(slots, choice, n_acc + 1, logits, hidden if modes.keep_hidden else None)
        if k > 0:
            # proposals past a row's end (EOT or budget) were never needed: not counted
            self.state.drafted[:B] += torch.where(live, torch.where(self.state.done[:B], torch.minimum(valid, emitted), valid), 0)
            accepted = torch.minimum(n_acc, emitted)
            self.state.accepted_total[:B] += torch.where(live, accepted, 0)
            self.state.accepted_now[:B] = torch.where(live, accepted, -1)
        else:
            self.state.accepted_now[:B] = torch.where(~self.state.done[:B], 0, -1)
        if self.draft_in_step(B, k):
            self.draft_side.commit(B, k, n_acc)
        return self.state.n_tokens[:B]

    # False: greedy passes take `verify_step`'s Python form (the spec of `greedy_fused` and of
    # `cpu_ops.accept_greedy`)
    fused_greedy = True

    def greedy_fused(self, modes: Modes) -> bool:
        """A pass of plain greedy rows only (no log-probabilities kept) runs as one C++ call
        (`cpu_ops.verify_greedy`): the target's exact screened head, its steps one C++ call each."""
        head = self.target.head
        return (self.fused_greedy and modes.any_plain and not (modes.any_ruled or modes.any_full or modes.keep_hidden)
                and isinstance(head, ScreenedHead) and head.packed is not None and cpu_ops.active(head.weight)
                and self.target.model.decoder.cpu_fused())

    def commit_target(self, slots, choice: torch.Tensor, n_emit: torch.Tensor,
                      logits: torch.Tensor | None, hidden: torch.Tensor | None) -> torch.Tensor:
        """Append the first `n_emit` choices of each row (cut at EOT and the budget) -> the number
        appended [B]; the sampled rows' log-probabilities under `logits` [B, T, V] (full rows;
        None: none) add to their sums, and the decoder output `hidden` [B, T, d] that predicted
        each appended token is kept (a greedy row's log-probabilities, `greedy_logprob`; None: no
        row of the pass wants them). Done rows append nothing."""
        st = self.state
        if hidden is None and logits is None:
            return cpu_ops.commit_tokens(st.tokens, st.n_tokens, st.done, st.budget, slots, choice, n_emit, self.eot)
        t = torch.arange(choice.shape[1], device=self.device)[None]
        idx = st.n_tokens[slots][:, None] + t  # where the pass's tokens go (read before the append)
        m = cpu_ops.commit_tokens(st.tokens, st.n_tokens, st.done, st.budget, slots, choice, n_emit, self.eot)
        keep = t < m[:, None]
        if hidden is not None:
            st.hidden[slots[:, None], idx] = torch.where(keep[..., None], hidden.float(), st.hidden[slots[:, None], idx])
        if logits is not None:
            lp = torch.log_softmax(logits, dim=-1).gather(2, choice[..., None]).squeeze(2).double()  # [B, T]
            sampled = st.temperature[slots] > 0
            st.sum_logprob[slots] += torch.where(keep & sampled[:, None], lp, 0.0).sum(1)
        return m

    @torch.inference_mode()
    def align(self, slots: list[int], requests: list) -> list[tuple[torch.Tensor, list[float]]]:
        """The alignment passes (word timestamps) of the windows in `slots`, over the
        cross-attention K/V they hold -> per window (the alignment heads' cross-attention logits,
        its text tokens' probabilities); see longform/alignment.py."""
        from ..longform.alignment import alignment_pass

        return alignment_pass(self.target.model.decoder, requests, self.cache.cross_k, self.cache.cross_v,
                              self.target.alignment_heads, self.eot, rows=slots)

    # ---------------------------------------------------------------- host view
    def progress(self, B: int) -> Progress:
        """The one small read the host makes per iteration (one [4, B] tensor)."""
        dn = self.state.dn[:B] if self.drafter is not None else self.state.n_tokens[:B]
        done, n, accepted, draft_len = torch.stack([self.state.done[:B].long(), self.state.n_tokens[:B],
                                                    self.state.accepted_now[:B], dn]).tolist()
        if B:
            self._host_n_max = max(n)
            if self.draft_side is not None:
                self.draft_side.host_len_max = max(draft_len)
            for h, n_s in zip(self.hosts, n):
                h.n = n_s
        return Progress([bool(d) for d in done], n, accepted, draft_len)

    def output(self, s: int) -> SeqOutput:
        n, P = int(self.state.n_tokens[s]), int(self.state.prompt_len[s])
        tokens = self.state.tokens[s, P:n].tolist()
        if tokens and tokens[-1] == self.eot:
            tokens = tokens[:-1]
        out = SeqOutput(tokens, n - P, **self.state.outputs(s))
        spec = self.hosts[s].spec
        if spec is not None and spec.need_logprobs and spec.temperature == 0:
            out.sum_logprob += self.greedy_logprob(s)
        return out

    @torch.inference_mode()
    def greedy_logprob(self, s: int) -> float:
        """The sum of slot `s`'s generated tokens' log-probabilities, a greedy row's
        (`choosing.kept_logprob`: its passes skipped the full head)."""
        return kept_logprob(self.state, s, self.target.model.decoder.logits, self.dtype, self.suppress,
                            self.begin_suppress, self.rule_tables)


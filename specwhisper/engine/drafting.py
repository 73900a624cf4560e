"""The draft side of the runner: the draft's KV cache over the same slots, the token tables between
the two vocabularies, and the draft's part of an iteration: start a row's draft, catch up with the
target's tokens, propose k tokens, and keep in step after the verify pass. The runner owns the
slots (`SlotState`: dtokens, dn, dcached, draft_on, raw, proposals) and runs the iteration; the
glossary is in runner.py.

A row's draft sequence (`dtokens[:dn]`) is its own prompt, then the target's tokens spelled in
draft ids; the first `dcached` of them are in the draft's cache, and each draft call feeds the
rest first (`uncached_positions`).
"""
from __future__ import annotations

import torch

from ..backends import cpu_ops, ops
from ..constants import NO_PROPOSAL
from ..model.whisper import DecoderCache
from .choosing import Modes, Rows, choose_tokens
from .draft import Drafter, pool_positions
from .rules import RuleTables
from .slots import SeqSpec, SlotState


class DraftSide:
    def __init__(self, drafter: Drafter, state: SlotState, slots: int, device, dtype, backend,
                 rule_tables: RuleTables, sampling_rule: str, trim: bool, target_cache: DecoderCache):
        """`trim`: feed only the widest row's uncached tokens and attend up to the longest draft
        (host reads; the eager path), else fixed shapes (the graph-shaped path). `target_cache`:
        the target's, whose cross K/V a draft with `Drafter.cross_sources` copies."""
        d = self.drafter = drafter
        self.state, self.device, self.dtype, self.target_cache = state, device, dtype, target_cache
        self.rule_tables, self.sampling_rule, self.trim = rule_tables, sampling_rule, trim
        self.max_pos = d.target.config.max_target_positions
        # a compact CPU draft sharing the target's encoder attends over the means of `pool`
        # adjacent audio positions (half its cross K/V bytes, read every draft step); only its
        # proposals change (`Drafter.cross_pool`)
        self.pool = d.cross_pool(dtype)
        self.cache = DecoderCache.allocate(d.draft.config, slots, device, dtype,
                                           backend.draft_cross_dtype(d.draft.model.decoder, dtype),
                                           d.cross_positions(dtype))
        self.t2d, self.t2d_len = d.target_to_draft.to(device), d.target_to_draft_len.to(device)
        self.d2t = d.draft_to_target.to(device)
        self.noise_ids = d.noise_ids.to(device)
        self.catchup = 1 + self.t2d.shape[1]  # fixed catch-up width: the last draft + a spelling
        self.synced = True  # every row's uncached draft tokens fit the catch-up width
        self.host_len_max = self.max_pos  # the host's bound on draft lengths (kv_len), see Runner.progress

    @torch.inference_mode()
    def start(self, s: int, spec: SeqSpec, features, draft_mel) -> None:
        """The draft's cross K/V (its own encoder pass unless it shares the target's; copied from
        the target's rows where its layers project them as target layers do), its prompt, and
        every token the target has emitted so far, spelled in draft ids (left uncached: the next
        draft call feeds them). Slot s holds the same sequence in both caches."""
        d, st = self.drafter, self.state
        ddec = d.draft.model.decoder
        rows = DecoderCache(*(t[:, s:s + 1] for t in self.cache.buffers()))
        if d.cross_sources is not None:
            # the target's K/V of those layers, in the target's dtype (a compact draft's own
            # projections would use its bfloat16-rounded weights; the copy is what it was trained on)
            src = torch.tensor(d.cross_sources, device=self.device)
            rows.cross_k.copy_(pool_positions(self.target_cache.cross_k[:, s:s + 1].index_select(0, src), self.pool))
            rows.cross_v.copy_(pool_positions(self.target_cache.cross_v[:, s:s + 1].index_select(0, src), self.pool))
        else:
            full = rows
            if self.pool > 1:  # the whole positions first, then their means
                full = DecoderCache(rows.self_k, rows.self_v,
                                    *(t.new_empty(t.shape[:3] + (t.shape[3] * self.pool, t.shape[4]))
                                      for t in (rows.cross_k, rows.cross_v)))
            if d.shared_encoder:
                ddec.fill_cross(full, features[None])
            else:
                dfeat, frames = d.encode(draft_mel.to(self.device, self.dtype))
                ddec.fill_cross(full, dfeat, frames=frames)
            if full is not rows:
                rows.cross_k.copy_(pool_positions(full.cross_k, self.pool))
                rows.cross_v.copy_(pool_positions(full.cross_v, self.pool))
        dprompt = d.prompt(spec)
        P = len(dprompt)
        ddec.hidden(torch.tensor([dprompt], device=self.device), torch.arange(P, device=self.device)[None],
                    rows, kv_len=P, keep=1)  # only the cache is wanted
        st.draft_passes[s] = 1
        st.dtokens[s, :P] = torch.tensor(dprompt, device=self.device)
        n = int(st.n_tokens[s])
        at = P
        for tok in st.tokens[s, int(st.prompt_len[s]):n].tolist():
            st.dtokens[s, at:at + self.t2d.shape[1]] = self.t2d[tok]
            at += int(self.t2d_len[tok])
        st.dn[s], st.dcached[s] = at, P
        self.host_len_max = max(self.host_len_max, at)
        st.draft_on[s] = True
        self.synced = False  # more than the catch-up width may be uncached

    def propose(self, B: int, k: int, modes: Modes, width: int | None = None) -> int:
        """Up to k proposals for each of the first B slots, feeding `width` draft positions first
        (graph-safe when `trim` is off; None: the widest row's uncached positions, `uncached_width`)
        -> the draft steps run, the proposals' columns (the proposals [B, k] in target ids, -1: no
        usable proposal from there on, in `state.proposals`). An adaptive row (no fixed k) stops
        after a proposal that leads the draft's next candidate by less than `stop_margin` (eager;
        greedy rows of a compact draft, or any rows beside sampled ones on the CPU), and the draft
        stops once no row goes on (a row whose draft is off, e.g. one it stands aside for, does not
        keep it going)."""
        d, st = self.drafter, self.state
        ddec = d.draft.model.decoder
        kv_len = min(int(self.host_len_max) + k + 1, self.max_pos + 1) if self.trim else None
        stop = self.stop_margin(modes)
        if self.trim and not modes.any_sampled and d.greedy_fused():
            # all of the below for greedy rows in one C++ call: the same proposals and state (the
            # width found there: 4 small ops here cost ≈ 60 µs an iteration on cold caches)
            return cpu_ops.draft_propose(ddec, d.head, d.draft.suppress, self.view(B), ddec.slots(kv_len), st, self.d2t,
                                         B, k, width or 0, self.max_pos, stop)
        if width is None:
            width = self.uncached_width(B)
        slots = torch.arange(B, device=self.device)
        dn = st.dn[:B]
        src = self.uncached_positions(B, width)  # [B, width]
        feed = st.dtokens[:B].gather(1, src)
        # the draft's weights as its windows' starts checked them (`Decoder.layer_params`)
        hidden = ddec.hidden(feed, src, self.view(B), kv_len=kv_len, keep=1, check=False)
        margins = torch.empty(B, device=self.device) if stop > 0 else None
        made = torch.full((B,), k, dtype=torch.long, device=self.device)  # each row's proposals
        stops = st.row_k[:B] == 0  # adaptive rows
        if margins is not None:  # rows not drafting do not keep the loop going
            made[~st.draft_on[:B]] = min(1, k)
        raws = []
        for step in range(k):
            x = self.choose(hidden, slots, st.n_tokens[:B] - 1 + step, modes, raws, margins)  # [B]
            raws.append(x)
            if margins is not None:
                made[(made == k) & stops & (margins < stop)] = step + 1
                if not bool((made == k).any()):
                    break
            if step + 1 < k:
                pos = (dn + step)[:, None]
                hidden = ddec.hidden(x[:, None], pos, self.view(B), kv_len=kv_len, check=False)
        steps = len(raws)
        st.draft_passes[:B] += steps * st.draft_on[:B].long()
        raw = torch.stack(raws, dim=1)  # [B, steps] draft ids
        st.raw[:B, :steps] = raw
        st.dcached[:B] = dn + steps - 1
        mapped = self.d2t[raw]
        usable = (mapped >= 0) & st.draft_on[:B, None] & (dn[:, None] + k <= self.max_pos)
        # a row with a fixed smaller k proposes only that many, one that stopped what it made
        limit = torch.minimum(torch.where(st.row_k[:B] > 0, st.row_k[:B], k), made)
        usable &= torch.arange(steps, device=self.device)[None] < limit[:, None]
        usable = usable.long().cumprod(dim=1).bool()
        st.proposals[:B, :steps] = torch.where(usable, mapped, NO_PROPOSAL)
        st.proposals[:B, steps:k] = NO_PROPOSAL
        return steps

    # the lead (exact logits) under which an adaptive row's draft stops proposing (0: never).
    # Teacher-forced on base's drafts (bench windows and the demo recording, k = 8, 130 iterations
    # each): a proposal leading by < 1 was accepted 42-47% of the time, by 1-2 65-76%, 2-3 85-87%,
    # by more 95-100%; in a cost model of those passes (verify and draft steps as bench/cpu.py
    # timed them on an AVX2-only Zen 3) stopping at a lead under 2 decoded 12% faster than the
    # best fixed k for tiny.en and base-2l alike (1.80 against 1.60 and 1.90 against 1.70 plain
    # steps' time a token)
    STOP_MARGIN = 2.0

    def stop_margin(self, modes: Modes) -> float:
        """The lead an adaptive row's draft stops under this iteration (0.0: it does not stop):
        STOP_MARGIN, eager (a graph's shapes are fixed), where the leads come with the proposals:
        greedy rows of a draft whose head tells them (a compact draft's 2- or 4-bit head), or
        batches with sampled rows on the CPU, whose race writes them (`sampling.race_leads`: in
        logit units, T · ln of the winner's score over the runner-up's, the noise shared with the
        target's race). Sampled proposals with a small lead are kept about as rarely as greedy
        ones: base-2l at T = 0.5 (7 windows, 2 seeds, k = 6), lead < 0.5 / 0.5-1 / 1-2 / 2-3 / 3-5
        / more: kept 37 / 48 / 76 / 87 / 97 / 100%."""
        if not self.trim:
            return 0.0
        if modes.any_sampled:
            return self.STOP_MARGIN if ops.which_backend(self.device) == "cpp" else 0.0
        return self.STOP_MARGIN if self.drafter.leads_known() else 0.0

    def choose(self, hidden, slots, index, modes, raws, margins=None) -> torch.Tensor:
        """The draft's proposal [B] from hidden [B, 1, d]: its greedy argmax, or its race winner
        under the target's noise (keyed by target ids) for sampled rows. Sampled rows of a draft
        with the target's vocabulary follow the timestamp rules too, given its own proposals
        `raws` so far (another vocabulary only suppresses: its proposals are verified all the same).
        `margins`: float32 [B] written with each proposal's lead (greedy rows alone: the compact
        head's, `Q4Head.argmax`; with sampled rows: the race's, `sampling.race_leads`)."""
        d = self.drafter
        banned = d.draft.suppress
        if margins is not None and not modes.any_sampled:
            return d.head.argmax(hidden[:, 0], banned, margins)
        if not modes.any_sampled:
            # every row greedy: the draft's screened argmax, without its full logits (tiny.en's:
            # 80 MB of float32 a step) and without the timestamp rules, which the target applies
            # when it verifies. Under the rules, base's distilled draft proposed the same tokens
            # on the demo recording (385 drafted, 2.88 tokens per target pass at k = 3 either way,
            # held to AVX2), and each of its steps cost about 2 ms more than its two layers (0.6)
            return d.greedy(hidden, banned)[:, 0]
        proposed = torch.stack(raws, dim=1) if raws else None
        rows = Rows(self.state, slots, (index + 1)[:, None], proposed)
        follows_rules = modes.any_timestamps and d.vocab.identity
        choice, logits = choose_tokens(d.logits, hidden, banned, rows, self.rule_tables,
                                       follows_rules, self.noise_ids, margins)
        if self.sampling_rule == "rejection":
            self.state.draft_logits[:hidden.shape[0], len(raws)] = logits[:, 0]
        return choice[:, 0]

    def catch_up(self, B: int) -> None:
        """Feed every row's uncached draft tokens (after iterations without drafting)."""
        st = self.state
        ddec = self.drafter.draft.model.decoder
        dn, dc = st.dn[:B], st.dcached[:B]
        src = self.uncached_positions(B, self.uncached_width(B))
        ddec.hidden(st.dtokens[:B].gather(1, src), src, self.view(B), keep=1, check=False)  # only the cache is wanted
        st.dcached[:B] = torch.maximum(dn - 1, dc)
        st.draft_passes[:B] += st.draft_on[:B].long()  # rows whose draft runs
        self.synced = True

    def commit(self, B: int, k: int, n_acc: torch.Tensor) -> None:
        """After the verify pass: keep the accepted drafts' cache entries, append the correction or
        bonus token spelled in draft ids, drop the rest by shortening the length."""
        st = self.state
        dn = st.dn[:B]
        rows = torch.arange(B, device=self.device)[:, None]
        if k > 0:
            st.dtokens[rows, dn[:, None] + torch.arange(k, device=self.device)] = st.raw[:B, :k]
            st.dcached[:B] = torch.minimum(st.dcached[:B], dn + n_acc)
        last = st.tokens[:B].gather(1, (st.n_tokens[:B] - 1)[:, None])[:, 0]
        W = self.t2d.shape[1]
        base = dn + n_acc
        st.dtokens[rows, base[:, None] + torch.arange(W, device=self.device)] = self.t2d[last]
        new_dn = base + self.t2d_len[last]
        st.dn[:B] = torch.where(st.done[:B] | ~st.draft_on[:B], dn, new_dn)

    # ---------------------------------------------------------------- feeding
    def uncached_positions(self, B: int, width: int) -> torch.Tensor:
        """Draft positions [B, width] to feed: each row's uncached tokens, right-aligned; shorter
        rows repeat their first uncached position on the left (rewriting one slot with the same
        values), and a row with nothing uncached re-feeds its last token, whose output predicts
        the next one."""
        dn, start = self.state.dn[:B], self.uncached_start(B)
        j = torch.arange(width, device=self.device)
        return start[:, None] + (j[None] - (width - (dn - start)[:, None])).clamp(min=0)

    def uncached_start(self, B: int) -> torch.Tensor:
        """Each row's first draft position to feed [B] (a row without a draft, dn = 0, re-feeds slot 0)."""
        return torch.minimum(self.state.dcached[:B], self.state.dn[:B] - 1).clamp(min=0)

    def uncached_width(self, B: int) -> int:
        """The widest row's number of positions to feed (a host read; at least 1)."""
        return max(1, int((self.state.dn[:B] - self.uncached_start(B)).max()))

    def view(self, B: int) -> DecoderCache:
        """The draft cache's first B slots."""
        return DecoderCache(*(t[:, :B] for t in self.cache.buffers()))

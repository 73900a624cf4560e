"""The draft side of speculative decoding: proposing k tokens, acceptance, cache bookkeeping, and
the adaptive choice of k. The engine drives it; see the glossary in engine.py."""
from __future__ import annotations

import torch

from .head import SubsetHead
from .vocab import VocabMap

MAX_K = 8


class Drafter:
    """A loaded draft model paired with the target it serves."""

    def __init__(self, draft, target, shared_encoder: bool | None = None, head_tokens: int | None = None):
        self.draft, self.target = draft, target
        dcfg, tcfg = draft.config, target.config
        same_encoder = shares_encoder(draft.model, target.model)
        if shared_encoder is None:
            shared_encoder = same_encoder
        elif shared_encoder and not same_encoder:
            raise ValueError(f"draft {draft.path} does not share the encoder of target {target.path} "
                             "(encoder configs or weights differ); pass shared_encoder=None or False")
        self.shared_encoder = shared_encoder
        if shared_encoder:
            draft.model.encoder = None  # the target's encoder output serves both
        elif dcfg.num_mel_bins != tcfg.num_mel_bins:
            raise ValueError(f"draft {draft.path} expects {dcfg.num_mel_bins} mel bins but target "
                             f"{target.path} expects {tcfg.num_mel_bins}; use a draft with the same "
                             "mel front end")
        self.vocab = VocabMap.build(draft.tokenizer, target.tokenizer, draft.path, target.path)
        if head_tokens is not None:
            draft.head = SubsetHead(draft.model.decoder.embed_tokens.weight, self.head_ids(head_tokens))
        self.length = DraftLength(None)  # running estimates for num_draft_tokens=None, kept across calls

    def head_ids(self, n: int) -> torch.Tensor:
        """The draft's `n` lowest text ids the target can spell (BPE ids follow merge order,
        roughly frequency), plus EOT: what a pruned draft head may propose (greedy only)."""
        eot = self.draft.tokenizer.eot
        ids = torch.arange(eot)
        if not self.vocab.identity:
            ids = ids[self.vocab.draft_to_target[:eot] >= 0]
        return torch.cat([ids[:n], torch.tensor([eot])]).to(self.draft.suppress.device)

    def start(self, engine, mel, features, prompts, out, opts, generator) -> "DraftRun | None":
        tok = self.draft.tokenizer
        if not tok.multilingual and opts.language not in (None, "en"):
            return None  # an English-only draft cannot follow another language
        langs = [engine.target.tokenizer.language_code(p[1]) if len(p) == 4 else None for p in prompts]
        if not tok.multilingual and any(lang not in (None, "en") for lang in langs):
            return None
        dprompts = [tok.prompt(lang if tok.multilingual else None, opts.task) for lang in langs]
        B = mel.shape[0]
        cache = engine._cache("draft", self.draft.config, B)
        draft_features = features if self.shared_encoder else self.draft.model.encoder(mel.to(engine.dtype))
        self.draft.model.decoder.fill_cross(cache, draft_features, slice(0, B))
        seqs = [dp + [d for t in o for d in self.vocab.to_draft(t)] for dp, o in zip(dprompts, out)]
        return DraftRun(self, cache, seqs, engine.device)


def shares_encoder(a, b) -> bool:
    if a.config.d_model != b.config.d_model or a.config.encoder_layers != b.config.encoder_layers \
            or a.config.num_mel_bins != b.config.num_mel_bins:
        return False
    pa, pb = a.encoder.state_dict(), b.encoder.state_dict()
    return pa.keys() == pb.keys() and all(pa[k].shape == pb[k].shape and torch.equal(pa[k], pb[k]) for k in pa)


class DraftRun:
    """Per-call draft state: each row's draft-side token sequence and how much of it is cached.

    Rows may differ in length (per-row acceptance) and, with a mapped vocabulary, the draft's
    positions may differ from the target's; each model keeps its own positions.
    """

    def __init__(self, drafter: Drafter, cache, seqs: list[list[int]], device):
        self.drafter, self.cache, self.device = drafter, cache, device
        self.decoder = drafter.draft.model.decoder
        self.max_pos = drafter.draft.config.max_target_positions
        self.seqs = seqs  # draft token ids per row (prompt + emitted, mapped to draft ids)
        self.cached = [0] * len(seqs)  # leading tokens of each row already in the draft cache
        self.passes = 0
        self.valid = [0] * len(seqs)  # usable proposals per row in the last propose()
        self.raw = None  # last proposals in draft ids [B, k]

    def room(self, done) -> int:
        """Largest k the draft's positions allow for every active row."""
        free = [self.max_pos - len(s) for s, d in zip(self.seqs, done) if not d]
        return max(0, min(free) if free else 0)

    def _step(self, tokens, pos, kv_len, pick):
        hidden = self.decoder.hidden(tokens, pos.clamp(max=self.max_pos - 1), self.cache, kv_len=kv_len)
        self.passes += 1
        token, logits = pick(self.drafter.draft, hidden[:, -1:])
        return token[:, 0], None if logits is None else logits[:, 0]

    def propose(self, k: int, done, pick) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k draft tokens per row -> (target ids [B, k] with -1 after the first unusable one,
        suppressed draft logits [B, k, V_draft] when sampling, else None)."""
        lens = [len(s) for s in self.seqs]
        # Catch-up: feed each row's uncached tokens; shorter rows repeat their first uncached
        # (token, position) on the left, which rewrites the same cache slot with the same values.
        # A row with nothing uncached (finished, or its last token had no draft spelling)
        # re-feeds its last token, whose logits predict the next position.
        starts = [min(c, n - 1) for n, c in zip(lens, self.cached)]
        width = max(n - c for n, c in zip(lens, starts))
        feed, pos = [], []
        for s, n, c in zip(self.seqs, lens, starts):
            pad = width - (n - c)
            feed.append([s[c]] * pad + s[c:])
            pos.append([c] * pad + list(range(c, n)))
        feed = torch.tensor(feed, device=self.device)
        pos = torch.tensor(pos, device=self.device)
        kv_len = min(max(lens) + k, self.max_pos)
        token, logits = self._step(feed, pos, kv_len, pick)
        raw, steps = [token], [logits]
        base = torch.tensor(lens, device=self.device)
        for j in range(1, k):
            token, logits = self._step(token[:, None], (base + j - 1)[:, None], kv_len, pick)
            raw.append(token)
            steps.append(logits)
        self.raw = torch.stack(raw, dim=1)  # [B, k]
        self.cached = [n + k - 1 for n in lens]  # provisional: fixed up in commit()
        proposals, valid = self.drafter.vocab.proposals_to_target(self.raw)
        self.valid = [0 if d else v for v, d in zip(valid.tolist(), done)]
        return proposals, None if steps[0] is None else torch.stack(steps, dim=1)

    def commit(self, accepted: list[int], out: list[list[int]], done) -> None:
        """After a verify pass: keep the accepted draft tokens' cache entries, append the
        correction/bonus token (mapped to draft ids), drop the rest by shortening the length."""
        raw = self.raw.tolist() if self.raw is not None else None
        for b, a in enumerate(accepted):
            if done[b]:
                continue
            n = len(self.seqs[b])
            self.seqs[b] += (raw[b][:a] if a else []) + self.drafter.vocab.to_draft(out[b][-1])
            self.cached[b] = min(self.cached[b], n + a)
        self.raw = None  # an iteration without drafting (k == 0) accepts nothing


class DraftLength:
    """How many tokens to draft next.

    Fixed when the user gives `num_draft_tokens`. Otherwise adaptive, in two parts:
    - *which k*: the acceptance rate α is estimated as accepted / (accepted + rejections) over
      recent iterations (exponentially weighted), the cost ratio c = (draft step time) / (verify
      pass time) is measured, and k in 1..8 maximizes E[tokens per pass] / (k·c + 1) with
      E = (1 − α^(k+1)) / (1 − α);
    - *whether to draft at all*: the measured throughput (emitted tokens per second) of
      speculative iterations, charged with the draft's per-utterance setup (its encoder and
      cross K/V), is compared with that of plain target steps. One plain step every 16
      speculative iterations keeps the plain rate fresh; while speculation is off, a k = 1
      probe keeps the speculative rate fresh, after 16 plain steps and then, while probes keep
      losing, after twice as many each time (a probe may pay the draft's whole setup). Until
      both rates are measured the model above decides (speculate when its best gain exceeds 1).
    The estimates live in the engine's drafter, so they carry over between calls.
    """

    REFRESH = 16  # iterations between plain-step refreshes / speculative probes
    DECAY = 0.9  # weight of the past in every running estimate

    def __init__(self, fixed: int | None):
        self.fixed = fixed
        self.accepted, self.trials = 4.0, 5.0  # prior α = 0.8, weight of ~5 tokens
        self.cost_ratio = 0.3  # prior draft-step / verify-pass time
        self.spec = None  # running (tokens, seconds) of speculative iterations
        self.plain = None  # running (tokens, seconds) of plain target steps
        self.spec_iters = 0
        self.probe_every = self.until_probe = self.REFRESH  # plain steps between probes (backs off)
        self.k = fixed if fixed is not None else 4

    def best(self) -> tuple[int, float]:
        alpha = min(self.accepted / self.trials, 0.999)
        gains = [((1 - alpha ** (k + 1)) / (1 - alpha) / (k * self.cost_ratio + 1), k) for k in range(1, MAX_K + 1)]
        gain, k = max(gains)
        return k, gain

    def _track(self, current, tokens: float, seconds: float):
        t, s = current if current is not None else (0.0, 0.0)
        return self.DECAY * t + tokens, self.DECAY * s + seconds

    def charge(self, seconds: float) -> None:
        """Add the draft's per-utterance setup time to the speculative side."""
        if self.fixed is None and self.spec is not None:
            self.spec = (self.spec[0], self.spec[1] + seconds)

    def pays(self) -> bool:
        if self.spec is None or self.plain is None:
            return self.best()[1] > 1.0
        return self.spec[0] / self.spec[1] > self.plain[0] / self.plain[1]

    def update(self, k: int, accepted: list[int], done, draft_seconds: float, verify_seconds: float):
        if self.fixed is not None:
            return
        rows = [a for a in accepted if a >= 0]
        tokens, seconds = sum(a + 1 for a in rows), draft_seconds + verify_seconds
        if k == 0:
            self.plain = self._track(self.plain, tokens, seconds)
            if self.pays():
                self.k = self.best()[0]
            else:
                self.until_probe -= 1
                self.k = 1 if self.until_probe <= 0 else 0
            return
        probing = self.k == 1 and self.until_probe <= 0
        self.spec = self._track(self.spec, tokens, seconds)
        self.spec_iters += 1
        succ = sum(rows) / max(len(rows), 1)
        fail = sum(1 for a in rows if a < k) / max(len(rows), 1)
        self.accepted = self.DECAY * self.accepted + succ
        self.trials = self.DECAY * self.trials + succ + fail
        if verify_seconds > 0:
            self.cost_ratio = self.DECAY * self.cost_ratio + (1 - self.DECAY) * (draft_seconds / k) / verify_seconds
        refresh = self.spec_iters % self.REFRESH == 0
        if self.pays():
            self.probe_every = self.until_probe = self.REFRESH
            self.k = 0 if refresh else self.best()[0]
        else:
            if probing:  # a lost probe: wait twice as long before the next one
                self.probe_every = min(2 * self.probe_every, 4096)
            self.until_probe = self.probe_every
            self.k = 0

"""Output heads: the exact screened int8 head of greedy decoding, the compact drafts' 4-bit head
(greedy proposals and the logits sampled rows draft from), the pruned draft head.

`ScreenedHead`: the head is the widest matrix of the decoder (vocab × d_model: 51865 × 512 for
base) and greedy decoding needs only its argmax. An int8 copy of the weights is read instead (a
quarter of the float32 bytes) in one product for all rows, with the hidden states kept in float32;
then a rigorous bound on each approximate logit's distance to the exact one selects the
*candidates*, whose exact logits are recomputed from the float32 rows. Their argmax is the answer.

The int8 copy. Row v of the weights is stored as q_v = round(w_v / s_v) with s_v = max|w_v| / 127
(float32). A hidden row h is quantized once to 16-bit integers p = round(fl(h / s_h)) with
s_h = fl(max|h| / R), R = `q16_range(K)` (≤ 32767, small enough that |q_v · p| < 2^31), so the
screen's products P_v = q_v · p are exact integer sums (16 products per AVX2 instruction, any
order, the same at every vector level), and the approximate logit is ã_v = fl(fl(P_v) · fl(s_v s_h)).

The bound. With l_v = w_v · h the exact float32-computed logit (`cpu_ops.gather_dot`'s
arithmetic), γ_K = K·2^-24 / (1 − K·2^-24) the error factor of a float32 sum of K products in any
order (u = 2^-24) and e = s_h p − h the rounding of h (|e_i| ≤ s_h/2 + |h_i| u ≤ max|h| ε with
ε = (1 + u)/(2R) + u, so ‖e‖ ≤ √K ε ‖h‖):

    |ã_v − l_v| ≤ |(s_v q_v − w_v) · h|              (the rounding to int8)
                + s_v |q_v · e|                         (the rounding of h to 16 bits)
                + 4u s_v |q_v · s_h p|                  (three float32 roundings of ã)
                + γ_K Σ|w_vi h_i|                      (l's float32 sum)
              ≤ (‖s_v q_v − w_v‖ + s_v ‖q_v‖ (√K ε + 4u (1 + √K ε)) + γ_K ‖w_v‖) · ‖h‖ = c_v ‖h‖

by Cauchy–Schwarz (and ‖s_h p‖ ≤ ‖h‖ + ‖e‖). c_v is computed once in float64 from the actual
rounding errors (not a worst case: ≈ 2.5× the bfloat16 worst-case bound, so on real hidden states
a row has ≈ 1.3 candidates, 7 at most on our test windows; the 16-bit term adds < 1% for base) and
stored with a factor (1 + 2^-12) that covers the float32 rounding of ‖h‖ and of the bound's own
product; + TINY covers underflow. Comparisons need no margin: rounding is monotone, so
fl(ã_v + b_v) ≥ l_v and fl(ã_w − b_w) ≤ l_w. A token is a candidate when its upper bound reaches
the best lower bound over the row; the true argmax always is one.

In PyTorch (`argmax_reference`) the candidates are the top `MAX_CANDIDATES` upper bounds per row
(checked: the next upper bound must fall below the row's best lower bound, else that row falls
back to the full float32 head); the C++ op (`cpu_ops.screened_argmax`) streams the int8 copy in
blocks of 8 rows and keeps any number of candidates. Ties go to the lowest token id, like
`torch.argmax` over the full logits.
"""
from __future__ import annotations

import functools

import torch

from ..backends import cpu_ops
from .memory import huge_copy, huge_zeros

FP32_ROUNDOFF = 2.0**-24
TINY = 2.0**-40  # underflow of the products (< K·2^-149 for any float32 h)
MAX_CANDIDATES = 16
BLOCK = 8  # vocabulary rows per block of the packed int8 copy
# nats: openai's float32 log-probabilities move the timestamp rule's comparison by < 1e-5 (see
# `ScreenedHead.timestamp_argmax`); closer calls are decided from the full logits
TIMESTAMP_MARGIN = 1e-3


def q16_range(K: int) -> int:
    """R: hidden rows are quantized to integers in [-R, R], so that 127 · R · K < 2^31 (the
    screen's int32 sums cannot overflow); the C++ op computes the same."""
    return min(32767, (2**31 - 1) // (127 * max(1, K)))


def quantize_rows(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, K] float32 -> (p [N, K] integer-valued float32 in [-R, R], s_h [N] float32):
    s_h = fl(max|h| / R), p = round-half-even(fl(h / s_h)); a zero row gives s_h = 0 and p = 0, a
    row with a NaN or an infinity s_h = NaN (no candidates), as the C++ op does."""
    hidden = hidden.float()
    mx = hidden.abs().amax(dim=1)
    finite = hidden.isfinite().all(dim=1)
    sh = mx / q16_range(hidden.shape[1])
    p = (hidden / torch.where(sh > 0, sh, 1.0)[:, None]).round()
    p = p.masked_fill_(~(finite & (sh > 0))[:, None], 0.0)
    return p, torch.where(finite, sh, float("nan"))


def bound_coefficients(K: int) -> tuple[float, float]:
    """The bound's factors for K features (module docstring): (√K ε + 4u (1 + √K ε), γ_K)."""
    u = FP32_ROUNDOFF
    e16 = K**0.5 * ((1 + u) / (2 * q16_range(K)) + u)  # ‖e‖ / ‖h‖ for the 16-bit rows
    return e16 + 4 * u * (1 + e16), K * u / (1 - K * u)


def quantize(weight: torch.Tensor, rows: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [V, K] float32 -> (q int8 [V, K], s float32 [V], c float32 [V]): the int8 copy and
    the bound per unit ‖h‖ (see the module docstring), rounded up. Every row is computed on its
    own, `rows` at a time: the float64 temporaries stay in cache (base's head, the same bits: the
    whole head at once 0.41 s, 4096 rows at a time 0.11 s on a Xeon's larger cache and 0.31-0.53 s
    on a 2-core Zen 3 EPYC share, where 1024 rows (4 MB temporaries) take 0.11 s; every Engine
    builds it)."""
    if weight.shape[0] > rows:
        parts = [quantize(weight[i:i + rows], rows) for i in range(0, weight.shape[0], rows)]
        return tuple(torch.cat(p) for p in zip(*parts))
    w = weight.double()
    s = (w.abs().amax(dim=1) / 127).float()
    s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero row: q = 0 exactly
    q = (w / s.double()[:, None]).round().clamp(-127, 127)
    coef, gamma = bound_coefficients(w.shape[1])
    sq = s.double()[:, None] * q
    c = ((w - sq).norm(dim=1) + coef * sq.norm(dim=1) + gamma * w.norm(dim=1))
    c = (c * (1 + 2.0**-12)).float()
    c = torch.nextafter(c, torch.full_like(c, float("inf")))  # rounded up, not to nearest
    return q.to(torch.int8), s, c


def pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float32 (N, K multiples of 8) -> (packed int8 [N/8, K/8, 8, 8], scale [N]):
    the per-row int8 copy of `quantize` in the C++ block layout (`cpu_ops.linear_q8`)."""
    N, K = weight.shape
    if N % BLOCK or K % 8:
        raise ValueError(f"int8 packing needs rows and features in multiples of 8, got {N}x{K}")
    q, scale, _ = quantize(weight)
    return q.view(N // BLOCK, BLOCK, K // 8, 8).transpose(1, 2).contiguous(), scale


class ScreenedHead:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight.float().contiguous()  # [V, K] float32 (the token embedding)
        V, K = self.weight.shape
        blocks = -(-V // BLOCK)
        if cpu_ops.available() and self.weight.device.type == "cpu" and K % 8 == 0:
            # quantize's per-row arithmetic and the packing in one C++ pass, straight into huge
            # pages (base's head, 2 threads of a Zen 3 EPYC: 0.24 -> 0.06 s at an engine's first step)
            self.packed = huge_zeros((blocks, K // 8, BLOCK, 8), torch.int8)
            self.scale, self.bound = torch.empty(V, dtype=torch.float32), torch.empty(V, dtype=torch.float32)
            cpu_ops.quantize_head(self.weight, self.packed, self.scale, self.bound, *bound_coefficients(K))
            self.q = None
        else:
            q, self.scale, self.bound = quantize(self.weight)
            padded = torch.zeros(blocks * BLOCK, K, dtype=torch.int8)
            padded[:V] = q
            # [blocks, K/8, 8 rows, 8 features]: one block streams as one sequential run (C++ op)
            self.packed = (huge_copy(padded.view(blocks, BLOCK, K // 8, 8).transpose(1, 2))
                           if K % 8 == 0 else None)
            self.q = q if self.packed is None else None  # the reference unpacks `packed` when it can
        self._tail = None  # (start, weight[start:]) for `tail`

    def int8_weights(self) -> torch.Tensor:
        """q [V, K] int8."""
        if self.q is not None:
            return self.q
        V, K = self.weight.shape
        return self.packed.transpose(1, 2).reshape(-1, K)[:V]

    def argmax(self, hidden: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, d] -> [N]: argmax over the vocabulary of the float32 logits hidden @ weight.T,
        skipping `banned` ([V] or [N, V] bool), ties to the lowest id."""
        if cpu_ops.active(hidden) and self.packed is not None:  # one C++ op, any number of candidates
            return cpu_ops.screened_argmax(hidden, self.packed, self.scale, self.bound, self.weight, TINY, banned)
        return self.argmax_reference(hidden, banned)

    def approx(self, hidden: torch.Tensor) -> torch.Tensor:
        """ã [N, V]: the exact integer products of the 16-bit rows and the int8 copy (float64 sums
        of integers below 2^31: exact), then fl(fl(P) · fl(s_v · s_h)), as the C++ op computes them."""
        p, sh = quantize_rows(hidden)
        products = (p.double() @ self.int8_weights().double().T).float()
        return products * (self.scale[None, :] * sh[:, None])

    def argmax_reference(self, hidden: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor:
        hidden = hidden.float()
        approx = self.approx(hidden)  # [N, V]
        bound = hidden.norm(dim=1, keepdim=True) * self.bound + TINY
        if banned is not None:
            approx.masked_fill_(banned, -float("inf"))
        floor = (approx - bound).amax(dim=1, keepdim=True)  # the best guaranteed logit per row
        upper = approx.add_(bound)  # [N, V] (approx is not needed any more)
        c = min(MAX_CANDIDATES + 1, upper.shape[1])
        top, ids = upper.topk(c, dim=1)  # [N, c], descending
        fits = top[:, -1] < floor[:, 0] if c == MAX_CANDIDATES + 1 else torch.ones_like(floor[:, 0], dtype=torch.bool)
        top, ids = top[:, :MAX_CANDIDATES], ids[:, :MAX_CANDIDATES]
        ids, order = ids.sort(dim=1)  # ascending ids: argmax's first maximum is the lowest id
        candidate = top.gather(1, order) >= floor
        exact = cpu_ops.gather_dot(hidden, self.weight, ids).masked_fill_(~candidate, -float("inf"))
        out = ids.gather(1, exact.argmax(dim=1, keepdim=True))[:, 0]
        if not bool(fits.all()):  # more candidates than fit: the full float32 head for those rows
            rows = (~fits).nonzero()[:, 0]
            logits = cpu_ops.linear(hidden[rows], self.weight, None, torch.float32)
            if banned is not None:
                logits.masked_fill_(banned if banned.ndim == 1 else banned[rows], -float("inf"))
            out[rows] = logits.argmax(dim=1)
        return out


    def tail(self, start: int) -> torch.Tensor:
        """The float32 head's rows start.. as one contiguous matrix (cached): exact logits for a
        range of the vocabulary, bit-identical to the full head's (`cpu_ops.linear` computes every
        output by the same operations wherever its row sits)."""
        if self._tail is None or self._tail[0] != start:
            self._tail = (start, self.weight[start:].contiguous())
        return self._tail[1]

    def timestamp_argmax(self, hidden: torch.Tensor, banned: torch.Tensor, timestamp_begin: int,
                         margin: float = TIMESTAMP_MARGIN) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy tokens of timestamp rows without their full logits -> (tokens [N], undecided [N]).

        hidden [N, d]; banned [N, V] the tokens Whisper's rules exclude (`rules.rule_mask`). The
        last rule forces a timestamp when the timestamps' total probability beats every single
        token below them: log Σ exp(l_ts) > max l_text (the log-softmax normaliser cancels), so
        the exact float32 logits of the 1501 timestamps (a 3 MB slice of the head) and the
        screened argmax over the rest (its exact logit recomputed) decide it, and the token is the
        better of the two (ties to the lower id, the text token, as argmax over the full logits).
        openai compares float32 log-probabilities, whose rounding moves the difference by far
        less than `margin` nats; rows closer than that are `undecided` (their tokens here are not
        to be used: the caller decides them from full logits).

        Most rows need no exact timestamp logit: the screen's upper bounds on them (fl(ã + b),
        see the module docstring) bound their log-sum-exp from above (`split`), and where that
        bound stays below the best text logit by more than `margin`, the rule cannot force a
        timestamp and no timestamp beats the text token (a maximum is at most the log-sum-exp):
        the row's token is the text token, as the exact comparison would decide. Only the other
        rows (a timestamp near or ahead) read the exact timestamp rows. The same tokens and
        undecided rows either way (the PyTorch path reads every row's)."""
        hidden = hidden.float()
        tb = timestamp_begin
        text_arg, text_best, lse_upper = self.split(hidden, banned, tb, bounds=False)
        tokens, undecided = text_arg.clone(), torch.zeros(len(text_arg), dtype=torch.bool, device=hidden.device)
        if lse_upper is None:
            rows = torch.arange(len(text_arg), device=hidden.device)
        else:
            # 1e-9: beyond the float64 rounding of either log-sum-exp (values of a few tens); nan
            # (nothing allowed, or a NaN row) falls to the exact comparison
            rows = (~(lse_upper - text_best.double() < -(margin + 1e-9))).nonzero()[:, 0]
        if len(rows) == 0:
            return tokens, undecided
        ts = cpu_ops.linear(hidden[rows], self.tail(tb), None, torch.float32)  # [n, V - tb]
        ts.masked_fill_(banned[rows, tb:], -float("inf"))
        ts_arg = ts.argmax(dim=1)  # the first maximum
        ts_best = ts.gather(1, ts_arg[:, None])[:, 0]
        best = text_best[rows]
        gap = ts.double().logsumexp(dim=1) - best.double()  # +inf: no text; -inf / nan: no timestamp
        force = gap > 0
        undecided[rows] = gap.abs() < margin
        tokens[rows] = torch.where(force | (ts_best > best), ts_arg + tb, text_arg[rows])
        return tokens, undecided

    def split(self, hidden: torch.Tensor, banned: torch.Tensor, split: int, bounds: bool = True):
        """One pass of the screen -> (the exact argmax below `split` [N], its exact logit [N]
        (-inf: every token below it banned), an upper bound on the log-sum-exp of the allowed
        logits from `split` on [N] float64). The C++ op where it runs (it always bounds); spec:
        `split_reference`, whose bound (`bounds`; None without) costs a float64 pass over [N, V]."""
        if cpu_ops.active(hidden) and self.packed is not None:
            return cpu_ops.screened_split(hidden, self.packed, self.scale, self.bound, self.weight, TINY, banned,
                                          split)
        return self.split_reference(hidden, banned, split, bounds=bounds)

    def split_reference(self, hidden: torch.Tensor, banned: torch.Tensor, split: int, bounds: bool = False):
        """`split` in PyTorch: the argmax through `argmax`, its logit through `cpu_ops.gather_dot`
        (the same arithmetic), and with `bounds` the upper log-sum-exp from `approx` (the C++ op
        sums in another order: the same value within float64 rounding); without, None (the
        callers then read every row's exact logits)."""
        hidden = hidden.float()
        below = banned.clone() if banned.dim() == 2 else banned[None].expand(hidden.shape[0], -1).clone()
        below[:, split:] = True
        arg = self.argmax(hidden, below)
        best = cpu_ops.gather_dot(hidden, self.weight, arg[:, None])[:, 0].masked_fill(below.all(dim=1), -float("inf"))
        if not bounds:
            return arg, best, None
        upper = self.approx(hidden)[:, split:] + (hidden.norm(dim=1, keepdim=True) * self.bound[split:] + TINY)
        rest = banned[:, split:] if banned.dim() == 2 else banned[None, split:]
        return arg, best, upper.double().masked_fill_(rest, -float("inf")).logsumexp(dim=1)


class SubsetHead:
    """Greedy argmax over a subset of the vocabulary: a draft's pruned output head.

    A draft only proposes; the target verifies every proposal with its full head, so a draft
    that can only say the `keep` tokens stays exact and just proposes less often right. A float32
    head where the backend screens heads (the CPU) is screened like the full one (`ScreenedHead` over the kept rows: an int8
    copy, a quarter of the bytes, the same argmax)."""

    def __init__(self, weight: torch.Tensor, keep: torch.Tensor, screen: bool = True):
        """`screen`: read the kept rows through an int8 screen where it applies (float32 weights,
        features a multiple of 8; the caller's backend says whether its device screens heads)."""
        self.keep = keep  # [N] vocabulary ids kept, ascending
        self.weight = weight[keep].contiguous()  # [N, d]
        screen = screen and weight.dtype == torch.float32 and weight.shape[1] % 8 == 0
        self.screened = ScreenedHead(self.weight) if screen else None

    def argmax(self, hidden: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor:
        if self.screened is not None:
            return self.keep[self.screened.argmax(hidden, None if banned is None else banned[..., self.keep])]
        if cpu_ops.active(hidden):
            logits = cpu_ops.linear(hidden, self.weight, None, torch.float32)  # [rows, N]
        else:
            logits = hidden @ self.weight.T
        if banned is not None:
            logits.masked_fill_(banned[..., self.keep], -float("inf"))
        return self.keep[logits.argmax(dim=-1)]


Q4_CHUNK = 32  # features per packed chunk of the 4-bit copy (16 bytes a row)
Q4_CANDIDATES = 16  # approximate logits rechecked in float32 per row
Q2_CHUNK = 64  # features per packed chunk of the 2-bit copy (16 bytes a row)
Q2_CANDIDATES = 16  # the 2-bit copy's approximate logits rechecked in float32 per row


def quantize_rows8(hidden: torch.Tensor) -> torch.Tensor:
    """hidden [N, K] -> p [N, K] integer-valued float32 in [-127, 127]: round-half-even(fl(h / s_h)),
    s_h = fl(max|h| / 127); a zero row or one with a NaN or an infinity gives p = 0 (the C++ op's)."""
    hidden = hidden.float()
    sh = hidden.abs().amax(dim=1) / 127
    ok = hidden.isfinite().all(dim=1) & (sh > 0)
    p = (hidden / torch.where(ok, sh, 1.0)[:, None]).round()
    return p.masked_fill_(~ok[:, None], 0.0)


class Q4Head:
    """A compact draft's head in 4 bits, for its greedy proposals (`argmax`) and the logits its
    sampled rows draft from (`logits`): not exact, proposals (the target verifies every one).

    The output head is most of a compact draft's step (base's distilled draft on a Zen 4 EPYC:
    1.1 of 2.0 ms; tiny.en's own head is 51864 x 384). Row v is stored as q_v = round(w_v / s_v)
    in -7..7, s_v = max|w_v| / 7 (as q_v + 8, a nibble), half the bytes of the int8 screen; a
    hidden row is rounded to int8 (`quantize_rows8`), the products P_v = q_v . p are exact integers, and the
    approximate logit is fl(fl(P_v) s_v). The `candidates` largest (ties to the lower id) are
    rechecked in float32 (`cpu_ops.gather_dot`) and the best of those (ties to the lower id) is
    the proposal. On real hidden states of base's distilled draft and tiny.en (3 windows, 219
    tokens) the exact argmax was among the 16 best approximations for 219 / 217 of them, against
    207 / 188 for the single best. The C++ op (`cpu_ops.q4_argmax`) streams the copy as uint8
    [ceil(V/8), K/32, 8, 16]: per block of 8 rows and chunk of 32 features, row j's byte b holds
    q + 8 of feature b (low nibble) and of feature b + 16 (high nibble)."""

    BITS, CHUNK, PAD = 4, Q4_CHUNK, 8  # bits a weight; features a packed chunk; the padding rows' code
    SCALE = 1.0  # the stored scale per row step (`scale`: what the approximate logits multiply)

    def __init__(self, weight: torch.Tensor, candidates: int = Q4_CANDIDATES):
        V, K = weight.shape
        if K % self.CHUNK or K > 16384:
            raise ValueError(f"a {self.BITS}-bit head needs features in multiples of {self.CHUNK} (at most "
                             f"16384), got {K}")
        if candidates < 1:
            raise ValueError(f"candidates must be >= 1, got {candidates}")
        self.weight = weight.float().contiguous()
        self.candidates = candidates
        w = self.weight
        step = self.row_steps(w)
        self.scale = step * self.SCALE
        blocks, per = -(-V // BLOCK), 8 // self.BITS  # codes a byte
        self.packed = huge_zeros((blocks, K // self.CHUNK, BLOCK, 16), torch.uint8)  # [blocks, K/CHUNK, 8, 16]
        # 1024 rows at a time, each row on its own (the same bytes): the float temporaries of the
        # whole head at once (100 MB each for base's) made a draft's Engine 0.4 s slower to build
        for b0 in range(0, blocks, 128):
            r0, r1 = b0 * BLOCK, min(V, (b0 + 128) * BLOCK)
            nb = min(128, blocks - b0)
            u = torch.full((nb * BLOCK, K), self.PAD, dtype=torch.uint8)
            u[:r1 - r0] = self.codes(w[r0:r1], step[r0:r1, None])
            u = u.view(nb, BLOCK, K // self.CHUNK, per, 16)  # [block, row, chunk, code in the byte, byte]
            packed = u[:, :, :, 0]
            for i in range(1, per):
                packed = packed | (u[:, :, :, i] << (self.BITS * i))
            self.packed[b0:b0 + nb] = packed.transpose(1, 2)

    @staticmethod
    def row_steps(w: torch.Tensor) -> torch.Tensor:
        """s_v = max|w_v| / 7 (an all-zero row: 1, so q = 0 exactly)."""
        s = w.abs().amax(dim=1) / 7
        return torch.where(s > 0, s, torch.ones_like(s))

    @staticmethod
    def codes(w: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """The stored codes u = q + 8 of rows w, q = round(w / s) in -8..7."""
        return ((w / step).round().clamp(-8, 7) + 8).to(torch.uint8)

    def unpacked(self) -> torch.Tensor:
        """The codes u [V, K] uint8, from `packed` (the references read them; no second copy is kept)."""
        blocks, chunks = self.packed.shape[:2]
        mask = (1 << self.BITS) - 1
        u = torch.cat([(self.packed >> (self.BITS * i)) & mask for i in range(8 // self.BITS)], dim=-1)
        return u.transpose(1, 2).reshape(blocks * BLOCK, chunks * self.CHUNK)[:self.weight.shape[0]]

    def argmax(self, hidden: torch.Tensor, banned: torch.Tensor | None = None,
               margins: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, d] -> proposals [N] (`banned`: [V] or [N, V] bool tokens never proposed;
        `margins`: float32 [N] written with each proposal's lead, `argmax_reference`'s)."""
        if cpu_ops.active(hidden):
            return cpu_ops.q4_argmax(hidden, self.packed, self.scale, self.weight, self.candidates, banned, margins)
        return self.argmax_reference(hidden, banned, margins)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> float32 logits [..., V] for a sampled draft: every token's 4-bit
        approximation fl(fl(P_v) fl(s_v s_h)), s_h = max|h| / 127 (the row's int8 step), with the
        `candidates` largest (ties to the lower id) replaced by their exact float32 logits, where a
        race's winner lies. Not the exact logits: a draft's proposals and, under rejection
        sampling, the distribution they are drawn from and tested against, the same one."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        if cpu_ops.active(flat):
            out = cpu_ops.q4_logits(flat, self.packed, self.scale, self.weight, self.candidates)
        else:
            out = self.logits_reference(flat)
        return out.view(*hidden.shape[:-1], -1)

    def logits_reference(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.float()
        ok = hidden.isfinite().all(dim=1)
        step = torch.where(ok, hidden.abs().amax(dim=1) / 127, 0.0)
        out = self.products(hidden) * (self.scale[None, :] * step[:, None])
        c = min(self.candidates, out.shape[1])
        if c:
            ids = out.sort(dim=1, descending=True, stable=True)[1][:, :c]
            out.scatter_(1, ids, cpu_ops.gather_dot(hidden, self.weight, ids))
        return out

    def int4_weights(self) -> torch.Tensor:
        """q [V, K] int8 in -7..7, unpacked from `packed` (base's would be 26.5 MB kept)."""
        return self.unpacked().to(torch.int8) - 8

    def integer_weights(self) -> torch.Tensor:
        """The integer rows the products use (`int4_weights`)."""
        return self.int4_weights()

    def products(self, hidden: torch.Tensor) -> torch.Tensor:
        """fl(P) [N, V]: the exact integer products of the int8 rows (`quantize_rows8`) and the
        copy's integer rows (float64 sums of integers < 2^53)."""
        return (quantize_rows8(hidden).double() @ self.integer_weights().double().T).float()

    def approx(self, hidden: torch.Tensor) -> torch.Tensor:
        """fl(fl(P) s_v) [N, V]: the approximate logits `argmax` ranks."""
        return self.products(hidden) * self.scale[None, :]

    def argmax_reference(self, hidden: torch.Tensor, banned: torch.Tensor | None = None,
                         margins: torch.Tensor | None = None) -> torch.Tensor:
        """The proposals; `margins` (float32 [N], written): the proposal's exact logit minus the best
        other candidate's, in float32 (infinite where no other is above -inf): how far the draft's choice
        leads, which `DraftSide.propose` stops at (a small lead: a likely rejection)."""
        hidden = hidden.float()
        approx = self.approx(hidden)
        if banned is not None:
            approx.masked_fill_(banned, -float("inf"))
        c = min(self.candidates, approx.shape[1])
        top, ids = approx.sort(dim=1, descending=True, stable=True)  # equal values: lower ids first
        top, ids = top[:, :c], ids[:, :c]
        ids, order = ids.sort(dim=1)
        exact = cpu_ops.gather_dot(hidden, self.weight, ids)
        out = torch.zeros(hidden.shape[0], dtype=torch.long)
        for r in range(hidden.shape[0]):
            best, best_id, second = None, None, -float("inf")
            for v, a, e in zip(ids[r].tolist(), top[r].gather(0, order[r]).tolist(), exact[r].tolist()):
                if a == -float("inf"):
                    continue  # banned
                if best_id is None or e > best:
                    second = second if best_id is None else best
                    best, best_id = e, v
                else:
                    second = max(second, e)
            out[r] = 0 if best_id is None else best_id
            if margins is not None:  # (float32 arithmetic, as the op's)
                margins[r] = float("inf") if second == -float("inf") else torch.tensor(best) - torch.tensor(second)
        return out


class Q2Head(Q4Head):
    """A compact draft's greedy head in 2 bits: half the bytes of `Q4Head`, the largest part of a
    draft step. Row v is stored as q_v in {-1.5, -0.5, 0.5, 1.5} (q_v + 1.5, two bits), the nearest
    level to w_v / s_v with s_v the row's standard deviation (an all-zero row: s_v = 1); the hidden
    row is rounded to int8 as for `Q4Head`, the products 2 q_v . p are exact integers and the
    approximate logit is fl(fl(2 q_v . p) s_v / 2). The `candidates` largest (ties to the lower id,
    banned tokens skipped) are rechecked in float32 and the best of those is the proposal, as
    `Q4Head.argmax` does. On base-2l's hidden states over the demo recording (372 rows, k = 3)
    the exact argmax was among the 16 / 32 / 64 best 2-bit approximations for 98.7 / 98.9 / 99.2%
    of them; 5 proposals differed from the 4-bit head's and the recording's acceptance (262 of 367)
    did not change. 32 candidates cost a 4-row pass 1.05x the 4-bit head's time (the recheck), 16
    0.96x. Sampled
    drafts read `logits` from a 4-bit copy (`Q4Head.logits`), built at its first use. The C++ op
    (`cpu_ops.q2_argmax`) streams the copy as uint8 [ceil(V/8), K/64, 8, 16]: per block of 8 rows
    and chunk of 64 features, row j's byte b holds q + 1.5 of features b, b + 16, b + 32, b + 48 in
    its bit pairs 0-1, 2-3, 4-5 and 6-7."""

    BITS, CHUNK, PAD = 2, Q2_CHUNK, 0  # padding rows: u = 0, never offered
    SCALE = 0.5  # the step of 2 q

    def __init__(self, weight: torch.Tensor, candidates: int = Q2_CANDIDATES):
        super().__init__(weight, candidates)

    @staticmethod
    def row_steps(w: torch.Tensor) -> torch.Tensor:
        """s_v = the row's standard deviation (an all-zero row: 1)."""
        s = w.std(dim=1)
        return torch.where(s > 0, s, torch.ones_like(s))

    @staticmethod
    def codes(w: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """u = q + 1.5 of rows w, q the level in {-1.5, -0.5, 0.5, 1.5} nearest to w / s."""
        return ((w / step - 0.5).round().clamp(-2, 1) + 2).to(torch.uint8)

    @functools.cached_property
    def q4(self) -> Q4Head:
        """The 4-bit copy sampled drafts read their logits from (built at its first use)."""
        return Q4Head(self.weight)

    def argmax(self, hidden: torch.Tensor, banned: torch.Tensor | None = None,
               margins: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, d] -> proposals [N] (`banned`: [V] or [N, V] bool tokens never proposed;
        `margins`: as `Q4Head.argmax`'s)."""
        if cpu_ops.active(hidden):
            return cpu_ops.q2_argmax(hidden, self.packed, self.scale, self.weight, self.candidates, banned, margins)
        return self.argmax_reference(hidden, banned, margins)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.q4.logits(hidden)

    def logits_reference(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.q4.logits_reference(hidden)

    def int2_weights(self) -> torch.Tensor:
        """2 q [V, K] int8 in {-3, -1, 1, 3}, unpacked from `packed`."""
        return 2 * self.unpacked().to(torch.int8) - 3

    def integer_weights(self) -> torch.Tensor:
        return self.int2_weights()

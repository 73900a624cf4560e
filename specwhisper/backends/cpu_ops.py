"""Decoder-step ops on the CPU: a C++ extension (`csrc/decode_ops.cpp`, built just in time with
ninja on first use) beside the PyTorch reference of each op, with the same signatures.

- `linear(x, weight, bias, out_dtype)`: x [..., K] @ weight[N, K]^T + bias, float32 accumulation;
  weight float32 or bfloat16 (a bfloat16 weight with a float32 x screens the output head).
- `gather_dot(x [M, K], weight [V, K], ids [M, C])`: x[m] · weight[ids[m, c]], bit-identical to
  `linear`'s value for that token (the exact recompute of a screened head's candidates).
- `screened_argmax(...)`: the screened int8 greedy head of `model/head.py` in one op.
- `attention(q [B, T, H, D], k_cache, v_cache [B, H, S, D], n_keys [B, T], scale)`: each query reads
  keys 0..n_keys-1 -> [B, T, H * D].
- `kv_write(k_cache, v_cache, k, v, pos [B, T])`: cache[b, :, pos[b, t]] = new[b, t].
- `layer_norm(x, weight, bias, eps)`, `gelu(x)`: the step's norms and activation (float32
  arithmetic, the same operations at every vector level).
- `decoder_step(decoder, tokens, input_pos, cache, kv_len)`: a whole decoder step in one call (the
  embeddings, the ops above in the order of `model.whisper.DecoderLayer.forward_rows`, the last
  norm): no per-op Python overhead.
- `encoder_attention(qkv [T, 3 d], heads, block=None)`: the encoder's self-attention read from its
  fused projection, over all T positions or within runs of `block` (a draft's local layers)
  (csrc/encoder_ops.h; AVX2 code only, used where AVX2 is the CPU's best level or AVX-512 runs
  on 256-bit units: `encoder_attention_usable`); spec `encoder_attention_reference`, equal to
  float rounding.
- `linear_q8(x, packed, scale, bias)`: an int8 draft's projections, x's rows rounded to 16 bits
  and multiplied in exact integers (the screen's kernels); spec `linear_q8_reference`, the same bits.

Why the C++ ops: torch's CPU GEMM runs a 1-row product at about half the memory bandwidth and
2-3 rows as repeated GEMVs; these ops read every weight once for all rows, and compute each
output element by the same operations whatever the other rows (a row's hidden state does not
depend on the batch or on T, bit for bit: what exact greedy speculation needs).

$SPECWHISPER_VECTOR_LEVEL=0/1/2 holds the ops to scalar / AVX2 / AVX-512 code from their first
use (`vector_level` does so inside a block).

Dispatch: tensors on the CPU use the C++ ops when they are built and enabled; otherwise (other
devices, $SPECWHISPER_NO_EXT=1, a failed build announced by one warning, or inside `reference()`)
the references run. The build lives in ~/.cache/specwhisper/build (or $SPECWHISPER_BUILD_DIR).
"""
from __future__ import annotations

import contextlib
import functools
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

_use_reference = False


# ---------------------------------------------------------------- references (the spec)
def linear_reference(x, weight, bias=None, out_dtype=None):
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(out_dtype or x.dtype)


def gather_dot_reference(x, weight, ids):
    return torch.einsum("mk,mck->mc", x.float(), weight.float()[ids])


def attention_reference(q, k_cache, v_cache, n_keys, scale):
    B, T, H, D = q.shape
    slots = torch.arange(k_cache.shape[2], device=q.device)
    mask = (slots < n_keys[:, :, None])[:, None]  # [B, 1, T, S]
    q = q.transpose(1, 2) * scale  # scaled before the product, as Whisper does
    out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, scale=1.0)
    return out.transpose(1, 2).reshape(B, T, H * D)


def kv_write_reference(k_cache, v_cache, k, v, pos):
    index = pos[:, None, :, None].expand(-1, k_cache.shape[1], -1, k_cache.shape[3])
    k_cache.scatter_(2, index, k.transpose(1, 2))
    v_cache.scatter_(2, index, v.transpose(1, 2))


def layer_norm_reference(x, weight, bias, eps):
    return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps).to(x.dtype)


def gelu_reference(x):
    return F.gelu(x.float()).to(x.dtype)


def commit_tokens_reference(tokens, n_tokens, done, budget, slots, choice, n_emit, eot):
    """Per row i of slot s = slots[i]: append the first m of choice[i] to tokens[s] at n_tokens[s]
    (m = n_emit[i], cut after the first EOT among them and at the budget; 0 for a done row), advance
    n_tokens[s] by m, set done[s] when the last token is EOT or the budget is reached -> m [B].
    Any device, no host read (CUDA graphs capture it)."""
    T = choice.shape[1]
    n = n_tokens[slots]
    t = torch.arange(T, device=choice.device)
    is_eot = (choice == eot) & (t[None] < n_emit[:, None])
    first_eot = torch.where(is_eot.any(1), is_eot.long().argmax(1) + 1, T + 1)
    m = torch.minimum(torch.minimum(n_emit, first_eot), budget[slots] - n)
    m = torch.where(done[slots], 0, m.clamp(min=0))
    keep = t[None] < m[:, None]
    idx = n[:, None] + t[None]  # positions past m are written back unchanged
    old = tokens[slots].gather(1, idx)
    tokens[slots[:, None], idx] = torch.where(keep, choice, old)
    n_new = n + m
    n_tokens[slots] = n_new
    last = tokens[slots].gather(1, (n_new - 1)[:, None])[:, 0]
    done[slots] |= (last == eot) | (n_new >= budget[slots])
    return m


# ---------------------------------------------------------------- dispatch
def active(x: torch.Tensor) -> bool:
    """Whether ops on tensors like `x` run the C++ extension (inference only: the ops have no
    backward, so anything recording gradients, e.g. training a draft, takes the PyTorch path)."""
    return (x.device.type == "cpu" and not _use_reference and not torch.is_grad_enabled()
            and _ops() is not None)


def available() -> bool:
    """Whether the C++ ops are built and enabled (whatever the grad mode)."""
    return _ops() is not None


@contextlib.contextmanager
def reference():
    """Run the PyTorch references inside this block (tests compare the two)."""
    global _use_reference
    before, _use_reference = _use_reference, True
    try:
        yield
    finally:
        _use_reference = before


def linear(x, weight, bias=None, out_dtype=None):
    if active(x) and weight.is_contiguous():
        return _ops().linear_rows(x, weight, bias, out_dtype)
    return linear_reference(x, weight, bias, out_dtype)


def layer_norm(x, weight, bias, eps: float):
    """Layer norm over the last dim (float32 arithmetic; equal to `layer_norm_reference` to float
    rounding): the decoder step's norms, a few microseconds against torch's ~12 on cold caches."""
    if active(x):
        return _ops().layer_norm(x, weight, bias, eps)
    return layer_norm_reference(x, weight, bias, eps)


def gelu(x):
    """The exact (erf) gelu to float rounding (`gelu_reference`); the decoder step's."""
    if active(x):
        return _ops().gelu(x)
    return gelu_reference(x)


def linear_q8_reference(x, packed, scale, bias=None):
    """`linear_q8`'s spec: each row of x rounded to 16-bit integers p = round(x / s), s = max|x| /
    `q16_range(K)` (float32 division, ties to even; a zero row: s = 0, a row with a NaN or an
    infinity: s = NaN), the exact integer products P = p . q_n, then fl(fl(fl(P) * s) * scale_n) +
    bias_n in float32."""
    from ..model.head import q16_range  # (head.py imports this module)

    n_blocks, k8 = packed.shape[:2]
    K = k8 * 8
    q = packed.transpose(1, 2).reshape(n_blocks * 8, K).double()
    rows = x.reshape(-1, K).float()
    top = rows.abs().amax(dim=1, keepdim=True)
    finite = rows.isfinite().all(dim=1, keepdim=True)
    s = top / q16_range(K)
    p = torch.where(s > 0, torch.round(rows / torch.where(s > 0, s, 1.0)), 0.0)
    s = torch.where(finite, s, torch.full_like(s, float("nan")))
    p = torch.where(finite, p, 0.0).double()
    P = (p @ q.T).float()  # integer sums, exact in float64, rounded to float32 as the kernels' are
    out = (P * s) * scale
    out = out if bias is None else out + bias.float()
    return out.reshape(*x.shape[:-1], -1).to(x.dtype)


def linear_q8(x, packed, scale, bias=None):
    """x @ (scale[:, None] * q).T + bias with q the int8 rows in the screen's block layout
    (`head.pack_int8`), x's rows rounded to 16 bits (`linear_q8_reference`): an int8 draft's
    projections (it only proposes; the target verifies)."""
    if active(x):
        return _ops().linear_q8(x, packed, scale, bias)
    return linear_q8_reference(x, packed, scale, bias)


def gather_dot(x, weight, ids):
    if active(x) and weight.is_contiguous() and weight.dtype == torch.float32:
        return _ops().gather_dot(x, weight, ids)
    return gather_dot_reference(x, weight, ids)


def screened_argmax(hidden, packed, scale, bound, weight, tiny, banned):
    """The C++ form of `head.ScreenedHead.argmax_reference` (callers check `active` first)."""
    return _ops().screened_argmax(hidden, packed, scale, bound, weight, tiny, banned)


def screened_split(hidden, packed, scale, bound, weight, tiny, banned, split: int):
    """The C++ form of `head.ScreenedHead.split_reference` (callers check `active` first)."""
    return _ops().screened_split(hidden, packed, scale, bound, weight, tiny, banned, split)


def q4_argmax(hidden, packed, scale, weight, candidates, banned, margins=None):
    """The C++ form of `head.Q4Head.argmax_reference` (callers check `active` first; `margins`:
    float32 [N] the proposals' leads are written to)."""
    return _ops().q4_argmax(hidden, packed, scale, weight, candidates, banned, margins)


def q2_argmax(hidden, packed, scale, weight, candidates, banned, margins=None):
    """The C++ form of `head.Q2Head.argmax_reference` (callers check `active` first)."""
    return _ops().q2_argmax(hidden, packed, scale, weight, candidates, banned, margins)


def q4_logits(hidden, packed, scale, weight, candidates):
    """The C++ form of `head.Q4Head.logits_reference` (callers check `active` first)."""
    return _ops().q4_logits(hidden, packed, scale, weight, candidates)


def encoder_attention_reference(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """qkv [T, 3 d] (q pre-scaled) -> softmax(q kᵀ) v per head, [T, d] (`encoder_attention`'s spec)."""
    T, d = qkv.shape[0], qkv.shape[1] // 3
    q, k, v = qkv.reshape(T, 3, heads, d // heads).permute(1, 2, 0, 3)  # [H, T, Dh] each
    return F.scaled_dot_product_attention(q, k, v, scale=1.0).transpose(0, 1).reshape(T, d)


def encoder_attention_usable(x: torch.Tensor) -> bool:
    """Whether `encoder_attention` runs its C++ kernel for tensors like `x`: at the AVX2 and AVX-512
    levels (csrc/encoder_ops.h: 512-bit tiles with AVX-512; on an AMD Zen 4, with its AVX2 tiles,
    base's encoder on 2 threads, alternated in one process, took 0.462 s a window against 0.535 s
    with torch's flash kernel, paired median 1.15, and the 512-bit tiles are 1.048x faster again)."""
    return active(x) and _ops().vector_level() >= 1


def encoder_attention(qkv: torch.Tensor, heads: int, block: int | None = None) -> torch.Tensor:
    """The encoder's self-attention from its fused projection's output qkv [T, 3 d] (q pre-scaled;
    rows may be strided) -> [T, d] (csrc/encoder_ops.h; callers check `encoder_attention_usable`):
    over all T positions, or (`block`) within each run of `block` positions (T a multiple of it,
    a draft's block-local layers: `whisper.block_attention`'s spec)."""
    return _ops().encoder_attention(qkv, heads, block or 0)


def attention(q, k_cache, v_cache, n_keys, scale):
    if active(q) and q.shape[-1] == k_cache.shape[-1]:
        return _ops().decode_attention(q, k_cache, v_cache, n_keys, scale)
    return attention_reference(q, k_cache, v_cache, n_keys, scale)


def decoder_step(decoder, tokens, input_pos, cache, kv_len: int, keep: int = 0, check: bool = True):
    """`decoder.hidden(tokens, input_pos, cache, kv_len, keep)` in one C++ call: the embeddings, every
    layer (`model.whisper.DecoderLayer.forward_rows`'s ops in its order) and the last norm, with the
    same bits (callers check `active` first). keep in 1..T-1: the last layer runs past its key/value
    projections for the last `keep` positions only, whose hidden states are returned [B, keep, d].
    `check`: `Decoder.layer_params`'s."""
    return _ops().decoder_step(tokens, input_pos, *_step_args(decoder, cache, kv_len, check), keep)


def _step_args(decoder, cache, kv_len: int, check: bool = True) -> tuple:
    """The decoder's and its cache's arguments every C++ step op takes, in their order (`check`:
    `Decoder.layer_params`'s)."""
    return (decoder.embed_tokens.weight, decoder.embed_positions.weight, decoder.layer_params(check), cache.self_k,
            cache.self_v, cache.cross_k, cache.cross_v, kv_len, decoder.layers[0].self_attn.n_heads,
            decoder.layer_norm.eps, decoder.layer_norm.weight, decoder.layer_norm.bias)


def draft_greedy(decoder, tokens, input_pos, cache, kv_len: int, head, banned, next_pos, k: int):
    """`engine.drafting.DraftSide.propose`'s greedy loop in one C++ call: `decoder.hidden(tokens,
    input_pos, cache, kv_len, keep=1)`, `head.argmax` (a 2- or 4-bit `Q4Head`) on it, then k - 1
    times the proposal fed back at next_pos + j and proposed from -> proposals [B, k], the same bits
    (callers check `decoder.cpu_fused()` and the head's `active` first)."""
    return _ops().draft_greedy(tokens, input_pos, *_step_args(decoder, cache, kv_len), head.packed, head.scale,
                               head.weight, head.candidates, banned, head.BITS, next_pos, k)[0]


def draft_propose(decoder, head, banned, cache, kv_len: int, state, d2t, B: int, k: int, width: int, max_pos: int,
                  stop_margin: float = 0.0) -> int:
    """`engine.drafting.DraftSide.propose` for greedy rows (eager) in one C++ call: the uncached
    tokens fed (`width` positions; 0: the widest row's uncached ones, `DraftSide.uncached_width`),
    `draft_greedy`'s k proposals (adaptive rows stopping at a lead under `stop_margin`), and the
    slot state (`state`: draft_passes, raw, dcached, proposals) updated in place as `propose` does
    (an engine's iteration: the weights as its windows' starts checked them,
    `Decoder.layer_params`) -> the draft steps run."""
    return _ops().draft_propose(*_step_args(decoder, cache, kv_len, check=False), head.packed,
                                head.scale, head.weight, head.candidates, banned, head.BITS, state.dtokens, state.dn,
                                state.dcached, state.draft_on, state.row_k, d2t, state.raw, state.proposals,
                                state.draft_passes, B, k, width, max_pos, stop_margin)


def verify_greedy(decoder, head, suppress, cache, kv_len: int, state, B: int, k: int, eot: int, draft_side=None):
    """`engine.runner.Runner.verify_step` for plain greedy rows (eager, no log-probabilities kept)
    in one C++ call: the pass over each row's pending token and its k proposals, the exact
    screened argmax (`head`, a `ScreenedHead`), then `accept_greedy`'s bookkeeping (an engine's
    iteration: the weights as its windows' starts checked them, `Decoder.layer_params`)."""
    from ..model.head import TINY  # (head.py imports this module)

    _ops().verify_greedy(*_step_args(decoder, cache, kv_len, check=False), head.packed,
                         head.scale, head.bound, head.weight, TINY, suppress, state.tokens, state.n_tokens,
                         state.done, state.budget, state.proposals, state.target_passes, state.drafted,
                         state.accepted_total, state.accepted_now, eot, B, k, *_draft_commit(state, draft_side))


def accept_greedy(state, choice, hidden, k: int, eot: int, draft_side=None):
    """The bookkeeping of a greedy verify pass in one C++ call (`Runner.verify_step` after its
    choice, for rows that chose without full logits): choices [B, k + 1] checked against the
    proposals, the accepted prefix committed and counted, `hidden` [B, k + 1, d] (None: no row
    wants its log-probabilities) kept for the appended tokens, and with `draft_side` its
    `commit`; `state` updated in place."""
    _ops().accept_greedy(choice, None if hidden is None else hidden.float(), state.tokens, state.n_tokens, state.done,
                         state.budget, state.proposals, state.target_passes, state.drafted, state.accepted_total,
                         state.accepted_now, None if hidden is None else state.hidden, eot, k,
                         *_draft_commit(state, draft_side))


def _draft_commit(state, draft_side) -> tuple:
    """(draft_commit, the draft's state tensors) as `accept_greedy`'s C++ form takes them."""
    if draft_side is None:
        return (False,) + (None,) * 7
    return (True, state.dtokens, state.dn, state.dcached, state.draft_on, state.raw, draft_side.t2d,
            draft_side.t2d_len)


def rule_mask(at_begin, timestamps, n_sampled, last, penultimate, last_timestamp, max_initial, suppress,
              blank_ids, eot: int, no_timestamps: int, timestamp_begin: int):
    """`engine.rules.rule_mask_reference` in one C++ call (callers check `active` first)."""
    return _ops().rule_mask(at_begin, timestamps, n_sampled, last, penultimate, last_timestamp, max_initial,
                            suppress, blank_ids, eot, no_timestamps, timestamp_begin)


def rule_state(tokens, n_tokens, prompt_len, timestamps, max_initial, slots, predicted, proposed,
               timestamp_begin: int):
    """`engine.choosing.rule_state_reference` in one C++ call (callers check `active` first)."""
    return _ops().rule_state(tokens, n_tokens, prompt_len, timestamps, max_initial, slots, predicted, proposed,
                             timestamp_begin)


def commit_tokens(tokens, n_tokens, done, budget, slots, choice, n_emit, eot: int):
    """`commit_tokens_reference` in one C++ call (the state tensors are updated in place)."""
    if active(tokens):
        return _ops().commit_tokens(tokens, n_tokens, done, budget, slots, choice, n_emit, eot)
    return commit_tokens_reference(tokens, n_tokens, done, budget, slots, choice, n_emit, eot)


@contextlib.contextmanager
def vector_level(level: int):
    """Run the C++ ops at most at vector `level` inside this block (0 scalar, 1 AVX2, 2 AVX-512;
    a level the CPU lacks falls back to the best it has): tests compare every path."""
    before = _ops().set_vector_level(level)
    try:
        yield
    finally:
        _ops().set_vector_level(before)


@contextlib.contextmanager
def lean_step(enabled: bool):
    """Inside this block a decoder step takes (True) or skips (False) its lean C++ path
    (`decoder_layers_lean`: float32 rows on raw pointers, the same bits): tests compare the two."""
    before = _ops().set_lean_step(enabled)
    try:
        yield
    finally:
        _ops().set_lean_step(before)


@contextlib.contextmanager
def without_vnni():
    """Inside this block the AVX-512 level computes the screen's products (and `linear_q8`'s) without
    AVX512-VNNI (AVX512-BW multiply-adds, the same bits), and the AVX2 level the screen's and
    `linear_q8`'s products of 3 rows or more and the drafts' 4-bit and 2-bit heads' without AVX-VNNI
    (vpmaddwd + vpaddd, vpmaddubsw + vpmaddwd; 1-2 rows never use it): tests run those paths on a
    CPU with VNNI."""
    before = _ops().set_vnni(False)
    try:
        yield
    finally:
        _ops().set_vnni(before)


@contextlib.contextmanager
def stream_prefetch(l2: bool):
    """Inside this block the decode ops prefetch their weight streams to L2 (True: prefetcht1, the
    default on Intel CPUs) or non-temporally (False: prefetchnta, the default elsewhere): the same
    bits either way; benchmarks compare the two."""
    before = _ops().set_stream_l2(l2)
    try:
        yield
    finally:
        _ops().set_stream_l2(before)


def stream_prefetch_l2() -> bool:
    """Whether the decode ops prefetch their weight streams to L2 (Intel) or non-temporally (AMD)."""
    ops = _ops()
    if ops is None:
        return False
    before = ops.set_stream_l2(False)
    ops.set_stream_l2(before)
    return bool(before)


def half_exact(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """dst (float16) = contiguous float32 `src` rounded to float16 -> whether every value widens
    back exactly (one pass in C++ where the ops are built)."""
    if src.device.type == "cpu" and src.is_contiguous() and dst.is_contiguous() and _ops() is not None:
        return bool(_ops().half_exact(src, dst))
    dst.copy_(src)
    return bool(torch.equal(dst.float(), src))


def quantize_head(weight, packed, scale, bound, coef: float, gamma: float) -> None:
    """The screened head's int8 copy, packed, with its scales and bounds (spec: model/head.py
    `quantize`); C++ only (`ScreenedHead` takes `quantize` where the ops are not built)."""
    _ops().quantize_head(weight, packed, scale, bound, coef, gamma)


def current_vector_level() -> int | None:
    """The vector level the C++ ops run at (0 scalar, 1 AVX2, 2 AVX-512; None: no ops)."""
    ops = _ops()
    return None if ops is None else int(ops.vector_level())


def kv_write(k_cache, v_cache, k, v, pos):
    if active(k):
        return _ops().kv_write(k_cache, v_cache, k, v, pos)
    return kv_write_reference(k_cache, v_cache, k, v, pos)


MKL_CBWR_AUTO, MKL_CBWR_STRICT = 2, 0x10000  # mkl_cbwr_set's settings (MKL's mkl_cbwr.h)


@functools.cache
def strict_mkl() -> bool:
    """Put MKL into its strict reproducible mode (`MKL_CBWR=AUTO,STRICT`) -> whether it is.

    With its AVX2 kernels (any CPU without AVX-512, or MKL_ENABLE_INSTRUCTIONS=AVX2) MKL's GEMMs
    split their work by thread count: torch's F.linear and its flash attention then round
    differently at 1 and at 2 threads, so the encoder features, the cross K/V and from there a
    no-speech probability (and, at a near tie, a token) depended on the thread count, e.g.
    between a Ray worker (1 thread) and the process that started it. Strict mode makes them
    thread-count independent, at no measured cost (the base encoder 426 vs 431 ms a window at
    AVX2, 263 vs 264 ms with AVX-512). MKL accepts it only before its first computation, so
    the package asks at import; an MKL_CBWR the user set is left alone (MKL reads it itself)."""
    if "MKL_CBWR" in os.environ:
        return "STRICT" in os.environ["MKL_CBWR"].upper()
    if not torch.backends.mkl.is_available():
        return False
    import ctypes

    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        return lib.mkl_serv_cbwr_set(MKL_CBWR_AUTO | MKL_CBWR_STRICT) == 0
    except (OSError, AttributeError):  # another platform, or MKL's symbols not exported
        return False


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; else the platform's answer)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@functools.cache
def huge_pages() -> str:
    """Whether the buffers a decode step streams sit in transparent huge pages
    (`model.memory.huge_zeros`: weights, heads and KV caches in their own 2 MB-aligned mappings),
    as a phrase for benchmark headers (Linux; anything else reads "off"): on when a fresh 8 MB
    buffer of that kind is faulted in as huge pages. `THP_MEM_ALLOC_ENABLE=0` turns them off."""
    from ..model.memory import huge_zeros

    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "off (no transparent huge pages here)"

    def anon_huge_kb() -> int:
        text = Path("/proc/self/smaps_rollup").read_text()
        return next(int(line.split()[1]) for line in text.splitlines() if line.startswith("AnonHugePages"))

    try:
        before = anon_huge_kb()
        probe = huge_zeros((2 << 20,), torch.float32)  # 8 MB
        probe.fill_(1.0)
        after = anon_huge_kb()
        del probe
    except (OSError, StopIteration, ValueError):
        return f"unknown (THP {mode})"
    if after - before >= 2048:
        return f"on (THP {mode}: decode buffers in 2 MB pages)"
    return f"off (THP {mode}, THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')})"


def bf16_draft_encoder() -> bool:
    """Whether a compact draft's own encoder runs in bfloat16 (`Backend.compact_draft`): with AMX.
    With AVX512-BF16 alone fbgemm's int8 projections (VNNI) are faster: tiny.en's encoder and
    cross K/V on a Zen 4 EPYC, 2 threads, took 117-132 ms a window in bfloat16, about a third of
    that with int8 projections (all layers local), so the controller had kept tiny.en off there."""
    return native_bf16() and bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


# environment variables that hold a kernel library below the CPU's widest instructions (measuring
# an AVX2-only CPU on a wider one): what a pass costs depends on them (`Drafter.costs_key`)
KERNEL_HOLDS = ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                "FBGEMM_ENABLE_INSTRUCTIONS", "SPECWHISPER_VECTOR_LEVEL", "SPECWHISPER_NO_BF16")
# oneDNN's instruction sets (its names for DNNL_MAX_CPU_ISA) below AVX-512, and those without
# bfloat16 dot products
DNNL_BELOW_AVX512 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2"}
DNNL_WITHOUT_BF16 = DNNL_BELOW_AVX512 | {"AVX512_CORE", "AVX512_CORE_VNNI"}


def onednn_hold() -> str:
    """The instruction set this process holds oneDNN to (ONEDNN_MAX_CPU_ISA, else DNNL_MAX_CPU_ISA;
    upper case; "" where neither is set)."""
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()


def kernel_holds() -> dict[str, str]:
    """The `KERNEL_HOLDS` set in this process's environment (name: value)."""
    return {name: os.environ[name] for name in KERNEL_HOLDS if os.environ.get(name)}


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AVX512-BF16 or AMX) that torch's GEMMs use: a
    draft's encoder and cross K/V then run in bfloat16 (about 3-4x faster than float32 here). Not
    where oneDNN, which runs torch's bfloat16 GEMMs, is held below it (DNNL_MAX_CPU_ISA=AVX2 or
    ONEDNN_MAX_CPU_ISA): there tiny.en's bfloat16 encoder took 730 ms a window where its int8 one
    takes 46 (2 threads of an Intel Xeon with AMX), and drafting with it made calls 2x slower."""
    if os.environ.get("SPECWHISPER_NO_BF16", "") not in ("", "0"):
        return False
    if onednn_hold() in DNNL_WITHOUT_BF16:
        return False
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


@functools.cache
def _ops():
    """torch.ops.specwhisper_decode, built on first use; None if disabled or if the build fails."""
    if os.environ.get("SPECWHISPER_NO_EXT", "") not in ("", "0"):
        return None
    try:
        torch.ops.specwhisper_decode.linear_rows
    except (AttributeError, RuntimeError):
        try:
            _build()
        except Exception as exc:
            warnings.warn(f"specwhisper: could not build the C++ decode ops ({exc}); the decoder "
                          "uses PyTorch ops on the CPU (set SPECWHISPER_NO_EXT=1 to skip the build)",
                          RuntimeWarning, stacklevel=3)
            return None
    ops = torch.ops.specwhisper_decode
    level = os.environ.get("SPECWHISPER_VECTOR_LEVEL", "")
    if level:  # hold the ops to a lower vector level (measuring an AVX2-only CPU on a wider one)
        if level not in ("0", "1", "2"):
            raise ValueError(f"SPECWHISPER_VECTOR_LEVEL must be 0 (scalar), 1 (AVX2) or 2 (AVX-512), got {level!r}")
        ops.set_vector_level(int(level))
    return ops


def _build() -> None:
    # one build folder and one source folder for all
    from .ops import build_dir, headers_flag, hold_build_lock, load_or_build, stage_sources

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    # -ffp-contract=off: only the FMAs written in the source, so the scalar and vector forms of
    # every op compute the same bits
    # -fopenmp: at::parallel_for is a header template whose `omp parallel` is compiled into this
    # extension; without the flag every op silently runs on one thread (half the bandwidth here)
    cflags = ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp"]
    with contextlib.ExitStack() as stack:
        hold_build_lock(stack, directory)
        staged = stage_sources(directory, ("decode_ops.cpp", "encoder_ops.h"))
        cflags.append(headers_flag(staged, ("encoder_ops.h",)))
        load_or_build(directory, "specwhisper_decode_ops", [staged["decode_ops.cpp"], staged["encoder_ops.h"]], 1,
                      cflags, ["-fopenmp"])

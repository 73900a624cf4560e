"""Whisper encoder and decoder as plain `nn.Module`s.

Attribute names equal the Hugging Face safetensors keys (without the leading `model.`), so weights
load with `load_state_dict(strict=True, assign=True)`. The decoder is stateless: its static KV
cache is a separate `DecoderCache` of preallocated buffers written in place, so one set of weights
serves several caches (batch buckets, threads) and a step is graph-safe (no allocation of cache
memory, no host sync, positions passed as tensors).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..backends import cpu_ops
from ..config import WhisperConfig
from . import encoder_cpu
from .memory import huge_zeros


class NoMetaInit:
    """Skips a module's random initialisation on the meta device, where `load_whisper` builds the
    model before assigning the checkpoint's tensors; elsewhere it initialises as torch's module
    does. On a meta tensor torch's `normal_` imported `torch._dynamo` (2.4-3.7 s of every process
    that loads a model: a CLI call of a 30 s clip spent longer on it than on transcribing), and
    `uniform_` runs a Python decomposition: base's 96 linears and 2 convolutions took 0.15 s of
    `Engine("base")`'s 0.83 (tiny.en's 0.03 more)."""

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            super().reset_parameters()


class Embedding(NoMetaInit, nn.Embedding):
    pass


class Linear(NoMetaInit, nn.Linear):
    pass


class Conv1d(NoMetaInit, nn.Conv1d):
    pass


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.q_proj = Linear(d_model, d_model)
        self.k_proj = Linear(d_model, d_model, bias=False)  # Whisper has no key bias
        self.v_proj = Linear(d_model, d_model)
        self.out_proj = Linear(d_model, d_model)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, Dh]

    def fuse(self, names: tuple[str, ...]) -> None:
        """Pack the weights of projections `names` (e.g. q, k, v) into one matrix: one matrix
        product instead of several. Their parameters become views of it, so the state dict
        keeps the HF keys."""
        projs = [getattr(self, f"{n}_proj") for n in names]
        d = projs[0].out_features
        weight = torch.cat([p.weight for p in projs])
        self.fused_bias = torch.cat([p.bias if p.bias is not None else torch.zeros_like(p.weight[:, 0])
                                     for p in projs])
        for i, proj in enumerate(projs):
            proj.weight = nn.Parameter(weight[i * d:(i + 1) * d], requires_grad=False)
        self.fused_weight, self.fused_names = weight, names

    def project(self, x: torch.Tensor, names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
        """Projections `names` of x as [B, H, T, Dh] each (q unscaled)."""
        if getattr(self, "fused_names", None) == names:
            return tuple(self.heads(t) for t in F.linear(x, self.fused_weight, self.fused_bias).chunk(len(names), dim=-1))
        return tuple(self.heads(getattr(self, f"{n}_proj")(x)) for n in names)

    def attend(self, x, k, v, mask=None, block: int | None = None) -> torch.Tensor:
        return self.attend_q(self.heads(self.q_proj(x)), k, v, mask, block)

    def attend_q(self, q, k, v, mask=None, block: int | None = None) -> torch.Tensor:
        # Scale q before the product, as Whisper does (the order matters for bit-level parity).
        q = q * self.head_dim**-0.5
        if block is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        elif mask is None:
            out = block_attention(q, k, v, block)
        else:
            raise ValueError("block attention takes no mask")
        b, _, t, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    """Attention of q [B, H, T, Dh] (pre-scaled) to k/v within consecutive blocks of `block`
    positions: position t sees only the positions of its own block (T a multiple of `block`).
    One kernel call over [B, H * T / block, block, Dh]: 1 / (T / block) of full attention's work."""
    B, H, T, D = q.shape
    if T % block:
        raise ValueError(f"block attention needs a length that is a multiple of {block}, got {T}")
    split = lambda t: t.reshape(B, H * (T // block), block, D)  # noqa: E731 (a view where contiguous)
    return F.scaled_dot_product_attention(split(q), split(k), split(v), scale=1.0).view(B, H, T, D)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: WhisperConfig):
        super().__init__()
        d = cfg.d_model
        self.self_attn = Attention(d, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, block: int | None = None) -> torch.Tensor:
        h = self.self_attn_layer_norm(x)
        x = x + self.self_attn.attend(h, *self.self_attn.project(h, ("k", "v")), block=block)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class Encoder(nn.Module):
    def __init__(self, cfg: WhisperConfig):
        super().__init__()
        d = cfg.d_model
        self.conv1 = Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = Embedding(cfg.max_source_positions, d)  # sinusoids, stored
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    features_dtype: torch.dtype | None = None  # dtype of the returned features (None: the weights')
    int8_linears = False  # a draft's encoder: projections in int8 on the fast CPU path (`Whisper.int8_encoder`)
    fast_cpu = True  # float32 on the CPU: `encoder_cpu` (oneDNN fused products); False: `reference`
    # a draft's own encoder: its layers but the last (all with `local_last`) attend within blocks
    # of this many positions (`Whisper.local_encoder`; None: full attention, as Whisper)
    attention_block: int | None = None
    local_last = False
    # a draft's own encoder: its layers run on the means of each run of this many adjacent
    # positions (`Whisper.pool_encoder`; 1: every position, as Whisper)
    pool_positions = 1

    def layer_blocks(self, T: int) -> list[int | None]:
        """Each layer's attention block for the T positions its layers run on (None: full
        attention); `attention_block` counts 20-ms positions, so pooled ones make it shorter."""
        b = None if self.attention_block is None else self.attention_block // self.pool_positions
        local = b is not None and T % b == 0 and T > b
        n = len(self.layers)
        return [b if local and (i < n - 1 or self.local_last) else None for i in range(n)]

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [B, n_mels, 3000] -> audio features [B, 1500 / pool_positions, d_model], computed
        in the weights' dtype and returned in `features_dtype` (a bfloat16 decoder on a CPU without
        native bfloat16 arithmetic keeps a float32 encoder: 7x faster here)."""
        out = self.features_dtype or self.conv1.weight.dtype
        mel = mel.to(self.conv1.weight.dtype)
        positions = (mel.shape[-1] + 1) // 2  # conv2's outputs (stride 2)
        if positions % self.pool_positions:
            raise ValueError(f"an encoder pooling {self.pool_positions} positions needs a multiple of "
                             f"{2 * self.pool_positions} mel frames, got {mel.shape[-1]}")
        if self.fast_cpu and encoder_cpu.usable(self, mel):
            return encoder_cpu.encode(self, mel).to(out)
        return self.reference(mel).to(out)

    def reference(self, mel: torch.Tensor) -> torch.Tensor:
        """The spec: mel [B, n_mels, frames] -> features [B, frames / (2 pool_positions), d] in the
        weights' dtype."""
        x = F.gelu(self.conv2(F.gelu(self.conv1(mel)))).transpose(1, 2)
        x = encoder_cpu.pool_rows(x + self.embed_positions.weight[: x.shape[1]], self.pool_positions)
        for layer, block in zip(self.layers, self.layer_blocks(x.shape[1])):
            x = layer(x, block)
        return self.layer_norm(x)


@dataclass
class DecoderCache:
    """Preallocated decoder state for `batch` rows; every tensor is written in place.

    self_k/self_v: [n_layers, batch, heads, max_positions + 1, head_dim] self-attention keys/values;
    the last slot is a *scratch* slot: writes for positions past the end (proposals a row can never
    use) land there instead of overwriting a real slot, and no query ever reads it.
    cross_k/cross_v: [n_layers, batch, heads, 1500, head_dim] cross-attention keys/values,
    computed once per utterance by `Decoder.fill_cross`, in `cross_dtype` (default: `dtype`; a
    compact draft on the CPU keeps them in bfloat16, read by the C++ attention as float32).
    """

    self_k: torch.Tensor
    self_v: torch.Tensor
    cross_k: torch.Tensor
    cross_v: torch.Tensor

    @classmethod
    def allocate(cls, cfg: WhisperConfig, batch: int, device, dtype, cross_dtype=None,
                 cross_positions: int | None = None) -> "DecoderCache":
        """Zeroed caches for `batch` rows; `cross_positions`: the cross K/V's positions (default:
        the encoder's, 1500; a pooled draft's fewer)."""
        h = cfg.decoder_attention_heads
        shape = (cfg.decoder_layers, batch, h, cfg.max_target_positions + 1, cfg.d_model // h)
        cross = (cfg.decoder_layers, batch, h, cross_positions or cfg.max_source_positions, cfg.d_model // h)
        def new(s, t=dtype):  # CPU caches in huge pages, faulted in as slots first write them
            if torch.device(device).type == "cpu":
                return huge_zeros(s, t)
            return torch.zeros(s, device=device, dtype=t)

        return cls(new(shape), new(shape), new(cross, cross_dtype or dtype), new(cross, cross_dtype or dtype))

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.self_k, self.self_v, self.cross_k, self.cross_v


class DecoderLayer(nn.Module):
    def __init__(self, cfg: WhisperConfig):
        super().__init__()
        d = cfg.d_model
        self.self_attn = Attention(d, cfg.decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = Attention(d, cfg.decoder_attention_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = Linear(d, cfg.decoder_ffn_dim)
        self.fc2 = Linear(cfg.decoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x, input_pos, mask, self_k, self_v, cross_k, cross_v):
        """x [B, T, d]; input_pos [B, T] (cache slots written); mask [B, 1, T, S]; caches [B, H, S, Dh]."""
        q, k, v = self.self_attn.project(self.self_attn_layer_norm(x), ("q", "k", "v"))  # [B, H, T, Dh]
        index = input_pos[:, None, :, None].expand_as(k)
        self_k.scatter_(2, index, k)
        self_v.scatter_(2, index, v)
        x = x + self.self_attn.attend_q(q, self_k, self_v, mask)
        x = x + self.encoder_attn.attend(self.encoder_attn_layer_norm(x), cross_k, cross_v)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))

    def forward_fused(self, x, write_pos, n_self, n_cross, self_k, self_v, cross_k, cross_v, kernel):
        """`forward` on `kernel`'s GPU decode ops (specwhisper/kernels/decode_ops.py): the six linears with their
        layer norms, GELU and residual adds fused, and both attentions, each reading the first
        n_self / n_cross [B, T] slots: the same results to float rounding in half the kernels, each
        row's and query's bits independent of the others; the q/k/v projection writes the keys and
        values into the cache itself. The self-attention's q/k/v must be fused."""
        sa, ca = self.self_attn, self.encoder_attn
        B, T, d = x.shape
        ln = lambda m: (m.weight, m.bias, m.eps)  # noqa: E731
        scale = sa.head_dim**-0.5
        x = x.reshape(B * T, d)
        qkv = kernel.decode_linear(x, sa.fused_weight, sa.fused_bias, layer_norm=ln(self.self_attn_layer_norm),
                                   kv_write=(self_k, self_v, write_pos))  # k, v into the cache too
        q = sa.heads(qkv.view(B, T, 3 * d)[..., :d])
        a = kernel.decode_attention(q, self_k, self_v, n_self, scale)
        x = kernel.decode_linear(a.view(B * T, d), sa.out_proj.weight, sa.out_proj.bias, residual=x)
        q = kernel.decode_linear(x, ca.q_proj.weight, ca.q_proj.bias, layer_norm=ln(self.encoder_attn_layer_norm))
        a = kernel.decode_attention(ca.heads(q.view(B, T, d)), cross_k, cross_v, n_cross, scale)
        x = kernel.decode_linear(a.view(B * T, d), ca.out_proj.weight, ca.out_proj.bias, residual=x)
        h = kernel.decode_linear(x, self.fc1.weight, self.fc1.bias, layer_norm=ln(self.final_layer_norm), gelu=True)
        return kernel.decode_linear(h, self.fc2.weight, self.fc2.bias, residual=x).view(B, T, d)

    def forward_rows(self, x, write_pos, n_self, n_cross, self_k, self_v, cross_k, cross_v):
        """`forward` with the CPU decode ops (`cpu_ops`): the same results to float rounding, and
        each row's result independent of the other rows and of T. n_self / n_cross [B, T]: how
        many cache slots each query reads (slots 0..n-1)."""
        sa, ca = self.self_attn, self.encoder_attn
        B, T, _ = x.shape
        H, Dh = sa.n_heads, sa.head_dim
        qkv = cpu_ops.linear(norm(self.self_attn_layer_norm, x), sa.fused_weight, sa.fused_bias)
        q, k, v = qkv.view(B, T, 3, H, Dh).unbind(2)  # [B, T, H, Dh] each
        cpu_ops.kv_write(self_k, self_v, k, v, write_pos)
        a = cpu_ops.attention(q, self_k, self_v, n_self, Dh**-0.5)
        x = x + cpu_ops.linear(a, sa.out_proj.weight, sa.out_proj.bias)
        q = cpu_ops.linear(norm(self.encoder_attn_layer_norm, x), ca.q_proj.weight, ca.q_proj.bias)
        a = cpu_ops.attention(q.view(B, T, H, Dh), cross_k, cross_v, n_cross, Dh**-0.5)
        x = x + cpu_ops.linear(a, ca.out_proj.weight, ca.out_proj.bias)
        h = cpu_ops.gelu(cpu_ops.linear(norm(self.final_layer_norm, x), self.fc1.weight, self.fc1.bias))
        return x + cpu_ops.linear(h, self.fc2.weight, self.fc2.bias)


PROJECTIONS = (2, 4, 8, 10, 14, 16)  # the weight matrices among a layer's `layer_params`


def exact_half(w: torch.Tensor, huge: bool = False) -> torch.Tensor:
    """A float16 copy of float32 `w` if it holds only float16 values (the copy widens back to `w`
    bit for bit), else `w` itself. `huge`: the copy in 2 MB pages (`memory.huge_zeros`)."""
    if w.dtype != torch.float32:
        return w
    huge = huge and w.device.type == "cpu"
    h = huge_zeros(w.shape, torch.float16) if huge else torch.empty(w.shape, dtype=torch.float16, device=w.device)
    return h if cpu_ops.half_exact(w.detach().contiguous(), h) else w


SMALL_BYTES = 1 << 16  # module tensors up to this size are copied into the step's buffer (`one_buffer`)


def one_buffer(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU tensors side by side in one allocation (each 64-byte aligned) -> views of the
    copies, the same values. A decoder step streams its ~40 weight tensors a layer in order; apart
    they were 0.5-2 MB allocations, mostly in 4 KB pages (base's float16 projections: 20 of 44 MB
    in huge pages), and the hardware prefetchers stop at every 4 KB page. In one allocation
    (`memory.huge_zeros`) they sit in 2 MB pages. Cold caches, 2 threads of a Zen 3 EPYC, paired medians of
    60 alternated steps in one process: base's target step 0.974-1.000x of the time apart, its
    distilled draft's step 0.96-1.00x (4 runs); never slower, and two engines in one process no
    longer differ by where the allocator happened to put their copies."""
    spans = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]
    buffer = huge_zeros((sum(spans),), torch.uint8)
    out, offset = [], 0
    for t, span in zip(tensors, spans):
        n = t.numel() * t.element_size()
        copy = buffer[offset:offset + n].view(t.dtype).view(t.shape)
        copy.copy_(t)
        out.append(copy)
        offset += span
    return out


def norm(layer: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` with the CPU decode ops' layer norm (`cpu_ops.layer_norm`), the decoder step's."""
    return cpu_ops.layer_norm(x, layer.weight, layer.bias, layer.eps)


class Decoder(nn.Module):
    def __init__(self, cfg: WhisperConfig):
        super().__init__()
        d = cfg.d_model
        self.embed_tokens = Embedding(cfg.vocab_size, d)  # also the (tied) output head
        self.embed_positions = Embedding(cfg.max_target_positions, d)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    @torch.no_grad()
    def fill_cross(self, cache: DecoderCache, audio_features: torch.Tensor, rows: slice = slice(None),
                   frames: int | None = None):
        """Compute cross-attention K/V once per utterance into the cache rows `rows`, one
        utterance at a time: a row's K/V never depend on the other rows (a GEMM's rounding may
        depend on its shape). `frames`: the features past it are zero (`Drafter.encode`), so their
        K/V are the projections of one zero row (its biases), written without the products."""
        targets = range(cache.cross_k.shape[1])[rows]
        assert len(targets) == audio_features.shape[0], (len(targets), audio_features.shape)
        T = audio_features.shape[1]
        if frames is not None and frames < T:
            for j, row in enumerate(targets):
                # the audio's frames, then one zero row whose K/V every later position takes
                zero = audio_features.new_zeros(1, 1, audio_features.shape[2])
                part = torch.cat([audio_features[j:j + 1, :frames], zero], 1)
                head = DecoderCache(cache.self_k[:, row:row + 1], cache.self_v[:, row:row + 1],
                                    cache.cross_k[:, row:row + 1, :, :frames + 1],
                                    cache.cross_v[:, row:row + 1, :, :frames + 1])
                self.fill_cross(head, part)
                for buf in (cache.cross_k, cache.cross_v):
                    rest = buf[:, row:row + 1, :, frames + 1:]
                    rest.copy_(buf[:, row:row + 1, :, frames:frames + 1].expand_as(rest))
            return
        for j, row in enumerate(targets):
            features = audio_features[j:j + 1]
            for i, layer in enumerate(self.layers):
                attn = layer.encoder_attn
                weight_dtype = attn.k_proj.weight.dtype
                if self.int8_cross and features.dtype == torch.float32 and encoder_cpu.usable_rows(features):
                    # a draft whose own encoder runs in int8: its K/V projections too (`Whisper.int8_encoder`)
                    kv = encoder_cpu.linear(features[0], self.cross_int8(i))  # [T, 2 d]
                    k, v = (attn.heads(t[None]) for t in kv.chunk(2, -1))
                elif weight_dtype == torch.bfloat16 and self.native_bf16:
                    # a compact draft on a CPU with bfloat16 arithmetic: torch's bfloat16 GEMM
                    k, v = (attn.heads(F.linear(features.to(torch.bfloat16), p.weight, p.bias))
                            for p in (attn.k_proj, attn.v_proj))
                elif weight_dtype == torch.bfloat16 and features.dtype == torch.float32:
                    # a compact draft (bfloat16 weights, float32 compute): torch's float32 GEMM
                    k, v = (attn.heads(F.linear(features, p.weight.float(), None if p.bias is None else p.bias.float()))
                            for p in (attn.k_proj, attn.v_proj))
                elif cpu_ops.active(features) and weight_dtype == torch.bfloat16:
                    # torch's bfloat16 GEMM is slow without native bf16 arithmetic
                    k, v = (attn.heads(cpu_ops.linear(features, p.weight, p.bias)) for p in (attn.k_proj, attn.v_proj))
                elif self.fast_cross and weight_dtype == torch.float32 and encoder_cpu.usable_rows(features):
                    # one oneDNN product per layer on weights reordered once (`cross_packed`)
                    kv = encoder_cpu.linear(features[0], self.cross_packed(i))  # [T, 2 d]
                    k, v = (attn.heads(t[None]) for t in kv.chunk(2, -1))
                else:
                    k, v = attn.project(features, ("k", "v"))
                cache.cross_k[i, row:row + 1].copy_(k)
                cache.cross_v[i, row:row + 1].copy_(v)

    def cross_int8(self, i: int):
        """Layer i's cross-attention K and V projections as one int8 product (`encoder_cpu`'s
        dynamic int8 linear), packed once and kept until a weight changes (`int8_cross`)."""
        return self._cross_kept(i, "_cross_int8", lambda w, b: (encoder_cpu.int8_pack(w.float(), b.float()),))[0]

    def cross_packed(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's cross-attention K and V projections as one product's weights [2 d, d] in
        oneDNN's layout and its bias (k has none), reordered once and kept until a weight changes."""
        return self._cross_kept(i, "_cross_packed", lambda w, b: (encoder_cpu.pack(w, self.cross_rows), b))

    def _cross_kept(self, i: int, name: str, make) -> tuple:
        """make(weight [2 d, d], bias [2 d]) of layer i's K and V projections stacked (k's missing
        bias as zeros), kept in the dict `name` until one of their parameters changes."""
        attn = self.layers[i].encoder_attn
        k, v = attn.k_proj, attn.v_proj
        key = encoder_cpu.parameter_key(k, v)
        kept = self.__dict__.setdefault(name, {}).get(i)
        if kept is None or kept[0] != key:
            weight = torch.cat([k.weight, v.weight]).detach()
            bias = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features)
                              for p in (k, v)]).detach()
            kept = self.__dict__[name][i] = (key, *make(weight, bias))
        return kept[1:]

    def hidden(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache: DecoderCache,
               kv_len: int | None = None, keep: int | None = None, check: bool = True) -> torch.Tensor:
        """Run the blocks for tokens [B, T] at positions input_pos [B, T] -> hidden [B, T, d].

        Row b of the cache holds row b's keys; a query at position p sees cache slots 0..p, so
        stale slots past a row's length (after a rollback) are never read. `kv_len` (a bound on
        every position + 1, known on the host) trims the attended window; None attends all slots.
        `keep`: only the last `keep` positions' hidden states are wanted -> [B, keep, d], the same
        bits as [:, -keep:] of the whole; the caches get every position's keys and values. The C++
        step then runs the last layer past its key/value projections for those positions only (a
        long-form prompt pass of ≈ 200 positions whose last few are read: one layer's attention and
        MLP for the rest spared); elsewhere the whole is sliced. `check` False: the C++ step reads
        its weight copies as last checked (`layer_params`; an engine's iterations, whose windows
        checked at their start: the demo recording's long-form calls, 2 threads of a Zen 4 EPYC,
        8 alternated rounds, 1.009x paired for base alone and drafted by base-2l).
        """
        T = tokens.shape[1]
        keep = None if keep is None or keep >= T else keep
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        b = tokens.shape[0]
        last = self.embed_positions.num_embeddings - 1  # the last real position (447)
        s = self.slots(kv_len)
        kernel = self.fused_ops  # the GPU decode ops (`Whisper.fuse_decode_ops`), or None
        cpu = self.cpu_rows()
        if cpu and self.fused_step:  # all of the forward_rows branch below in one C++ call
            return cpu_ops.decoder_step(self, tokens, input_pos, cache, s, keep or 0, check)
        if keep is not None:
            return self.hidden(tokens, input_pos, cache, kv_len)[:, T - keep:]
        write_pos = input_pos.clamp(max=min(last + 1, s - 1))  # past the end: the scratch slot
        x = self.embed_tokens(tokens) + self.embed_positions(input_pos.clamp(max=last))
        rows = (cache.self_k[:, :b, :, :s], cache.self_v[:, :b, :, :s], cache.cross_k[:, :b], cache.cross_v[:, :b])
        layers = zip(self.layers, *rows)
        if cpu or kernel is not None:  # the row-independent ops: per-query slot counts, no mask
            # a query reads real slots up to its position, never the scratch slot
            n_self = (input_pos.clamp(max=min(last, s - 1)) + 1).long().contiguous()  # [B, T]
            n_cross = torch.full_like(n_self, cache.cross_k.shape[3])
            write_pos = write_pos.long().contiguous()
            if kernel is not None:
                for layer, self_k, self_v, cross_k, cross_v in layers:
                    x = layer.forward_fused(x, write_pos, n_self, n_cross, self_k, self_v, cross_k, cross_v, kernel)
                return self.layer_norm(x)
            for layer, self_k, self_v, cross_k, cross_v in layers:
                x = layer.forward_rows(x, write_pos, n_self, n_cross, self_k, self_v, cross_k, cross_v)
            return norm(self.layer_norm, x)
        slots = torch.arange(s, device=tokens.device)
        mask = ((slots <= input_pos[:, :, None]) & (slots <= last))[:, None]  # [B, 1, T, S]
        for layer, self_k, self_v, cross_k, cross_v in layers:
            x = layer(x, write_pos, mask, self_k, self_v, cross_k, cross_v)
        return self.layer_norm(x)

    def slots(self, kv_len: int | None) -> int:
        """The cache slots a step attends (`hidden`'s kv_len; None: every position + the scratch slot)."""
        return self.embed_positions.num_embeddings + 1 if kv_len is None else kv_len

    def cpu_rows(self) -> bool:
        """The C++ decode ops run this decoder's rows (CPU weights, q/k/v fused, no GPU kernel)."""
        return (self.fused_ops is None and cpu_ops.active(self.embed_tokens.weight)
                and getattr(self.layers[0].self_attn, "fused_names", None) == ("q", "k", "v"))

    def rows_independent(self) -> bool:
        """A pass's rows are computed independently of each other, bit for bit (the C++ decode
        ops, the GPU decode ops): a row's hidden states, cache entries and logits are the same
        whatever rows run beside it (`Runner.admit` prefills windows together only then). Asked
        as an inference pass would find it (the C++ ops never record gradients)."""
        with torch.no_grad():
            return self.fused_ops is not None or self.cpu_rows()

    def cpu_fused(self) -> bool:
        """A whole step is one C++ call (`cpu_ops.decoder_step`)."""
        return self.fused_step and self.cpu_rows()

    fused_step = True  # False: run the layers one `forward_rows` call at a time (the spec)
    # float32 on the CPU: the cross K/V from oneDNN products (`cross_packed`; base, two Zen 3 cores,
    # alternated in one process: 109.7 -> 90.2 ms a window); False: torch's GEMM (`AttentionBase.project`)
    fast_cross = True
    # a draft's cross K/V projections in int8 (`Whisper.int8_encoder` sets it with its encoder's)
    int8_cross = False
    cross_rows = 1500  # the rows oneDNN's weight layout is chosen for (a window's audio features)
    # the module whose `decode_linear` / `decode_attention` run the layers (`Whisper.fuse_decode_ops`)
    fused_ops = None
    compact = False  # projections in bfloat16 (`Whisper.compact_decoder`)
    native_bf16 = False  # a compact decoder's cross K/V from torch's bfloat16 GEMM (`compact_decoder`)
    int8 = False  # the C++ step reads int8 copies of the projections (`Whisper.int8_projections`)
    half = False  # ... float16 copies of float32 projections that are float16 values (`Whisper.half_projections`)

    def layer_params(self, check: bool = True) -> list[torch.Tensor]:
        """The 18 tensors per layer `cpu_ops.decoder_layers` reads, in its order (cached; call
        `forget_layer_params` after replacing weights); an int8 decoder (`int8_projections`)
        passes its packed int8 projections and appends their 6 scales (24 per layer); a `half`
        one passes float16 copies of the projection weights that are float16 values. Either passes
        copies of its tensors in one allocation (`one_buffer`; the float32 weights a step reads
        itself stay where they are), rebuilt when a tensor they copy changes in place, as the step
        would see a tensor it reads itself (not for inference tensors, which keep no version
        counter: call forget_layer_params after changing one).

        `check` False skips that check (the copies as last checked): an engine's iterations, whose
        windows checked at their start (the prompt pass), so a change in place reaches an engine
        from its next window on. The check reads a version counter of each of base's 108 copied
        tensors, each a cache miss right after a step has streamed the weights: ≈ 0.15 ms an
        iteration of base drafted by base-2l (2 threads of a Zen 4 EPYC), 4% of a step."""
        copied = getattr(self, "_copied", ()) if check else ()
        if any(version is not None and t._version != version for t, version in copied):
            self._layer_params = None
        if getattr(self, "_layer_params", None) is None:
            params, sources = [], []  # what the step reads, and the tensor each copies (None: its own)
            for layer in self.layers:
                sa, ca = layer.self_attn, layer.encoder_attn
                w = [sa.fused_weight, sa.out_proj.weight, ca.q_proj.weight, ca.out_proj.weight,
                     layer.fc1.weight, layer.fc2.weight]
                b = [sa.fused_bias, sa.out_proj.bias, ca.q_proj.bias, ca.out_proj.bias, layer.fc1.bias, layer.fc2.bias]
                w_from, b_from, scales, own_scales = w, b, [], []
                if self.half:
                    w = [exact_half(t) for t in w]
                if self.int8:
                    # the packs and scales are the step's own (`int8_projections` replaces them and forgets)
                    w, scales = [q for q, _ in layer.int8], [s for _, s in layer.int8]
                    w_from, own_scales = [None] * len(w), [None] * len(scales)
                    # the int8 products add their biases in float32: widened once here (exactly),
                    # not in every call (a compact draft's bfloat16 biases: 24 conversions a
                    # tiny.en step)
                    b = [t.float() for t in b]
                norms = [layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm]
                for out, ws, bs, ss in ((params, w, b, scales), (sources, w_from, b_from, own_scales)):
                    out += [t for i in range(3) for t in (norms[i].weight, norms[i].bias, ws[2 * i], bs[2 * i],
                                                         ws[2 * i + 1], bs[2 * i + 1])] + ss
            params = [t.detach() for t in params]
            self._copied = []
            if (self.half or self.int8) and params and params[0].device.type == "cpu":
                own = {t.data_ptr() for t in self.parameters()}
                moved = [i for i, t in enumerate(params)
                         if t.data_ptr() not in own or t.numel() * t.element_size() <= SMALL_BYTES]
                for i, copy in zip(moved, one_buffer([params[i] for i in moved])):
                    params[i] = copy
                self._copied = [(sources[i], None if sources[i].is_inference() else sources[i]._version)
                                for i in moved if sources[i] is not None]
                if self.int8:  # the step's copies are the packs from now on (not held twice)
                    per = len(params) // len(self.layers)
                    for j, layer in enumerate(self.layers):
                        p = params[per * j:per * (j + 1)]
                        layer.int8 = [(p[k], s) for k, s in zip(PROJECTIONS, p[18:])]
            self._layer_params = params
        return self._layer_params

    def forget_layer_params(self) -> None:
        self._layer_params = None
        self.__dict__.pop("_head_half", None)

    def head_weight(self) -> torch.Tensor:
        """The tied output head as the C++ linear reads it: with `half`, a float16 copy of the
        float32 embedding when it holds only float16 values (Whisper's checkpoints: the same bits,
        half the bytes), made at first use and remade when the embedding changes; else the
        embedding. The full logits' product: a window's kept log-probabilities (≈ 95 rows) and
        every sampled step read 106 MB of base's head in float32, 53 MB so."""
        w = self.embed_tokens.weight
        if not self.half or w.dtype != torch.float32 or w.device.type != "cpu":
            return w
        key = (w.data_ptr(), None if w.is_inference() else w._version)
        cached = self.__dict__.get("_head_half")
        if cached is None or cached[0] != key:
            cached = (key, exact_half(w, huge=True))
            self.__dict__["_head_half"] = cached
        return cached[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> float32 logits [..., vocab] (tied output head, float32 accumulation)."""
        if cpu_ops.active(hidden):
            return cpu_ops.linear(hidden, self.head_weight(), None, torch.float32)
        if self.fused_ops is not None:  # rows independent of each other (the GPU decode ops)
            flat = hidden.reshape(-1, hidden.shape[-1])
            if not flat.is_contiguous():
                flat = flat.contiguous()
            return self.fused_ops.decode_linear(flat, self.embed_tokens.weight).view(
                *hidden.shape[:-1], -1).float()
        return (hidden @ self.embed_tokens.weight.T).float()

    def forward(self, tokens, input_pos, cache, kv_len=None) -> torch.Tensor:
        """tokens [B, T], input_pos [B, T] -> logits [B, T, vocab]."""
        return self.logits(self.hidden(tokens, input_pos, cache, kv_len))


class Whisper(nn.Module):
    def __init__(self, cfg: WhisperConfig):
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)

    def fuse(self) -> None:
        """After loading: fuse the decoder's self-attention q/k/v projections (see
        `Attention.fuse`)."""
        for layer in self.decoder.layers:
            layer.self_attn.fuse(("q", "k", "v"))
        self.decoder.forget_layer_params()

    def fuse_decode_ops(self, kernel=None) -> None:
        """Run the decoder's layers on the GPU decode ops (specwhisper/kernels/decode_ops.py; `kernel`: that
        module, by default this checkout's, compiled by Triton): linears with their layer norms,
        GELU and residual adds fused, and chunked attention, each row's bits independent of the
        others. Experimental, for the GPU (bench/gpu_profile.py times it); the CPU's C++ path
        fuses its own. Fuses q/k/v first."""
        head_dim = self.decoder.layers[0].self_attn.head_dim
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise ValueError(f"the decode ops need a head size that is a power of two >= 16, this "
                             f"model's is {head_dim}")
        if kernel is None:
            from ..backends.ops import _import_kernels

            try:
                kernel = _import_kernels("decode_ops")
            except ImportError as exc:
                raise RuntimeError(f"the decode ops need Triton, which cannot be imported ({exc})") from exc
        if getattr(self.decoder.layers[0].self_attn, "fused_names", None) != ("q", "k", "v"):
            self.fuse()
        self.decoder.fused_ops = kernel

    def compact_decoder(self) -> None:
        """Store the decoder blocks' projection weights in bfloat16 (half the bytes a step reads),
        computing in float32 as before (`cpu_ops.linear` widens them exactly). For drafts on the
        CPU only: a draft proposes and the target verifies, so the output stays exact; the C++
        decode ops must be available (torch's own float32 path cannot mix the dtypes)."""
        if not cpu_ops.available():
            raise RuntimeError("compact_decoder needs the C++ decode ops (cpu_ops)")
        for layer in self.decoder.layers:
            for module in layer.modules():
                if isinstance(module, nn.Linear):
                    module.to(torch.bfloat16)
            layer.self_attn.fuse(("q", "k", "v"))
        self.decoder.compact = True  # its runner keeps the cross-attention K/V in bfloat16 too
        self.decoder.native_bf16 = cpu_ops.native_bf16()
        self.decoder.forget_layer_params()

    def half_projections(self) -> bool:
        """Let the decoder's C++ step read float16 copies of its float32 projection weights where
        they are float16 values (`exact_half`) -> whether every one is. Whisper's checkpoints are
        stored in float16, so a float32 model loaded from them holds float16 values: the step
        widens them back exactly, computes the same bits and reads half the bytes (whisper-base:
        the decoder blocks' 88 MB a step -> 44 MB, of 151 MB with the int8 head and the cross K/V).
        The module weights stay float32 (the PyTorch paths and the encoder's cross K/V read them)."""
        if not cpu_ops.available():
            return False
        self.decoder.half = True
        self.decoder.forget_layer_params()
        params, n = self.decoder.layer_params(), len(self.decoder.layers)
        per = len(params) // max(1, n)
        return all(params[per * i + j].dtype == torch.float16 for i in range(n) for j in PROJECTIONS)

    def int8_projections(self) -> None:
        """Let the decoder's C++ step read int8 copies of its projections (per output row
        q = round(w / s), s = max|w| / 127; a quarter of float32's bytes, half of bfloat16's),
        products in float32. For drafts on the CPU only (their proposals change a little, the
        verified output does not); the layer-by-layer path keeps the module weights."""
        from .head import pack_int8

        if not cpu_ops.available():
            raise RuntimeError("int8_projections needs the C++ decode ops (cpu_ops)")
        cfg = self.config
        if any(n % 8 for n in (cfg.d_model, cfg.decoder_ffn_dim)):
            return  # the int8 blocks need multiples of 8: the bfloat16 projections stay
        for layer in self.decoder.layers:
            sa, ca = layer.self_attn, layer.encoder_attn
            if getattr(sa, "fused_names", None) != ("q", "k", "v"):
                sa.fuse(("q", "k", "v"))
            weights = [sa.fused_weight, sa.out_proj.weight, ca.q_proj.weight, ca.out_proj.weight,
                       layer.fc1.weight, layer.fc2.weight]
            layer.int8 = [pack_int8(w.detach().float()) for w in weights]
        self.decoder.int8 = True
        self.decoder.forget_layer_params()

    def int8_encoder(self) -> bool:
        """Run the encoder's projections in int8 on the CPU's fast path (`encoder_cpu`: fbgemm's
        dynamic int8 GEMM: 1.5x float32's speed on an AVX2 CPU), and the decoder's cross-attention
        K/V projections (`Decoder.int8_cross`) -> whether it will. For a draft with its own encoder
        on a CPU without bfloat16 arithmetic: proposals may change, the verified output does not.
        Never for a target. tiny.en's cross K/V, 2 threads of a Zen 4 EPYC, a window: 4.8-5.4 ->
        3.2-3.3 ms natively (bfloat16 products before), 8.3-8.6 -> 5.1-5.7 ms held to AVX2 (float32
        products of bfloat16 weights); acceptance at k = 3 over six windows 0.769 -> 0.769 / 0.778,
        on the demo recording 0.823 -> 0.823 / 0.833."""
        self.encoder.int8_linears = self.decoder.int8_cross = encoder_cpu.int8_usable()
        return self.encoder.int8_linears

    def compact_encoder(self) -> None:
        """Run the encoder in bfloat16 (weights and arithmetic; its features come out in
        bfloat16). For a draft with its own encoder on a CPU with bfloat16 arithmetic
        (`cpu_ops.native_bf16`): 2.8x faster for tiny.en's encoder here; proposals may change,
        the verified output does not."""
        self.encoder.to(torch.bfloat16)

    def local_encoder(self, block: int = 150, last: bool = False) -> None:
        """Let the encoder's layers but the last (`last`: all of them) attend within blocks of
        `block` positions (150: 3 s of audio, 10 blocks a window) instead of all 1500: a tenth of
        their attention's work, the largest part of a small encoder's pass (tiny.en with int8
        projections, held to AVX2: 155 -> 109 ms a window, and 123 -> 103 ms with the last layer
        local too). For a draft with its own encoder: its proposals may change, the verified
        output does not. tiny.en drafting base, k = 3: acceptance 0.87 -> 0.84 over four speech
        windows with the last layer global; the last layer local too, with int8 projections,
        0.837 -> 0.811 over six windows and 0.869 -> 0.868 on the demo recording, but in
        bfloat16 0.904 -> 0.868 on the demo for 6 of 42 ms (`Backend.compact_draft` therefore
        makes it local with int8 projections only)."""
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.encoder.attention_block = block
        self.encoder.local_last = last

    def pool_encoder(self, pool: int = 2) -> None:
        """Let the encoder's layers run on the means of each run of `pool` adjacent positions
        (after the position embedding; 2: one per 40 ms of audio): 1 / pool of their work and of
        the cross K/V the decoder reads each step, its features [B, 1500 / pool, d]. For a draft
        with its own encoder: its proposals may change, the verified output does not. tiny.en
        drafting base, k = 3, 2 threads of a Zen 4 EPYC: its setup a window 72 -> 42 ms natively
        and 93 -> 57 ms held to AVX2, acceptance 0.805 -> 0.761 over six windows and 0.844 ->
        0.833 on the demo recording, whole calls 0.936x -> 0.974x of target-only (README)."""
        positions = self.config.max_source_positions
        block = self.encoder.attention_block
        if pool < 1 or positions % pool or (block is not None and block % pool):
            raise ValueError(f"pool must be a positive divisor of the {positions} positions"
                             f"{'' if block is None else f' and of the {block}-position attention blocks'}, got {pool}")
        self.encoder.pool_positions = pool

"""The Whisper encoder on the CPU in float32 at GEMM speed: the same arithmetic as `Encoder`'s
reference forward (`whisper.py`), arranged so that almost all of the time is matrix products.

What differs from the reference (every product and sum is still float32, over the full 1500
positions; only rounding order changes, ≈ 1e-3 on the features, and greedy tokens stay
identical — tests/test_encoder_cpu.py, tests/test_real.py):

- every projection is one oneDNN inner product on weights reordered once into oneDNN's blocked
  layout (`torch.ops.mkldnn._reorder_linear_weight`), with its bias or residual add fused into
  the product's epilogue: no separate bias copy or residual add; the GELU (erf) is fused into
  the product too where oneDNN runs its AVX-512 kernels, else runs in place after it (ATen's
  GELU): `fused_gelu`;
- q, k and v come from one fused product, q's 1/sqrt(head_dim) folded into its weights (exact:
  a power of two for every Whisper model, head_dim 64; an encoder whose scale is not takes the
  reference forward);
- attention is specwhisper's own kernel (`cpu_ops.encoder_attention`, csrc/encoder_ops.h) at the
  AVX2 and AVX-512 levels: it reads q/k/v straight from the fused projection's output and writes
  the [T, d] rows the out projection reads; a plain softmax over each query's full row of scores
  (1500 keys fit in L2) on one register tile for both products. Whisper-base, two Zen 3 cores:
  45.1 against 48.6 ms a layer for torch's flash kernel, the whole encoder ≈ 3–6% faster (paired
  medians 1.028–1.063 over 30 alternated windows; README); two Zen 4 cores (the kernel's AVX2
  tiles), 0.462 against 0.535 s for the whole encoder (paired median 1.15), and the 512-bit tiles
  paired 1.048× faster again there (AVX-512 on 256-bit units); with full-width AVX-512 (an Intel
  Xeon: 64-query items on 6 × 64 tiles of 512-bit registers, the same bits) a layer 1.41× faster
  than the flash kernel, paired over 20 alternations (22.2 against 31.5 ms; 6 × 32 tiles: 1.27×),
  the whole encoder paired 1.089×
  over 24 alternated passes and 1.092× in `bench/cpu.py`; a draft's block-local layers
  (`Whisper.local_encoder`) run it on each run of positions (tiny.en's draft: 750 pooled positions
  in runs of 75, 6 heads, two Zen 4 cores: 0.79 against 1.46 ms a layer for the flash kernel and its
  copies). Scalar (no AVX2) it is PyTorch's flash kernel on head-major copies of q/k/v (≈ 8%
  faster than on strided views, the copy included), whose output ([T, H, Dh] in memory) feeds the
  out projection without a copy;
- the two convolutions are inner products over time-major columns: the weights reordered
  kernel-major ([O, 3·C]), the columns of output t are input frames s·t − 1, s·t, s·t + 1 side by
  side, so they are an overlapping strided view of the zero-padded [T + 2, C] input (`im2col`) and
  conv1's [T, d] output feeds conv2 without a transpose (conv2 14 → 7 ms a window for base: the
  channel-major columns needed a transposing copy).

Windows are encoded one at a time: a window's features never depend on its batch neighbours.
The reordered weights are cached on the encoder and rebuilt when any parameter changes
(identity or in-place version).

A draft's own encoder may run its four projections per layer and conv2 in int8 instead (`int8=True`,
`Whisper.int8_encoder`: torch's dynamic int8 GEMM, weights per output row packed by oneDNN's engine
(`_pack_int8`; within ±63 where the kernels lack VNNI and would saturate: `int8_weight_max`),
activations per call): 1.5x faster than float32 with fbgemm's AVX2 kernels (4x with
its AVX-512 VNNI ones), oneDNN's a fifth to a third faster again, for a CPU
without bfloat16 arithmetic. A draft only proposes, so the
verified output stays exact; a target's encoder never takes it. Such an encoder's layers (but the
last, unless `local_last`) may also attend within 3-second blocks (`Whisper.local_encoder`), and
run on the means of adjacent positions (`Whisper.pool_encoder`), on either path.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from ..backends import cpu_ops
from .memory import keep_freed_memory

MKLDNN = torch.ops.mkldnn
GELU_ = torch.ops.aten.gelu_  # in place, erf form (Whisper's)


def available() -> bool:
    """oneDNN's fused inner products are built into this torch (x86 builds) and enabled."""
    return (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and hasattr(MKLDNN, "_linear_pointwise") and hasattr(MKLDNN, "_reorder_linear_weight"))


def usable(encoder, mel: torch.Tensor) -> bool:
    """The fast path applies: float32 CPU weights and input, no autograd, q scale a power of 2."""
    w = encoder.conv1.weight
    if not (available() and w.device.type == "cpu" and w.dtype == torch.float32
            and mel.dtype == torch.float32 and mel.device.type == "cpu" and mel.dim() == 3):
        return False
    if torch.is_grad_enabled() and any(p.requires_grad for p in encoder.parameters()):
        return False
    head_dim = encoder.layers[0].self_attn.head_dim if len(encoder.layers) else 64
    return (head_dim & (head_dim - 1)) == 0 and head_dim.bit_length() % 2 == 1  # head_dim = 4^n


def pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """[out, in] float32 -> oneDNN's blocked layout for products with about `rows` rows."""
    return MKLDNN._reorder_linear_weight(weight.detach().contiguous(), rows)


def usable_rows(x: torch.Tensor) -> bool:
    """x [1, T, in] can go through `linear` (with `pack`ed weights): float32 on the CPU, oneDNN's
    products available (the decoder's cross-attention K/V, `Decoder.cross_packed`)."""
    return available() and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 3 and x.shape[0] == 1


class PackedEncoder:
    """The encoder's weights in the fast path's layout (built from an `Encoder`)."""

    def __init__(self, encoder, int8: bool = False, pool: int = 1):
        # packed for a whole window's rows (`pack`'s layout hint), whatever window comes first: a
        # draft's shorter windows (its audio only, `Drafter.encode`) reuse them, where packing per
        # frame count had re-packed tiny.en's encoder (75 ms) whenever a window's length changed
        positions = encoder.embed_positions.weight.shape[0]
        frames = 2 * positions
        keep_freed_memory()  # the products' fresh outputs: no page faults a window
        pack_layer = _pack_int8 if int8 else _pack_weights
        c1, c2 = encoder.conv1, encoder.conv2
        # conv weight [O, C, 3] -> [O, 3*C]: kernel-major, channel-minor, as `im2col` lays columns
        self.conv1 = (pack(c1.weight.permute(0, 2, 1).reshape(c1.out_channels, -1), frames), c1.bias.detach())
        # conv2 too in int8 for a draft's encoder (its largest product outside the layers once they
        # run on pooled positions; tiny.en's pass, alternated in one process on a Zen 4 EPYC: 29.0
        # -> 25.8 ms natively, 40.3 -> 37.8 held to AVX2; k = 3 acceptance 0.761 -> 0.769 over six
        # bench windows, 0.833 -> 0.823 on the demo); conv1's 240 inputs (80 mel bins x 3) stay float32
        self.conv2 = pack_layer(c2.weight.permute(0, 2, 1).reshape(c2.out_channels, -1), c2.bias, positions)
        self.positions = encoder.embed_positions.weight.detach()
        self.pool = pool  # the layers run on the means of `pool` adjacent positions (`Whisper.pool_encoder`)
        self.layers = []
        for layer in encoder.layers:
            a = layer.self_attn
            scale = a.head_dim ** -0.5
            qkv = torch.cat([a.q_proj.weight * scale, a.k_proj.weight, a.v_proj.weight])
            qkv_bias = torch.cat([a.q_proj.bias * scale, torch.zeros_like(a.q_proj.bias), a.v_proj.bias])
            self.layers.append(dict(
                ln1=layer.self_attn_layer_norm, ln2=layer.final_layer_norm, heads=a.n_heads,
                qkv=pack_layer(qkv, qkv_bias, positions),
                out=pack_layer(a.out_proj.weight, a.out_proj.bias, positions),
                fc1=pack_layer(layer.fc1.weight, layer.fc1.bias, positions),
                fc2=pack_layer(layer.fc2.weight, layer.fc2.bias, positions)))
        self.layer_norm = encoder.layer_norm

    def __call__(self, mel: torch.Tensor, layer_blocks) -> torch.Tensor:
        """mel [B, n_mels, frames] float32 -> features [B, frames // (2 pool), d], one window at a time;
        layer_blocks(T): each layer's attention block for T positions (`Encoder.layer_blocks`)."""
        return torch.stack([self.window(m, layer_blocks) for m in mel])

    def window(self, mel: torch.Tensor, layer_blocks) -> torch.Tensor:
        """mel [n_mels, frames] -> [frames // (2 pool), d]."""
        x = linear_gelu(im2col(mel.t(), 1), self.conv1)  # [frames, d]
        x = linear_gelu(im2col(x, 2), self.conv2)  # [frames // 2, d]
        x = pool_rows(x.add_(self.positions[: x.shape[0]]), self.pool)
        for layer, block in zip(self.layers, layer_blocks(x.shape[0])):
            x = self.block(x, layer, block)
        ln = self.layer_norm
        return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)

    @staticmethod
    def block(x: torch.Tensor, p: dict, block: int | None) -> torch.Tensor:
        """One pre-norm encoder layer on x [T, d], attending within blocks of `block` positions
        (None: full attention)."""
        T, d = x.shape
        H = p["heads"]
        ln1, ln2 = p["ln1"], p["ln2"]
        h = F.layer_norm(x, ln1.normalized_shape, ln1.weight, ln1.bias, ln1.eps)
        qkv = linear(h, p["qkv"])  # [T, 3 d], q pre-scaled
        if cpu_ops.encoder_attention_usable(qkv) and (block is None or T % block == 0):
            o = cpu_ops.encoder_attention(qkv, H, block)  # [T, d], read from qkv in place
        else:
            # head-major copies: the flash kernel runs ≈ 8% faster on them, the copy included
            q, k, v = qkv.view(1, T, 3, H, d // H).permute(2, 0, 3, 1, 4).contiguous()  # [1, H, T, Dh]
            if block is None:
                o = F.scaled_dot_product_attention(q, k, v, scale=1.0)  # q is pre-scaled
            else:
                from .whisper import block_attention  # (whisper.py imports this module)

                o = block_attention(q, k, v, block)  # a draft's local layers (`Whisper.local_encoder`)
            o = o.transpose(1, 2).reshape(T, d)  # the kernel's output is [T, H, Dh] in memory: a view
        x = _linear_add(o, x, p["out"])  # x + out_proj(o)
        h = F.layer_norm(x, ln2.normalized_shape, ln2.weight, ln2.bias, ln2.eps)
        return _linear_add(linear_gelu(h, p["fc1"]), x, p["fc2"])


def _pack_weights(weight: torch.Tensor, bias: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return pack(weight, rows), bias.detach()


INT8_ENGINE = "onednn"  # the quantized engine that packs a draft encoder's int8 weights (else fbgemm)


def _int8_engine() -> str:
    return INT8_ENGINE if INT8_ENGINE in torch.backends.quantized.supported_engines else "fbgemm"


def _pack_int8(weight: torch.Tensor, bias: torch.Tensor, rows: int, qmax: int | None = None,
               engine: str | None = None):
    """Prepacked int8 weights (per output row: q = round(w / s), s = max|w| / qmax) for torch's
    dynamic int8 linear, packed by oneDNN's quantized engine where this torch has it (the packed
    object carries its engine: `linear_dynamic` runs oneDNN's kernel whatever the global engine),
    else fbgemm's. tiny.en's draft encoder (int8, block-local), one 30 s window, 2 threads of a
    Zen 4 EPYC alternated in one process: 86.6 ms with fbgemm's, 68.7 ms with oneDNN's; held to
    AVX2 157.6 -> 106.0 ms. qmax (default `int8_weight_max()`): 127, or 63 where the kernels
    would saturate; engine (default `_int8_engine()`): the quantized engine that packs them."""
    w = weight.detach().float()
    scale = (w.abs().amax(1) / (qmax or int8_weight_max())).clamp(min=1e-12).double()
    engine = engine or _int8_engine()
    before = torch.backends.quantized.engine
    with warnings.catch_warnings():  # quantized tensors are marked deprecated in torch; the op is what runs
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scale, torch.zeros(len(scale), dtype=torch.long), 0, torch.qint8)
        try:
            torch.backends.quantized.engine = engine
            return torch.ops.quantized.linear_prepack(q, bias.detach().float())
        finally:
            torch.backends.quantized.engine = before


def int8_weight_max() -> int:
    """The largest int8 weight `_pack_int8` uses: 127, or 63 where the int8 kernels would saturate.

    Without VNNI (any AVX2-only CPU, or ops held to AVX2) the kernels multiply unsigned 8-bit
    activations by int8 weights with `vpmaddubsw`, which adds each pair of products into a
    saturating int16: 2 · 255 · 127 = 64770 overflows it, so rows with large activations against
    large weights came out wrong (random [300, 64] x [64, 96] products: 13.9% relative error against
    1.6% with VNNI). Weights of at most 63 keep every pair under 2^15 (2 · 255 · 63 = 32130): 2.0%
    there, where torch's other remedy, 7-bit activations (`reduce_range`, per call and per tensor),
    measured 3.0%. A product that saturates decides: ones [1, 64] against weights at 127 sum to 64,
    and to about half that where pairs saturate; the probe reads what this process's kernels do
    (the CPU, and the variables that hold torch's libraries to AVX2: `DNNL_MAX_CPU_ISA` for
    oneDNN's engine, `FBGEMM_ENABLE_INSTRUCTIONS` for fbgemm's), once per engine."""
    return _weight_max(_int8_engine()) if int8_usable() else 127


@functools.cache
def _weight_max(engine: str) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed = _pack_int8(torch.ones(8, 64), torch.zeros(8), 0, qmax=127, engine=engine)
        y = torch.ops.quantized.linear_dynamic(torch.ones(1, 64), packed)
    return 127 if bool(((y - 64).abs() < 1).all()) else 63


def int8_pack(weight: torch.Tensor, bias: torch.Tensor):
    """`linear`'s int8 weights for weight [out, in] and bias [out] (a draft's products only)."""
    return _pack_int8(weight, bias, 0)


def linear(x: torch.Tensor, packed) -> torch.Tensor:
    """x [T, in] @ weight.T + bias, weight in oneDNN's layout (or fbgemm's int8 one)."""
    if not isinstance(packed, tuple):
        return torch.ops.quantized.linear_dynamic(x, packed)
    weight, bias = packed
    return MKLDNN._linear_pointwise(x, weight, bias, "none", [], "")


def fused_gelu() -> bool:
    """Whether `linear_gelu` fuses the GELU into oneDNN's product: where oneDNN runs its AVX-512
    kernels (the CPU has AVX-512 and DNNL_MAX_CPU_ISA / ONEDNN_MAX_CPU_ISA do not hold it below).
    base's fc1 ([1500, 512] x [512, 2048]) on 2 threads of an Intel Xeon, alternated in one
    process: 10.5-10.7 ms fused against 11.1-11.4 ms for the product and ATen's GELU after it;
    held to AVX2 20.9-22.9 against 18.7-19.7 ms (oneDNN's AVX2 erf is the slower one), so there
    the GELU stays separate. Whole encoders, the demo's first window, 24 alternations: base paired
    1.029x (342 -> 335 ms), tiny.en 1.010x; features bit-identical to the separate GELU's there.
    On an AMD Zen 4 (AVX-512 on 256-bit units) the two run alike, so it keeps the fused path: whole
    encoders alternated 24 times, base paired 1.009x (467 -> 461 ms), tiny.en 0.997x, the same bits."""
    return (cpu_ops.onednn_hold() not in cpu_ops.DNNL_BELOW_AVX512
            and bool(getattr(torch.cpu, "_is_avx512_supported", lambda: False)()))


def linear_gelu(x: torch.Tensor, packed) -> torch.Tensor:
    """gelu(x @ weight.T + bias) (erf form), fused into oneDNN's product where `fused_gelu`."""
    if isinstance(packed, tuple) and fused_gelu():
        weight, bias = packed
        return MKLDNN._linear_pointwise(x, weight, bias, "gelu", [], "none")
    return GELU_(linear(x, packed))


def _linear_add(x: torch.Tensor, residual: torch.Tensor, packed) -> torch.Tensor:
    """residual + x @ weight.T + bias (oneDNN: the add fused into the product)."""
    if not isinstance(packed, tuple):
        return torch.ops.quantized.linear_dynamic(x, packed).add_(residual)
    return MKLDNN._linear_pointwise.binary(x, residual, *packed, "add")


def pool_rows(x: torch.Tensor, pool: int) -> torch.Tensor:
    """x [..., T, d] -> [..., T / pool, d]: the mean of each run of `pool` adjacent rows."""
    if pool == 1:
        return x
    return x.unflatten(-2, (x.shape[-2] // pool, pool)).mean(-2)


def int8_usable() -> bool:
    """This torch has fbgemm's dynamic int8 linear (x86 builds; deprecated upstream, so checked)."""
    try:
        return "fbgemm" in torch.backends.quantized.supported_engines and \
            hasattr(torch.ops.quantized, "linear_dynamic") and hasattr(torch.ops.quantized, "linear_prepack")
    except (AttributeError, RuntimeError):
        return False


def im2col(x: torch.Tensor, stride: int) -> torch.Tensor:
    """x [T, C] (time-major) -> the columns of a kernel-3, padding-1 convolution, kernel-major:
    [T', 3 * C], row t = x[s·t − 1], x[s·t], x[s·t + 1] (zeros outside), T' = (T − 1) // s + 1. A
    view of the padded input whose rows overlap (oneDNN reads it in place)."""
    T, C = x.shape
    return F.pad(x, (0, 0, 1, 1)).as_strided(((T - 1) // stride + 1, 3 * C), (stride * C, 1))


def parameter_key(*modules) -> tuple:
    """Changes when any parameter of `modules` is replaced or modified in place (inference tensors,
    made under `torch.inference_mode`, keep no version counter: their identity alone is the key)."""
    return tuple((p.data_ptr(), 0 if p.is_inference() else p._version) for m in modules for p in m.parameters())


def encode(encoder, mel: torch.Tensor) -> torch.Tensor:
    """mel [B, n_mels, frames] -> features [B, frames // (2 pool_positions), d] by the fast path
    (check `usable`)."""
    int8 = encoder.int8_linears
    key = (parameter_key(encoder), int8, encoder.attention_block, encoder.local_last, encoder.pool_positions)
    cached = encoder.__dict__.get("_packed_cpu")
    if cached is None or cached[0] != key:
        cached = (key, PackedEncoder(encoder, int8, encoder.pool_positions))
        encoder.__dict__["_packed_cpu"] = cached
    with torch.no_grad():
        return cached[1](mel, encoder.layer_blocks)

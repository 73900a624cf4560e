// The encoder's self-attention on the CPU (AVX2 and AVX-512 tiles): softmax(q kᵀ) v over all T
// positions of every head (or within runs of `block` positions: a draft's block-local layers),
// read straight from the fused q/k/v projection's output (q pre-scaled) and written in the
// [T, heads · head_dim] layout the out projection reads.
//
// Spec: `encoder_attention_reference` in specwhisper/backends/cpu_ops.py (the same product in
// float64 and torch's scaled_dot_product_attention). Included by decode_ops.cpp inside its
// namespace (it uses parallel_for and exp_avx2's constants from there).
//
// Why: torch's flash CPU kernel computes each (query block, key block) pair with a small BLAS call
// and rescales an online softmax per key block; for whisper-base's 1500 × 1500 × 64 heads it ran
// at 103-121 GFLOP/s on two Zen 3 cores (FMA peak ≈ 180). Here a whole row of scores fits in L2
// (1500 keys), so the softmax is plain (max, exp, sum: no rescaling), and both products run on one
// 6 × 16 register tile (12 ymm accumulators, the FMA units' latency × throughput) over operands
// packed so that every load is contiguous:
//   Sᵀ [keys, 32 queries]  = K · Qᵀ   (A = keys packed 6 at a time, B = the item's queries)
//   Oᵀ [head_dim, 32]      = Vᵀ · Pᵀ  (A = values packed 6 channels at a time, B = Pᵀ in place)
// Working on Sᵀ puts the queries in the vector lanes: the softmax's max, exp and sum run down the
// keys with whole vectors, and Pᵀ is already the second product's B operand.
//
// With AVX-512 a work item is 64 queries on 6 × 64 tiles (four zmm a row, 24 of the 32 zmm
// registers accumulating: one broadcast serves 64 queries; a last item of at most 32 queries runs
// 6 × 32 tiles) and the softmax runs on 16 lanes. All compute each element with the same
// operations in the same order: the same bits at either level.
// (base's layer, 1500 × 8 × 64, two Xeon cores: 64-query items 1.12× faster than 32-query ones,
// 1.42× torch's flash kernel. On an AMD Zen 4, whose AVX-512 runs on 256-bit units, these tiles
// had been left to the AVX2 ones; they are faster there too, fewer instructions for the same
// FMAs: two Zen 4 cores, alternated 30 times in one process, base's layer 28.3 -> 25.1 ms,
// tiny.en's 23.3 -> 19.0, large's 1500 × 20 × 64 68.4 -> 62.2, tiny.en's draft runs of 75
// positions 1.16 -> 0.98 ms; base's whole encoder paired 1.048× over 20 alternated passes.)
//
// Subnormals: a query that attends sharply (whisper-base's first layer on speech) has weights
// exp(s − best) below 2^-126 and products of them below it, and on Intel cores each subnormal
// result costs a microcode assist: that layer took 30.5 ms against 17.2 for the others (two Xeon
// cores, the demo recording). The item loop runs with MXCSR's flush-to-zero and
// denormals-are-zero set (`FlushDenormals`), so such a weight or product is 0: that layer 17.8 ms.
// A row's weights sum to at least 1 (its best key's exp(0)), and a term below 2^-126 can move a
// float32 sum only while that sum is below ≈ 2^-102 in magnitude: outputs bit-identical with and without,
// every layer of base and tiny.en at both vector levels on the demo's first four 30 s windows.
//
// Determinism: each output element is computed by one thread in a fixed order (keys in order
// within blocks of kEncKC, blocks in order), whatever the thread count or the other queries.

constexpr int64_t kEncMR = 6;    // tile rows (keys, or value channels)
constexpr int64_t kEncNR = 16;   // tile columns (queries): two ymm vectors
constexpr int64_t kEncQ = 32;    // queries a work item (AVX2; full-width AVX-512: 64, or a last item of <= 32)
constexpr int64_t kEncKC = 256;  // keys per block of the value product (64 to 512 measured alike)

// c[R × NV·W] (row stride ldc) = (first ? 0 : c) + Σ_k a[6k + r] · b[k · ldb + j]: FMAs over k in
// order, one accumulator per (row, W columns); R = 6, or 4 for a last group of 4 rows (the
// values' 64 channels: 10 groups of 6 and one of 4, whose 2 zero rows are skipped). The
// accumulators are named, not an array: GCC kept an array's elements on the stack, storing ten of
// them every step (a third of the FMA rate). ENC_TILE(NAME, TARGET, P, W) defines NAME<R> for
// vectors of W floats with intrinsics P##_... (_mm256: AVX2, 6 × 16; _mm512: AVX-512, 6 × 32, or
// 6 × 64 with NV = 4): one body for all, so each element is the same FMAs in the same order at
// either width.
#define ENC_INIT(P, W, r) /* rows past R, and vectors past NV, stay zero, unread and unused */    \
  auto c##r##0 = first || r >= R ? P##_setzero_ps() : P##_loadu_ps(c + r * ldc);                \
  auto c##r##1 = first || r >= R ? P##_setzero_ps() : P##_loadu_ps(c + r * ldc + W);            \
  auto c##r##2 = first || r >= R || NV < 4 ? P##_setzero_ps() : P##_loadu_ps(c + r * ldc + 2 * W); \
  auto c##r##3 = first || r >= R || NV < 4 ? P##_setzero_ps() : P##_loadu_ps(c + r * ldc + 3 * W);
#define ENC_FMA(P, r)                          \
  {                                            \
    const auto ar = P##_set1_ps(a[r]);         \
    c##r##0 = P##_fmadd_ps(ar, b0, c##r##0);   \
    c##r##1 = P##_fmadd_ps(ar, b1, c##r##1);   \
    if constexpr (NV == 4) {                   \
      c##r##2 = P##_fmadd_ps(ar, b2, c##r##2); \
      c##r##3 = P##_fmadd_ps(ar, b3, c##r##3); \
    }                                          \
  }
#define ENC_STORE(P, W, r)                          \
  P##_storeu_ps(c + r * ldc, c##r##0);              \
  P##_storeu_ps(c + r * ldc + W, c##r##1);          \
  if constexpr (NV == 4) {                          \
    P##_storeu_ps(c + r * ldc + 2 * W, c##r##2);    \
    P##_storeu_ps(c + r * ldc + 3 * W, c##r##3);    \
  }
#define ENC_TILE(NAME, TARGET, P, W)                                                                         \
  template <int R, int NV = 2>                                                                               \
  __attribute__((target(TARGET))) inline void NAME(const float* a, const float* b, int64_t ldb, int64_t kc, \
                                                   float* c, int64_t ldc, bool first) {                      \
    static_assert(R == 6 || R == 4, #NAME ": 6 or 4 rows");                                                 \
    static_assert(NV == 2 || NV == 4, #NAME ": 2 or 4 vectors a row");                                      \
    ENC_INIT(P, W, 0) ENC_INIT(P, W, 1) ENC_INIT(P, W, 2) ENC_INIT(P, W, 3) ENC_INIT(P, W, 4) ENC_INIT(P, W, 5) \
    for (int64_t k = 0; k < kc; ++k, a += kEncMR, b += ldb) {                                                \
      const auto b0 = P##_loadu_ps(b), b1 = P##_loadu_ps(b + W);                                           \
      const auto b2 = NV == 4 ? P##_loadu_ps(b + 2 * W) : b0, b3 = NV == 4 ? P##_loadu_ps(b + 3 * W) : b1;  \
      ENC_FMA(P, 0) ENC_FMA(P, 1) ENC_FMA(P, 2) ENC_FMA(P, 3)                                                \
      if constexpr (R == 6) { ENC_FMA(P, 4) ENC_FMA(P, 5) }                                                  \
    }                                                                                                        \
    ENC_STORE(P, W, 0) ENC_STORE(P, W, 1) ENC_STORE(P, W, 2) ENC_STORE(P, W, 3)                              \
    if constexpr (R == 6) { ENC_STORE(P, W, 4) ENC_STORE(P, W, 5) }                                          \
  }
ENC_TILE(enc_tile, "avx2,fma,f16c", _mm256, 8)
// The AVX-512 form (a CPU whose AVX-512 runs at full width): c[R × 32] over both 16-lane halves of
// an item's queries at once, so each key's (or value channel's) broadcast serves 32 queries.
ENC_TILE(enc_tile512, "avx512f,avx512dq,avx2,fma,f16c", _mm512, 16)
#undef ENC_TILE
#undef ENC_INIT
#undef ENC_FMA
#undef ENC_STORE

// src [rows, cols] (row stride ld) -> [ceil(rows / 6)][cols][6]: element (i, j) at
// [i / 6][j][i % 6]; rows past `rows` are zero. The A operand layout of enc_tile. Written in
// order, six source rows read side by side: writing one source row at a time (stores 24 bytes
// apart) and the values' per-element index arithmetic (below) made the packing 3.5 of a layer's
// 45 ms (whisper-base, two Zen 3 cores; this way the whole kernel runs 8% faster, the same bits).
inline void enc_pack_rows(const float* src, int64_t ld, int64_t rows, int64_t cols, float* dst) {
  for (int64_t g = 0; g < rows; g += kEncMR, dst += kEncMR * cols) {
    const float* s[kEncMR];
    for (int64_t r = 0; r < kEncMR; ++r) s[r] = g + r < rows ? src + (g + r) * ld : nullptr;
    if (g + kEncMR <= rows) {
      for (int64_t j = 0; j < cols; ++j)
        for (int64_t r = 0; r < kEncMR; ++r) dst[j * kEncMR + r] = s[r][j];
    } else {
      for (int64_t j = 0; j < cols; ++j)
        for (int64_t r = 0; r < kEncMR; ++r) dst[j * kEncMR + r] = s[r] ? s[r][j] : 0.0f;
    }
  }
}

// exp(x) for x <= 0 (softmax weights): exp_avx2's range reduction, clamp and polynomial, evaluated
// with fused multiply-adds: 16 vector operations instead of 27 (one thread's softmax over base's
// heads, 13 -> 9 ms of a ≈ 90 ms pass). Its rounding differs from exp_avx2's; there is no scalar
// twin to match, as this kernel has no scalar path (callers check the vector level).
// ENC_EXP(NAME, TARGET, V, P, ROUND, CAST): the one body at both widths (the same bits a lane).
#define ENC_EXP(NAME, TARGET, V, P, ROUND, CAST)                                                    \
  __attribute__((target(TARGET))) inline V NAME(V x) {                                            \
    x = P##_max_ps(x, P##_set1_ps(kExpLo));                                                         \
    const V fx = ROUND(P##_mul_ps(x, P##_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); \
    x = P##_fnmadd_ps(fx, P##_set1_ps(kC1), x);                                                     \
    x = P##_fnmadd_ps(fx, P##_set1_ps(kC2), x);                                                     \
    V y = P##_fmadd_ps(P##_set1_ps(kP0), x, P##_set1_ps(kP1));                                      \
    y = P##_fmadd_ps(y, x, P##_set1_ps(kP2));                                                       \
    y = P##_fmadd_ps(y, x, P##_set1_ps(kP3));                                                       \
    y = P##_fmadd_ps(y, x, P##_set1_ps(kP4));                                                       \
    y = P##_fmadd_ps(y, x, P##_set1_ps(kP5));                                                       \
    y = P##_add_ps(P##_fmadd_ps(y, P##_mul_ps(x, x), x), P##_set1_ps(1.0f));                        \
    const auto e = P##_add_epi32(P##_cvtps_epi32(fx), P##_set1_epi32(127));                         \
    return P##_mul_ps(y, CAST(P##_slli_epi32(e, 23)));                                              \
  }
ENC_EXP(enc_exp, "avx2,fma,f16c", __m256, _mm256, _mm256_round_ps, _mm256_castsi256_ps)
ENC_EXP(enc_exp512, "avx512f,avx512dq,avx2,fma,f16c", __m512, _mm512, _mm512_roundscale_ps, _mm512_castsi512_ps)
#undef ENC_EXP

// r[a][b] = src[b · ld + a]: an 8 × 8 block of floats transposed into registers (decode_ops.cpp's
// transpose8x8, which the decode attention's key packing uses too).
__attribute__((target("avx2,fma,f16c"))) inline void enc_transpose8_regs(const float* src, int64_t ld, __m256* r) {
  for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(src + k * ld);
  transpose8x8(r);
}

// dst[a · ldd + b] = src[b · lds + a] over an 8 × 8 block.
__attribute__((target("avx2,fma,f16c"))) inline void enc_transpose8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8];
  enc_transpose8_regs(src, lds, r);
  for (int k = 0; k < 8; ++k) _mm256_storeu_ps(dst + k * ldd, r[k]);
}

// Qᵀ [Dh][Q] from queries q [nq][Dh] (row stride ldq), queries past nq zero (Q: an item's 32 or 64).
template <int64_t Q>
__attribute__((target("avx2,fma,f16c"))) inline void enc_pack_queries(const float* q, int64_t ldq, int64_t nq,
                                                                      int64_t Dh, float* qp) {
  if (nq == Q && Dh % 8 == 0) {  // by 8 × 8 blocks
    for (int64_t i = 0; i < Q; i += 8)
      for (int64_t d = 0; d < Dh; d += 8) enc_transpose8(q + i * ldq + d, ldq, qp + d * Q + i, Q);
    return;
  }
  for (int64_t d = 0; d < Dh; ++d)
    for (int64_t i = 0; i < Q; ++i) qp[d * Q + i] = i < nq ? q[i * ldq + d] : 0.0f;
}

// out [nq][Dh] (row stride ldo) = Oᵀ [Dh][Q] transposed back to rows, row i scaled by inv[i].
template <int64_t Q>
__attribute__((target("avx2,fma,f16c"))) inline void enc_unpack_output(const float* o, int64_t nq, int64_t Dh,
                                                                       const float* inv, float* out, int64_t ldo) {
  if (nq == Q && Dh % 8 == 0) {  // by 8 × 8 blocks
    for (int64_t j = 0; j < Dh; j += 8)
      for (int64_t i = 0; i < Q; i += 8) {
        __m256 r[8];
        enc_transpose8_regs(o + j * Q + i, Q, r);
        for (int64_t a = 0; a < 8; ++a)
          _mm256_storeu_ps(out + (i + a) * ldo + j, _mm256_mul_ps(r[a], _mm256_set1_ps(inv[i + a])));
      }
    return;
  }
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t j = 0; j < Dh; ++j) out[i * ldo + j] = o[j * Q + i] * inv[i];
}

// One work item: queries q0 .. q0 + nq (nq <= 32) of head h. kp: the head's keys packed
// ([Tr / 6][Dh][6]); vp: its values transposed and packed ([ceil(Dh / 6)][Tr][6]).
__attribute__((target("avx2,fma,f16c"))) void enc_attention_item(const float* q, int64_t ldq, int64_t nq, int64_t T,
                                                                 int64_t Dh, const float* kp, const float* vp,
                                                                 float* out, int64_t ldo, float* qp, float* s,
                                                                 float* o) {
  const int64_t Tr = (T + kEncMR - 1) / kEncMR * kEncMR, Jr = (Dh + kEncMR - 1) / kEncMR * kEncMR;
  enc_pack_queries<kEncQ>(q, ldq, nq, Dh, qp);
  // Sᵀ [Tr][32], and each query's largest score as its rows are made (still in L1)
  __m256 best0 = _mm256_set1_ps(-INFINITY), best1 = best0, best2 = best0, best3 = best0;
  for (int64_t g = 0; g < Tr; g += kEncMR) {
    float* sg = s + g * kEncQ;
    enc_tile<6>(kp + g * Dh, qp, kEncQ, Dh, sg, kEncQ, true);
    enc_tile<6>(kp + g * Dh, qp + kEncNR, kEncQ, Dh, sg + kEncNR, kEncQ, true);
    for (int64_t r = 0; r < std::min(kEncMR, T - g); ++r, sg += kEncQ) {  // keys past T are padding
      best0 = _mm256_max_ps(best0, _mm256_loadu_ps(sg));
      best1 = _mm256_max_ps(best1, _mm256_loadu_ps(sg + 8));
      best2 = _mm256_max_ps(best2, _mm256_loadu_ps(sg + 16));
      best3 = _mm256_max_ps(best3, _mm256_loadu_ps(sg + 24));
    }
  }
  // Pᵀ = exp(Sᵀ − best) in place, summed down the keys in order (named registers: see enc_tile);
  // keys past T get zero weight
  __m256 total0 = _mm256_setzero_ps(), total1 = total0, total2 = total0, total3 = total0;
  for (int64_t t = 0; t < T; ++t) {
    float* st = s + t * kEncQ;
    const __m256 e0 = enc_exp(_mm256_sub_ps(_mm256_loadu_ps(st), best0));
    const __m256 e1 = enc_exp(_mm256_sub_ps(_mm256_loadu_ps(st + 8), best1));
    const __m256 e2 = enc_exp(_mm256_sub_ps(_mm256_loadu_ps(st + 16), best2));
    const __m256 e3 = enc_exp(_mm256_sub_ps(_mm256_loadu_ps(st + 24), best3));
    _mm256_storeu_ps(st, e0), _mm256_storeu_ps(st + 8, e1), _mm256_storeu_ps(st + 16, e2), _mm256_storeu_ps(st + 24, e3);
    total0 = _mm256_add_ps(total0, e0), total1 = _mm256_add_ps(total1, e1);
    total2 = _mm256_add_ps(total2, e2), total3 = _mm256_add_ps(total3, e3);
  }
  std::fill(s + T * kEncQ, s + Tr * kEncQ, 0.0f);
  for (int64_t t0 = 0; t0 < Tr; t0 += kEncKC) {  // Oᵀ [Jr][32] = Vᵀ Pᵀ, keys in blocks
    const int64_t kc = std::min(kEncKC, Tr - t0);
    for (int64_t g = 0; g < Jr; g += kEncMR)
      for (int64_t p = 0; p < kEncQ; p += kEncNR)
        if (Dh - g == 4)
          enc_tile<4>(vp + g * Tr + t0 * kEncMR, s + t0 * kEncQ + p, kEncQ, kc, o + g * kEncQ + p, kEncQ, t0 == 0);
        else
          enc_tile<6>(vp + g * Tr + t0 * kEncMR, s + t0 * kEncQ + p, kEncQ, kc, o + g * kEncQ + p, kEncQ, t0 == 0);
  }
  float inv[kEncQ];  // 1 / the weights' sum, as torch's flash kernel applies it
  const __m256 one = _mm256_set1_ps(1.0f);
  _mm256_storeu_ps(inv, _mm256_div_ps(one, total0)), _mm256_storeu_ps(inv + 8, _mm256_div_ps(one, total1));
  _mm256_storeu_ps(inv + 16, _mm256_div_ps(one, total2)), _mm256_storeu_ps(inv + 24, _mm256_div_ps(one, total3));
  enc_unpack_output<kEncQ>(o, nq, Dh, inv, out, ldo);
}

// enc_attention_item with 512-bit tiles and softmax (the same bits), over Q = 32 queries (6 × 32
// tiles) or 64 (6 × 64 tiles: 24 of the 32 zmm registers accumulate, so each key's broadcast and
// each load of B serve twice the FMAs; the value product then runs over blocks of 128 keys so its
// B block, 128 × 64 floats, stays in L1).
template <int64_t Q>
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) void enc_attention_item512(
    const float* q, int64_t ldq, int64_t nq, int64_t T, int64_t Dh, const float* kp, const float* vp, float* out,
    int64_t ldo, float* qp, float* s, float* o) {
  static_assert(Q == 32 || Q == 64, "enc_attention_item512: 32 or 64 queries");
  constexpr int NV = Q / 16, KC = kEncKC * kEncQ / Q;  // zmm a tile row; keys a block of the value product
  const int64_t Tr = (T + kEncMR - 1) / kEncMR * kEncMR, Jr = (Dh + kEncMR - 1) / kEncMR * kEncMR;
  enc_pack_queries<Q>(q, ldq, nq, Dh, qp);
  __m512 best[NV];
  for (int v = 0; v < NV; ++v) best[v] = _mm512_set1_ps(-INFINITY);
  for (int64_t g = 0; g < Tr; g += kEncMR) {
    float* sg = s + g * Q;
    enc_tile512<6, NV>(kp + g * Dh, qp, Q, Dh, sg, Q, true);
    for (int64_t r = 0; r < std::min(kEncMR, T - g); ++r, sg += Q)
      for (int v = 0; v < NV; ++v) best[v] = _mm512_max_ps(best[v], _mm512_loadu_ps(sg + 16 * v));
  }
  __m512 total[NV];
  for (int v = 0; v < NV; ++v) total[v] = _mm512_setzero_ps();
  for (int64_t t = 0; t < T; ++t) {
    float* st = s + t * Q;
    for (int v = 0; v < NV; ++v) {
      const __m512 e = enc_exp512(_mm512_sub_ps(_mm512_loadu_ps(st + 16 * v), best[v]));
      _mm512_storeu_ps(st + 16 * v, e);
      total[v] = _mm512_add_ps(total[v], e);
    }
  }
  std::fill(s + T * Q, s + Tr * Q, 0.0f);
  for (int64_t t0 = 0; t0 < Tr; t0 += KC) {
    const int64_t kc = std::min<int64_t>(KC, Tr - t0);
    for (int64_t g = 0; g < Jr; g += kEncMR)
      if (Dh - g == 4)
        enc_tile512<4, NV>(vp + g * Tr + t0 * kEncMR, s + t0 * Q, Q, kc, o + g * Q, Q, t0 == 0);
      else
        enc_tile512<6, NV>(vp + g * Tr + t0 * kEncMR, s + t0 * Q, Q, kc, o + g * Q, Q, t0 == 0);
  }
  float inv[Q];
  for (int v = 0; v < NV; ++v) _mm512_storeu_ps(inv + 16 * v, _mm512_div_ps(_mm512_set1_ps(1.0f), total[v]));
  enc_unpack_output<Q>(o, nq, Dh, inv, out, ldo);
}

// qkv [T, 3 · H · Dh] (row stride free, q pre-scaled) -> [T, H · Dh]. block > 0: each position
// attends only to the positions of its own run of `block` (T a multiple of it; a draft's
// block-local layers, `Whisper.local_encoder`), each run packed and computed as a sequence of its
// own; 0: every position to all T.
at::Tensor encoder_attention(const at::Tensor& qkv, int64_t heads, int64_t block) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.stride(1) == 1,
              "encoder_attention: qkv must be a float32 CPU matrix [T, 3 * d] with unit column stride");
  TORCH_CHECK(heads > 0 && qkv.size(1) % (3 * heads) == 0, "encoder_attention: ", qkv.size(1),
              " columns are not 3 * heads * head_dim for heads = ", heads);
  TORCH_CHECK(has_avx2(), "encoder_attention needs AVX2 and FMA (the caller checks the vector level)");
  const int64_t T = qkv.size(0), d = qkv.size(1) / 3, Dh = d / heads, ld = qkv.stride(0);
  TORCH_CHECK(block >= 0 && (block == 0 || T % block == 0), "encoder_attention: block must be 0 or divide the ", T,
              " positions, got ", block);
  at::Tensor out = at::empty({T, d}, qkv.options());
  if (T == 0) return out;
  const int64_t L = block > 0 ? block : T, runs = T / L;  // positions a run, runs
  const int64_t Tr = (L + kEncMR - 1) / kEncMR * kEncMR, Jr = (Dh + kEncMR - 1) / kEncMR * kEncMR;
  const int64_t head_pack = Tr * Dh + Jr * Tr;  // keys, then values (of one run)
  // scratch kept per thread across calls: fresh multi-MB buffers cost a page fault every 4 KB
  // (≈ 1.5 ms a layer for base's 6 MB of packed keys and values)
  thread_local std::vector<float> packed;
  packed.resize(std::max(packed.size(), static_cast<size_t>(runs * heads * head_pack)));
  const float* base = qkv.data_ptr<float>();
  float* pk = packed.data();
  parallel_for(0, 2 * runs * heads, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t rh = i / 2, t0 = rh / heads * L, h = rh % heads;  // run rh / heads, head h
      const float* rows = base + t0 * ld;
      if (i % 2 == 0) {  // keys as A of Sᵀ = K Qᵀ: [Tr / 6][Dh][6]
        enc_pack_rows(rows + d + h * Dh, ld, L, Dh, pk + rh * head_pack);
      } else {  // values transposed, as A of Oᵀ = Vᵀ Pᵀ: [Jr / 6][Tr][6]
        float* dst = pk + rh * head_pack + Tr * Dh;
        const float* v = rows + 2 * d + h * Dh;
        for (int64_t g = 0; g < Jr; g += kEncMR) {  // channels g..g+5 of every key, keys past L zero
          float* dg = dst + g * Tr;
          const int64_t w = std::min(kEncMR, Dh - g);
          for (int64_t t = 0; t < L; ++t)
            for (int64_t r = 0; r < kEncMR; ++r) dg[t * kEncMR + r] = r < w ? v[t * ld + g + r] : 0.0f;
          std::fill(dg + L * kEncMR, dg + Tr * kEncMR, 0.0f);
        }
      }
    }
  });
  float* o = out.data_ptr<float>();
  const bool wide = vector_level() >= 2;  // 512-bit tiles
  const int64_t iq = wide ? 64 : kEncQ;                   // queries a work item
  const int64_t blocks = (L + iq - 1) / iq;               // query items a run
  parallel_for(0, runs * heads * blocks, 1, [&](int64_t b, int64_t e) {
    const FlushDenormals flush;  // softmax weights and their products far below 1: no subnormals
    // rows of 32 or 64 floats from a 64-byte boundary: a 512-bit load or store across two cache
    // lines costs two (the AVX-512 tiles ran at 38% of the FMA peak on malloc's 16-byte alignment)
    thread_local std::vector<float> work;
    float* qp = aligned_floats(work, (Dh + Tr + Jr) * iq);
    float *s = qp + Dh * iq, *ot = s + Tr * iq;
    for (int64_t i = b; i < e; ++i) {
      const int64_t rh = i / blocks, t0 = rh / heads * L, h = rh % heads, q0 = t0 + (i % blocks) * iq;
      const int64_t nq = std::min(iq, t0 + L - q0);
      const float* kp = pk + rh * head_pack;
      const auto item = !wide ? enc_attention_item
                        : nq > kEncQ ? enc_attention_item512<64>
                                     : enc_attention_item512<kEncQ>;  // a last item of <= 32 queries: not padded to 64
      item(base + q0 * ld + h * Dh, ld, nq, L, Dh, kp, kp + Tr * Dh, o + q0 * d + h * Dh, d, qp, s, ot);
    }
  });
  return out;
}

"""Speculative greedy decoding is exact: token for token the target's own greedy output, for
every draft kind, k, batch size, EOT position and max_new_tokens cut-off."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import make_checkpoint
from specwhisper import Engine
from specwhisper.backends import cpu_ops
from specwhisper.model.head import Q2Head, Q4Head, SubsetHead
from specwhisper.model.whisper import DecoderCache

MAX_NEW = 40


@pytest.fixture(scope="module")
def target(ckpt_dir):
    return ckpt_dir("spec-target", vocab_size=51865, d_model=64, heads=4, seed=11)


def perturbed(src, dst, scale: float, seed: int):
    """A copy of `src` whose decoder weights carry relative noise `scale`: a draft that agrees
    with the target often but not always."""
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for key, value in state.items():
        if key.startswith("model.decoder.layers") and value.ndim == 2:
            state[key] = value + scale * value.std() * torch.randn(value.shape, generator=gen)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory, ckpt_dir):
    root = tmp_path_factory.mktemp("drafts")
    return {
        "self": target,  # same weights: every proposal is accepted
        "noisy": perturbed(target, root / "noisy", 0.05, seed=1),  # own (identical) encoder, shared
        "wrong": ckpt_dir("spec-wrong", vocab_size=51865, d_model=32, heads=2, encoder_layers=1,
                          decoder_layers=1, seed=99),  # unrelated: (almost) never right
        "shared": make_checkpoint(root / "shared", vocab_size=51865, d_model=64, heads=4, seed=12,
                                  decoder_layers=1, encoder_from=target),  # distil-style
    }


@pytest.fixture(scope="module")
def mels():
    torch.manual_seed(0)
    return torch.randn(4, 80, 3000)


@pytest.fixture(scope="module")
def reference(target, mels):
    engine = Engine(target)
    return [o.tokens for o in engine.transcribe(mels, language="en", max_new_tokens=MAX_NEW)]


def test_reference_is_long_enough(reference):
    assert all(len(t) >= 20 for t in reference)


@pytest.mark.parametrize("kind", ["self", "noisy", "wrong", "shared"])
@pytest.mark.parametrize("k", range(1, 9))
def test_speculative_equals_target_only(kind, k, drafts, target, mels, reference):
    batch = 1 + (k + len(kind)) % 4  # every k and every batch size 1..4 across the grid
    engine = Engine(target, drafts[kind])
    out = engine.transcribe(mels[:batch], language="en", max_new_tokens=MAX_NEW, num_draft_tokens=k)
    assert [o.tokens for o in out] == reference[:batch]
    if batch == 1:
        # the loop really verifies: every emitted token (EOT included) came from the prefill or
        # a verify pass, which yields its accepted tokens + 1 (the last pass may stop at an
        # accepted EOT or at max_new_tokens before its own token)
        o = out[0]
        emitted = len(o.tokens) + (len(o.tokens) < MAX_NEW)
        assert o.stats.target_passes + o.stats.accepted - 1 <= emitted <= o.stats.target_passes + o.stats.accepted
        assert o.stats.drafted <= k * (o.stats.target_passes - 1)
        # one proposal per draft pass after the draft's prefill
        assert o.stats.drafted <= o.stats.draft_passes - 1 <= k * (o.stats.target_passes - 1)
    if kind == "self":
        assert all(o.stats.acceptance_rate == 1.0 for o in out)
        n = max(len(t) + (len(t) < MAX_NEW) for t in reference[:batch])
        assert out[0].stats.target_passes == 1 + -(-(n - 1) // (k + 1))  # ceil: k + 1 tokens per pass
    if kind == "wrong":
        assert sum(o.stats.accepted for o in out) <= 0.1 * sum(o.stats.drafted for o in out)
    if kind == "noisy":
        rate = sum(o.stats.accepted for o in out) / sum(o.stats.drafted for o in out)
        assert 0.05 < rate < 1.0, rate


@pytest.mark.parametrize("k", [2, 5])
def test_a_float16_checkpoint_target_is_exact(k, ckpt_dir, tmp_path_factory, mels):
    """A target stored in float16 (as Whisper's are) decodes in float32 with its C++ step reading
    the projections in float16 (`Whisper.half_projections`): its verify passes of k + 1 rows and 3
    sequences give target-only's tokens, with a self draft and a perturbed one."""
    target16 = ckpt_dir("spec-target16", vocab_size=51865, d_model=64, heads=4, seed=11, float16=True)
    noisy = perturbed(target16, tmp_path_factory.mktemp("noisy16") / "noisy", 0.05, seed=1)
    plain = Engine(target16)
    assert torch.float16 in {p.dtype for p in plain.target.model.decoder.layer_params()} or not cpu_ops.available()
    reference = [o.tokens for o in plain.transcribe(mels[:3], language="en", max_new_tokens=MAX_NEW)]
    assert all(len(t) >= 20 for t in reference)
    for draft in (target16, noisy):
        out = Engine(target16, draft).transcribe(mels[:3], language="en", max_new_tokens=MAX_NEW, num_draft_tokens=k)
        assert [o.tokens for o in out] == reference
        assert sum(o.stats.accepted for o in out) > 0


def test_shared_encoder_is_detected_and_run_once(target, drafts):
    engine = Engine(target, drafts["shared"])
    assert engine.drafter.shared_encoder

    def must_not_run(*args):
        raise AssertionError("the shared-encoder draft ran its own encoder")

    engine.drafter.draft.model.encoder.forward = must_not_run
    mel = torch.randn(80, 3000)
    assert engine.transcribe(mel, language="en", max_new_tokens=8, num_draft_tokens=2).tokens == \
        Engine(target).transcribe(mel, language="en", max_new_tokens=8).tokens
    assert not Engine(target, drafts["wrong"]).drafter.shared_encoder
    with pytest.raises(ValueError, match="does not share the encoder"):
        Engine(target, drafts["wrong"], shared_encoder=True)


def test_draft_prompt_keeps_the_last_previous_tokens(target, drafts):
    """A draft's prompt keeps <|startofprev|> and the last PREV_TOKENS of the previous text (its
    prompt pass is a cost speculation adds to every window), then its own start sequence."""
    from specwhisper.engine.slots import SeqSpec

    engine = Engine(target, drafts["noisy"])
    tok, d = engine.target.tokenizer, engine.drafter
    sot_prev = tok.backend.token_to_id("<|startofprev|>")
    start = tok.prompt("en", "transcribe")[:-1]
    for n_prev in (0, 5, d.PREV_TOKENS, d.PREV_TOKENS + 37):
        prev = [100 + i for i in range(n_prev)]
        prompt = ([sot_prev] + prev if n_prev else []) + start
        spec = SeqSpec(prompt, "en", "transcribe", 8, timestamps=True, sot_index=prompt.index(tok.sot))
        kept = prev[max(0, n_prev - d.PREV_TOKENS):]
        assert d.prompt(spec) == ([sot_prev] + kept if n_prev else []) + start


def test_a_draft_with_the_targets_embedding_reads_the_targets_head(target, drafts, mels, reference):
    """A draft kept at full precision whose output head equals the target's (distilled drafts
    reuse the target's embedding) greedy-picks through the target's screened head: one int8 copy
    for both, and the output stays exact. Another embedding keeps its own head."""
    engine = Engine(target, drafts["noisy"], compact_draft=False)
    assert engine.drafter.head is engine.target.head
    out = engine.transcribe(mels[:2], language="en", max_new_tokens=MAX_NEW, num_draft_tokens=3)
    assert [o.tokens for o in out] == reference[:2]
    other = Engine(target, drafts["shared"], compact_draft=False)
    assert other.drafter.head is other.drafter.draft.head is not None


@pytest.mark.skipif(not cpu_ops.available(), reason="C++ decode ops unavailable")
def test_a_compact_draft_proposes_through_a_4_bit_head(target, drafts, mels, reference, monkeypatch):
    """A compact draft (the CPU default) reads a 2-bit copy of its output head (`Q2Head`; a
    4-bit one, `Q4Head`, where its width is not a multiple of 64); its
    proposals are what that head says (counted: its `argmax`, or the C++ draft steps given it),
    and the output stays exact, greedy and batched. A pruned head (draft_head_tokens) stays what
    was asked for."""
    from specwhisper.backends import cpu_ops

    engine = Engine(target, drafts["noisy"])
    head = engine.drafter.head
    two_bit = engine.drafter.shared_encoder and engine.drafter.draft.config.d_model % 64 == 0
    assert type(head) is (Q2Head if two_bit else Q4Head)
    # its float32 rows are the embedding itself, not a copy
    assert head.weight.data_ptr() == engine.drafter.draft.model.decoder.embed_tokens.weight.data_ptr()
    calls = []
    argmax, fused = head.argmax, cpu_ops.draft_propose
    head.argmax = lambda h, *rest: calls.append(h.shape[0]) or argmax(h, *rest)
    monkeypatch.setattr(cpu_ops, "draft_propose", lambda *a: calls.append(a[7] * a[8] * (a[1] is head)) or fused(*a))
    out = engine.transcribe(mels[:3], language="en", max_new_tokens=MAX_NEW, num_draft_tokens=3)
    assert [o.tokens for o in out] == reference[:3]
    assert sum(o.stats.drafted for o in out) > 0 and sum(calls) > 0
    pruned = Engine(target, drafts["noisy"], draft_head_tokens=500)
    assert isinstance(pruned.drafter.head, SubsetHead)


def test_a_draft_encoder_in_bfloat16_keeps_output_exact(target, drafts, mels, reference, monkeypatch):
    """On a CPU with AMX a compact draft with its own encoder runs that encoder and its cross K/V
    in bfloat16 (forced here, whatever this CPU has): other proposals, the same
    output; a shared-encoder draft keeps the target's float32 encoder."""
    from specwhisper.backends import cpu_ops

    if not cpu_ops.available():
        pytest.skip("compact drafts need the C++ decode ops")
    monkeypatch.setattr(cpu_ops, "native_bf16", lambda: True)
    monkeypatch.setattr(cpu_ops, "bf16_draft_encoder", lambda: True)  # AMX
    engine = Engine(target, drafts["wrong"])
    draft = engine.drafter.draft.model
    assert draft.encoder.conv1.weight.dtype == torch.bfloat16 and draft.decoder.native_bf16
    assert draft.encoder.attention_block == 150 and not draft.encoder.local_last  # last layer global
    assert draft.encoder.pool_positions == 2  # its layers on one position per 40 ms (`pool_encoder`)
    assert not draft.decoder.int8_cross  # its cross K/V in bfloat16 too
    out = engine.transcribe(mels[:2], language="en", max_new_tokens=MAX_NEW, num_draft_tokens=2)
    assert [o.tokens for o in out] == reference[:2]
    assert sum(o.stats.draft_passes for o in out) > 0
    shared = Engine(target, drafts["shared"])
    assert shared.drafter.shared_encoder and shared.drafter.draft.model.encoder.conv1.weight.dtype == torch.float32


def test_a_draft_encoder_in_int8_keeps_output_exact(target, drafts, mels, reference, monkeypatch):
    """On a CPU without bfloat16 arithmetic (forced here) a compact draft with its own encoder runs
    that encoder's projections in int8 (fbgemm), and its decoder's cross K/V projections
    (`int8_cross`: near the float ones): other proposals, the same output; never the target's
    encoder or cross K/V, nor a shared-encoder draft's."""
    from specwhisper.backends import cpu_ops
    from specwhisper.model import encoder_cpu

    if not cpu_ops.available() or not encoder_cpu.int8_usable():
        pytest.skip("needs the C++ decode ops and fbgemm's int8 linear")
    monkeypatch.setattr(cpu_ops, "native_bf16", lambda: False)
    engine = Engine(target, drafts["wrong"])
    draft = engine.drafter.draft.model
    assert draft.encoder.int8_linears and draft.encoder.conv1.weight.dtype == torch.float32
    assert draft.encoder.attention_block == 150  # and attention within 3 s blocks (`local_encoder`),
    assert draft.encoder.local_last  # the last layer's too with int8 projections
    assert draft.encoder.pool_positions == 2 and engine.drafter.cross_positions(torch.float32) == 750
    assert draft.decoder.int8_cross and not engine.target.model.decoder.int8_cross
    features, _ = engine.drafter.encode(mels[0])
    caches = [DecoderCache.allocate(engine.drafter.draft.config, 1, "cpu", torch.float32, torch.float32, 750)
              for _ in range(2)]
    for cache, int8 in zip(caches, (True, False)):
        draft.decoder.int8_cross = int8
        draft.decoder.fill_cross(cache, features)
    for a, b in ((caches[0].cross_k, caches[1].cross_k), (caches[0].cross_v, caches[1].cross_v)):
        assert not torch.equal(a, b) and (a - b).abs().max() <= 0.05 * b.abs().max()
    assert not engine.target.model.encoder.int8_linears
    assert engine.target.model.encoder.attention_block is None
    assert engine.target.model.encoder.pool_positions == 1
    out = engine.transcribe(mels[:2], language="en", max_new_tokens=MAX_NEW, num_draft_tokens=2)
    assert [o.tokens for o in out] == reference[:2]
    assert sum(o.stats.draft_passes for o in out) > 0
    shared = Engine(target, drafts["shared"]).drafter.draft.model
    assert not shared.decoder.int8_cross
    shared = shared.encoder
    assert not shared.int8_linears and shared.attention_block is None and shared.pool_positions == 1


def test_content_frames_end_at_the_audio_in_whole_blocks():
    from specwhisper import log_mel_spectrogram
    from specwhisper.engine.draft import content_frames

    g = torch.Generator().manual_seed(3)
    clip = 0.1 * torch.randn(7 * 16000, generator=g)  # 7 s of noise, then padding to 30 s
    assert content_frames(log_mel_spectrogram(clip.numpy())) == 900  # 700 frames (+ the STFT's tail)
    assert content_frames(log_mel_spectrogram(torch.zeros(16000).numpy())) == 300  # silence: one block
    assert content_frames(log_mel_spectrogram((0.1 * torch.randn(30 * 16000, generator=g)).numpy())) == 3000
    mel = torch.randn(80, 3000, generator=g)
    mel[:, 1234:] = mel.min()
    mel[5, 1500] = mel.min() + 1  # a column off the floor: the audio goes on
    assert content_frames(mel) == 1800


def test_a_draft_encoder_runs_over_the_audio_only(target, drafts, mels, monkeypatch):
    """A draft with its own encoder encodes a window's audio, not its padding (whole 3 s blocks;
    zero features after them): other proposals, the target's output."""
    clip = mels[:2].clone()
    clip[0, :, 1000:] = clip[0].min()  # audio ends at 10 s: 1200 frames of whole blocks
    plain = Engine(target).transcribe(clip, language="en", max_new_tokens=MAX_NEW)
    engine = Engine(target, drafts["wrong"])
    encoder, seen = engine.drafter.draft.model.encoder, []
    forward = encoder.forward
    monkeypatch.setattr(encoder, "forward", lambda mel: seen.append(mel.shape[-1]) or forward(mel))
    out = engine.transcribe(clip, language="en", max_new_tokens=MAX_NEW, num_draft_tokens=2)
    assert [o.tokens for o in out] == [o.tokens for o in plain]
    assert sorted(seen) == [1200, 3000]
    features, frames = engine.drafter.encode(clip[0])
    pool = engine.drafter.draft.model.encoder.pool_positions  # 2 on a CPU (`Whisper.pool_encoder`)
    assert frames == 600 // pool and features.shape[1] == 1500 // pool == engine.drafter.cross_positions(torch.float32)
    assert not features[0, frames:].any() and features[0, :frames].abs().sum() > 0
    # the zero frames' K/V written from one zero row: the same bits as projecting them all
    ddec = engine.drafter.draft.model.decoder
    cfg = engine.drafter.draft.config
    for dtype in (torch.float32, torch.bfloat16):
        caches = [DecoderCache.allocate(cfg, 1, "cpu", torch.float32, dtype, 1500 // pool) for _ in range(2)]
        ddec.fill_cross(caches[0], features)
        ddec.fill_cross(caches[1], features, frames=frames)
        assert torch.equal(caches[0].cross_k, caches[1].cross_k) and torch.equal(caches[0].cross_v, caches[1].cross_v)


def test_the_calibration_warms_a_draft_encoder_so_that_every_start_is_charged(target, drafts, mels, monkeypatch):
    """`Drafter.warm` runs a draft's own encoder once, on one block of silence, when the adaptive k
    calibrates (the pass that packs its weights costs several setups and is not charged); from
    then on every window's start is timed and charged. A shared-encoder draft has nothing to warm."""
    from specwhisper.engine.draft import CONTENT_BLOCK
    from specwhisper.engine.draft_length import DraftLength

    engine = Engine(target, drafts["wrong"])
    drafter = engine.drafter
    encoder, seen = drafter.draft.model.encoder, []
    forward = encoder.forward
    monkeypatch.setattr(encoder, "forward", lambda mel: seen.append(mel.shape[-1]) or forward(mel))
    drafter.warm("cpu", torch.float32)
    assert drafter.encodes == 1 and seen == [CONTENT_BLOCK]
    drafter.warm("cpu", torch.float32)  # once only
    assert drafter.encodes == 1 and seen == [CONTENT_BLOCK]
    shared = Engine(target, drafts["shared"]).drafter
    shared.warm("cpu", torch.float32)
    assert shared.shared_encoder and shared.encodes == 0

    charged = []
    original = DraftLength.charge
    monkeypatch.setattr(DraftLength, "charge", lambda self, seconds, rows=1: charged.append(rows) or original(self, seconds, rows))
    fresh = Engine(target, drafts["wrong"])
    seen.clear()
    encoder = fresh.drafter.draft.model.encoder
    forward = encoder.forward
    monkeypatch.setattr(encoder, "forward", lambda mel: seen.append(mel.shape[-1]) or forward(mel))
    fresh.transcribe(mels[:2], language="en", max_new_tokens=MAX_NEW)  # adaptive: calibrates, warms
    starts = fresh.drafter.encodes - 1
    warm = seen.index(CONTENT_BLOCK)  # after the calibration's whole-window passes, if it measured
    assert set(seen[:warm]) <= {2 * fresh.drafter.draft.config.max_source_positions}
    assert starts >= 1 and sum(charged) == starts  # its trial started it: every start charged


def test_a_draft_encoder_without_amx_takes_int8_projections(target, drafts, monkeypatch):
    """bfloat16 arithmetic without AMX (AVX512-BF16 alone, forced here): the draft's own encoder
    takes fbgemm's int8 projections, faster there than torch's bfloat16 GEMM; its decoder keeps
    bfloat16 cross K/V."""
    from specwhisper.backends import cpu_ops
    from specwhisper.model import encoder_cpu

    if not cpu_ops.available() or not encoder_cpu.int8_usable():
        pytest.skip("needs the C++ decode ops and fbgemm's int8 linear")
    monkeypatch.setattr(cpu_ops, "native_bf16", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert not cpu_ops.bf16_draft_encoder()
    draft = Engine(target, drafts["wrong"]).drafter.draft.model
    assert draft.encoder.int8_linears and draft.encoder.conv1.weight.dtype == torch.float32
    assert draft.encoder.local_last and draft.decoder.native_bf16
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert cpu_ops.bf16_draft_encoder()


@pytest.mark.parametrize("variable", ["DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA"])
def test_no_bfloat16_arithmetic_where_onednn_is_held_below_it(variable, monkeypatch):
    """torch's bfloat16 GEMMs are oneDNN's: held to AVX2 (or AVX-512 without BF16) they run without
    bfloat16 dot products, 16x slower for tiny.en's draft encoder, so a CPU with AVX512-BF16 or AMX
    then counts as one without (a draft's encoder in int8, a bfloat16 model's encoder in float32)."""
    from specwhisper.backends import cpu_ops

    monkeypatch.delenv("SPECWHISPER_NO_BF16", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    cpu_ops.native_bf16.cache_clear()
    try:
        assert cpu_ops.native_bf16() and cpu_ops.bf16_draft_encoder()
        for isa, bf16 in [("AVX2", False), ("avx512_core", False), ("AVX512_CORE_VNNI", False),
                          ("AVX512_CORE_BF16", True), ("AVX512_CORE_AMX", True), ("ALL", True)]:
            monkeypatch.setenv(variable, isa)
            cpu_ops.native_bf16.cache_clear()
            assert cpu_ops.native_bf16() == bf16 and cpu_ops.bf16_draft_encoder() == bf16, isa
            assert cpu_ops.kernel_holds()[variable] == isa
    finally:
        monkeypatch.undo()
        cpu_ops.native_bf16.cache_clear()


@pytest.mark.parametrize("k", [1, 3, 8])
def test_max_new_tokens_cut_inside_a_run(k, target, mels, reference):
    engine = Engine(target, target)
    for max_new in range(1, 2 * k + 4):
        out = engine.transcribe(mels[0], language="en", max_new_tokens=max_new, num_draft_tokens=k)
        assert out.tokens == reference[0][:max_new]


def relabel_eot(src, dst, token: int):
    """Copy a checkpoint, swapping the strings of `token` and <|endoftext|> in tokenizer.json:
    the same weights then end a sequence wherever they first emit `token`."""
    shutil.copytree(src, dst)
    path = dst / "tokenizer.json"
    tj = json.loads(path.read_text())
    eot = next(a for a in tj["added_tokens"] if a["content"] == "<|endoftext|>")
    added = next((a for a in tj["added_tokens"] if a["id"] == token), None)
    if added is not None:  # a special token (e.g. a language token): swap the two contents
        added["content"], eot["content"] = eot["content"], added["content"]
    else:
        # `tokenizers` numbers added tokens itself, so both strings move into the BPE vocab
        vocab = tj["model"]["vocab"]
        string = next(s for s, i in vocab.items() if i == token)
        vocab[string], vocab["<|endoftext|>"] = eot["id"], token
        tj["added_tokens"].remove(eot)
    path.write_text(json.dumps(tj))
    return dst


@pytest.mark.parametrize("k", [3, 8])
def test_eot_at_every_position_of_a_draft_run(k, target, mels, reference, tmp_path):
    """With a draft that is always right, the first run after the prefill covers generated
    tokens 1..k+1; an EOT at each of them must end the output right there."""
    seq = reference[0]
    offsets = [j for j in range(1, k + 2) if seq[j] not in seq[:j]]
    assert len(offsets) >= k - 1, seq[: k + 2]  # the reference must be varied enough to test
    for j in offsets:
        folder = relabel_eot(target, tmp_path / f"eot{j}", seq[j])
        plain = Engine(folder).transcribe(mels[0], language="en", max_new_tokens=MAX_NEW)
        assert plain.tokens == seq[:j]
        spec = Engine(folder, folder).transcribe(mels[0], language="en", max_new_tokens=MAX_NEW, num_draft_tokens=k)
        assert spec.tokens == seq[:j]
        assert spec.stats.target_passes == 2  # prefill + one verify pass that met the EOT


@pytest.mark.parametrize("kind", ["self", "noisy", "wrong"])
def test_adaptive_k_is_exact_and_backs_off(kind, target, drafts, mels, reference):
    engine = Engine(target, drafts[kind])
    for _ in range(2):
        out = engine.transcribe(mels[:2], language="en", max_new_tokens=MAX_NEW)
        assert [o.tokens for o in out] == reference[:2]
    if kind == "wrong":  # speculation switched off: only occasional k = 1 probes remain
        assert out[0].stats.drafted <= 2 * 4


def test_measured_costs_are_kept_on_disk_per_machine_and_pair(target, drafts, mels, reference, tmp_path,
                                                               monkeypatch):
    """The adaptive k's pass costs are measured once per machine and pair and read back by later
    engines (a one-shot CLI run paid them in every process); a changed checkpoint file, another
    thread count, other code (`code_digest`), or an unreadable file measure them again;
    SPECWHISPER_COSTS_DIR=off keeps none.
    The output never changes."""
    from specwhisper.engine import draft as draft_mod

    folder = tmp_path / "costs"
    monkeypatch.setenv("SPECWHISPER_COSTS_DIR", str(folder))
    measured = []
    real = draft_mod.Drafter.measure_costs

    def counting(self, *args, **kwargs):
        measured.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(draft_mod.Drafter, "measure_costs", counting)

    def run():
        engine = Engine(target, drafts["noisy"])
        out = engine.transcribe(mels[:2], language="en", max_new_tokens=MAX_NEW)
        assert [o.tokens for o in out] == reference[:2]
        return engine

    first = run()
    files = sorted(folder.glob("*.json"))
    assert len(measured) == 1 and len(files) == 1
    saved = json.loads(files[0].read_text())
    assert saved["key"]["threads"] == torch.get_num_threads() and draft_mod.valid_costs(saved["costs"])
    assert first.drafter.length.calibrated
    second = run()  # read back: not measured, the same starting point
    assert len(measured) == 1 and second.drafter.length.calibrated
    assert second.drafter.length.verify_ratio[:2] == [1.0, 1.0]
    files[0].write_text("{not json")  # unreadable: measured and written again
    run()
    assert len(measured) == 2 and draft_mod.valid_costs(json.loads(files[0].read_text())["costs"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # another thread count: another file
        run()
    finally:
        torch.set_num_threads(threads)
    assert len(measured) == 3 and len(list(folder.glob("*.json"))) == 2
    code_digest = draft_mod.code_digest
    monkeypatch.setattr(draft_mod, "code_digest", lambda: "other code")  # other kernels: measured again
    run()
    assert len(measured) == 4 and len(list(folder.glob("*.json"))) == 3
    monkeypatch.setattr(draft_mod, "code_digest", code_digest)
    run()  # this code again: read back
    assert len(measured) == 4
    # a draft whose own encoder runs another way (here: every position) keeps its own costs
    own = Engine(target, drafts["wrong"])
    assert not own.drafter.shared_encoder and own.drafter.costs_key("cpu", torch.float32)["draft_encoder"]["pool"] == 2
    key = own.drafter.costs_key("cpu", torch.float32)
    own.drafter.draft.model.encoder.pool_positions = 1
    assert own.drafter.costs_key("cpu", torch.float32) != key
    assert first.drafter.costs_key("cpu", torch.float32)["draft_encoder"] is None  # the target's encoder
    # kernels held to another instruction set (an AVX2-only CPU measured on a wider one) run at
    # other speeds: costs measured natively are not read back there
    native = first.drafter.costs_key("cpu", torch.float32)
    isa = "AVX" if os.environ.get("DNNL_MAX_CPU_ISA") == "AVX2" else "AVX2"  # not the run's own hold
    with monkeypatch.context() as held_env:
        held_env.setenv("DNNL_MAX_CPU_ISA", isa)
        held = first.drafter.costs_key("cpu", torch.float32)
    assert held != native and held["holds"] == {**native["holds"], "DNNL_MAX_CPU_ISA": isa}
    assert first.drafter.costs_key("cpu", torch.float32) == native
    monkeypatch.setenv("SPECWHISPER_COSTS_DIR", "off")
    shutil.rmtree(folder)
    run()
    assert len(measured) == 5 and not folder.exists()
    assert draft_mod.costs_folder() is None
    monkeypatch.delenv("SPECWHISPER_COSTS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert draft_mod.costs_folder() == tmp_path / "xdg" / "specwhisper" / "costs"
    assert not draft_mod.valid_costs({"plain_seconds": 0.01, "verify_ratio": [1.0], "cost_ratio": 0.3,
                                      "setup_seconds": 0.0})


def test_draft_starts_only_when_speculation_runs(target, drafts, mels, reference):
    """A draft is set up (its encoder, cross K/V, prompt) at its row's first drafting iteration:
    while the adaptive k keeps speculation off, a row never pays for it; once drafting starts
    mid-window, the draft catches up on every token emitted so far (a self draft: all accepted)."""
    engine = Engine(target, drafts["self"], background=False)
    rule = engine.drafter.length
    rule.k, rule.update = 0, lambda *a, **kw: None  # speculation off
    off = engine.transcribe(mels[0], language="en", max_new_tokens=MAX_NEW)
    assert off.tokens == reference[0]
    assert off.stats.draft_passes == 0 and off.stats.drafted == 0
    assert not engine.runner.state.dtokens.any()  # nor its bookkeeping after each plain pass
    calls = []

    def later(k, *a, **kw):  # off for 5 iterations, then k = 2
        calls.append(k)
        rule.k = 2 if len(calls) >= 5 else 0

    rule.update = later
    on = engine.transcribe(mels[0], language="en", max_new_tokens=MAX_NEW)
    assert on.tokens == reference[0]
    assert on.stats.drafted > 0 and on.stats.accepted == on.stats.drafted


def test_adaptive_k_never_drafts_with_a_self_draft(target, drafts, mels, reference):
    """The pass costs are measured before the first decision: a self draft (a step no cheaper
    than the target's, a verify pass no cheaper than a step) never drafts, not in the first window
    either, and never probes."""
    engine = Engine(target, drafts["self"], background=False)
    for mel, tokens in zip(mels[:2], reference[:2]):
        out = engine.transcribe(mel, language="en", max_new_tokens=MAX_NEW)
        assert out.tokens == tokens and out.stats.drafted == 0 and out.stats.draft_passes == 0
    rule = engine.drafter.length
    assert rule.calibrated and rule.cost_ratio >= 1.0 and rule.best(always_right=True)[1] <= 1.0


def test_a_probe_never_starts_a_draft_with_its_own_encoder(target, drafts, mels, reference):
    """While speculation is off, a k = 1 probe runs only where a row's draft runs already: it
    never pays a window's draft encoder when that costs more than 16 plain passes; speculation
    that is on does start it."""
    engine = Engine(target, drafts["wrong"], background=False)
    assert not engine.drafter.shared_encoder
    rule = engine.drafter.length
    rule.calibrated, rule.update, rule.pays = True, lambda *a, **kw: None, lambda: True  # decisions held where set below
    rule.setup = 100.0  # an encoder pass of 100 plain passes
    rule.k, rule.until_probe = 1, 0  # a probe
    assert rule.probing()
    out = engine.transcribe(mels[0], language="en", max_new_tokens=MAX_NEW)
    assert out.tokens == reference[0] and out.stats.draft_passes == 0
    rule.k, rule.until_probe = 2, 16  # speculation on
    out = engine.transcribe(mels[0], language="en", max_new_tokens=MAX_NEW)
    assert out.tokens == reference[0] and out.stats.draft_passes > 0


def test_an_engine_tries_its_switched_off_draft_with_its_own_encoder_again(target, drafts, mels, reference):
    """The engine counts the windows a draft with its own encoder spends switched off (it calls
    `DraftLength.window_done` for them) and, after RETRIAL of them, starts that draft again at a
    window's start for the retrial; the tokens stay target-only's throughout."""
    engine = Engine(target, drafts["wrong"], background=False)
    assert not engine.drafter.shared_encoder
    rule = engine.drafter.length
    rule.calibrated, rule.spec_iters, rule.trial_end = True, rule.TRIAL, rule.TRIAL  # past its first trial
    rule.plain_pass, rule.setup = 1e-3, 100.0  # its encoder: 100 plain passes a window (not cheap)
    # the unit of the costs held: on a loaded CI machine the test model's steps (~25 ms) moved the
    # plain pass up 1.1x a step (`_follow`), the encoder read cheap (CHEAP_SETUP), a probe paid it
    # and the draft ran in the first window. This test is about counting windows, not timings
    rule._new_plain_pass = lambda seconds: None
    rule.always_right_gain = lambda start=False: 2.0  # a draft that would pay were it always right
    for i in range(rule.RETRIAL):  # switched off: never drafts, not even a probe (its encoder)
        out = engine.transcribe(mels[i], language="en", max_new_tokens=MAX_NEW)
        assert out.tokens == reference[i] and out.stats.draft_passes == 0, i
    assert rule.trial_end == rule.TRIAL + rule.TRIAL and rule.retrial_every == 2 * rule.RETRIAL
    out = engine.transcribe(mels[0], language="en", max_new_tokens=MAX_NEW)  # the retrial
    assert out.tokens == reference[0] and out.stats.draft_passes > 0 and rule.spec_iters > rule.TRIAL


def test_a_clear_draft_keeps_its_refresh_cadence_across_windows():
    """A draft whose measured rate beats plain steps by CLEAR refreshes every 128 speculative
    iterations across windows too: a window's start, whose own rate is not measured yet, keeps the
    verdict (read as not clear, every window start brought the refresh forward to 32 iterations,
    onto the window's first, slowest plain steps)."""
    from specwhisper.engine.draft_length import DraftLength

    rule, ks = DraftLength(None), []
    for _ in range(12):  # windows of 20 iterations, each keeping one proposal (two tokens, 1.8x
        for _ in range(20):  # a plain step's rate), a draft step 5% of a pass
            k = rule.k
            rule.update(k, [min(k, 1)], [False], draft_seconds=0.05 * k, verify_seconds=1.0)
            ks.append(k)
        rule.window_done(sum(min(k, 1) + 1 for k in ks[-20:]))
    plain = [i for i, k in enumerate(ks) if k == 0]
    assert plain == [0, 1, 2, 3, 132, 133], plain  # plain steps first: COLD_STEPS untimed, one timed
    assert rule.clear() and rule.cleared


def test_cold_plain_steps_do_not_set_the_unit_of_the_costs():
    """A window's first steps follow its encoder pass, an engine's first the calibration's passes
    too: on cold caches (base: 7.38, 3.70, 3.64 ms, then 3.1). The first timed plain pass replaces
    the calibrated one, and while a draft runs plain steps are rare (a refresh every 32-128
    iterations), so timing such a step made every cost in plain passes read too cheap for the rest
    of a run (the rule's plain pass 3.72 ms where steps took 3.0, tiny.en drafting). Here: a
    cheap, accurate draft; cold steps (a window's first COLD_STEPS, the step after a draft's)
    cost 1.6 passes, warm ones 1.0."""
    from specwhisper.engine.draft_length import DraftLength

    rule, ks = DraftLength(None), []
    rule.calibrate(plain_seconds=1.0, verify_ratio=[1.0] + [1.0 + 0.2 * (r - 1) for r in range(1, 10)],
                   cost_ratio=0.1, setup_seconds=0.0)
    cold = True
    for _ in range(4):  # windows of 25 iterations
        for i in range(25):
            k = rule.k
            if k == 0:
                warm = not cold and i >= rule.COLD_STEPS
                rule.update(0, [0], [False], draft_seconds=0.0, verify_seconds=1.0 if warm else 1.6)
            else:  # every proposal kept
                rule.update(k, [k], [False], draft_seconds=0.1 * k, verify_seconds=1.0 + 0.2 * k)
            cold = k > 0
            ks.append(k)
        rule.window_done(sum(k + 1 for k in ks[-25:]))
        cold = True
    assert rule.plain_pass == 1.0  # the warm step's time, not the cold one's
    assert ks[:4] == [0] * 4 and min(ks[4:]) > 0, ks  # drafting after COLD_STEPS + 1 plain steps
    assert abs(rule.cost_ratio - 0.1) < 1e-9 and abs(rule.verify_ratio[3] - 1.4) < 0.01


def test_a_stalled_first_timed_plain_pass_moves_the_unit_at_most_first_plain_span():
    """The first timed plain pass replaces the calibrated one (rows needing full logits pass about
    twice as slowly), but within FIRST_PLAIN_SPAN of it: a step stalled 50x (a busy machine) must
    not make a draft's encoder of 100 passes read cheap enough to probe; later passes follow."""
    from specwhisper.engine.draft_length import DraftLength

    for stall, expected in ((50.0, DraftLength.FIRST_PLAIN_SPAN), (2.0, 2.0), (1 / 50, 1 / DraftLength.FIRST_PLAIN_SPAN)):
        rule = DraftLength(None)
        rule.calibrate(plain_seconds=1e-3, verify_ratio=[1.0] * 10, cost_ratio=0.5, setup_seconds=0.1)
        assert rule.setup == 100.0 and not rule.setup_is_cheap()
        rule.window_steps = rule.COLD_STEPS  # past the untimed cold steps
        rule.update(0, [0], [False], draft_seconds=0.0, verify_seconds=stall * 1e-3)
        assert rule.plain_timed and abs(rule.plain_pass - expected * 1e-3) < 1e-12, (stall, rule.plain_pass)
        assert abs(rule.setup - 100.0 / expected) < 1e-9  # the setup keeps its seconds
        assert not rule.setup_is_cheap()
        first = rule.plain_pass  # later passes follow (`_follow`: clipped to 2x, DECAY)
        rule.update(0, [0], [False], draft_seconds=0.0, verify_seconds=50 * first)
        assert abs(rule.plain_pass - (rule.DECAY + (1 - rule.DECAY) * 2) * first) < 1e-12


def test_draft_length_rule():
    """The adaptive rule: long runs for a cheap, accurate draft; off once speculative iterations
    emit fewer tokens per second than plain steps, with sparse k = 1 probes; fixed k stays fixed."""
    from specwhisper.engine.draft_length import DraftLength

    def step(rule, accepted_all: bool, draft_cost: float):
        k = rule.k  # k == 0: a plain step emitting one token
        rule.update(k, [k if accepted_all else 0], [False], draft_seconds=draft_cost * k, verify_seconds=1.0)
        return k

    rule = DraftLength(None)
    ks = [step(rule, True, 0.05) for _ in range(140)]  # everything accepted, draft step 5% of a pass
    # a plain step first, then a refresh (two plain steps) after 128 speculative iterations: the
    # measured rate beats plain steps by far more than CLEAR; every EXPLORE-th iteration drafts one
    # fewer (one more would pass MAX_K); k climbs from the second speculative iteration, the first
    # (an engine's first use of its buffers) being untimed
    assert [i for i, k in enumerate(ks) if k == 0] == [0, 1, 2, 3, 132, 133], ks
    assert ks[4:8] == [3, 4, 6, 8] and ks[-1] == 8 and ks[8::8][:15] == [7] * 15, ks
    near = DraftLength(None)  # 1.2x plain steps, under CLEAR: a refresh every 32 iterations
    ks = [step(near, True, 0.8) for _ in range(80)]
    assert [i for i, k in enumerate(ks) if k == 0] == [0, 1, 2, 3, 36, 37, 70, 71], ks
    for _ in range(200):  # nothing accepted any more: speculation loses to plain steps
        step(rule, False, 0.05)
        if rule.k == 0 and not rule.pays():
            break
    assert rule.k == 0
    ks = [step(rule, False, 0.05) for _ in range(16 + 32 + 64 + 10)]
    probes = [i for i, k in enumerate(ks) if k]
    # k = 1 probes, backing off 16, 32, 64 timed plain steps, each after the untimed one that
    # follows a probe (cold caches)
    assert set(ks) == {0, 1} and len(probes) == 3
    assert probes[0] == 17 and probes[1] - probes[0] == 34 and probes[2] - probes[1] == 66

    rule = DraftLength(None)
    for _ in range(100):  # accurate but slower per token than the target: not worth it
        step(rule, True, 1.2)
    assert rule.k in (0, 1) and sum(step(rule, True, 1.2) > 1 for _ in range(32)) == 0

    rule = DraftLength(None)
    drafting = []
    for _ in range(30):  # windows of 4 iterations; a window that drafts pays a 40-pass draft setup
        if rule.k > 0:
            rule.charge(40.0)
        ks = [step(rule, True, 0.05) for _ in range(4)]
        rule.window_done(sum(k + 1 for k in ks))
        drafting.append(sum(k > 0 for k in ks))
    assert sum(drafting[-10:]) == 0, drafting  # accurate and cheap per token, but not worth its setup

    cheap = DraftLength(None)  # the same setup over windows of ~300 tokens pays
    cheap.plain_pass = 1.0
    cheap.charge(40.0)
    assert cheap.setup == 40.0
    for _ in range(30):
        cheap.window_done(300)
    # plain steps first (COLD_STEPS untimed, one timed), then drafting
    assert cheap.best()[1] > cheap.MARGIN and all(k > 0 for k in [step(cheap, True, 0.05) for _ in range(8)][4:])

    # calibrated costs decide before any drafting: a self draft (c = 1) never drafts, not even a probe
    verify = [1.0] + [1.0 + 0.2 * (r - 1) for r in range(1, 10)]  # a CPU: each row adds 20%
    same = DraftLength(None)
    same.calibrate(plain_seconds=1.0, verify_ratio=verify, cost_ratio=1.0, setup_seconds=0.0)
    assert sum(step(same, True, 1.0) for _ in range(200)) == 0
    small = DraftLength(None)  # a draft at 0.45 of a pass, as tiny.en on an AVX2 CPU: pays alone...
    small.calibrate(plain_seconds=1.0, verify_ratio=verify, cost_ratio=0.45, setup_seconds=0.0)
    assert small.best()[1] > small.MARGIN
    small.calibrate(plain_seconds=1.0, verify_ratio=verify, cost_ratio=0.45, setup_seconds=30.0)
    assert sum(step(small, True, 0.45) for _ in range(200)) == 0  # ... but not with its encoder per window

    rule = DraftLength(None)  # a CPU-like verify pass: each drafted token adds 25% of a plain pass
    rule.verify_ratio = [1.0 + 0.25 * (r - 1) for r in range(10)]  # as calibrated
    flat = DraftLength(None)
    for r in (rule, flat):
        r.plain_pass = 1.0
    for i in range(60):
        accepted = [4, 3, 4, 2, 4, 4, 1, 4][i % 8]
        rule.update(4, [accepted], [False], draft_seconds=4 * 0.1, verify_seconds=2.0)
        flat.update(4, [accepted], [False], draft_seconds=4 * 0.1, verify_seconds=1.0)
    assert abs(rule.verify_ratio[5] - 2.0) < 0.01 and flat.verify_ratio[5] == 1.0
    assert abs(rule.cost_ratio - 0.1) < 0.01 and abs(flat.cost_ratio - 0.1) < 0.01  # per plain pass
    assert rule.best()[0] < flat.best()[0]  # the growing pass asks for fewer drafted tokens

    # calibrated in a fast-memory phase (each row +25%), decoding in a phase where a row adds 8%:
    # drafting k = 3 measures v(4) only; the other row counts' extra costs follow its scale
    live, fixed = DraftLength(None), DraftLength(None)
    for r in (live, fixed):
        r.calibrate(plain_seconds=1.0, verify_ratio=[1.0, 1.0] + [1.0 + 0.25 * (n - 1) for n in range(2, 10)],
                    cost_ratio=0.15, setup_seconds=0.0)
        r.plain_timed = True
    fixed._new_verify_ratio = lambda rows, value: fixed.verify_ratio.__setitem__(rows, value)  # as before
    for i in range(80):
        for r in (live, fixed):
            r.update(3, [[3, 3, 2, 3][i % 4]], [False], draft_seconds=0.45, verify_seconds=1.24)
    assert abs(live.verify_ratio[4] - 1.24) < 0.01 and abs(fixed.verify_ratio[4] - 1.24) < 0.01
    assert all(abs(live.verify_ratio[n] - (1.0 + 0.08 * (n - 1))) < 0.01 for n in range(2, 10))
    assert live.verify_ratio[:2] == [1.0, 1.0] and fixed.verify_ratio[5] == 2.0
    assert fixed.best()[0] == 3 < live.best()[0]  # fewer rows than the machine asks for, left alone
    flat = DraftLength(None)  # a GPU: rows cost about nothing, nothing to scale
    flat.calibrate(plain_seconds=1.0, verify_ratio=[1.0] * 10, cost_ratio=0.15, setup_seconds=0.0)
    for _ in range(20):
        flat.update(3, [3], [False], draft_seconds=0.45, verify_seconds=1.3)
    assert flat.verify_ratio[4] > 1.2 and flat.verify_ratio[5:] == [1.0] * 5

    short = DraftLength(None)  # the first two proposals always accepted, the third never:
    short.plain_pass = 1.0     # the pooled rate (2/3) would ask for long drafts, the positions do not
    for _ in range(60):
        short.update(4, [2], [False], draft_seconds=4 * 0.1, verify_seconds=1.0)
    assert short.best()[0] == 2

    # a draft that stops early (`DraftSide.stop_margin`): under a cap of 6 it makes 2 proposals, both
    # kept, in every iteration. The estimate charges what ran (2 steps, 3 rows) and counts the stop
    # as a third proposal not kept, so a cap of 6 costs what a cap of 2 does; a draft that makes all
    # 6 and has the third rejected pays for 6 steps and 7 rows
    stops, full = DraftLength(None), DraftLength(None)
    for r in (stops, full):
        r.calibrate(plain_seconds=1.0, verify_ratio=[1.0 + 0.25 * max(n - 1, 0) for n in range(10)],
                    cost_ratio=0.2, setup_seconds=0.0)
        r.plain_timed = True
    for _ in range(60):
        stops.update(2, [2], [False], draft_seconds=2 * 0.2, verify_seconds=1.5, cap=6)
        full.update(6, [2], [False], draft_seconds=6 * 0.2, verify_seconds=2.5)
    g_stops, g_full = ({k: g for g, k in r.gains()} for r in (stops, full))
    assert stops.hit[3] == 0 < stops.reach[3] and stops.made[2] > 0 == stops.went_on[2]
    assert abs(g_stops[2] - 3 / (2 * 0.2 + 1.5)) < 0.01 * g_stops[2]  # 3 tokens for 2 steps and 3 rows
    assert g_stops[6] >= g_stops[2] and g_full[6] < 0.6 * g_full[2]

    tie = DraftLength(None)  # a draft that only ties plain steps stays off (their bookkeeping is not timed)
    tie.spec, tie.plain, tie.spec_iters = (10.2, 10.0), (10.0, 10.0), tie.TRIAL
    assert not tie.pays()
    tie.spec = (11.0, 10.0)
    assert tie.pays()
    tie.spec = (2.0, 20.0)  # one slow speculative iteration alone does not decide: the model does
    assert tie.pays()

    # costs as calibrated for base's distilled draft held to AVX2 (in plain passes): a plain step,
    # then a first iteration that keeps 1 of 3 proposals on cold caches and costs more per token
    # than plain steps; the draft stays on, and its later iterations show it pays
    first = DraftLength(None)
    first.calibrate(plain_seconds=1.0, verify_ratio=[1.0, 1.0, 1.1, 1.13, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7],
                    cost_ratio=0.25, setup_seconds=0.0)
    assert first.k == 0
    for _ in range(first.COLD_STEPS):  # a window's first steps run cold: not timed
        first.update(0, [0], [False], draft_seconds=0.0, verify_seconds=1.6)
    assert first.k == 0 and first.plain is None
    first.update(0, [0], [False], draft_seconds=0.0, verify_seconds=1.0)
    k = first.k
    assert k > 0
    first.update(k, [1], [False], draft_seconds=0.35 * k, verify_seconds=1.2)  # 2 tokens, 1.1 passes each
    assert first.k > 0
    for i in range(40):  # then 2-4 tokens an iteration at about 0.45 passes a token
        k = first.k
        first.update(k, [min(k, [3, 2, 3, 1][i % 4])], [False], draft_seconds=0.25 * k, verify_seconds=1.15)
    assert first.pays() and first.spec[0] >= first.MEASURED_TOKENS

    # as calibrated for base's long-form distilled draft held to AVX2 (the demo recording): its
    # first iteration keeps 0 of 2 proposals, then it keeps 2 of 3 on average; it stays on
    def trial(first_accepted, setup=0.0):
        rule = DraftLength(None)
        rule.window_tokens = 300.0  # long windows: a setup of 18 passes still leaves drafting worth it
        rule.calibrate(plain_seconds=1.0, verify_ratio=[1.0, 1.0, 1.11, 1.14, 1.22, 1.38, 1.4, 1.56, 1.65, 1.7],
                       cost_ratio=0.28, setup_seconds=setup)
        for _ in range(rule.COLD_STEPS + 1):  # a window's first plain steps, cold, are not timed
            rule.update(0, [0], [False], draft_seconds=0.0, verify_seconds=1.0)
        on = []
        for i in range(40):
            k = rule.k
            accepted = first_accepted if i == 0 else min(k, [3, 2, 1, 3, 2][i % 5])
            rule.update(k, [accepted], [False], draft_seconds=0.28 * k, verify_seconds=rule.verify_ratio[k + 1])
            on.append(k > 0)
        return rule, on

    missed, on = trial(0)
    assert sum(on[:10]) >= 8 and missed.pays() and missed.spec[0] >= missed.MEASURED_TOKENS, on
    # a draft whose start costs an encoder pass (18 plain passes a window; 14: tiny.en's int8,
    # block-local encoder held to AVX2) gets the trial too: its first TRIAL iterations draft
    # whatever the first one kept, then its measurements decide (here: on, a good draft)
    for setup in (18.0, 14.0):
        rule, on = trial(0, setup=setup)
        assert all(on[:rule.TRIAL]) and on[-1] and rule.pays(), (setup, on)
    for setup in (0.0, 18.0):  # a draft never right gets its trial, then stays off
        useless = DraftLength(None)
        useless.calibrate(plain_seconds=1.0, verify_ratio=[1.0] * 2 + [1.1 + 0.05 * r for r in range(8)],
                          cost_ratio=0.28, setup_seconds=setup)
        ks = [step(useless, False, 0.28) for _ in range(60)]
        assert 0 < sum(k > 0 for k in ks[:10]) <= useless.TRIAL + 1 and sum(k > 1 for k in ks[10:]) == 0, (setup, ks)
    # no trial where even a draft that is always right would not pay (a self draft: c = 1)
    selfish = DraftLength(None)
    selfish.calibrate(plain_seconds=1.0, verify_ratio=[1.0] * 2 + [1.1 + 0.05 * r for r in range(8)],
                      cost_ratio=1.0, setup_seconds=18.0)
    assert selfish.best(always_right=True)[1] < 1.0
    assert not any(step(selfish, True, 1.0) for _ in range(30))

    # a draft with its own encoder (20 plain passes a window) that has drafted before, switched
    # off, and whose estimate is now just above MARGIN does not switch back on (START_MARGIN); the
    # same estimate keeps it on while on, and switches it on before it ever drafted; clearly above
    # START_MARGIN, it switches back on
    def hovering(cost_ratio):
        rule = DraftLength(None)
        rule.window_tokens = 80.0
        rule.calibrate(plain_seconds=1.0, verify_ratio=[1.0, 1.0] + [1.1 + 0.1 * r for r in range(8)],
                       cost_ratio=cost_ratio, setup_seconds=20.0)
        rule.window_steps = rule.COLD_STEPS  # its window's first plain steps (cold, not timed) behind it
        rule.spec_iters = rule.TRIAL  # past the trial (an engine's first TRIAL speculative iterations)
        return rule
    near, clear = hovering(0.22), hovering(0.1)
    assert near.MARGIN < near.best()[1] < near.START_MARGIN < clear.best()[1], (near.best(), clear.best())
    assert near.pays()  # never drafted: the margin is MARGIN
    for rule in (near, clear):
        rule.spec = (2.0, 1.0)  # has drafted (too little for its measured rate to decide), is off
    assert step(near, True, 0.22) == 0 and near.k == 0 and not near.on and not near.pays()
    near.on = True  # the same estimate keeps a draft that is on
    assert near.pays()
    assert step(clear, True, 0.1) == 0 and clear.k > 0 and clear.on
    # once every live row's draft has started (`paid`: their windows' encoder passes are spent),
    # the setup is left out: the same off draft near its margin switches back on there, and a
    # draft worth it only without its setup (c = 0.3: 1.01 with it, 1.36 without) keeps drafting in
    # such a window but starts in no new one
    near.paid = True
    assert near.pays() and step(near, True, 0.22) == 0 and near.k > 0 and near.on
    costly = hovering(0.3)
    assert costly.best()[1] < costly.MARGIN and not costly.pays()
    costly.paid = True
    assert costly.best()[1] > costly.START_MARGIN and costly.pays()
    costly.update(0, [0], [False], draft_seconds=0.0, verify_seconds=1.0)
    assert costly.k > 0 and costly.on
    costly.paid = False
    costly.update(0, [0], [False], draft_seconds=0.0, verify_seconds=1.0)
    assert costly.k == 0 and not costly.on
    # the setup is spread over the tokens its window has yet to generate: a draft clearly worth
    # its encoder pass at a window's start is not started near its end (75 of 80 tokens: the
    # pass serves at most W / 8 = 10 more), and a window longer than usual still counts W / 8
    late = hovering(0.1)
    assert late.best()[1] > late.START_MARGIN and late.pays()
    late.generated = 40.0
    assert late.setup_share() == 20.0 / 40.0
    late.generated = 75.0
    assert late.setup_share() == 20.0 / 10.0 and not late.pays()
    late.generated = 200.0
    assert late.setup_share() == 20.0 / 10.0
    late.paid = True
    assert late.setup_share() == 0.0 and late.pays()

    # a measured rate that switched a draft off in one window does not keep it off in the next:
    # the window's end leaves it the weight of NEW_WINDOW_TOKENS, so the model decides again (and
    # the new window's iterations are measured before the rate decides)
    stale = DraftLength(None)
    stale.calibrate(plain_seconds=1.0, verify_ratio=[1.0] * 2 + [1.1 + 0.05 * r for r in range(8)],
                    cost_ratio=0.28, setup_seconds=0.0)
    stale.spec, stale.plain, stale.spec_iters = (40.0, 60.0), (20.0, 20.0), stale.TRIAL  # 1.5 passes a token
    assert stale.best()[1] > stale.MARGIN and not stale.pays()
    assert step(stale, True, 0.28) == 0 and stale.k == 0
    stale.window_done(100)
    assert stale.spec == (stale.NEW_WINDOW_TOKENS, 1.5 * stale.NEW_WINDOW_TOKENS) and stale.pays()
    for _ in range(stale.COLD_STEPS):  # the window's first steps run cold: untimed
        assert step(stale, True, 0.28) == 0 and stale.k == 0
    assert step(stale, True, 0.28) == 0 and stale.k > 0
    ks = [step(stale, False, 0.28) for _ in range(8)]  # the new window's iterations lose: off again
    assert ks[0] > 0 and ks[-1] == 0, ks

    fixed = DraftLength(5)
    fixed.update(5, [0], [False], 1.0, 1.0)
    assert fixed.k == 5


def test_adaptive_k_finds_the_best_k_where_the_calibration_misjudged_the_verify_passes():
    """A verify pass's cost over r rows, v(r), calibrated in another phase of the machine and with
    another shape (isolated passes in a slow-memory phase: 1.11, 1.11, 1.24, 1.52 for 2..5 rows)
    than the engine's passes show (a jump to the first extra row, then a few percent a row, as base
    drafted by base-2l on a Zen 4 EPYC: 1.39, 1.37, 1.48 for 3..5 rows). Extrapolating the
    calibration's shape from the one row count in use, the rule stayed at k = 2 (base-2l: 1.49x
    decode against k = 4's 1.61x; this simulation: 0.84 of the best fixed k's rate, and 0.91 where
    the passes cost 0.25 more a row from 6 rows on). Simulated with the acceptance by position of
    base-2l at k = 8 on six bench windows, timings jittered by ±10%, windows of 75 tokens: the
    rule decodes at >= 0.94 of the best fixed k's expected rate on average over 16 seeds (0.96 and
    0.97 here), >= 0.87 on each (over 60 seeds: means 0.956 and 0.972, the lowest 0.881 and 0.919;
    4 seeds and 0.9 each had held by the seeds' luck), and its v(r) ends within 0.1 of the engine's
    for the row counts about its k."""
    import random

    from specwhisper.engine.draft_length import DraftLength

    accept = [0.85, 0.853, 0.862, 0.88, 0.955, 0.952, 0.95, 0.921]
    calibrated = [1.0, 1.0, 1.11, 1.11, 1.24, 1.52, 1.52, 1.52, 1.61, 1.74]
    engine = [1.0, 1.0] + [1.3 + 0.06 * (r - 2) for r in range(2, 10)]
    cliff = [1.0, 1.0, 1.2, 1.3, 1.37, 1.48, 1.75, 2.0, 2.25, 2.5]
    c = 0.2

    def expected_rate(verify, k):  # tokens per plain pass at a fixed k
        emitted, survive = 1.0, 1.0
        for p in accept[:k]:
            survive *= p
            emitted += survive
        return emitted / (k * c + verify[k + 1])

    def decode(verify, seed, n=600):
        rng = random.Random(seed)
        rule = DraftLength(None)
        rule.calibrate(plain_seconds=1.0, verify_ratio=calibrated, cost_ratio=0.25, setup_seconds=0.0)
        tokens = passes = window = 0.0
        for _ in range(n):
            if window >= 75:
                rule.window_done(int(window))
                window = 0
            k, jitter = rule.k, 1.0 + 0.1 * (2 * rng.random() - 1)
            kept = 0
            while kept < k and rng.random() < accept[kept]:
                kept += 1
            rule.update(k, [kept], [False], draft_seconds=c * k * jitter, verify_seconds=verify[k + 1] * jitter)
            tokens, passes, window = tokens + kept + 1, passes + c * k + verify[k + 1], window + kept + 1
        return tokens / passes, rule

    for verify in (engine, cliff):
        best = max(range(1, 9), key=lambda k: expected_rate(verify, k))
        runs = [decode(verify, seed) for seed in range(16)]
        ratios = [rate / expected_rate(verify, best) for rate, _ in runs]
        assert sum(ratios) / len(ratios) >= 0.94 and min(ratios) >= 0.87, (best, ratios)
        for _, rule in runs if verify is engine else []:  # a line fits the engine's passes, not the cliff
            k = rule.best()[0]
            assert all(abs(rule.verify_ratio[r] - verify[r]) < 0.1 for r in (k, k + 1, k + 2) if r <= 9), \
                (k, rule.verify_ratio, verify)


def test_speculation_leaves_out_a_spent_setup_only_while_no_window_has_yet_to_pay_one():
    """`Speculation` tells the adaptive k whether the setup is spent: after an iteration where
    every row goes on with its draft started, yes; after one where a row ended (its slot takes a
    window whose draft has not started), no; and a decision made for spent setups is made again
    when a window has been admitted since, before its draft's encoder pass is paid."""
    from types import SimpleNamespace

    from specwhisper.engine.draft_length import DraftLength
    from specwhisper.engine.runner import Progress
    from specwhisper.engine.speculation import Speculation

    rule = DraftLength(None)
    rule.window_tokens = 80.0
    rule.calibrate(plain_seconds=1.0, verify_ratio=[1.0, 1.0] + [1.1 + 0.1 * r for r in range(8)],
                   cost_ratio=0.3, setup_seconds=20.0)  # pays without its setup only (as above)
    rule.spec_iters = rule.TRIAL  # past its trial: the model decides
    pending = [False]
    spec = SimpleNamespace(use_draft=True, num_draft_tokens=None, prompt=[1, 2, 3])
    generated = [5.0]  # tokens the pending row has generated
    runner = SimpleNamespace(specs=lambda B: [spec] * B,
                             pending_generated=lambda B: generated[0] if pending[0] else None,
                             hosts=[SimpleNamespace(budget=100, n=10, spec=spec)], start_drafts=lambda B: 0,
                             sync_draft=lambda B: None)
    # each iteration costs what the calibration says (a draft step 0.3, a pass over r rows v(r))
    clock = SimpleNamespace(mark=lambda: None,
                            intervals=lambda: (0.3 * control.k, rule.verify_ratio[control.k + 1]))
    backend = SimpleNamespace(clock=lambda: clock, calibrates=False, synchronize=lambda: None)
    control = Speculation(runner, SimpleNamespace(length=rule, shared_encoder=False, encodes=1), backend)

    def iteration(done: bool) -> int:
        k = control.begin(1)
        # no proposal counted (-1): the acceptance stays the prior, so only `paid` moves the decision;
        # a window that ends has generated 80 tokens (as `window_tokens` says)
        control.end(Progress(done=[done], n_tokens=[83], accepted=[-1], draft_len=[20]))
        return k

    for _ in range(rule.COLD_STEPS):  # the window's first plain steps run cold: not timed
        assert iteration(False) == 0 and rule.k == 0
    assert iteration(False) == 0 and rule.paid and rule.k > 0  # a window whose draft had started
    assert iteration(False) > 0 and rule.paid
    iteration(True)  # the window ends: the next decision counts the next window's setup
    assert not rule.paid and rule.k == 0
    rule.paid, rule.k, pending[0] = True, 3, True  # decided for spent setups; a window came in since
    assert control.begin(1) == 0 and not rule.paid and rule.k == 0

    # a draft worth its setup over a whole window (c = 0.1) starts in a window at its start, but
    # not in one whose row has generated most of its tokens: the decision made for one window is
    # made again for the window whose draft would start
    rule.calibrate(plain_seconds=1.0, verify_ratio=rule.verify_ratio, cost_ratio=0.1, setup_seconds=20.0)
    rule.paid, rule.generated, rule.k, rule.on = False, 0.0, 3, True
    generated[0] = 75.0
    assert control.begin(1) == 0 and rule.k == 0 and rule.generated == 75.0
    rule.generated, rule.k = 0.0, 3
    generated[0] = 2.0
    assert control.begin(1) == 3 and rule.generated == 2.0
    pending[0] = False
    control.end(Progress(done=[False], n_tokens=[20], accepted=[-1], draft_len=[20]))
    assert rule.paid and rule.generated == 0.0


def _windows(rule, n: int, accept, setup: float = 13.0, tokens: int = 72, c: float = 0.27) -> list[int]:
    """Drive `rule` as the engine does through n windows of `tokens` tokens each, one row, a draft
    with its own encoder: a window's draft starts (its setup of `setup` plain passes charged) at its
    first speculative iteration, never for a probe (`Speculation.choose_k`); a draft step costs c
    plain passes, a pass over r rows 1 + 0.11 (r - 1), a window's first plain steps 1.6 (cold).
    accept(w, j): the proposals kept in iteration j of window w. -> per window, the iterations
    that drafted."""
    drafted = []
    for w in range(n):
        rule.paid, rule.generated, started, done, ks = False, 0.0, False, 0, []
        while done < tokens:
            k = rule.k
            if rule.probing() and not started and not rule.setup_is_cheap():
                k = 0
            if k > 0 and not started:
                rule.charge(setup)
                started = True
            kept = min(k, accept(w, len(ks))) if k else 0
            verify = 1.0 + 0.11 * k if k else (1.6 if len(ks) < rule.COLD_STEPS else 1.0)
            rule.update(k, [kept], [False], draft_seconds=c * k, verify_seconds=verify)
            rule.paid, rule.generated = started, float(done)
            done += kept + 1
            ks.append(k)
        rule.paid = False
        rule.window_done(done)
        drafted.append(sum(k > 0 for k in ks))
    return drafted


def _tiny_like():
    """A rule calibrated as tiny.en drafting base on an AVX2-only Zen 3 (in plain passes): a verify
    row 11% of a pass, a draft step 0.3, its own encoder 18 passes over a whole 30 s window."""
    from specwhisper.engine.draft_length import DraftLength

    rule = DraftLength(None)
    rule.calibrate(plain_seconds=1.0, verify_ratio=[1.0, 1.0] + [1.0 + 0.11 * (r - 1) for r in range(2, 10)],
                   cost_ratio=0.3, setup_seconds=18.0)
    rule.window_tokens = 72.0
    return rule


def test_a_draft_with_its_own_encoder_switched_off_is_tried_again():
    """A draft whose start costs its own encoder pass, switched off by a bad first window, is
    tried again at a window's start after RETRIAL windows off (then 2x as many, up to
    RETRIAL_MAX): a good one is measured again and stays on; a useless one costs a trial's few
    iterations at each retrial only. Switched off, such a draft never drafted again (probes do not
    pay its encoder): tiny.en drafting base stayed off for 24 bench windows where k = 3 decoded
    1.14x faster."""
    good = _tiny_like()
    retrial = good.RETRIAL
    drafted = _windows(good, 30, lambda w, j: 0 if w == 0 else [3, 2, 3, 1, 3][j % 5])
    assert drafted[0] > 0 and drafted[1:retrial] == [0] * (retrial - 1), drafted  # the trial, then off
    assert all(d > 10 for d in drafted[retrial:]), drafted  # the retrial, and on from there
    assert good.setup == 13.0  # the starts' time replaced the calibration's whole-window pass

    useless = _tiny_like()
    drafted = _windows(useless, 80, lambda w, j: 0)
    schedule, at, every = [0], 0, useless.RETRIAL
    while at + every < 80:  # retrials after 4, 8, 16, 32, 32 ... windows that ended off
        at += every
        schedule.append(at)
        every = min(2 * every, useless.RETRIAL_MAX)
    assert [w for w, d in enumerate(drafted) if d] == schedule[:len([d for d in drafted if d])], drafted
    assert len([d for d in drafted if d]) >= 4 and max(drafted) <= useless.TRIAL + 2, drafted
    assert sum(drafted) <= 0.01 * 80 * 72  # iterations drafting: about 1% of the tokens

    # a retrial that switches the draft back on resets the back-off: switched off again later (a
    # slow spell), it is retried RETRIAL windows on, not after the doubled wait. Kept doubled, tiny.en
    # drafting base waited 8 bench windows after 9 it had drafted
    relapse = _tiny_like()
    good_run = lambda w, j: 0 if w == 0 or w >= 3 * retrial else [3, 2, 3, 1, 3][j % 5]  # noqa: E731
    drafted = _windows(relapse, 4 * retrial + 2, good_run)
    assert all(d > 10 for d in drafted[retrial:3 * retrial]), drafted  # the retrial: on from there
    assert drafted[3 * retrial] > 0 and drafted[3 * retrial + 1:4 * retrial] == [0] * (retrial - 1), drafted
    assert drafted[4 * retrial] > 0, drafted  # retried RETRIAL windows after it ended off again
    assert relapse.retrial_every == 2 * retrial

    # no retrial where even a draft that is always right would not pay for its setup (windows of 8
    # tokens), nor by window for a draft whose start is cheap (a shared encoder: its probes do that)
    short = _tiny_like()
    short.window_tokens = 8.0
    assert sum(_windows(short, 40, lambda w, j: 0, tokens=8)[1:]) == 0
    cheap = _tiny_like()
    drafted = _windows(cheap, 40, lambda w, j: 0, setup=1.0)
    assert cheap.setup_is_cheap() and cheap.retrial_every == cheap.RETRIAL and cheap.trial_end == cheap.TRIAL

    # a k = 1 the model chooses with speculation on is no probe, even after a probe's countdown ran
    # out: taken for one, it never started the retrial's draft encoder (`Speculation.choose_k`)
    one = _tiny_like()
    one.k, one.until_probe, one.on = 1, 0, True
    assert not one.probing()
    one.on = False
    assert one.probing()


def test_the_first_timed_draft_start_replaces_the_calibrated_setup_where_lower():
    """The calibration times a draft encoder's pass over a whole 30 s window, the most a start costs
    (a draft encodes its window's audio only): the first start timed replaces it where lower;
    a start timed slower than it, and every later start, moves the estimate a tenth of the way
    (clipped to within 2x of it, as every running cost)."""
    from specwhisper.engine.draft_length import DraftLength

    lower = DraftLength(None)
    lower.calibrate(plain_seconds=1.0, verify_ratio=[1.0] * 10, cost_ratio=0.3, setup_seconds=20.0)
    lower.charge(12.0)
    assert lower.setup == 12.0
    lower.charge(30.0)  # 0.9 * 12 + 0.1 * 24 (30 clipped to twice the estimate)
    assert abs(lower.setup - 13.2) < 1e-9
    higher = DraftLength(None)
    higher.calibrate(plain_seconds=1.0, verify_ratio=[1.0] * 10, cost_ratio=0.3, setup_seconds=10.0)
    higher.charge(15.0)
    assert abs(higher.setup - 10.5) < 1e-9
    fixed = DraftLength(3)  # a fixed k keeps no estimates
    fixed.plain_pass = 1.0
    fixed.charge(15.0)
    assert fixed.setup == 0.0


def test_two_draft_starts_in_a_row_beyond_the_clip_set_the_setup_at_once():
    """One start timed more than twice the estimate is a busy moment, followed a tenth of the way
    (clipped); a second in a row is a change (a calibration read back from another arrangement):
    the estimate takes the lower of the two. Starts within the clip in between break the run."""
    from specwhisper.engine.draft_length import DraftLength

    rule = DraftLength(None)
    rule.calibrate(plain_seconds=1.0, verify_ratio=[1.0] * 10, cost_ratio=0.3, setup_seconds=10.0)
    rule.charge(100.0)  # beyond 2 x 10: clipped to 20, a tenth of the way
    assert abs(rule.setup - 11.0) < 1e-9
    rule.charge(15.0)  # within the clip: the run of high starts ends
    assert abs(rule.setup - 11.4) < 1e-9
    rule.charge(100.0)
    assert abs(rule.setup - (0.9 * 11.4 + 0.1 * 22.8)) < 1e-9
    rule.charge(80.0)  # the second in a row: the lower of the two
    assert rule.setup == 80.0
    rule.charge(90.0)  # within 2x of the new estimate: followed again
    assert abs(rule.setup - 81.0) < 1e-9
    low = DraftLength(None)  # starts far below the estimate keep the tenth (after the first timed)
    low.calibrate(plain_seconds=1.0, verify_ratio=[1.0] * 10, cost_ratio=0.3, setup_seconds=40.0)
    low.charge(30.0)
    low.charge(5.0)
    low.charge(5.0)
    assert abs(low.setup - (0.9 * 28.5 + 0.1 * 28.5 / 2)) < 1e-9  # 30, then 0.9 * 30 + 0.1 * 15 = 28.5


def test_the_first_finished_window_replaces_the_prior_tokens_a_window():
    """The running tokens a window (which spreads a draft's setup) starts from a prior of 64; the
    first finished window's count replaces it, as the first timed start replaces the calibrated
    setup, and later windows move it a tenth of the way. A window with no tokens counts for
    nothing, and a fixed k keeps no estimates."""
    from specwhisper.engine.draft_length import DraftLength

    rule = DraftLength(None)
    assert rule.window_tokens == 64.0
    rule.window_done(0)
    assert rule.window_tokens == 64.0
    rule.window_done(80)
    assert rule.window_tokens == 80.0
    rule.window_done(60)
    assert abs(rule.window_tokens - 78.0) < 1e-9
    fixed = DraftLength(3)
    fixed.window_done(80)
    assert fixed.window_tokens == 64.0


def test_an_engines_first_draft_encoder_pass_is_not_charged():
    """`Speculation` charges each window's draft start to the adaptive k, but not the drafter's
    first own-encoder pass: it packs the encoder's weights (tiny.en's first start 365 ms against
    75-86 ms for the next ones on an AVX2-only Zen 3), a cost paid once, not per window."""
    from types import SimpleNamespace

    from specwhisper.engine.draft_length import DraftLength
    from specwhisper.engine.speculation import Speculation

    rule = DraftLength(None)
    rule.calibrate(plain_seconds=1.0, verify_ratio=[1.0] * 10, cost_ratio=0.3, setup_seconds=20.0)
    rule.k = 2
    charged = []
    rule.charge = lambda seconds, rows=1: charged.append(rows)
    spec = SimpleNamespace(use_draft=True, num_draft_tokens=None, prompt=[1, 2, 3])
    drafter = SimpleNamespace(length=rule, shared_encoder=False, encodes=0)

    def start_drafts(B):
        drafter.encodes += 1
        return 1

    runner = SimpleNamespace(specs=lambda B: [spec] * B, pending_generated=lambda B: 0.0,
                             hosts=[SimpleNamespace(budget=100, n=10, spec=spec)], start_drafts=start_drafts,
                             sync_draft=lambda B: None)
    backend = SimpleNamespace(clock=lambda: None, calibrates=False, synchronize=lambda: None)
    control = Speculation(runner, drafter, backend)
    rule.pays = lambda: True
    assert control.begin(1) == 2 and drafter.encodes == 1 and charged == []  # the first: not charged
    assert control.begin(1) == 2 and drafter.encodes == 2 and charged == [1]  # the next window's: charged
    shared = SimpleNamespace(length=rule, shared_encoder=True, encodes=5)  # a shared encoder: never charged
    Speculation(runner, shared, backend).begin(1)
    assert charged == [1]


def test_plain_steps_right_after_speculation_are_not_timed():
    """A plain step right after a speculative iteration runs on caches the draft has just filled
    (base held to AVX2: 6.8 against 6.3 ms). A draft whose iterations cost 0.99 warm plain passes a
    token (1% faster than plain decoding, under the 5% margin), against 1.15 for such cold steps,
    must end up off; timing those cold steps, it stayed on."""
    from specwhisper.engine.draft_length import DraftLength

    rule = DraftLength(None)
    rule.calibrate(plain_seconds=1.0, verify_ratio=[1.0] * 10, cost_ratio=0.3, setup_seconds=0.0)
    ks, after_spec = [], False
    for _ in range(300):
        k = rule.k
        if k == 0:
            rule.update(0, [0], [False], draft_seconds=0.0, verify_seconds=1.15 if after_spec else 1.0)
        else:  # every proposal kept, (k + 1) * 0.99 passes an iteration
            rule.update(k, [k], [False], draft_seconds=0.3 * k, verify_seconds=(k + 1) * 0.99 - 0.3 * k)
        after_spec = k > 0
        ks.append(k)
    # drafted at first (its calibration promised a gain), then off: k = 1 probes only, backing off
    assert max(ks[:10]) > 1 and max(ks[-150:]) == 1 and sum(ks[-150:]) <= 3, ks
    assert abs(rule.plain_pass - 1.0) < 1e-9  # the unit of the costs: a warm plain pass


def test_pruned_draft_head_is_exact(target, drafts, mels, reference):
    """A draft whose head only knows its 20000 lowest ids (plus EOT) proposes only those; the
    output is still the target's."""
    engine = Engine(target, drafts["noisy"], draft_head_tokens=20000)
    keep = engine.drafter.head.keep
    assert len(keep) == 20001 and keep[-1] == engine.drafter.draft.tokenizer.eot
    out = engine.transcribe(mels[:2], language="en", max_new_tokens=MAX_NEW, num_draft_tokens=3)
    assert [o.tokens for o in out] == reference[:2]
    seen = []
    orig = engine.drafter.head.argmax
    engine.drafter.head.argmax = lambda h, banned=None: seen.append(orig(h, banned)) or seen[-1]
    engine.transcribe(mels[0], language="en", max_new_tokens=MAX_NEW, num_draft_tokens=3)
    proposed = torch.cat(seen)
    assert len(proposed) > 0 and bool(torch.isin(proposed, keep).all())


@pytest.mark.skipif(not cpu_ops.available(), reason="C++ decode ops unavailable")
@pytest.mark.parametrize("kind", ["noisy", "wrong"])  # the target's encoder output / its own encoder
def test_a_compact_draft_attends_over_pooled_cross_positions(target, drafts, mels, reference, kind, monkeypatch):
    """A compact CPU draft sharing the target's encoder keeps its cross-attention K/V as the means
    of CROSS_POOL adjacent positions (`draft.pool_positions`): exactly those of the full K/V it
    would have kept, its output unchanged, greedy and sampled, and its cost calibration runs on
    the pooled cache. One with its own encoder runs its layers on pooled positions instead
    (`Whisper.pool_encoder`: its cross K/V projected from those) and keeps a 4-bit head."""
    from specwhisper.backends.cpu import CpuBackend
    from specwhisper.constants import CROSS_POOL
    from specwhisper.engine.draft import pool_positions

    x = torch.arange(2 * 1 * 2 * 6 * 3, dtype=torch.float32).view(2, 1, 2, 6, 3)
    assert torch.equal(pool_positions(x, 2), (x[:, :, :, 0::2] + x[:, :, :, 1::2]) / 2)
    assert pool_positions(x, 1) is x
    pooled = Engine(target, drafts[kind])
    side = pooled.runner.draft_side
    if not pooled.drafter.shared_encoder:
        assert kind == "wrong" and side.pool == 1 and side.cache.cross_k.shape[3] == 750
        assert pooled.drafter.draft.model.encoder.pool_positions == 2
        assert type(pooled.drafter.head) is Q4Head
        out = pooled.transcribe(mels[:2], language="en", max_new_tokens=MAX_NEW, num_draft_tokens=3)
        assert [o.tokens for o in out] == reference[:2]
        assert pooled.drafter.measure_costs(pooled.device, torch.float32, rounds=1)["setup_seconds"] > 0
        return
    assert kind == "noisy" and side.pool == CROSS_POOL == 2 and side.cache.cross_k.shape[3] == 1500 // CROSS_POOL
    out = pooled.transcribe(mels[:2], language="en", max_new_tokens=MAX_NEW, num_draft_tokens=3)
    assert [o.tokens for o in out] == reference[:2]
    monkeypatch.setattr(CpuBackend, "draft_cross_pool", lambda self, decoder, dtype: 1)
    full = Engine(target, drafts[kind])
    assert full.runner.draft_side.pool == 1 and full.runner.draft_side.cache.cross_k.shape[3] == 1500
    full.transcribe(mels[:2], language="en", max_new_tokens=MAX_NEW, num_draft_tokens=3)
    for a, b in ((side.cache.cross_k, full.runner.draft_side.cache.cross_k),
                 (side.cache.cross_v, full.runner.draft_side.cache.cross_v)):
        assert a.dtype == b.dtype and torch.equal(a[:, :2], pool_positions(b[:, :2], 2).to(a.dtype))
    monkeypatch.undo()
    sampled = pooled.transcribe(mels[0], language="en", max_new_tokens=MAX_NEW, temperature=1.0, seed=5,
                                num_draft_tokens=3)
    plain = Engine(target).transcribe(mels[0], language="en", max_new_tokens=MAX_NEW, temperature=1.0, seed=5)
    assert sampled.tokens == plain.tokens and sampled.stats.drafted > 0
    costs = pooled.drafter.measure_costs(pooled.device, torch.float32, rounds=1)
    assert costs["cost_ratio"] > 0 and (costs["setup_seconds"] > 0) == (not pooled.drafter.shared_encoder)


def test_an_engines_first_speculative_iteration_is_not_timed():
    """An engine's first speculative iteration (its first use of the draft's and the slot's
    buffers: 2.0x a warm one for tiny.en drafting base on an AVX2-only Zen 3) leaves the costs and
    the measured speculative rate as they were; its acceptance counts. The next one is timed."""
    from specwhisper.engine.draft_length import DraftLength

    verify = [1.0, 1.0] + [1.0 + 0.1 * (r - 1) for r in range(2, 10)]
    rule = DraftLength(None)
    rule.calibrate(plain_seconds=1.0, verify_ratio=verify, cost_ratio=0.2, setup_seconds=0.0)
    for _ in range(rule.COLD_STEPS + 1):
        rule.update(0, [0], [False], draft_seconds=0.0, verify_seconds=1.0)
    k = rule.k
    assert k > 0
    rule.update(k, [k], [False], draft_seconds=2.0 * k, verify_seconds=10.0)
    assert rule.verify_ratio == verify and rule.cost_ratio == 0.2 and rule.spec is None
    assert rule.spec_iters == 1 and rule.hit[1] > 0  # counted as an iteration, its proposals as kept
    k = rule.k
    rule.update(k, [k], [False], draft_seconds=2.0 * k, verify_seconds=10.0)
    assert rule.verify_ratio[k + 1] > verify[k + 1] and rule.cost_ratio > 0.2 and rule.spec is not None


def test_one_slow_verify_pass_does_not_write_a_good_draft_off():
    """A draft whose calibration says it pays, whose first timed verify pass (an engine's first
    speculative iteration is not timed) is slow against a first plain pass timed fast (each about one standard deviation of this machine's timings: the
    plain pass at 0.8 of the usual, the verify pass at 1.15), is probed again and drafts once its
    passes time as usual. At the measured costs alone that one pass (1.75 plain passes for the 2
    rows calibrated at 1.22) scaled every row count's extra cost 3.4x, no draft that is always
    right paid, and no probe ever timed a pass again: the draft stayed off for the engine's life."""
    from specwhisper.engine.draft_length import DraftLength

    # base's distilled draft on a Zen 4 EPYC: isolated passes as bench/cpu.py timed them (2-5 rows
    # 1.22, 1.52, 1.69, 2.05 plain passes), a draft step 0.22 of a pass
    verify = [1.0, 1.0, 1.22, 1.52, 1.69, 2.05, 2.37, 2.7, 3.03, 3.36]
    rule = DraftLength(None)
    rule.calibrate(plain_seconds=1.0, verify_ratio=verify, cost_ratio=0.22, setup_seconds=0.6)
    for _ in range(rule.COLD_STEPS):
        rule.update(0, [0], [False], draft_seconds=0.0, verify_seconds=1.0)
    rule.update(0, [0], [False], draft_seconds=0.0, verify_seconds=0.8)  # timed fast
    k = rule.k
    assert k == 1  # the fast unit makes the draft's steps look dearer
    rule.update(k, [0], [False], draft_seconds=0.22 * k, verify_seconds=9.0)  # an engine's first: untimed
    assert rule.verify_ratio == verify and rule.spec is None
    k = rule.k
    assert k == 1
    rule.update(k, [1], [False], draft_seconds=0.22 * k, verify_seconds=1.15 * verify[k + 1])  # timed slow
    assert rule.best(always_right=True)[1] < rule.MARGIN  # at the measured costs alone: hopeless
    ks = []
    for i in range(300):  # then every pass as calibrated; most proposals accepted
        k = rule.k
        ks.append(k)
        rule.update(k, [min(k, [4, 3, 4, 2][i % 4])], [False], draft_seconds=0.22 * k,
                    verify_seconds=verify[k + 1] if k else 1.0)
    assert rule.on and sum(k > 1 for k in ks[-100:]) > 80, ks


def test_a_fixed_k_above_the_adaptive_range_beside_adaptive_rows(target, drafts, mels, reference):
    """A row asking for more draft tokens than the adaptive k ever chooses (12 > MAX_ADAPTIVE_K)
    decoded beside adaptive rows: the iteration's k is the larger one, and the adaptive estimate
    learns nothing from it (its counts stop at MAX_ADAPTIVE_K). Before, the adaptive rows' accepted
    proposals past 8 were counted into those arrays and every request of the iteration failed
    (IndexError)."""
    from specwhisper.constants import MAX_ADAPTIVE_K

    engine = Engine(target, drafts["self"], background=False)  # accepts every proposal
    fixed = engine.submit(mels[0], language="en", max_new_tokens=MAX_NEW, num_draft_tokens=12)
    adaptive = [engine.submit(m, language="en", max_new_tokens=MAX_NEW) for m in mels[1:3]]
    engine.run_until([fixed, *adaptive])
    assert [f.result().tokens for f in (fixed, *adaptive)] == reference[:3]
    assert 12 > MAX_ADAPTIVE_K and fixed.result().stats.drafted > 0

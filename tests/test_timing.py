"""Word timestamps, piece by piece, against openai-whisper's own functions (whisper/timing.py):
alignment heads, median filter, DTW, the alignment pass's attention weights, word splitting,
punctuation merging and `add_word_timestamps` (the words' clipping and the segments' bounds)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specwhisper.config import WhisperConfig
from specwhisper.longform import timing
from specwhisper.results import Segment


def config(vocab, mels, d, enc, dec, heads):
    return WhisperConfig(d_model=d, encoder_layers=enc, encoder_attention_heads=heads, encoder_ffn_dim=4 * d,
                         decoder_layers=dec, decoder_attention_heads=heads, decoder_ffn_dim=4 * d,
                         vocab_size=vocab, num_mel_bins=mels)


def test_alignment_heads_follow_openai_table_and_refuse_unknown_models():
    import whisper

    from whisper.model import ModelDimensions, Whisper

    assert timing.OPENAI_ALIGNMENT_HEADS == {k: v for k, v in whisper._ALIGNMENT_HEADS.items()
                                             if k not in ("large", "turbo")}
    for name, (vocab, mels, d, enc, dec, heads) in {"tiny.en": (51864, 80, 384, 4, 4, 6),
                                                    "base": (51865, 80, 512, 6, 6, 8),
                                                    "large-v3-turbo": (51866, 128, 1280, 32, 4, 20)}.items():
        ref = SimpleNamespace(dims=ModelDimensions(mels, 1500, d, heads, enc, vocab, 448, d, heads, dec))
        ref.register_buffer = lambda name, value, persistent: setattr(ref, name, value)
        Whisper.set_alignment_heads(ref, whisper._ALIGNMENT_HEADS[name])  # openai's decoding of its table
        want = [tuple(map(int, ij)) for ij in ref.alignment_heads.indices().T.tolist()]
        assert timing.alignment_heads(config(vocab, mels, d, enc, dec, heads), {}) == want
    base = config(51865, 80, 512, 6, 6, 8)
    assert timing.alignment_heads(base, {"alignment_heads": [[5, 2], [3, 1]]}) == [(3, 1), (5, 2)]
    with pytest.raises(ValueError, match="outside the decoder"):
        timing.alignment_heads(base, {"alignment_heads": [[6, 0]]})
    with pytest.raises(ValueError, match="large-v1 and large-v2"):
        timing.alignment_heads(config(51865, 80, 1280, 32, 32, 20), {})
    with pytest.raises(ValueError, match="none of openai's models"):
        timing.alignment_heads(config(51865, 80, 64, 2, 2, 4), {})


@pytest.mark.parametrize("shape", [(3, 17, 40), (5, 200), (2, 1), (1, 3, 7, 11)])
def test_median_filter_equals_openai(shape):
    from whisper.timing import median_filter

    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    x[..., ::2] = (x[..., ::2] * 2).round() / 2  # ties
    assert torch.equal(timing.median_filter(x, 7), median_filter(x, 7))


@pytest.mark.parametrize("n, m, seed", [(1, 1, 0), (3, 50, 1), (40, 700, 2), (60, 60, 3), (80, 30, 4)])
def test_dtw_equals_openai(n, m, seed):
    from whisper.timing import dtw_cpu

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, m))
    if seed % 2:
        x = np.round(x, 1)  # ties between paths
    rows, cols = timing.dtw(x)
    want = dtw_cpu(x.copy())
    assert np.array_equal(rows, want[0]) and np.array_equal(cols, want[1])


def test_alignment_pass_weights_equal_openai_cross_attention(ckpt_dir):
    """The alignment heads' cross-attention logits and the text tokens' probabilities equal those
    openai's `find_alignment` reads through its hooks (same weights), batched with padding."""
    from whisper.model import disable_sdpa
    from whisper_ref import openai_whisper

    from specwhisper.engine.decoding import LoadedModel
    from specwhisper.longform.alignment import alignment_pass
    from specwhisper.model.whisper import DecoderCache

    folder = ckpt_dir("openai_shaped", d_model=64, heads=4, ffn_dim=256, seed=5)  # openai's MLP is 4 x d
    model = LoadedModel.load(folder, torch.device("cpu"), torch.float32)
    ref = openai_whisper(folder)
    heads = model.alignment_heads
    assert heads == [(1, h) for h in range(4)]  # the tiny checkpoints carry openai's default
    tok = model.tokenizer
    mels = torch.randn(2, 80, 3000, generator=torch.Generator().manual_seed(0))
    features = model.model.encoder(mels)
    cache = DecoderCache.allocate(model.config, 2, "cpu", torch.float32)
    model.model.decoder.fill_cross(cache, features)
    prompt = tok.prompt("en", "transcribe")
    texts = [[300, 301, 302, 7000, 12], [55, 4000]]
    requests = [timing.AlignmentRequest(prompt + t + [tok.eot], len(prompt) - 1, t, 3000 - 100 * i)
                for i, t in enumerate(texts)]
    outputs = alignment_pass(model.model.decoder, requests, cache.cross_k, cache.cross_v, heads, tok.eot)
    for b, (request, (weights, probs)) in enumerate(zip(requests, outputs)):
        qks = [None] * 2
        hooks = [block.cross_attn.register_forward_hook(lambda _, ins, outs, i=i: qks.__setitem__(i, outs[-1][0]))
                 for i, block in enumerate(ref.decoder.blocks)]
        with torch.no_grad(), disable_sdpa():
            logits = ref(mels[b:b + 1], torch.tensor([request.tokens]))[0]
        for h in hooks:
            h.remove()
        want = torch.stack([qks[layer][head] for layer, head in heads])
        torch.testing.assert_close(weights, want, atol=2e-4, rtol=1e-4)
        token_probs = logits[request.n_prefix:, :tok.eot].softmax(-1)[np.arange(len(request.text_tokens)),
                                                                      request.text_tokens]
        assert probs == pytest.approx(token_probs.tolist(), rel=1e-4, abs=1e-9)


@pytest.fixture(scope="module")
def base_tokenizers():
    import whisper.tokenizer

    from conftest import real_folder
    from specwhisper.tokenizer import Tokenizer

    return Tokenizer.from_folder(real_folder("base"), 51865), whisper.tokenizer.get_tokenizer(True)


@pytest.mark.real
@pytest.mark.parametrize("language, text", [
    ("en", " Hello, world! It's 3.5 o'clock (maybe) — \"quoted\" words-with-hyphens."),
    ("ja", "こんにちは、世界。今日は良い天気ですね"),
    ("zh", "我们今天去公园散步，好吗？"),
])
def test_word_split_equals_openai(base_tokenizers, language, text):
    import whisper.tokenizer

    ours, ref = base_tokenizers
    tokens = ref.encode(text) + [ref.eot]
    assert ours.encode(text) == tokens[:-1]
    assert timing.split_to_word_tokens(ours, tokens, language) == \
        whisper.tokenizer.get_tokenizer(True, language=language).split_to_word_tokens(tokens)


def _timings(words):
    from whisper.timing import WordTiming

    return ([timing.WordTiming(w, list(t), s, e, p) for w, t, s, e, p in words],
            [WordTiming(w, list(t), s, e, p) for w, t, s, e, p in words])


def test_merge_punctuations_equals_openai():
    from whisper.timing import merge_punctuations

    words = [(" \"", [1], 0.0, 0.1, 0.9), (" Hello", [2], 0.1, 0.4, 0.8), (",", [3], 0.4, 0.5, 0.7),
             (" (", [4], 0.5, 0.6, 0.9), (" world", [5], 0.6, 0.9, 0.6), (")", [6], 0.9, 1.0, 0.5),
             (".", [7], 1.0, 1.1, 0.5), ("\"", [8], 1.1, 1.2, 0.4), (" -", [9], 1.2, 1.3, 0.4)]
    ours, ref = _timings(words)
    timing.merge_punctuations(ours, timing.PREPEND_PUNCTUATIONS, timing.APPEND_PUNCTUATIONS)
    merge_punctuations(ref, timing.PREPEND_PUNCTUATIONS, timing.APPEND_PUNCTUATIONS)
    assert [(w.word, w.tokens) for w in ours] == [(w.word, w.tokens) for w in ref]


@pytest.mark.parametrize("last_speech", [0.0, 9.0])
def test_add_word_timestamps_equals_openai(monkeypatch, last_speech):
    """openai's clipping of long words (at sentence ends, after pauses), punctuation merging and
    segment bounds, on a given alignment (its `find_alignment` replaced by the same words)."""
    import whisper.timing as wt

    tokenizer = type("Tok", (), {"eot": 1000})()
    words = [(" The", [1], 0.0, 0.3, 0.9), (" cat", [2], 0.3, 2.9, 0.8), (".", [3], 2.9, 3.0, 0.9),
             (" A", [4], 3.0, 6.5, 0.2), (" dog", [5], 6.5, 6.8, 0.95), (" ran", [6], 6.8, 7.0, 0.9),
             ("!", [7], 7.0, 9.9, 0.5), (" Then", [8], 12.0, 12.4, 0.7), (" home", [9], 12.4, 13.1, 0.6)]
    tokens = [[50, 1, 2, 3, 70], [70, 4, 5, 6, 7, 90], [91, 8, 9, 95]]
    bounds = [(10.0, 12.9), (11.4, 20.5), (22.0, 22.6)]
    ours_alignment, ref_alignment = _timings(words)
    monkeypatch.setattr(wt, "find_alignment", lambda *a, **k: ref_alignment)
    ref_segments = [dict(seek=1000, start=s, end=e, tokens=t) for (s, e), t in zip(bounds, tokens)]
    wt.add_word_timestamps(segments=ref_segments, model=None, tokenizer=tokenizer, mel=None, num_frames=3000,
                           last_speech_timestamp=last_speech)
    segments = [Segment(i, 1000, s, e, "", t) for i, ((s, e), t) in enumerate(zip(bounds, tokens))]
    timing.add_word_timestamps(segments, ours_alignment, tokenizer, last_speech_timestamp=last_speech)
    assert [(s.start, s.end) for s in segments] == [(s["start"], s["end"]) for s in ref_segments]
    assert [[w.to_dict() for w in s.words] for s in segments] == [
        [{k: float(v) if k != "word" else v for k, v in w.items()} for w in s["words"]] for s in ref_segments]

"""specwhisper.tools.distill: a trained shared-encoder draft from the target's own transcripts.

A tiny random target (the `multilingual` fixture) and three bundled clips keep every run to a few
seconds; the teacher's transcripts are capped at 16 tokens."""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specwhisper import Engine
from specwhisper.model.weights import load_whisper
from specwhisper.model.whisper import DecoderCache
from specwhisper.samples import sample_paths
from specwhisper.tools.distill import (DistillOptions, Example, agreement, audio_files, batch_of, cross_kv, distill,
                                       distill_loss, draft_prompt, init_draft_decoder, layer_choice,
                                       split_holdout,
                                       teacher_examples, teacher_forced_hidden)

OPTS = DistillOptions(steps=3, batch_size=2, lr=1e-3, warmup=0, language="en", max_new_tokens=16,
                      progress=False, device="cpu", pack=False, longform=False)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clips")
    for path in sample_paths()[:3]:
        shutil.copy(path, folder / path.name)
    return folder


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


def test_loss_decreases(multilingual, clips, tmp_path):
    # one batch = all three windows, so every step sees the same data and losses compare
    report = distill(multilingual, clips, tmp_path / "draft", replace(OPTS, steps=6, batch_size=3))
    assert report.examples == 3 and report.step == 6 and len(report.losses) == 6
    assert report.losses[-1] < report.losses[0] - 0.1, report.losses


def test_saved_folder_is_a_shared_encoder_draft_with_identical_output(multilingual, clips, tmp_path):
    out = tmp_path / "draft"
    distill(multilingual, clips, out, OPTS)
    assert json.loads((out / "config.json").read_text())["decoder_layers"] == 2
    for name in ("tokenizer.json", "generation_config.json"):
        assert (out / name).read_bytes() == (multilingual / name).read_bytes()
    saved, original = weights(out), load_file(str(multilingual / "model.safetensors"))
    encoder = sorted(k for k in original if k.startswith("model.encoder."))
    assert encoder and all(torch.equal(saved[k], original[k]) for k in encoder)

    from transformers import WhisperForConditionalGeneration

    hf, info = WhisperForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and len(hf.model.decoder.layers) == 2

    engine, plain = Engine(multilingual, draft=out, device="cpu"), Engine(multilingual, device="cpu")
    assert engine.drafter.shared_encoder
    assert engine.drafter.draft.config.decoder_layers == 2
    for path in sample_paths()[:3]:
        want = plain.transcribe(path, language="en", max_new_tokens=24)
        for k in (1, 4):
            got = engine.transcribe(path, language="en", max_new_tokens=24, num_draft_tokens=k)
            assert got.tokens == want.tokens
            assert got.stats.drafted > 0


def test_a_distilled_draft_copies_the_targets_cross_kv(multilingual, clips, tmp_path):
    """distill freezes the draft layers' cross K/V projections at their target layers', so with the
    shared encoder the draft's cross K/V for a window are the target's: copied at the draft's start,
    bit for bit what its own projections give (float32 draft), never projected again; a compact
    draft keeps the means of their adjacent positions (`pool_positions`)."""
    from specwhisper.audio import load_audio, log_mel_spectrogram, pad_or_trim
    from specwhisper.engine.draft import pool_positions

    out = tmp_path / "draft"
    distill(multilingual, clips, out, OPTS)
    n_target = load_whisper(multilingual).config.decoder_layers
    path = sample_paths()[0]
    mel = log_mel_spectrogram(pad_or_trim(torch.from_numpy(load_audio(path))), 80)
    plain = Engine(multilingual, device="cpu", background=False).transcribe(mel, language="en", max_new_tokens=24)
    for compact in (False, True):
        engine = Engine(multilingual, draft=out, device="cpu", compact_draft=compact, background=False)
        assert engine.drafter.cross_sources == layer_choice(n_target, 2)
        projected = []
        ddec = engine.drafter.draft.model.decoder
        fill = ddec.fill_cross
        ddec.fill_cross = lambda *a, **k: projected.append(1) or fill(*a, **k)
        got = engine.transcribe(mel, language="en", max_new_tokens=24, num_draft_tokens=3)
        assert got.tokens == plain.tokens and got.stats.drafted > 0 and not projected
        side, target = engine.runner.draft_side.cache, engine.runner.cache
        pool = engine.runner.draft_side.pool  # a compact CPU draft keeps the means of adjacent positions
        assert pool == (2 if compact else 1)
        for i, j in enumerate(engine.drafter.cross_sources):  # slot 0 holds the call's window in both
            for mine, theirs in ((side.cross_k, target.cross_k), (side.cross_v, target.cross_v)):
                want = pool_positions(theirs[j:j + 1, 0:1], pool)[0, 0]
                assert torch.equal(mine[i, 0], want.to(mine.dtype))
        if not compact:
            own = DecoderCache.allocate(engine.drafter.draft.config, 1, "cpu", torch.float32)
            fill(own, engine.runner.encode_windows([mel])[0][None])
            assert torch.equal(own.cross_k[:, 0], side.cross_k[:, 0]) and torch.equal(own.cross_v[:, 0], side.cross_v[:, 0])

    # a draft layer whose value projection moved (not a distilled one): projected as before
    tensors = weights(out)
    key = "model.decoder.layers.1.encoder_attn.v_proj.weight"
    tensors[key] = tensors[key] + 1e-3
    from safetensors.torch import save_file

    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    engine = Engine(multilingual, draft=out, device="cpu", background=False)
    assert engine.drafter.cross_sources is None
    assert engine.transcribe(mel, language="en", max_new_tokens=24, num_draft_tokens=3).tokens == plain.tokens


def test_same_seed_gives_bit_identical_weights(multilingual, clips, tmp_path):
    distill(multilingual, clips, tmp_path / "a", OPTS)
    distill(multilingual, clips, tmp_path / "b", OPTS)
    distill(multilingual, clips, tmp_path / "c", replace(OPTS, seed=1))
    a, b, c = weights(tmp_path / "a"), weights(tmp_path / "b"), weights(tmp_path / "c")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)  # another seed: another batch order


def test_resume_continues_from_the_saved_step(multilingual, clips, tmp_path):
    straight = distill(multilingual, clips, tmp_path / "straight", replace(OPTS, steps=4))
    first = distill(multilingual, clips, tmp_path / "resumed", replace(OPTS, steps=2))
    again = distill(multilingual, clips, tmp_path / "resumed", replace(OPTS, steps=4))
    assert (first.step, again.step, len(again.losses)) == (2, 4, 2)
    assert again.losses == straight.losses[2:]
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="other settings"):
        distill(multilingual, clips, tmp_path / "resumed", replace(OPTS, steps=5, lr=2e-3))


def test_init_starts_from_an_earlier_draft_and_refuses_another_targets(multilingual, clips, tmp_path, ckpt_dir):
    """`init`: the draft starts from a saved draft's decoder (0 more steps save it unchanged; more
    steps train it further, deterministically); a draft of another shape or target is refused."""
    first = tmp_path / "first"
    distill(multilingual, clips, first, OPTS)
    again = distill(multilingual, clips, tmp_path / "again", replace(OPTS, steps=0, init=str(first)))
    a, b = weights(first), weights(tmp_path / "again")
    decoder = [k for k in a if k.startswith("model.decoder.")]
    assert again.step == 0 and all(torch.equal(a[k], b[k]) for k in decoder)
    further = [distill(multilingual, clips, tmp_path / f"further{i}", replace(OPTS, init=str(first)))
               for i in range(2)]
    c, d = weights(tmp_path / "further0"), weights(tmp_path / "further1")
    assert further[0].losses == further[1].losses and all(torch.equal(c[k], d[k]) for k in c)
    fresh = distill(multilingual, clips, tmp_path / "fresh", OPTS)
    assert further[0].losses[0] < fresh.losses[0]  # it starts where the first run ended
    with pytest.raises(ValueError, match="not a 1-layer draft of this target's shape"):
        distill(multilingual, clips, tmp_path / "one", replace(OPTS, layers=1, init=str(first)))
    other = ckpt_dir("distill-other-target", seed=5)  # the same shapes, other weights
    with pytest.raises(ValueError, match="not a draft of this target: its frozen tensors"):
        distill(other, clips, tmp_path / "other", replace(OPTS, init=str(first)))


def test_minutes_bound_the_training(multilingual, clips, tmp_path):
    report = distill(multilingual, clips, tmp_path / "draft", replace(OPTS, steps=10**6, minutes=1e-4))
    assert 1 <= report.step < 10**6  # stops after the step in flight, and still saves the draft
    assert (tmp_path / "draft" / "model.safetensors").is_file()


def test_bf16_autocast_trains_and_saves_float32(multilingual, clips, tmp_path):
    report = distill(multilingual, clips, tmp_path / "draft", replace(OPTS, steps=1, bf16=True))
    assert report.step == 1 and torch.isfinite(torch.tensor(report.losses)).all()
    assert weights(tmp_path / "draft")["model.decoder.layers.0.fc1.weight"].dtype == torch.float32


def test_unusable_audio_folders(multilingual, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        distill(multilingual, tmp_path / "missing", tmp_path / "out", OPTS)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no audio here")
    with pytest.raises(ValueError, match="no audio files"):
        audio_files(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "broken.wav").write_bytes(b"RIFF not really a wave file")
    with pytest.raises(ValueError, match="no usable audio.*cannot decode"):
        distill(multilingual, tmp_path / "bad", tmp_path / "out", OPTS)


def test_audio_transcribed_to_nothing_is_refused(multilingual, clips, tmp_path, monkeypatch):
    engine = Engine(multilingual, device="cpu")
    transcribe = engine.transcribe

    def empty(*args, **kwargs):
        result = transcribe(*args, **kwargs)
        result.tokens = []
        return result

    monkeypatch.setattr(engine, "transcribe", empty)
    skipped = []
    with pytest.raises(ValueError, match="transcribes it to nothing"):
        teacher_examples(engine, audio_files(clips), tmp_path / "cache", OPTS, skipped)
    assert len(skipped) == 3


def test_teacher_forced_forward_equals_the_cached_decoder(multilingual):
    """The training forward (all target layers copied) gives the decoder's own hidden states."""
    target = load_whisper(multilingual)
    n = target.config.decoder_layers
    assert layer_choice(6, 2) == [0, 5] and layer_choice(n, n) == list(range(n))
    copy = init_draft_decoder(target, n)
    torch.manual_seed(0)
    features = torch.randn(2, 1500, target.config.d_model)
    tokens = torch.randint(0, 50257, (2, 7))
    k, v = cross_kv(copy, features)
    trained = teacher_forced_hidden(copy, k, v, tokens)
    cache = DecoderCache.allocate(target.config, 2, "cpu", torch.float32)
    target.decoder.fill_cross(cache, features)
    reference = target.decoder.hidden(tokens, torch.arange(7).expand(2, 7), cache)
    torch.testing.assert_close(trained, reference, rtol=1e-5, atol=1e-5)


def test_batches_label_only_generated_positions():
    examples = [Example(torch.zeros(1), [9, 8, 7], [1, 2]), Example(torch.zeros(1), [9, 8, 7], [3])]
    opts = replace(OPTS, batch_size=2)
    picks, inputs, labels, soft = batch_of(examples, 0, opts, eot=0, device="cpu")
    assert soft is None  # these examples carry no teacher distribution
    rows = {tuple(inputs[b].tolist()): labels[b].tolist() for b in range(2)}
    # input: prompt + tokens (EOT-padded); label: tokens + EOT from the last prompt position on
    assert rows == {(9, 8, 7, 1, 2): [-100, -100, 1, 2, 0], (9, 8, 7, 3, 0): [-100, -100, 3, 0, -100]}
    assert sorted(picks) == [0, 1]
    # a transcript cut at the length limit has no EOT to learn
    examples[1].ended = False
    _, inputs, labels, _ = batch_of(examples, 0, opts, eot=0, device="cpu")
    rows = {tuple(inputs[b].tolist()): labels[b].tolist() for b in range(2)}
    assert rows == {(9, 8, 7, 1, 2): [-100, -100, 1, 2, 0], (9, 8, 7, 0, 0): [-100, -100, 3, -100, -100]}
    # the order is seeded: the same (seed, step) gives the same batch
    assert batch_of(examples, 5, opts, 0, "cpu")[0] == batch_of(examples, 5, opts, 0, "cpu")[0]


def test_cli(multilingual, clips, tmp_path, capsys):
    from specwhisper.tools.cli import main

    out = tmp_path / "draft"
    assert main(["distill", "--target", str(multilingual), "--audio", str(clips), "--out", str(out),
                 "--steps", "2", "--batch-size", "2", "--language", "en", "--max-new-tokens", "8",
                 "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    # three short clips: one window, and as a recording, the long-form windows
    found = re.search(r"2 steps in all .* over (\d+) windows, (\d+) of them long-form\)", printed)
    assert found and int(found[1]) == 1 + int(found[2]) >= 2, printed
    assert Engine(multilingual, draft=out, device="cpu").drafter.shared_encoder
    state = lambda folder: torch.load(folder / ".distill_state.pt", weights_only=False)  # noqa: E731
    assert state(out)["options"]["prev_tokens"] == DistillOptions().prev_tokens == 64

    many = tmp_path / "many"  # 12 windows: one is held out, and its agreement is printed
    many.mkdir()
    for i in range(4):
        for path in clips.iterdir():
            shutil.copy(path, many / f"{i}-{path.name}")
    assert main(["distill", "--target", str(multilingual), "--audio", str(many), "--out", str(tmp_path / "d2"),
                 "--steps", "1", "--batch-size", "2", "--language", "en", "--max-new-tokens", "8",
                 "--device", "cpu", "--holdout", "0.1", "--no-pack", "--no-longform", "--prev-tokens", "7"]) == 0
    printed = capsys.readouterr().out
    assert "held-out agreement with the target (1 of 12 windows held out)" in printed and "long-form" not in printed
    assert state(tmp_path / "d2")["options"]["prev_tokens"] == 7


def test_soft_targets_follow_the_labels_and_weigh_in_the_loss(multilingual, clips, tmp_path):
    engine = Engine(multilingual, device="cpu")
    examples = teacher_examples(engine, audio_files(clips), tmp_path / "cache", OPTS, [])
    eot = engine.target.tokenizer.eot
    for ex in examples:
        n = len(ex.tokens) + ex.ended
        assert ex.soft_ids.shape == ex.soft_logp.shape == (n, OPTS.top)
        # the teacher-forced pass ranks the target's own greedy token first (ties aside)
        want = torch.tensor(ex.tokens + [eot] * ex.ended)
        top1 = ex.soft_ids[:, 0].long()
        tied = ex.soft_logp[:, 0] == ex.soft_logp.gather(1, (ex.soft_ids == want[:, None]).long().argmax(1, keepdim=True))[:, 0]
        assert bool(((top1 == want) | tied).all())
        assert bool((ex.soft_logp[:, :-1] >= ex.soft_logp[:, 1:]).all())  # sorted, most likely first
    # a full copy of the target agrees with it everywhere under teacher forcing
    copy = init_draft_decoder(engine.target.model, engine.target.config.decoder_layers)
    assert agreement(copy, examples, eot, engine.target.suppress) > 0.95

    # kd = 0: plain cross-entropy; one-hot soft targets on the labels: the same term twice
    opts = replace(OPTS, batch_size=3)
    picks, inputs, labels, soft = batch_of(examples, 0, opts, eot, "cpu")
    assert soft is not None and soft[0].shape[0] == int((labels >= 0).sum())
    draft = init_draft_decoder(engine.target.model, 1)
    k, v = cross_kv(draft, torch.stack([examples[i].features for i in picks]))
    hard = distill_loss(draft, k, v, inputs, labels)
    assert torch.equal(distill_loss(draft, k, v, inputs, labels, soft, kd=0.0), hard)
    one_hot = (labels[labels >= 0][:, None], torch.zeros(soft[0].shape[0], 1))
    torch.testing.assert_close(distill_loss(draft, k, v, inputs, labels, one_hot, kd=1.0), 2 * hard)
    assert distill_loss(draft, k, v, inputs, labels, soft, kd=1.0) > hard


def test_holdout_split_and_reported_agreement(multilingual, clips, tmp_path):
    examples = [Example(torch.zeros(1), [1], [i], recording=i) for i in range(20)]
    train, held = split_holdout(examples, replace(OPTS, holdout=0.1))
    assert len(held) == 2 and len(train) == 18 and {id(e) for e in train}.isdisjoint(id(e) for e in held)
    again = split_holdout(examples, replace(OPTS, holdout=0.1))[1]
    assert [e.tokens for e in again] == [e.tokens for e in held]  # seeded
    assert split_holdout(examples[:9], replace(OPTS, holdout=0.1))[1] == []  # too few windows to spare one
    assert split_holdout(examples, replace(OPTS, holdout=0.0))[1] == []

    many = tmp_path / "many"
    many.mkdir()
    for i in range(4):
        for path in clips.iterdir():
            shutil.copy(path, many / f"{i}-{path.name}")
    report = distill(multilingual, many, tmp_path / "draft", replace(OPTS, steps=2, holdout=0.25))
    assert report.held_out == 3 and report.examples == 9
    assert 0.0 <= report.agreement_start <= 1.0 and 0.0 <= report.agreement <= 1.0
    with pytest.raises(ValueError, match="holdout"):
        DistillOptions(holdout=1.0)


def test_short_files_are_joined_into_full_windows(tmp_path):
    import numpy as np
    import soundfile as sf

    from specwhisper.tools.distill import PACK_GAP, WINDOW_SAMPLES, windows_of

    sr, seconds = 16000, {"a": 10, "b": 12, "c": 9, "d": 40, "e": 5}
    sounds = {}
    for i, (name, s) in enumerate(seconds.items()):
        sounds[name] = np.full(s * sr, (i + 1) / 10, dtype=np.float32)
        sf.write(tmp_path / f"{name}.wav", sounds[name], sr)
    (tmp_path / "f.wav").write_bytes(b"RIFF not audio")
    files = audio_files(tmp_path)
    skipped = []
    packed = [([p.stem for p in paths], w, audio) for paths, w, audio in windows_of(files, True, skipped)]
    assert [(names, w) for names, w, _ in packed] == [(["a", "b"], 0), (["d"], 0), (["d"], 1), (["c", "e"], 0)]
    assert len(skipped) == 1 and "f.wav: cannot decode" in skipped[0]
    ab = packed[0][2]  # a, 0.5 s of silence, b: nothing lost, nothing over a window
    assert ab.size == (10 + 12) * sr + PACK_GAP <= WINDOW_SAMPLES
    np.testing.assert_allclose(ab[:10 * sr], sounds["a"], atol=1e-4)
    assert not ab[10 * sr:10 * sr + PACK_GAP].any()
    np.testing.assert_allclose(ab[10 * sr + PACK_GAP:], sounds["b"], atol=1e-4)
    assert packed[1][2].size == WINDOW_SAMPLES and packed[2][2].size == 10 * sr  # a long file is cut
    alone = [([p.stem for p in paths], w) for paths, w, _ in windows_of(files, False, [])]
    assert alone == [(["a"], 0), (["b"], 0), (["c"], 0), (["d"], 0), (["d"], 1), (["e"], 0)]


def test_packed_windows_teach_and_stay_cached(multilingual, clips, tmp_path):
    engine = Engine(multilingual, device="cpu")
    opts = replace(OPTS, pack=True)
    examples = teacher_examples(engine, audio_files(clips), tmp_path / "cache", opts, [])
    assert len(examples) == 1  # three clips of 4-5 s: one window
    again = teacher_examples(engine, audio_files(clips), tmp_path / "cache", opts, [])
    assert again[0].tokens == examples[0].tokens and len(list((tmp_path / "cache").iterdir())) == 1


def test_the_best_held_out_draft_is_the_one_saved(multilingual, clips, tmp_path):
    many = tmp_path / "many"
    many.mkdir()
    for i in range(4):
        for path in clips.iterdir():
            shutil.copy(path, many / f"{i}-{path.name}")
    opts = replace(OPTS, steps=6, lr=3e-2, holdout=0.25, eval_every=1, ema=0.0)  # a rate that wanders
    out = tmp_path / "draft"
    report = distill(multilingual, many, out, opts)
    scores = [(0, report.agreement_start)] + report.curve
    assert [s for s, _ in report.curve] == list(range(1, 7))
    best = max(scores, key=lambda s: s[1])  # the first of equals
    assert (report.best_step, report.agreement) == best
    assert best[0] != 6 and best[1] > report.curve[-1][1], scores  # the choice matters in this run
    # the saved folder is that draft: its own agreement on the held-out windows
    engine = Engine(multilingual, device="cpu")
    examples = teacher_examples(engine, audio_files(many), out / ".distill_cache", opts, [])
    held = split_holdout(examples, opts)[1]
    saved = load_whisper(out).decoder
    assert agreement(saved, held, engine.target.tokenizer.eot, engine.target.suppress) == pytest.approx(best[1])

    # a resumed run keeps the best seen before it
    more = distill(multilingual, many, out, replace(opts, steps=8))
    assert more.step == 8 and [s for s, _ in more.curve] == [7, 8]
    assert more.agreement == max(best[1], *(a for _, a in more.curve))


def test_the_draft_is_the_moving_average_of_the_trained_weights(multilingual, clips, tmp_path):
    out = tmp_path / "draft"
    distill(multilingual, clips, out, replace(OPTS, steps=1, holdout=0.0, ema=0.99))
    trained = torch.load(out / ".distill_state.pt", weights_only=True)["decoder"]
    start = init_draft_decoder(load_whisper(multilingual), OPTS.layers).state_dict()
    saved = weights(out)
    decay = 2 / 11  # the decay's warm-up after one step: min(0.99, (1 + 1) / (10 + 1))
    name = "layers.0.fc1.weight"
    torch.testing.assert_close(saved[f"model.decoder.{name}"], decay * start[name] + (1 - decay) * trained[name])
    assert not torch.equal(trained[name], start[name])
    # frozen tensors are the target's
    assert torch.equal(saved["model.decoder.embed_tokens.weight"], start["embed_tokens.weight"])
    with pytest.raises(ValueError, match="ema"):
        DistillOptions(ema=1.0)


def test_longform_windows_teach_with_their_own_prompts(multilingual, clips, tmp_path, monkeypatch):
    """With `longform`, the audio is also decoded as one recording by the long-form algorithm; each
    window it decodes greedily is an Example with that window's prompt (timestamps allowed), held
    out with its recording and cached."""
    engine = Engine(multilingual, device="cpu")
    tok = engine.target.tokenizer
    opts = replace(OPTS, pack=True, longform=True)
    examples = teacher_examples(engine, audio_files(clips), tmp_path / "cache", opts, [])
    short = [e for e in examples if not e.longform]
    long = [e for e in examples if e.longform]
    assert len(short) == 1 and short[0].prompt[-1] == tok.no_timestamps  # three clips of 4-5 s: one window
    assert long and all(e.prompt[-3:] == tok.sot_sequence("en", "transcribe") for e in long)
    assert long[0].prompt == tok.sot_sequence("en", "transcribe")  # nothing before the first window
    assert all(e.recording == 0 for e in examples)
    assert all(e.soft_ids.shape[0] == len(e.labels) for e in long)

    def no_decoding(*args, **kwargs):
        raise AssertionError("a cached recording was decoded again")

    monkeypatch.setattr(engine, "transcribe_long", no_decoding)
    monkeypatch.setattr(engine, "transcribe", no_decoding)
    again = teacher_examples(engine, audio_files(clips), tmp_path / "cache", opts, [])
    assert [(e.prompt, e.tokens, e.longform) for e in again] == [(e.prompt, e.tokens, e.longform) for e in examples]


def test_draft_prompts_are_the_engines(multilingual, english):
    """A long-form window's previous text is cut for the draft as the engine cuts it
    (`Drafter.prompt`: <|startofprev|> and the last PREV_TOKENS), multilingual and English-only
    vocabularies alike; None keeps it whole and a prompt without previous text is kept as it is."""
    from specwhisper.engine.slots import SeqSpec

    for folder, language in ((multilingual, "en"), (english, None)):
        engine = Engine(folder, draft=folder, device="cpu")
        tok, drafter = engine.target.tokenizer, engine.drafter
        start = tok.sot_sequence(language, "transcribe")
        for n_prev in (0, 1, 5, drafter.PREV_TOKENS, drafter.PREV_TOKENS + 37):
            prompt = ([tok.sot_prev] + [100 + i for i in range(n_prev)] if n_prev else []) + start
            spec = SeqSpec(prompt, language, "transcribe", 8, timestamps=True, sot_index=prompt.index(tok.sot))
            assert draft_prompt(prompt, tok.sot_prev, tok.sot, OPTS.prev_tokens) == drafter.prompt(spec)
            assert draft_prompt(prompt, tok.sot_prev, tok.sot, None) == prompt
    assert OPTS.prev_tokens == drafter.PREV_TOKENS
    with pytest.raises(ValueError, match="prev_tokens"):
        DistillOptions(prev_tokens=-1)


def test_the_draft_learns_and_is_checked_under_the_engines_prompts(multilingual, clips, tmp_path, monkeypatch):
    """Training batches and the held-out check see each window's prompt as the engine gives it to
    the draft (`draft_prompt`), and the setting is part of a run's fingerprint."""
    import specwhisper.tools.distill as D

    tok = Engine(multilingual, device="cpu").target.tokenizer
    many = tmp_path / "many"
    many.mkdir()
    for i in range(4):
        for path in clips.iterdir():
            shutil.copy(path, many / f"{i}-{path.name}")
    real = D.teacher_examples

    def with_previous_text(*args, **kwargs):  # every window as if 90 tokens of previous text led it
        return [replace(e, prompt=[tok.sot_prev] + [200 + i for i in range(90)] + e.prompt)
                for e in real(*args, **kwargs)]

    seen = {"batch": [], "check": []}
    batch, check = D.batch_of, D.agreement
    monkeypatch.setattr(D, "teacher_examples", with_previous_text)
    monkeypatch.setattr(D, "batch_of", lambda ex, *a, **k: seen["batch"].append(ex) or batch(ex, *a, **k))
    monkeypatch.setattr(D, "agreement", lambda dec, ex, *a, **k: seen["check"].append(ex) or check(dec, ex, *a, **k))
    for keep, n in ((OPTS.prev_tokens, OPTS.prev_tokens), (None, 90), (3, 3)):
        seen = {"batch": [], "check": []}
        distill(multilingual, many, tmp_path / f"draft{keep}", replace(OPTS, steps=2, holdout=0.25, prev_tokens=keep))
        for kind in ("batch", "check"):
            prompts = [e.prompt for ex in seen[kind] for e in ex]
            assert prompts and all(p[:1] == [tok.sot_prev] and p.index(tok.sot) == n + 1 for p in prompts), kind
            assert all(p[1:n + 1] == [200 + i for i in range(90 - n, 90)] for p in prompts)
    with pytest.raises(ValueError, match="settings|options|differ"):  # a run is resumed with its own setting
        distill(multilingual, many, tmp_path / "draft3", replace(OPTS, steps=3, holdout=0.25))


def test_recordings_join_windows_and_are_held_out_whole(tmp_path):
    import numpy as np

    from specwhisper.tools.distill import PACK_GAP, RECORDING_WINDOWS, joined_audio, recordings_of

    a, b = Path("a.wav"), Path("b.wav")
    windows = [([a], 0, np.ones(5)), ([a], 1, np.ones(3)), ([b], 0, np.ones(2))]
    joined = joined_audio(windows)  # a's second window continues it; b follows after a gap
    assert joined.size == 5 + 3 + PACK_GAP + 2 and not joined[8:8 + PACK_GAP].any()
    many = [([Path(f"{i}.wav")], 0, np.ones(1)) for i in range(RECORDING_WINDOWS + 2)]
    assert [len(g) for g in recordings_of(many, True)] == [RECORDING_WINDOWS, 2]
    assert [len(g) for g in recordings_of(many, False)] == [1] * len(many)

    examples = [Example(torch.zeros(1), [1], [i], recording=i // 3, longform=i % 3 > 0) for i in range(36)]
    train, held = split_holdout(examples, replace(OPTS, holdout=0.2))
    assert len({e.recording for e in held}) == 2 and len(held) == 6  # 2 of 12 recordings, all their windows
    assert {e.recording for e in train}.isdisjoint(e.recording for e in held)


def test_longform_teacher_on_real_speech_gives_the_transcript_windows(tmp_path):
    """base's long-form windows on 35 s of joined clips: timestamps in the tokens, each window's
    prompt the text kept so far, and together the transcript `transcribe(timestamps=True)` gives;
    a draft trained on them keeps that transcript exact."""
    from conftest import real_folder

    from specwhisper.tools.distill import joined_audio, longform_examples, recordings_of, windows_of

    base = real_folder("base")
    engine = Engine(base, device="cpu")
    tok = engine.target.tokenizer
    folder = tmp_path / "clips"
    folder.mkdir()
    for path in sample_paths():
        shutil.copy(path, folder / path.name)
    opts = DistillOptions(language="en", progress=False, device="cpu")
    (group,) = recordings_of(windows_of(audio_files(folder), True, []), True)
    audio = torch.from_numpy(joined_audio(group))
    long = longform_examples(engine, joined_audio(group), opts)
    want = engine.transcribe(audio, language="en", timestamps=True).tokens
    assert len(long) >= 2 and all(any(t >= tok.timestamp_begin for t in e.tokens) for e in long)
    assert long[0].prompt == tok.sot_sequence("en", "transcribe")
    starts = []  # where each window's kept tokens start in the transcript: its prompt holds those before
    for e in long:
        previous = e.prompt[1:-3] if e.prompt[0] == tok.sot_prev else []
        assert e.prompt[-3:] == tok.sot_sequence("en", "transcribe") and previous == want[:len(previous)]
        starts.append(len(previous))
    assert starts == sorted(starts) and starts[0] == 0 and len(want) < 223  # no prompt cut short here
    for e, start, end in zip(long, starts, starts[1:] + [len(want)]):
        assert end > start and e.tokens[:end - start] == want[start:end]

    out = tmp_path / "draft"
    report = distill(base, folder, out, replace(opts, steps=2, batch_size=2, holdout=0.0))
    assert report.longform == len(long) and report.examples == len(long) + len(group)
    speculative = Engine(base, draft=out, device="cpu")
    got = speculative.transcribe(audio, language="en", timestamps=True, num_draft_tokens=3)
    assert got.tokens == want and got.stats.drafted > 0

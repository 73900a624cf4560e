"""bench/cpu.py's end-to-end harness: the order it times systems in and its paired ratios."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import cpu  # noqa: E402  (bench/cpu.py)


def test_end_to_end_interleaves_windows_and_pairs_rounds(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(cpu.time, "perf_counter", lambda: clock[0])
    order = []
    decode = {"A": 2.0, "B": 1.0, "C": 2.0}  # seconds per window at round 0's speed; encoders take 1 s

    def system(name):
        def run(mel):
            rnd = max(0, len(order) - 6) // 6  # 6 calls a round (3 systems x 2 windows) after the warm-up
            order.append((name, mel))
            clock[0] += (1 + 3 * rnd) * decode[name] + 1.0  # the machine slows down round by round
            return [1, 2, 3]

        def encode(mel):
            clock[0] += 1.0
        return name, run, encode

    out = cpu.end_to_end([system(n) for n in "ABC"], mels=[0, 1], repeats=3)
    timed = order[6:]  # after the warm-up (every system on every window)
    assert timed[:6] == [("A", 0), ("B", 0), ("C", 0), ("A", 1), ("B", 1), ("C", 1)]
    assert timed[6:12] == [("C", 0), ("B", 0), ("A", 0), ("C", 1), ("B", 1), ("A", 1)]
    by = {x["name"]: x for x in out}
    # paired: every round's decode of A over B's is 2, whatever that round's speed
    assert by["B"]["paired_decode_vs_first"] == dict(median=2.0, low=2.0, high=2.0)
    assert by["C"]["paired_call_vs_first"] == dict(median=1.0, low=1.0, high=1.0)
    assert by["B"]["paired_call_vs_first"]["low"] == pytest.approx(6 / 4)  # round 0: (2 + 1) * 2 / (1 + 1) * 2
    assert by["A"]["round_decode_seconds"] == [4.0, 16.0, 28.0]


def test_end_to_end_pools_encoder_samples_within_a_group(monkeypatch):
    """Systems of one group subtract one pooled encoder median: equal calls read as equal decode
    even when the encoder, timed apart, ran slower beside one of them."""
    clock = [0.0]
    monkeypatch.setattr(cpu.time, "perf_counter", lambda: clock[0])
    enc_time = {"A": 1.0, "B": 1.2, "C": 1.2}  # the same encoder, timed 20% slower beside B and C

    def system(name, group):
        def run(mel):
            clock[0] += 3.0  # every call alike
            return [1, 2, 3]

        def encode(mel):
            clock[0] += enc_time[name]
        return (name, run, encode) if group is None else (name, run, encode, group)

    out = cpu.end_to_end([system("A", "g"), system("B", "g"), system("C", None)], mels=[0, 1, 2], repeats=3)
    by = {x["name"]: x for x in out}
    # A and B pool 9 samples at 1.0 and 9 at 1.2 into one median (1.1); C keeps its own (1.2)
    assert by["A"]["encoder_seconds"] == by["B"]["encoder_seconds"] == pytest.approx(1.1)
    assert by["C"]["encoder_seconds"] == pytest.approx(1.2)
    assert by["B"]["paired_decode_vs_first"] == pytest.approx(dict(median=1.0, low=1.0, high=1.0))
    # ungrouped, C's own median reads its equal calls as faster decode: 1.9 s against 1.8 s
    assert by["C"]["paired_decode_vs_first"]["median"] == pytest.approx(1.9 / 1.8)


def test_engine_split_takes_the_rest_of_each_round_from_that_round(monkeypatch):
    """The host loop's share is each round's call less that round's parts, then the median over
    rounds: a difference of medians taken over different rounds reads a slow round's share."""
    from types import SimpleNamespace

    clock = [0.0]
    monkeypatch.setattr(cpu.time, "perf_counter", lambda: clock[0])
    rnd = [0]
    # per round: (encoder, steps, admission, rest) seconds of a call; round 1 runs the encoder slow
    plan = [(1.0, 2.0, 0.5, 0.1), (3.0, 2.0, 0.5, 0.1), (1.0, 4.0, 0.5, 0.1)]

    class Runner:
        def encode_windows(self, *a):
            clock[0] += plan[rnd[0]][0]

        def verify_step(self, *a):
            clock[0] += plan[rnd[0]][1]

        def admit(self, *a):
            clock[0] += plan[rnd[0]][2]

    runner = Runner()

    def transcribe(mel, language):
        runner.encode_windows()
        runner.admit()
        runner.verify_step()
        clock[0] += plan[rnd[0]][3]
        rnd[0] += 1
        return SimpleNamespace(tokens=[1, 2, 3])

    split = cpu.engine_split(SimpleNamespace(runner=runner, transcribe=transcribe), mels=[0], repeats=3)
    assert split["rest"] == pytest.approx(0.1) and split["tokens"] == 4
    # the difference of medians: the calls' (5.6, rounds 1 and 2) less the parts' (1, 2, 0.5, from
    # the fast rounds) reads 2.1 seconds of host loop where every round spent 0.1
    assert split["call"] == pytest.approx(5.6) and split["encode_windows"] == 1.0 and split["verify_step"] == 2.0
    assert not hasattr(runner, "__dict__") or "verify_step" not in vars(runner)  # the wrappers are gone


def test_interleaved_splits_alternate_the_engines_and_time_a_drafts_parts(monkeypatch):
    """Each round runs every engine's calls in turn, the order reversed every other round; a
    draft's engine also has its draft steps and draft starts timed, and its rest is what its
    parts leave of its calls."""
    from types import SimpleNamespace

    clock = [0.0]
    monkeypatch.setattr(cpu.time, "perf_counter", lambda: clock[0])
    order = []

    def fake(name, costs):
        class Runner:
            pass

        runner = Runner()
        for part, seconds in costs.items():
            setattr(Runner, part, lambda self, *a, seconds=seconds: clock.__setitem__(0, clock[0] + seconds))

        def transcribe(mel, language):
            order.append(name)
            for part in costs:
                getattr(runner, part)()
            clock[0] += 0.25  # the host loop
            return SimpleNamespace(tokens=[1])
        return SimpleNamespace(runner=runner, transcribe=transcribe)

    parts = dict(encode_windows=1.0, admit=0.5, verify_step=2.0)
    engines = {"target-only": fake("target-only", parts),
               "tiny.en": fake("tiny.en", dict(parts, verify_step=1.0, draft=0.5, start_drafts=0.125))}
    splits = cpu.interleaved_splits(engines, mels=[0], repeats=3)
    assert order == ["target-only", "tiny.en", "tiny.en", "target-only", "target-only", "tiny.en"]
    assert "draft" not in splits["target-only"] and splits["target-only"]["rest"] == pytest.approx(0.25)
    drafted = splits["tiny.en"]
    assert drafted["draft"] == 0.5 and drafted["start_drafts"] == 0.125 and drafted["verify_step"] == 1.0
    assert drafted["rest"] == pytest.approx(0.25) and drafted["call"] == pytest.approx(3.375)
    assert drafted["tokens"] == 2  # a call's tokens and its EOT
    assert all(not vars(e.runner) for e in engines.values())  # the wrappers are gone


def test_round_sums_skip_the_warm_up_and_split_the_rounds():
    """An adaptive system's proposals per round: the first call per window is the warm-up, then
    each round's calls in turn; a count that does not fit the order is refused, not misread."""
    from types import SimpleNamespace

    drafted = [9, 9, 1, 2, 0, 0, 5, 6]  # 2 windows: warm-up, then 3 rounds
    stats = [SimpleNamespace(drafted=d, target_passes=10 + d) for d in drafted]
    assert cpu.round_sums(stats, "drafted", windows=2, repeats=3) == [3, 0, 11]
    assert cpu.round_sums(stats, "target_passes", windows=2, repeats=3) == [23, 20, 31]
    with pytest.raises(ValueError, match="8 calls"):
        cpu.round_sums(stats, "drafted", windows=2, repeats=4)


def test_verify_bounds_put_the_extra_rows_arithmetic_after_or_under_the_stream():
    """A row's arithmetic a = float32 / its peak + int16 / its peak; `serial` adds it for every row
    past the first, `overlapped` hides it until r rows' arithmetic outlasts the step."""
    macs = dict(float32=30e6, int16=20e6)
    peaks = dict(float32=60.0, int16=100.0)  # GMAC/s: 0.5 + 0.2 ms a row
    b = cpu.verify_bounds(macs, peaks, step_ms=2.8, rows=[1, 2, 5, 9])
    assert b["row_ms"] == pytest.approx(0.7)
    assert b["serial"] == pytest.approx({1: 1.0, 2: 1.25, 5: 2.0, 9: 3.0})
    assert b["overlapped"] == pytest.approx({1: 1.0, 2: 1.0, 5: 1.25, 9: 2.25})


def test_whole_call_bound_from_the_encoders_share():
    """With half the call in the encoder a whole call is at most 2x faster; 1.3x then needs the rest
    1.86x faster (0.5 + 0.5 / 1.857 = 1 / 1.3), and with 80% in it 1.3x is out of reach."""
    b = cpu.whole_call_bound(0.5, 1.3)
    assert b["ceiling"] == pytest.approx(2.0)
    assert b["decode_needed"] == pytest.approx(0.5 / (1 / 1.3 - 0.5))
    assert 1 / (0.5 + 0.5 / b["decode_needed"]) == pytest.approx(1.3)
    assert cpu.whole_call_bound(0.8, 1.3)["decode_needed"] is None
    assert cpu.whole_call_bound(0.8, 1.3)["ceiling"] == pytest.approx(1.25)


def test_row_macs_count_a_rows_linears_attention_and_head(tmp_path):
    """Per layer: the fused q/k/v, the out projections, the cross query, the MLP; attention over
    POSITION keys and every audio position; the vocabulary once (16-bit where it is screened)."""
    from checkpoints import make_checkpoint
    from specwhisper import Engine

    d, F, L, V = 64, 128, 2, 51865
    engine = Engine(make_checkpoint(tmp_path / "m", d_model=d, decoder_layers=L, ffn_dim=F), background=False)
    linears = L * (3 * d * d + d * d + d * d + d * d + 2 * F * d)
    attention = 2 * L * d * (cpu.POSITION + engine.target.config.max_source_positions)
    screened = engine.target.head is not None
    assert cpu.row_macs(engine) == dict(float32=linears + attention + (0 if screened else V * d),
                                        int16=V * d if screened else 0)


def test_the_peak_binary_measures_fmas_and_the_screens_multiply_adds(tmp_path):
    """bench/fma_peak.cpp at the AVX2 width: both kinds run and report rates a core can reach: at
    most two 256-bit instructions a cycle at 4.7 GHz, 300 G operations a second (a loop the compiler
    folded, sharing one product among the chains or hoisting it, read 700-1000 here)."""
    import encoder as encoder_bench  # bench/encoder.py

    if "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("needs an AVX2 CPU")
    binary = encoder_bench.fma_binary(8, tmp_path)
    fma = encoder_bench.fma_peak(binary, 1, 0.05)
    madd = encoder_bench.fma_peak(binary, 1, 0.05, kind="madd16")
    assert all(1 < x < 300 for x in fma + madd), (fma, madd)  # G operations a second, one thread


def test_verify_parts_times_each_part_at_every_row_count(tmp_path):
    """bench/verify_parts.py: the projections, cross attention and head, each timed at one row and
    at the verify rows asked for, as positive medians (a tiny random checkpoint, one round)."""
    import verify_parts  # bench/verify_parts.py
    from checkpoints import make_checkpoint
    from specwhisper import Engine
    from specwhisper.backends import cpu_ops

    if not cpu_ops.available():
        pytest.skip("the C++ decode ops are not available here")
    engine = Engine(make_checkpoint(tmp_path / "m", d_model=64, decoder_layers=2), background=False)
    out = verify_parts.measure(engine, rows=[3, 5], rounds=1, flush_mb=1)
    assert set(out) == {"projections", "cross attention", "head"}
    assert all(set(t) == {1, 3, 5} and all(s > 0 for s in t.values()) for t in out.values())


def test_step_times_time_a_plain_read_in_the_steps_rounds(tmp_path, monkeypatch):
    """read_bytes > 0: a torch sum of a buffer of that many bytes is timed in every round beside
    the passes (the floor of the moment); without it only the passes."""
    import torch
    from checkpoints import make_checkpoint
    from specwhisper import Engine

    engine = Engine(make_checkpoint(tmp_path / "m", d_model=64, decoder_layers=2, ffn_dim=128), background=False)
    mel = torch.zeros(engine.target.config.num_mel_bins, 3000)
    assert set(cpu.step_times(engine, mel, 2, rows=[1, 2])) == {1, 2}
    reads, real_sum = [], torch.Tensor.sum

    def spy(self, *args, **kwargs):
        if self.numel() == (1 << 22) // 4:
            reads.append(self.dtype)
        return real_sum(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sum", spy)
    out = cpu.step_times(engine, mel, 3, rows=[1], read_bytes=1 << 22)
    assert set(out) == {1, "read"} and all(v > 0 for v in out.values())
    assert reads == [torch.float32] * (3 + 3)  # the three warm-up rounds and the three timed

"""`specwhisper demo`: the bundled recording, the CTranslate2 worker's seek rules, and a short real run."""
from __future__ import annotations

import re

import pytest
soundfile = pytest.importorskip("soundfile")  # absent on GPU images with their own packages
from conftest import real_folder

from specwhisper.samples import demo_recording
from specwhisper.tools.ct2_longform import window_tokens

TB = 1000  # a timestamp_begin for the seek-rule cases: ids >= 1000 are timestamps


def test_demo_recording_is_bundled_with_its_reference():
    path, text = demo_recording()
    info = soundfile.info(str(path))
    assert info.samplerate == 16000 and info.channels == 1
    assert 90 <= info.duration <= 150
    assert len(text.split()) > 200


def test_window_ending_on_a_single_timestamp_is_kept_whole():
    ids = [TB + 0, 5, 6, TB + 50, TB + 50, 7, 8, TB + 120]
    assert window_tokens(ids, TB, 3000) == ([5, 6, 7, 8], 3000)


def test_window_cut_mid_segment_seeks_to_the_last_complete_segment():
    ids = [TB + 0, 5, 6, TB + 50, TB + 50, 7, 8]  # the last segment has no end timestamp
    assert window_tokens(ids, TB, 3000) == ([5, 6], 100)  # <|1.00|> = 100 mel frames


def test_window_without_consecutive_timestamps_advances_by_its_frames():
    assert window_tokens([TB, 5, 6, TB + 40], TB, 1200) == ([5, 6], 1200)
    assert window_tokens([5, 6], TB, 3000) == ([5, 6], 3000)


@pytest.mark.real
def test_demo_prints_its_measurements_and_speculation_is_exact(capsys):
    from specwhisper.tools.demo import run_demo

    drafts = [str(real_folder("base-2l")), str(real_folder("tiny.en"))]
    code = run_demo(str(real_folder("base")), drafts, "base", None, 2, seconds=35.0, ct2=True,
                    draft_names=["base-2l", "tiny.en"])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0
    # stderr is not a terminal here: its status lines are plain (no escape codes), phases only
    assert "\x1b[" not in captured.err and "\r" not in captured.err
    assert "loading models ..." in captured.err and "s of audio" not in captured.err
    assert "vector level:" in out and "decode ops: " in out and "target-only (base)" in out
    assert "speculative (+ base-2l" in out and "speculative (+ tiny.en" in out
    assert "Speculative tokens (+ base-2l) identical to target-only: yes" in out
    assert "Speculative tokens (+ tiny.en) identical to target-only: yes" in out
    windows = re.search(r"greedy, (\d+) windows", out)  # CTranslate2 walked the whole 35 s, not one window
    assert windows is None or int(windows.group(1)) >= 2

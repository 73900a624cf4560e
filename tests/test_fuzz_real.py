"""A few fixed cases of `fuzz_real.py` (randomized requests on the real checkpoints, each draft
against its target alone) in the suite; `python tests/fuzz_real.py --seconds 1800` runs many."""
import random
import tempfile
from pathlib import Path

import numpy as np
import pytest

import fuzz_real
from conftest import real_folder


@pytest.mark.real
def test_random_requests_on_real_pairs_equal_the_target_alone():
    from specwhisper import load_audio
    from specwhisper.samples import demo_recording

    base, tiny, b2l = (str(real_folder(name)) for name in ("base", "tiny.en", "base-2l"))
    pairs = fuzz_real.engines(base, tiny, b2l, small=True, background=False)
    demo = np.asarray(load_audio(str(demo_recording()[0])), np.float32)
    rng = random.Random(5)
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(3):
            problems, _ = fuzz_real.check_case(rng, pairs, demo, Path(folder))
            assert not problems, "\n".join(problems)


def test_the_check_compares_what_must_be_equal():
    """must_equal: greedy and seeded race sampling always, rejection sampling only greedy."""
    assert fuzz_real.must_equal("base+base-2l", {"temperature": 1.0, "seed": 3})
    assert fuzz_real.must_equal("base+base-2l", {"temperature": 0.0})
    assert not fuzz_real.must_equal("base+base-2l", {"temperature": 1.0})
    assert not fuzz_real.must_equal("base+base-2l rejection", {"temperature": 1.0, "seed": 3})
    assert fuzz_real.must_equal("base+base-2l rejection", {"temperature": 0.0, "seed": 3})

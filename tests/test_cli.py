"""The command line on a tiny random checkpoint (the demo itself runs real weights in CI's README job)."""
from __future__ import annotations

import json

import pytest

from specwhisper.cli import main
from specwhisper.samples import sample_paths


def test_transcribe_json(multilingual, capsys):
    audio = [str(p) for p in sample_paths()[:2]]
    assert main(["transcribe", *audio, "--target", str(multilingual), "--draft", str(multilingual),
                 "--language", "en", "--k", "3", "--max-new-tokens", "12", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["file"] for r in rows] == audio
    assert all(r["language"] == "en" and 0 < len(r["tokens"]) <= 12 and r["stats"]["target_passes"] >= 1
               for r in rows)


def test_unknown_model_name_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        main(["transcribe", str(sample_paths()[0]), "--target", str(tmp_path / "missing")])

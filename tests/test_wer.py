import pytest

pytest.importorskip("jiwer")

from specwhisper.wer import normalize, wer


def test_normalize_case_punctuation_and_numbers():
    assert normalize("The weather today will be mostly SUNNY, with a high of seventy-two degrees!") == \
        "the weather today will be mostly sunny with a high of 72 degrees"
    assert normalize("Open from nine until six.") == normalize("open from 9 until 6")
    assert normalize("It's Mr. Smith's train.") == "it is mister smith is train"


def test_identical_after_normalization_is_zero():
    refs = ["The train to Boston leaves from platform 4 in 20 minutes."]
    hyps = ["the train to boston leaves from platform four in twenty minutes"]
    assert wer(refs, hyps) == 0.0


def test_known_substitution_count():
    # 1 substitution in 5 words, 1 deletion in 3 words, 1 insertion in 2 words -> 3 / 10
    refs = ["Please lock the front door.", "see you soon", "good night"]
    hyps = ["please lock the back door", "see you", "good night all"]
    assert wer(refs, hyps) == pytest.approx(3 / 10)


def test_empty_hypothesis_and_empty_reference():
    assert wer(["one two three"], [""]) == pytest.approx(1.0)
    # a reference with no words: its hypothesis words are insertions against the corpus total
    assert wer(["a b", "[inaudible]"], ["a b", "extra"]) == pytest.approx(1 / 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="2 references but 1"):
        wer(["a", "b"], ["a"])
    with pytest.raises(TypeError):
        wer("a b", "a b")
    with pytest.raises(ValueError, match="no words"):
        wer(["!"], ["x"])

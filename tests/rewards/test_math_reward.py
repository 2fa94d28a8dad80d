"""MATH rule reward: last-box extraction with nested braces, equivalence via math-verify, registry wiring."""

import threading

import pytest

from hybridflow.rewards import MATH_DATA_SOURCES, default_compute_score
from hybridflow.rewards.math import compute_score, extract_boxed_answer, is_equiv, last_boxed_only_string, remove_boxed


@pytest.mark.parametrize("text, expected", [
    ("so $\\boxed{\\frac{1}{2}}$.", "\\boxed{\\frac{1}{2}}"),
    ("\\boxed{1} then finally \\boxed{\\sqrt{3}}", "\\boxed{\\sqrt{3}}"),  # the last box wins
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}"),
    ("\\fbox{12}", "\\fbox{12}"),
    ("the answer is $\\boxed 5$", "\\boxed 5"),
    ("\\boxed{a} and an unclosed \\boxed{\\frac{1}{2}", "\\boxed{a}"),  # unbalanced braces: not a box
    ("\\boxed{\\boxed{2}}", "\\boxed{\\boxed{2}}"),  # an inner box is part of the outer one
    ("\\boxedx{3} and \\boxed", None),
    ("no box at all", None),
])
def test_last_boxed_only_string(text, expected):
    assert last_boxed_only_string(text) == expected


def test_remove_boxed_and_extract():
    assert remove_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert remove_boxed("\\fbox{x}") == "x"
    assert remove_boxed("\\boxed 5") == "5"
    with pytest.raises(ValueError, match="not a boxed expression"):
        remove_boxed("\\frac{1}{2}")
    assert extract_boxed_answer("We get $\\boxed{ [2, 5) }$.") == "[2, 5)"
    assert extract_boxed_answer("nothing") is None


@pytest.mark.parametrize("answer, truth", [
    ("0.5", "\\frac{1}{2}"),
    ("\\dfrac12", "\\frac{1}{2}"),
    ("3^{1/2}", "\\sqrt{3}"),
    ("\\frac{\\sqrt{3}}{1}", "\\sqrt{3}"),
    ("(-\\infty,3]", "(-\\infty, 3]"),
    ("[2, 5)", "[2,5)"),
    ("\\left(3,\\frac{\\pi}{2}\\right)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("1000", "1,000"),
    ("10\\%", "10\\%"),
    ("\\text{(C)}", "\\text{(C)}"),
])
def test_equivalent_answers_score_one(answer, truth):
    assert is_equiv(answer, truth)
    assert compute_score(f"Reasoning... the answer is $\\boxed{{{answer}}}$.", truth) == 1.0


@pytest.mark.parametrize("answer, truth", [
    ("\\frac{1}{3}", "\\frac{1}{2}"),
    ("\\sqrt{2}", "\\sqrt{3}"),
    ("(-\\infty, 3)", "(-\\infty, 3]"),  # open vs closed end
    ("[2, 5]", "[2,5)"),
    ("\\left(\\frac{\\pi}{2}, 3\\right)", "\\left( 3, \\frac{\\pi}{2} \\right)"),  # order matters in a tuple
    ("-1", "1"),
    ("\\text{(D)}", "\\text{(C)}"),
])
def test_different_answers_score_zero(answer, truth):
    assert compute_score(f"$\\boxed{{{answer}}}$", truth) == 0.0


def test_only_the_last_box_counts_and_format_score():
    assert compute_score("\\boxed{1/2} no wait \\boxed{3}", "\\frac{1}{2}") == 0.0
    assert compute_score("\\boxed{3} no wait \\boxed{1/2}", "\\frac{1}{2}") == 1.0
    assert compute_score("1/2 without a box", "\\frac{1}{2}") == 0.0
    # a wrong boxed answer earns format_score; no box earns 0; a right one earns score
    assert compute_score("\\boxed{7}", "8", format_score=0.1, score=2.0) == 0.1
    assert compute_score("no box", "8", format_score=0.1) == 0.0
    assert compute_score("\\boxed{8}", "8", format_score=0.1, score=2.0) == 2.0


@pytest.mark.parametrize("truth", ["???", "", "\\frac{", "}{"])
def test_unparseable_ground_truth_never_scores_one(truth):
    assert compute_score(f"\\boxed{{{truth}}}", truth) == 0.0
    assert compute_score("\\boxed{1}", truth) == 0.0


def test_registered_for_math_data_sources():
    assert MATH_DATA_SOURCES == ("DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "HuggingFaceH4/MATH-500")
    for source in MATH_DATA_SOURCES:
        assert default_compute_score(source, "$\\boxed{\\frac{1}{2}}$", "0.5") == 1.0
        assert default_compute_score(source, "$\\boxed{\\frac{1}{3}}$", "0.5") == 0.0


def test_unknown_data_source_names_known_ones():
    with pytest.raises(ValueError) as info:
        default_compute_score("my/dataset", "\\boxed{1}", "1")
    message = str(info.value)
    assert "'my/dataset'" in message
    for known in ("openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH"):
        assert known in message


def test_scores_outside_the_main_thread():
    # math-verify's time limit uses signals, which only the main thread may set; other threads run without it
    results = []
    thread = threading.Thread(target=lambda: results.append(compute_score("\\boxed{\\sqrt{4}}", "2")))
    thread.start()
    thread.join()
    assert results == [1.0]

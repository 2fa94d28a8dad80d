import pytest

from hybridflow.rewards import REWARD_REGISTRY, default_compute_score, gsm8k, register_reward


@pytest.mark.parametrize(
    "response, expected",
    [
        ("7 + 5 = 12\n12 - 3 = 9\n#### 9", "9"),
        ("#### 1,000", "1,000"),
        ("so #### $42.", "$42"),
        ("#### -3", "-3"),
        ("#### 3.50 dollars", "3.50"),
        ("####7", "7"),
        ("#### 4\nwait, no\n#### 5", "5"),  # last marker wins
        ("#### 12" + " filler" * 100, "12"),  # no tail window: the marker may stand anywhere
        ("the answer is 9", None),  # strict needs the marker
        ("#### nine", None),
    ],
)
def test_extract_strict(response, expected):
    assert gsm8k.extract_solution(response, method="strict") == expected


@pytest.mark.parametrize(
    "response, expected",
    [
        ("I think the answer is 9.", "9"),
        ("12-3=9 so 9", "9"),
        ("12 - 3", "3"),
        ("it costs $1,250.75 in total", "$1,250.75"),
        ("from 4 to -2", "-2"),
        ("no numbers here.", None),
    ],
)
def test_extract_flexible(response, expected):
    assert gsm8k.extract_solution(response, method="flexible") == expected


def test_extract_unknown_method():
    with pytest.raises(ValueError, match="bogus"):
        gsm8k.extract_solution("#### 1", method="bogus")


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("#### 9", "9", 1.0),
        ("#### 9.", "9", 1.0),  # trailing period
        ("#### 1,000", "1000", 1.0),  # thousands comma
        ("#### 1000", "1,000", 1.0),  # comma in the ground truth
        ("#### 3.50", "3.5", 1.0),  # same decimal value
        ("#### $5", "5", 1.0),  # dollar sign
        ("#### -4", "-4", 1.0),
        ("#### 4", "-4", 0.0),  # sign matters
        ("#### 10", "9", 0.0),
        ("9", "9", 0.0),  # no marker under strict
        ("", "9", 0.0),
    ],
)
def test_compute_score_strict(response, truth, expected):
    assert gsm8k.compute_score(response, truth) == expected


def test_compute_score_flexible_and_custom_scores():
    assert gsm8k.compute_score("so it is 9.", "9", method="flexible") == 1.0
    # wrong but well-formed -> format_score; no answer at all -> 0.0
    assert gsm8k.compute_score("#### 8", "9", format_score=0.1, score=2.0) == 0.1
    assert gsm8k.compute_score("#### 9", "9", format_score=0.1, score=2.0) == 2.0
    assert gsm8k.compute_score("no answer", "9", format_score=0.1) == 0.0


def test_default_compute_score_dispatch():
    assert default_compute_score("openai/gsm8k", "#### 72", "72") == 1.0
    assert default_compute_score("hybridflow/arith", "1 + 2 = 3\n#### 3", "3") == 1.0
    assert default_compute_score("hybridflow/arith", "#### 4", "3") == 0.0
    # strict: the bare last number does not count
    assert default_compute_score("hybridflow/arith", "it is 3", "3") == 0.0


def test_default_compute_score_unknown_source_lists_known():
    with pytest.raises(ValueError, match="no/such") as info:
        default_compute_score("no/such", "#### 1", "1")
    assert "openai/gsm8k" in str(info.value) and "hybridflow/arith" in str(info.value)


def test_register_reward_adds_and_rejects_duplicates():
    @register_reward("test/always-half")
    def half(data_source, solution_str, ground_truth, extra_info=None):
        return 0.5

    try:
        assert default_compute_score("test/always-half", "anything", "1") == 0.5
        with pytest.raises(ValueError, match="already registered"):
            register_reward("test/always-half")(half)
    finally:
        REWARD_REGISTRY.pop("test/always-half")

"""Rule costs: the built-in subtraction_before_last_step on hand-written answers, and the registry."""

import pytest

from hybridflow.algorithms import UnknownNameError
from hybridflow.rewards.cost import get_cost_fn, register_cost

COST = get_cost_fn("subtraction_before_last_step")


@pytest.mark.parametrize("answer, cost", [
    (" 7 - 5 = 2\n2 + 3 = 5\n#### 5", 1.0),     # full solution that starts with a subtraction
    (" 9 - 1 = 8\n8 - 2 = 6\n#### 6", 1.0),
    (" 7 + 5 = 12\n12 - 3 = 9\n#### 9", 0.0),   # the subtraction is the last step
    (" 7 - 5 = 2\n#### 2", 0.0),               # shortcut: the subtraction is the only step
    (" 7 + 5 = 12\n#### 12", 0.0),
    (" 7 - 5 = 2\n2 + 3 = 5\n5 + 1 = 6\n#### 6", 1.0),
    ("", 0.0),
    ("#### -3", 0.0),                            # a negative answer is not a subtraction step
])
def test_subtraction_before_last_step(answer, cost):
    assert COST("hybridflow/arith", answer, "", None) == cost


def test_unknown_cost_lists_the_known_ones():
    with pytest.raises(UnknownNameError, match="unknown rule cost 'nope'; known: .*subtraction_before_last_step"):
        get_cost_fn("nope")


def test_a_name_cannot_be_taken_twice():
    with pytest.raises(ValueError, match="already registered"):
        register_cost("subtraction_before_last_step")(lambda d, s, g, e: 0.0)

"""The shared greedy partition: capped groups worked by hand, and the error when the cap cannot hold the items."""

import pytest

from hybridflow.utils.partition import balanced_groups


def test_capped_groups_worked_by_hand():
    # uncapped: 7 -> g0, 5 -> g1, 4 -> g1 (5 < 7), 3 -> g0 (7 < 9), 1 -> g1 (9 < 10)
    assert balanced_groups([4, 7, 1, 5, 3], 2) == [[1, 4], [0, 2, 3]]
    # at most 2 per group over 3 groups: 7 -> g0, 5 -> g1, 4 -> g2, 3 -> g2 (4 is lightest), 1 -> g1 (g2 full)
    assert balanced_groups([4, 7, 1, 5, 3], 3, max_items=2) == [[1], [2, 3], [0, 4]]
    with pytest.raises(ValueError, match="5 items do not fit in 2 groups of at most 2"):
        balanced_groups([1] * 5, 2, max_items=2)

"""The tier table and its guard (tests/tiers.py): lookups, refusals, and a table that names only real tests."""

from pathlib import Path

import pytest

import tiers

TESTS = Path(__file__).resolve().parent


def test_longest_key_wins_and_unnamed_tests_are_unit(monkeypatch):
    monkeypatch.setattr(tiers, "TIERS", {"a/test_x.py": "dist", "a/test_x.py::test_slow": "e2e",
                                         "a/test_x.py::test_cheap": "unit"})
    assert tiers.tier_of("tests/a/test_x.py::test_other") == "dist"
    assert tiers.tier_of("tests/a/test_x.py::test_slow[param-1]") == "e2e"  # parameters do not matter
    assert tiers.tier_of("a/test_x.py::test_cheap") == "unit"
    assert tiers.tier_of("tests/a/test_y.py::test_z") == "unit"
    assert tiers.tier_of("tests/a/test_x.py::TestGroup::test_method") == "dist"


def test_a_unit_test_that_starts_ray_or_a_process_is_refused_with_the_key_to_add():
    with tiers.running("tests/a/test_x.py::test_q", "unit"):
        with pytest.raises(tiers.TierError, match=r"in tier 'unit' but starts Ray .*'a/test_x.py': 'dist'"):
            tiers._observe("dist", "starts Ray (ray.init)")
    with tiers.running("tests/a/test_x.py::test_q", "dist"):
        tiers._observe("dist", "starts a process")  # within its tier
        with pytest.raises(tiers.TierError, match="in tier 'dist' but runs a training"):
            tiers._observe("e2e", "runs a training (TrainLoop.fit)")


def test_a_fixture_that_reached_a_tier_refuses_later_tests_below_it(monkeypatch):
    monkeypatch.setattr(tiers, "_fixture_levels", {})
    with tiers.running("tests/a/test_x.py::test_first", "dist"):
        with tiers.running("fixture:cluster", "dist"):
            tiers._observe("dist", "starts Ray (ray.init)")
    tiers.check_fixtures("tests/a/test_x.py::test_later", ["tmp_path", "cluster"], "dist")  # fine
    with pytest.raises(tiers.TierError, match="uses fixture 'cluster'"):
        tiers.check_fixtures("tests/a/test_y.py::test_unit", ["cluster"], "unit")


def test_child_processes_by_their_argument_lists():
    assert tiers._argv_level(["git", "status"]) is None
    assert tiers._argv_level(["/usr/bin/python3", "-c", "pass"])[0] == "dist"
    assert tiers._argv_level(["hybridflow", "train", "quickstart"])[0] == "dist"


def test_every_key_names_a_test_file_and_a_tier():
    for key, tier in tiers.TIERS.items():
        path, _, name = key.partition("::")
        assert tier in tiers.LEVELS, key
        source = (TESTS / path).read_text()  # raises if the file is gone
        assert not name or f"def {name.split('::')[-1]}(" in source, f"{key}: no such test"

"""The auto-mapper reads each planned algorithm's registered dataflow (no decision on an algorithm's name): a dataflow
registered by a user driver's registration is planned and emitted like a built-in one."""

from __future__ import annotations

import pytest

from hybridflow.mapping.dataflow import works
from hybridflow.mapping.emit import _algorithm_keys
from hybridflow.mapping.flows import DATAFLOWS, Dataflow, register_dataflow
from hybridflow.mapping.specs import ALGORITHMS, SpecError, Workload
from hybridflow.registry import UnknownNameError
from hybridflow.trainer.driver import DRIVERS, Driver, _ORDER, driver_for_plan, register_driver


@pytest.fixture
def user_driver():
    """A driver whose registration declares a critic-less dataflow with a greedy baseline and a cost model."""
    flow = Dataflow(greedy_baseline=True, cost_models=True, adv_estimator="rloo")

    @register_driver("flows_test_driver", dataflow={"flows-test": flow})
    class FlowsTestDriver(Driver):
        ROLES = ("actor",)

    yield flow
    DRIVERS.unregister("flows_test_driver")
    _ORDER.remove("flows_test_driver")
    DATAFLOWS.unregister("flows-test")


def test_a_drivers_declared_dataflow_is_what_the_mapper_plans(user_driver):
    workload = Workload("flows-test", batch=4, n=3)
    got = [(w.role, w.kind, w.sequences, w.greedy) for w in works(workload)]
    # written out from the declaration: S = 12 sampled, B = 4 greedy; no critic; cost model and cost critic
    assert got == [("actor", "generate", 12, False), ("actor", "generate", 4, True), ("actor", "infer", 12, False),
                   ("reference", "infer", 12, False), ("reward", "infer", 16, False), ("cost", "infer", 12, False),
                   ("cost_critic", "infer", 12, False), ("actor", "train", 12, False),
                   ("cost_critic", "train", 12, False)]
    assert ALGORITHMS["flows-test"] == ("actor", "reference", "reward", "cost", "cost_critic")
    assert driver_for_plan("flows-test") == "flows_test_driver"
    assert _algorithm_keys("flows-test", []) == {"driver": "flows_test_driver", "adv_estimator": "rloo"}


def test_built_in_plans_name_their_driver_and_estimator():
    notes: list[str] = []
    assert _algorithm_keys("ppo", notes) == {"driver": "ppo", "adv_estimator": "gae"}
    assert _algorithm_keys("grpo", notes) == {"driver": "ppo", "adv_estimator": "grpo"}
    assert _algorithm_keys("remax", notes) == {"driver": "remax", "adv_estimator": "remax"}
    assert _algorithm_keys("safe-rlhf", notes) == {"driver": "safe_rlhf"} and notes == []


def test_an_unknown_or_malformed_dataflow_is_refused():
    with pytest.raises(UnknownNameError, match="did you mean 'remax'"):
        DATAFLOWS.get("remx")
    with pytest.raises(SpecError, match="unknown algorithm 'remx'"):
        Workload("remx")
    with pytest.raises(TypeError, match="must be a hybridflow.mapping.flows.Dataflow"):
        register_dataflow("flows-bad", {"critic": True})

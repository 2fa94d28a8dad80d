"""KL estimators by hand; fixed/adaptive KL controllers by hand; controller config and state."""

import math
from dataclasses import dataclass

import pytest
import torch
from omegaconf import OmegaConf

from hybridflow.algorithms import AdaptiveKLController, FixedKLController, get_kl_controller, kl_penalty
from hybridflow.config.schema import KLCtrlConfig

LOGP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])  # d = logp - ref = [0.5, -1.0]


@pytest.mark.parametrize("names, expected", [
    (("kl", "k1"), [0.5, -1.0]),
    (("abs",), [0.5, 1.0]),
    (("mse", "k2"), [0.5 * 0.25, 0.5 * 1.0]),
    # ref - logp = [-0.5, 1.0]: exp(x) - x - 1
    (("low_var_kl", "k3"), [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]),
])
def test_estimators_by_hand(names, expected):
    for name in names:
        assert kl_penalty(LOGP, REF, name)[0].tolist() == pytest.approx(expected, abs=1e-6), name


def test_low_var_kl_is_clamped_and_finite():
    # ref - logp = -30 -> 30 - 1 + e^-30 ~ 29 -> 10;  ref - logp = +200 -> e^200 overflows without the clamp -> 10
    out = kl_penalty(torch.tensor([[0.0, -200.0]]), torch.tensor([[-30.0, 0.0]]), "low_var_kl")
    assert out.tolist() == [[10.0, 10.0]]


def test_unknown_estimator_lists_names():
    with pytest.raises(ValueError, match="unknown kl_penalty 'kl2'") as err:
        kl_penalty(LOGP, REF, "kl2")
    for name in ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]:
        assert name in str(err.value)


def test_fixed_controller():
    ctrl = FixedKLController(kl_coef=0.05)
    ctrl.update(current_kl=123.0, n_steps=1000)
    assert ctrl.value == 0.05


def test_adaptive_controller_by_hand():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    # kl 9: error 9/6 - 1 = 0.5 -> clipped to 0.2; factor 1 + 0.2 * 100 / 10000 = 1.002
    ctrl.update(current_kl=9.0, n_steps=100)
    assert ctrl.value == pytest.approx(0.1 * 1.002)
    # kl 3 (a tensor): error 0.5 - 1 = -0.5 -> -0.2; factor 1 - 0.2 * 100 / 10000 = 0.998
    ctrl.update(current_kl=torch.tensor(3.0), n_steps=100)
    assert ctrl.value == pytest.approx(0.1 * 1.002 * 0.998)
    # kl 6.6: error 0.1 (inside the clip); factor 1 + 0.1 * 500 / 10000 = 1.005
    ctrl.update(current_kl=6.6, n_steps=500)
    assert ctrl.value == pytest.approx(0.1 * 1.002 * 0.998 * 1.005)


def test_controller_state_round_trip():
    ctrl = AdaptiveKLController(0.2, 1.0, 100)
    ctrl.update(2.0, 10)
    restored = AdaptiveKLController(0.2, 1.0, 100)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value == pytest.approx(0.2 * 1.02)
    fixed = FixedKLController(0.3)
    fixed.load_state_dict({"value": 0.7})
    assert fixed.state_dict() == {"value": 0.7}


@dataclass
class _Cfg:
    type: str
    kl_coef: float = 0.01
    horizon: int = 500
    target_kl: float = 2.0


def test_get_kl_controller_from_dataclass_and_omegaconf():
    assert isinstance(get_kl_controller(KLCtrlConfig()), FixedKLController)
    ctrl = get_kl_controller(OmegaConf.structured(KLCtrlConfig(type="adaptive", kl_coef=0.3, horizon=50,
                                                               target_kl=1.0)))
    assert isinstance(ctrl, AdaptiveKLController)
    assert (ctrl.value, ctrl.target, ctrl.horizon) == (0.3, 1.0, 50)
    assert get_kl_controller(_Cfg("fixed", kl_coef=0.02)).value == 0.02


def test_get_kl_controller_errors():
    with pytest.raises(ValueError, match="unknown kl_ctrl.type 'pid'.*adaptive, fixed"):
        get_kl_controller(_Cfg("pid"))
    with pytest.raises(ValueError, match="horizon must be > 0"):
        get_kl_controller(_Cfg("adaptive", horizon=0))
    with pytest.raises(ValueError, match="target_kl must be > 0"):
        get_kl_controller(_Cfg("adaptive", target_kl=0.0))

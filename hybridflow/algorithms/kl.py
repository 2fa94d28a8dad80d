"""Per-token KL estimators between the actor and the reference policy, and KL-coefficient controllers.

Shapes: ``(B, T)`` = batch, response tokens. Tokens are sampled from the actor ``pi``; the
estimators below estimate ``KL(pi || pi_ref)`` from the log-probs of those tokens.
"""

from __future__ import annotations

import math
from typing import Any, Union

import torch

from hybridflow.registry import Registry

LOW_VAR_KL_CLAMP = 10.0  # the k3 estimate is clamped to [-10, 10]
LOG_RATIO_CLAMP = 20.0  # log(pi_ref / pi) is clamped to [-20, 20] before exp() (no effect after the k3 clamp)


def _k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return logprob - ref_logprob


def _abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return (logprob - ref_logprob).abs()


def _k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprob - ref_logprob).square()


def _k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    log_r = torch.clamp(ref_logprob - logprob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(log_r) - log_r - 1.0, -LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


#: per-token KL estimators by name (``algorithm.kl_penalty``, ``actor.kl_loss_type``); k1/k2/k3 are aliases
KL_ESTIMATORS: Registry = Registry("kl_penalty")
for _names, _fn in ((("kl", "k1"), _k1), (("abs",), _abs), (("mse", "k2"), _k2), (("low_var_kl", "k3"), _k3)):
    for _name in _names:
        KL_ESTIMATORS.register(_name)(_fn)
del _names, _fn, _name
KL_PENALTY_TYPES = tuple(KL_ESTIMATORS)  # the built-in names kl_penalty accepts


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from the log-probs of tokens sampled from ``pi``.

    With ``d = logprob - ref_logprob`` and ``r = pi_ref / pi = exp(-d)`` (Schulman, "Approximating
    KL Divergence", 2020, http://joschu.net/blog/kl-approx.html):

    - ``"kl"`` / ``"k1"``: ``d``. Unbiased, high variance, negative on some tokens.
    - ``"abs"``: ``|d|``. Biased (over-estimates); a heuristic.
    - ``"mse"`` / ``"k2"``: ``d^2 / 2``. Biased, low variance, always >= 0.
    - ``"low_var_kl"`` / ``"k3"``: ``r - log r - 1``, clamped to [-10, 10]. Unbiased (before the
      clamp), always >= 0, low variance.

    As a *value* (e.g. subtracted from the reward) k1 and k3 are the unbiased choices. As a *loss*
    differentiated through ``logprob`` on-policy, the picture changes (Tang & Munos 2025,
    arXiv 2506.09477): the expected gradient of k1 is 0 (it only adds noise), k2's is the true
    gradient of ``KL(pi || pi_ref)``, and k3's is the gradient of the other direction,
    ``KL(pi_ref || pi)``; the k3 clamp also zeroes the gradient of clamped tokens. (Per-token losses
    also miss how a token changes the distribution of later tokens; same paper.)

    Args:
        logprob: ``(B, T)`` log-probs of the sampled tokens under the actor.
        ref_logprob: ``(B, T)`` log-probs of the same tokens under the reference policy.
        kl_penalty: estimator name, one of :data:`KL_PENALTY_TYPES`.

    Returns:
        ``(B, T)`` per-token estimate (padded positions are not masked: mask them downstream).

    Raises:
        ValueError: (:class:`~hybridflow.registry.UnknownNameError`) unknown name; the
            message lists the known ones.
    """
    estimator = KL_ESTIMATORS.get(kl_penalty)
    return estimator(logprob, ref_logprob)


# --------------------------------------------------------------------------------------------------
# KL-coefficient controllers
# --------------------------------------------------------------------------------------------------


def _as_float(x: Union[float, torch.Tensor]) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


class FixedKLController:
    """A constant KL coefficient ``beta``.

    Attributes:
        value: the coefficient.
    """

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: Union[float, torch.Tensor], n_steps: int) -> None:
        """No-op (kept so both controllers are used the same way)."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """KL coefficient adapted toward a target KL (Ziegler et al. 2019, arXiv 1909.08593, eq. 2).

    ``update(current_kl, n_steps)``: ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)`` and
    ``value *= 1 + e * n_steps / horizon``: beta grows when the measured KL is above target and
    shrinks when below, by at most 20% per ``horizon`` steps.

    Args:
        init_kl_coef: initial beta.
        target_kl: target KL, in the unit of the ``current_kl`` passed to ``update``, > 0.
        horizon: adaptation horizon in steps (``n_steps`` units, usually samples), > 0.

    Raises:
        ValueError: ``target_kl <= 0`` or ``horizon <= 0``.
    """

    MAX_PROPORTIONAL_ERROR = 0.2

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if not target_kl > 0:
            raise ValueError(f"AdaptiveKLController: target_kl must be > 0, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: Union[float, torch.Tensor], n_steps: int) -> None:
        """Move ``value`` toward keeping ``current_kl`` at the target; ``n_steps`` since the last update."""
        kl = _as_float(current_kl)
        if not math.isfinite(kl):
            raise ValueError(f"AdaptiveKLController.update: current_kl must be finite, got {kl}")
        error = min(max(kl / self.target - 1.0, -self.MAX_PROPORTIONAL_ERROR), self.MAX_PROPORTIONAL_ERROR)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


KLController = Union[FixedKLController, AdaptiveKLController]


#: KL-coefficient controllers by ``algorithm.kl_ctrl.type``: each entry builds one from the ``kl_ctrl`` section
KL_CONTROLLERS: Registry = Registry("kl_ctrl.type")
KL_CONTROLLERS.register("fixed")(lambda cfg: FixedKLController(kl_coef=cfg.kl_coef))
KL_CONTROLLERS.register("adaptive")(lambda cfg: AdaptiveKLController(init_kl_coef=cfg.kl_coef, target_kl=cfg.target_kl,
                                                                     horizon=cfg.horizon))


def get_kl_controller(kl_ctrl_config: Any) -> KLController:
    """Build the controller described by ``algorithm.kl_ctrl`` (its ``type`` looked up in :data:`KL_CONTROLLERS`).

    Args:
        kl_ctrl_config: object with attributes ``type`` ("fixed" | "adaptive"), ``kl_coef`` (the
            initial beta), and for "adaptive" ``target_kl`` and ``horizon`` (a dataclass or an
            OmegaConf DictConfig).

    Raises:
        ValueError: unknown ``type`` (:class:`~hybridflow.registry.UnknownNameError`, listing the known ones) or
            invalid adaptive parameters.
    """
    return KL_CONTROLLERS.get(kl_ctrl_config.type)(kl_ctrl_config)

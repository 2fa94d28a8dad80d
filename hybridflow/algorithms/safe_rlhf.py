"""Safe-RLHF: the Lagrange multiplier of the cost constraint and the combined advantage.

Safe RLHF (Dai et al. 2023, arXiv 2310.12773, sec. 3.3) maximizes the expected reward subject to
the expected cost staying at or below a limit (the ``threshold`` here) and solves the constrained
problem through its Lagrangian ``min_theta max_{lambda >= 0} -J_R(theta) + lambda * J_C(theta)``,
where the paper writes ``J_C(theta) = E[C] + d`` with the constraint ``J_C <= 0`` (so its ``d`` is
``-threshold``). The policy step uses the advantage of that Lagrangian scaled by
``1 / (1 + lambda)`` (appendix eq. 30 of arXiv v1); the multiplier takes a gradient-ascent step on
the constraint violation, kept in log space so that ``lambda = exp(log lambda) >= 0``
(appendix eq. 31).

Shapes: ``(B, T)`` = batch, response tokens.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Iterable, Optional, Union

import torch

Costs = Union[torch.Tensor, Iterable[float]]


class LagrangeMultiplier:
    """The Safe-RLHF multiplier ``lambda`` of the constraint ``mean episode cost <= threshold``.

    ``lambda`` is held as ``log_lambda`` (so ``lambda = exp(log_lambda) > 0`` always; it can only
    reach 0 through float underflow). The costs of the latest ``window`` episodes (responses) are
    kept in a moving window, as the reference implementation keeps a deque of
    ``episode_cost_window_size`` episode costs. :meth:`update` adds a batch of episode costs to the
    window and takes one ascent step on ``log_lambda``:

    - default rule: ``log_lambda += lambda_lr * (mean_window_cost - threshold)``, i.e. ``lambda`` is
      multiplied by ``exp(lambda_lr * violation)``: it grows while the mean cost is above the
      threshold and shrinks while below, by a factor that does not depend on ``lambda`` itself,
      so a small ``lambda`` recovers as fast as a large one shrinks. This is the rule the authors
      give when deriving eq. 31 (PKU-Alignment/safe-rlhf GitHub issue #164).
    - ``scale_by_lambda=True``: ``log_lambda += lambda_lr * lambda * (mean_window_cost - threshold)``,
      eq. 31 as printed in the paper, which is the exact gradient of ``lambda * (J_C - d)`` with
      respect to ``log_lambda`` and what the reference code's SGD step on ``log_lambda`` computes.
      Steps shrink with ``lambda``, so a small ``lambda`` reacts slowly.

    After the step ``log_lambda`` is clamped to ``<= log(max_lambda)`` when ``max_lambda`` is set and to
    ``>= log(min_lambda)`` when ``min_lambda > 0``. The floor is not in the paper (whose lambda only has to stay
    >= 0): in log space a long run of steps below the threshold drives lambda towards 0 without bound (e.g. 5000
    steps of violation -0.1 at lambda_lr 1 give exp(-500) ~ 1e-217), and it then takes as many steps above the
    threshold to climb back. With the floor, climbing back to a given ``lambda`` takes at most
    ``log(lambda / min_lambda) / (lambda_lr * violation)`` steps (default rule).

    Args:
        init_lambda: initial ``lambda``, > 0.
        lambda_lr: step size of the ascent on ``log_lambda``, >= 0 (units: 1 / cost).
        threshold: the cost limit ``d``; the constraint is ``mean cost <= threshold``.
        max_lambda: upper bound on ``lambda`` (>= ``init_lambda``), or None for none.
        min_lambda: lower bound on ``lambda`` (``0 <= min_lambda <= init_lambda``); 0 means none.
        window: number of most recent episode costs averaged by :meth:`update`, >= 1.
        scale_by_lambda: use the paper's eq. 31 step (see above) instead of the default.

    Raises:
        ValueError: an argument outside the ranges above, or not finite.
    """

    def __init__(
        self,
        init_lambda: float,
        lambda_lr: float,
        threshold: float,
        max_lambda: Optional[float] = None,
        window: int = 128,
        scale_by_lambda: bool = False,
        min_lambda: float = 0.0,
    ) -> None:
        for name, value in (("init_lambda", init_lambda), ("lambda_lr", lambda_lr), ("threshold", threshold)):
            if not math.isfinite(value):
                raise ValueError(f"LagrangeMultiplier: {name} must be finite, got {value}")
        if not init_lambda > 0:
            raise ValueError(f"LagrangeMultiplier: init_lambda must be > 0 (lambda is kept as log lambda), "
                             f"got {init_lambda}")
        if not lambda_lr >= 0:
            raise ValueError(f"LagrangeMultiplier: lambda_lr must be >= 0, got {lambda_lr}")
        if max_lambda is not None and not init_lambda <= max_lambda:
            raise ValueError(f"LagrangeMultiplier: max_lambda ({max_lambda}) must be >= init_lambda ({init_lambda})")
        if not (math.isfinite(min_lambda) and 0.0 <= min_lambda <= init_lambda):
            raise ValueError(f"LagrangeMultiplier: min_lambda must be in [0, init_lambda={init_lambda}], got {min_lambda}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"LagrangeMultiplier: window must be an int >= 1, got {window!r}")
        self.lambda_lr = float(lambda_lr)
        self.threshold = float(threshold)
        self.max_lambda = None if max_lambda is None else float(max_lambda)
        self.min_lambda = float(min_lambda)
        self.scale_by_lambda = bool(scale_by_lambda)
        self.log_lambda = math.log(init_lambda)
        self._costs: deque[float] = deque(maxlen=window)

    @property
    def value(self) -> float:
        """The current ``lambda = exp(log_lambda)`` (>= 0)."""
        return math.exp(self.log_lambda)

    @property
    def window(self) -> int:
        """How many of the most recent episode costs are averaged."""
        return self._costs.maxlen  # type: ignore[return-value]

    @property
    def mean_cost(self) -> Optional[float]:
        """Mean of the episode costs in the window, or None before the first :meth:`update`."""
        return sum(self._costs) / len(self._costs) if self._costs else None

    def update(self, episode_costs: Costs) -> float:
        """Add this step's episode costs to the window and take one ascent step on ``log_lambda``.

        Args:
            episode_costs: the cost of each episode (response) of the step: a ``(B,)`` tensor (any
                shape is flattened) or an iterable of numbers. May be empty once the window holds
                costs (the step then uses the window as it is).

        Returns:
            The new ``lambda``.

        Raises:
            ValueError: a cost is not finite, or the window is still empty.
        """
        if isinstance(episode_costs, torch.Tensor):
            costs = episode_costs.detach().double().cpu().reshape(-1).tolist()
        else:
            costs = [float(c) for c in episode_costs]
        bad = [c for c in costs if not math.isfinite(c)]
        if bad:
            raise ValueError(f"LagrangeMultiplier.update: episode costs must be finite, got {bad[:5]}")
        self._costs.extend(costs)
        if not self._costs:
            raise ValueError("LagrangeMultiplier.update: no episode cost given yet; pass this step's costs")
        violation = self.mean_cost - self.threshold
        step = self.lambda_lr * violation * (self.value if self.scale_by_lambda else 1.0)
        self.log_lambda += step
        if self.max_lambda is not None:
            self.log_lambda = min(self.log_lambda, math.log(self.max_lambda))
        if self.min_lambda > 0:
            self.log_lambda = max(self.log_lambda, math.log(self.min_lambda))
        return self.value

    def state_dict(self) -> dict[str, Any]:
        """``{"log_lambda": float, "costs": list[float]}``: enough to resume exactly."""
        return {"log_lambda": self.log_lambda, "costs": list(self._costs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the window keeps its own size; older costs drop out).

        Raises:
            KeyError: ``state`` lacks ``"log_lambda"`` or ``"costs"``.
        """
        self.log_lambda = float(state["log_lambda"])
        self._costs.clear()
        self._costs.extend(float(c) for c in state["costs"])


def compute_safe_rlhf_advantage(
    reward_advantages: torch.Tensor,
    cost_advantages: torch.Tensor,
    lagrange_lambda: Union[float, torch.Tensor],
) -> torch.Tensor:
    """The Safe-RLHF policy advantage ``(A_r - lambda * A_c) / (1 + lambda)`` (Dai et al. 2023, appendix eq. 30).

    The advantage of the Lagrangian ``R - lambda * C``, divided by ``1 + lambda`` so its scale stays
    that of a single advantage whatever ``lambda`` is. Padded positions are 0 when both inputs are
    0 there (as the GAE estimator returns them).

    Args:
        reward_advantages: ``(B, T)`` advantages of the reward (e.g. GAE with the reward critic).
        cost_advantages: ``(B, T)`` advantages of the cost (e.g. GAE with the cost critic).
        lagrange_lambda: ``lambda >= 0``, a number or a 0-dim tensor (e.g. ``LagrangeMultiplier.value``).

    Returns:
        ``(B, T)`` tensor, dtype of the (promoted) inputs.

    Raises:
        ValueError: shapes differ, or ``lagrange_lambda`` is negative or not finite.
    """
    if reward_advantages.shape != cost_advantages.shape:
        raise ValueError(f"reward_advantages {tuple(reward_advantages.shape)} and cost_advantages "
                         f"{tuple(cost_advantages.shape)} must have the same shape")
    lam = float(lagrange_lambda)
    if not (math.isfinite(lam) and lam >= 0):
        raise ValueError(f"lagrange_lambda must be finite and >= 0, got {lam}")
    return (reward_advantages - lam * cost_advantages) / (1.0 + lam)

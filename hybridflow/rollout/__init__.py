"""Generation backends behind one interface (:class:`BaseRollout`), looked up by name.

``hf`` (default, CPU-capable, KV cache) is registered on import of this package.
"""

from hybridflow.rollout.base import (
    BaseRollout,
    RolloutAsleepError,
    get_rollout_class,
    register_rollout,
    registered_rollouts,
)
from hybridflow.rollout.hf_rollout import HFRollout

__all__ = [
    "BaseRollout",
    "HFRollout",
    "RolloutAsleepError",
    "get_rollout_class",
    "register_rollout",
    "registered_rollouts",
]

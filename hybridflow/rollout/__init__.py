"""Generation backends behind one interface (:class:`BaseRollout`), looked up by name.

``hf`` (default, CPU-capable, KV cache) and ``vllm`` are registered on import of this package; importing it
never imports vLLM (the ``vllm`` backend imports it when an engine is built) nor transformers (each backend
imports it when it runs), so reading a backend's metadata is cheap.
"""

from hybridflow.rollout.base import (
    ROLLOUTS,
    BaseRollout,
    RolloutAsleepError,
    get_rollout_class,
    register_rollout,
    registered_rollouts,
    rollout_meta,
    uses_hybrid_engine,
)
from hybridflow.rollout.hf_rollout import HFRollout
from hybridflow.rollout.vllm_rollout import VLLMRollout

__all__ = [
    "ROLLOUTS",
    "BaseRollout",
    "HFRollout",
    "RolloutAsleepError",
    "VLLMRollout",
    "get_rollout_class",
    "register_rollout",
    "registered_rollouts",
    "rollout_meta",
    "uses_hybrid_engine",
]

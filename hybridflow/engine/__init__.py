"""The 3D-HybridEngine: the actor trains in its (dp x tp x pp) layout and generates in a (dp_g x tp_g) layout on the
same ranks, resharding its weights between the two phases without redundant copies (HybridFlow, Sec. 5).

* :mod:`hybridflow.engine.plan`: which rank sends which slice to whom (pure Python, inspectable);
* :mod:`hybridflow.engine.tp_model`: the tensor-parallel HF generation model;
* :mod:`hybridflow.engine.hybrid_engine`: the switches, bucketed transfers, offload/onload;
* :mod:`hybridflow.engine.memory`: measuring the tensor memory a switch allocates.
"""

from hybridflow.engine.hybrid_engine import DEFAULT_BUCKET_BYTES, HybridEngine
from hybridflow.engine.memory import TensorMemoryTracker
from hybridflow.engine.plan import Layout, ReshardPlan, build_reshard_plan, generation_coords

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "HybridEngine",
    "Layout",
    "ReshardPlan",
    "TensorMemoryTracker",
    "build_reshard_plan",
    "generation_coords",
]

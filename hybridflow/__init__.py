"""hybridflow: RL fine-tuning of language models with a hybrid single controller (HybridFlow, EuroSys'25).

``DataProto`` is imported on first use (``hybridflow.DataProto``), so the command line's ``--help`` and
``--version`` start without loading torch.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["DataProto", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "DataProto":
        from hybridflow.protocol import DataProto

        return DataProto
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")

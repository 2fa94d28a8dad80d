"""hybridflow: RL fine-tuning of language models with a hybrid single controller (HybridFlow, EuroSys'25)."""

from hybridflow.protocol import DataProto

__version__ = "0.1.0"
__all__ = ["DataProto", "__version__"]

"""Compatibility home of the registry machinery: it lives in :mod:`hybridflow.registry` (one implementation for
every kind). Kept so that ``from hybridflow.algorithms.registry import Registry`` keeps working."""

from hybridflow.registry import Registry, UnknownNameError, unknown_name_error

__all__ = ["Registry", "UnknownNameError", "unknown_name_error"]

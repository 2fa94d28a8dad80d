"""The rollout-backend contract and its registry.

A rollout backend turns a batch of left-padded prompts into prompt + response sequences. The actor
worker owns one backend and drives it through a small lifecycle:

1. construct it (model, sampling config, special token ids); the actor worker does this through
   :meth:`BaseRollout.from_config`, which every backend accepts, and hands it a Hugging Face module only
   when the class sets ``needs_module`` (a backend with its own engine, such as ``vllm``, loads the
   checkpoint from the model path itself);
2. ``load_weights(...)`` whenever the trainer's parameters changed (after each optimizer step, or after
   a ``wake()`` from a sleep that discarded weights);
3. ``generate_sequences(prompts)`` any number of times while awake;
4. ``sleep()`` before the trainer needs the memory (update phase), ``wake()`` before the next
   generation. While asleep, ``generate_sequences`` and ``load_weights`` raise :class:`RolloutAsleepError`.

Backends register under a name with :func:`register_rollout` (in the one :class:`~hybridflow.registry.Registry`
``ROLLOUTS``, with metadata such as ``uses_hybrid_engine``) and are looked up with :func:`get_rollout_class` (the
``actor_rollout_ref.rollout.name`` config key); code decides on what a backend declares
(:func:`uses_hybrid_engine`, :func:`rollout_meta`), never on its name.

Sampling logprobs (the contract every backend and the trainer keep)
-------------------------------------------------------------------
``rollout_log_probs[i, t]`` is ``log mu(a_t)``, where ``mu`` is the distribution the sampler actually drew
``a_t`` from: the logits divided by the temperature, restricted to the top-k tokens, then to the top-p nucleus,
and renormalised (:func:`hybridflow.algorithms.sampling.sampling_logits` defines it; the ``hf`` backend samples
with that function, the ``vllm`` backend asks vLLM for ``logprobs_mode="processed_logprobs"``, which applies the
same rule). Greedy decoding (``do_sample`` false or temperature 0) records the plain ``log_softmax`` of the raw
logits.

The trainer takes the policy's logprobs under the same transform of its own logits (``old_log_probs`` and the
current logprobs of the loss; :class:`hybridflow.workers.ppo_actor.PPOActor`), keeping the sampled token in the
kept set even where the recomputed logits would put it just outside. So on-policy ``pi_old / mu = 1`` on
every sampled token (up to numerics), and the PPO ratio ``pi_theta / pi_old`` and the importance weights
``pi_old / mu`` (``bypass_old_log_prob``, TIS, AIPO) compare the same kind of distribution. Why truncated and
not the full softmax on both sides: an importance weight ``pi / mu`` needs ``mu > 0`` wherever ``pi > 0``, and
``mu`` is 0 outside the kept set, so only the truncated policy (the sampler as deployed) can be corrected for
with these samples; under the full softmax ``pi / mu = pi(kept set) < 1`` on every token, a bias. The gradient
of ``log pi_K(a)`` moves the logits of the kept tokens only (the kept set is piecewise constant: no gradient).
The reference policy's logprobs (``ref_log_prob``) use the temperature only: the KL term measures the sampler's
distance from the full reference distribution, which is ``>= -log(mass kept)`` per token even before the first
update when top-k / top-p are set.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Optional, Sequence, Union

import torch

from hybridflow.registry import Registry

if TYPE_CHECKING:  # pragma: no cover - typing only
    from hybridflow.protocol import DataProto

__all__ = [
    "ROLLOUTS",
    "BaseRollout",
    "RolloutAsleepError",
    "get_rollout_class",
    "register_rollout",
    "registered_rollouts",
    "rollout_meta",
    "uses_hybrid_engine",
]


class RolloutAsleepError(RuntimeError):
    """Raised when a sleeping rollout backend is asked to generate or to load weights."""


class BaseRollout(abc.ABC):
    """A generation backend: prompts in, prompt + response sequences out (see the module lifecycle)."""

    needs_module: ClassVar[bool] = True  # from_config wants a loaded Hugging Face module

    @classmethod
    def from_config(
        cls,
        model_path: str,
        module: Optional[torch.nn.Module],
        config: Any,
        eos_token_id: Union[int, Sequence[int]],
        pad_token_id: int,
        **options: Any,
    ) -> "BaseRollout":
        """Build the backend the way the actor worker does, the same call for every backend.

        Args:
            model_path: the checkpoint directory (or ``builtin:NAME``) the actor was loaded from.
            module: a freshly loaded Hugging Face causal LM on the rollout device when ``cls.needs_module``,
                else None.
            config: attribute-access sampling config (see the backend's class docstring).
            eos_token_id: id or ids that end a response.
            pad_token_id: id written to response slots after a row's end.
            options: engine options (``dtype``, ``trust_remote_code``, ``max_model_len``, ...); a backend
                ignores those it does not use.

        The default passes ``module`` to the constructor: ``cls(module, config, eos_token_id, pad_token_id)``.

        Raises:
            ValueError: ``cls.needs_module`` and ``module`` is None.
        """
        if module is None:
            raise ValueError(f"{cls.__name__} needs a loaded model; from_config got module=None")
        return cls(module, config, eos_token_id=eos_token_id, pad_token_id=pad_token_id)

    @abc.abstractmethod
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate responses for a batch of left-padded prompts.

        Args:
            prompts: tensors ``input_ids``, ``attention_mask``, ``position_ids``, each (B, P).
                ``meta_info`` may override sampling parameters for this call (backend-specific keys).

        Returns:
            A DataProto with (B*n) rows, prompt i's n samples at rows i*n .. i*n+n-1, holding at least
            ``prompts`` (B*n, P), ``responses`` (B*n, R), ``input_ids``, ``attention_mask``,
            ``position_ids`` (B*n, P+R), ``response_mask`` (B*n, R), ``rollout_log_probs`` (B*n, R) float32,
            the logprob of each sampled token under the distribution it was drawn from (after temperature and
            top-k / top-p truncation, renormalised; see "Sampling logprobs" above), 0 where the mask is 0, and
            ``truncated`` (B*n,) bool (cut by the length limit, no eos).
            B: prompts, n: samples per prompt, P: prompt tokens, R: response tokens.
            A multi-turn rollout (:mod:`hybridflow.rollout.multi_turn`) keeps this layout; there the response part
            of ``attention_mask`` is 1 on observation tokens, where ``response_mask`` is 0.

        Raises:
            RolloutAsleepError: if called between ``sleep()`` and ``wake()``.
        """

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy parameters into the engine's model by name (Hugging Face parameter names).

        The iterable may be a generator and may cover only part of the model (weights can be streamed in
        several calls). A weight for one of several tied parameters (e.g. ``lm_head.weight`` and
        ``model.embed_tokens.weight``) updates all of them.

        Raises:
            KeyError: a name that the model does not have (the message lists a few known names).
            ValueError: a tensor whose shape differs from the parameter's.
            RolloutAsleepError: if called while asleep.
        """

    @abc.abstractmethod
    def sleep(self, level: int = 1) -> None:
        """Release the memory the backend holds, until :meth:`wake`.

        Level 1 keeps the weights (offloaded to host memory), level 2 discards them, so the caller must
        call :meth:`load_weights` for every parameter after :meth:`wake`. KV caches are freed in both.
        Sleeping twice is a no-op.
        """

    @abc.abstractmethod
    def wake(self) -> None:
        """Undo :meth:`sleep`; waking an awake backend is a no-op."""


def _check_rollout_class(name: str, cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, BaseRollout)):
        raise TypeError(f"register_rollout({name!r}) expects a BaseRollout subclass, got {cls!r}")


ROLLOUTS: Registry = Registry("rollout backend", check=_check_rollout_class, config_section="actor_rollout_ref.rollout")
_ROLLOUT_REGISTRY = ROLLOUTS  # the former (dict) name; the Registry keeps ``pop`` for code that cleaned up with it


def register_rollout(name: str, **meta: Any) -> Callable[[type[BaseRollout]], type[BaseRollout]]:
    """Class decorator registering a :class:`BaseRollout` subclass under ``name``, with metadata ``meta``.

    The metadata the package reads (each optional, default False / None):

    - ``uses_hybrid_engine``: the actor builds the 3D-HybridEngine and hands this backend the engine's generation
      module (the colocated ``hf`` backend); otherwise the backend keeps its own copy of the weights.
    - ``supports_int8_quantization``: the backend generates from the Hugging Face module it was given, in place, so
      the async generators may quantize that module's Linear layers (``async_training.generator_quantization``).
    - ``requires_package``: the module the backend imports when built (``vllm``), with ``install_hint``, a dict
      ``trainer.device -> pip command`` (key ``None``: any device); a config naming the backend without that package
      installed is refused at load.
    - ``config``: a dataclass of the backend's own settings; its fields become keys of ``actor_rollout_ref.rollout``
      (the vllm engine's ``gpu_memory_utilization`` ...) and reach the backend's ``config`` object by their names;
      ``config_checks``: ``fn(get) -> list[str]`` validating them at load (:mod:`hybridflow.registry`).

    Raises:
        ValueError: ``name`` is already registered to a different class.
        TypeError: the decorated class is not a :class:`BaseRollout` subclass, or the config metadata is malformed.
    """
    return ROLLOUTS.register(name, **meta)


def registered_rollouts(**where: Any) -> list[str]:
    """Sorted names of the registered rollout backends (with ``where``: those whose metadata has those values)."""
    return ROLLOUTS.names(**where)


def get_rollout_class(name: str) -> type[BaseRollout]:
    """The rollout backend class registered under ``name``.

    Raises:
        UnknownNameError: (a ``KeyError`` and ``ValueError``) unknown name; the message lists the registered names.
    """
    return ROLLOUTS.get(name)


def rollout_meta(name: str, key: str, default: Any = None) -> Any:
    """One metadata value of the rollout backend ``name`` (see :func:`register_rollout`).

    Raises:
        UnknownNameError: ``name`` is not registered.
    """
    return ROLLOUTS.meta(name, key, default)


def uses_hybrid_engine(name: str) -> bool:
    """Whether the actor generates for backend ``name`` through the 3D-HybridEngine (its ``uses_hybrid_engine``).

    Raises:
        UnknownNameError: ``name`` is not registered.
    """
    return bool(ROLLOUTS.meta(name, "uses_hybrid_engine", False))

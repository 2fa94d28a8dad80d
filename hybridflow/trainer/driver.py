"""The driver contract and its registry: one :class:`Driver` subclass per algorithm's dataflow, registered by name
(``algorithm.driver``) with :func:`register_driver`; :class:`~hybridflow.trainer.loop.TrainLoop` runs any of them.

A driver's lifecycle (who calls what, and when):

1. **At config load, before Ray** (:func:`hybridflow.config.load_config`): ``config_problems(get)`` returns the
   problems of a config that names this driver (one line each, led by the dotted key); ``roles(config)`` says which
   worker groups the run needs. Both are classmethods and must not import Ray or start anything.
2. **Worker groups up** (:func:`hybridflow.trainer.setup.worker_groups`): one group per role of ``roles(config)``,
   on the role's resource pool, each worker built from its :attr:`Role.inputs` (its own config section and derived
   values, never the whole config); then ``build(config, groups)`` makes the driver.
3. **Resume** (the loop): the loop loads ``checkpointed_groups()`` (each from ``<ckpt>/<name>``) and
   ``checkpointed_state()`` (objects with ``state_dict``/``load_state_dict``, from ``trainer_state.pt``), then calls
   ``start(data, step)`` once with the data cursor (a :class:`~hybridflow.trainer.loop.DataCursor` at the resumed
   data position) and the step training continues from.
4. **Each step**: the loop sets ``global_step`` (1-based, the step being run), takes the step's input with
   ``take_batch()`` (default: the next prompt batch of the cursor) and calls ``step(batch) -> metrics``; every
   ``trainer.test_freq`` steps ``validate(val_data) -> metrics``; every ``trainer.save_freq`` steps it saves the
   checkpoint, whose data position is ``data.position - batches_in_flight()``.

Registry metadata (read with ``DRIVERS.meta(name, key)``, so no code decides on a driver's name):
``features``: the optional config features the driver implements (``bypass_old_log_prob``, ``filter_groups``,
``overlong_buffer``); ``owns_estimators``: advantage estimators only this driver can feed (ReMax's greedy baseline);
``planned_as``: the auto-mapper's ``Workload.algorithm`` names whose dataflow this driver runs;
``trains_on_current_samples``: every update runs on samples of exactly the weights being updated (the old-logprob
forward may then be skipped, :mod:`hybridflow.trainer.old_log_prob`); ``config``: a dataclass of the driver's own
hyper-parameters, keys of ``algorithm`` (or of the section named by ``config_section``, ``""`` for the top level),
with ``config_checks`` validating them at load (:mod:`hybridflow.registry`); ``dataflow``: ``{planned name:
:class:`~hybridflow.mapping.flows.Dataflow`}``, registered as the auto-mapper's planned algorithms and added to
``planned_as`` (the built-in drivers' dataflows are registered by :mod:`hybridflow.mapping.flows` itself).

User drivers: subclass :class:`Driver` in a module of your own, decorate it with ``@register_driver("name")``,
list the module in ``trainer.plugins`` and set ``algorithm.driver=name``.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Optional, Union

from hybridflow.protocol import DataProto
from hybridflow.registry import Registry

#: the modules that register the built-in drivers (imported on the first registry lookup)
BUILTIN_DRIVER_MODULES = ("hybridflow.trainer.ppo", "hybridflow.trainer.remax", "hybridflow.trainer.safe_rlhf",
                          "hybridflow.trainer.async_rl")

#: config features a driver may implement (registry metadata ``features``): feature -> (its config switch, what it
#: is, for messages)
FEATURES = {"bypass_old_log_prob": ("algorithm.bypass_old_log_prob", ""),
            "filter_groups": ("algorithm.filter_groups.enable", " (DAPO dynamic sampling)"),
            "overlong_buffer": ("reward_model.overlong_buffer.enable", "")}

Get = Callable[[str], Any]  # get(dotted_key) -> value, as the config loader's checks receive it


@dataclasses.dataclass(frozen=True)
class Role:
    """One worker group a driver needs.

    Args:
        worker: the :class:`~hybridflow.controller.Worker` subclass, or its ``"module:Class"`` path (imported only
            when the groups are built, so declaring roles imports no worker code).
        inputs: the function giving the worker's constructor arguments,
            ``inputs(config, total_steps, *args) -> tuple`` (the built-in workers': :mod:`hybridflow.trainer.
            worker_inputs`, each worker's own config section(s) and derived values); None: the worker is built as
            ``worker(config, *args)`` with the whole run config (a user's worker that declares no inputs). Either
            way the group's ``init_model()`` is then called with no arguments.
        args: the role's extra arguments (e.g. which roles an actor worker holds), passed on after ``(config,
            total_steps)`` to ``inputs`` (without ``inputs``: after ``config`` to the worker).
        checkpointed: the group's shards are part of a checkpoint (saved under ``<ckpt>/<role>``).
        strategy_key: the config key naming the training engine the worker builds (its ``strategy``), None when it
            builds none; two roles whose engines keep process-wide state (``process_wide_state`` in
            :data:`hybridflow.training.ENGINES`) are not colocated in one process (``trainer.colocate_roles``).
    """

    worker: Union[str, type]
    inputs: Optional[Callable[..., tuple]] = None
    args: tuple = ()
    checkpointed: bool = False
    strategy_key: Optional[str] = None

    def worker_class(self) -> type:
        """The worker class (imports ``"module:Class"``)."""
        if isinstance(self.worker, type):
            return self.worker
        module, _, name = self.worker.partition(":")
        return getattr(importlib.import_module(module), name)

    def constructor_args(self, config: Any, total_steps: int) -> tuple:
        """The worker's constructor arguments for a run of ``total_steps`` training steps (see ``inputs``)."""
        if self.inputs is None:
            return (config, *self.args)
        return tuple(self.inputs(config, total_steps, *self.args))


class Driver:
    """Base of every driver (see the module docstring for the lifecycle).

    Attributes:
        ROLES: every role name this driver may ask for (``resource_pool.mapping`` accepts the union over drivers).
        CHECKPOINTED_ROLES: those of :attr:`ROLES` whose groups it may checkpoint (a resume checks their ranks).
        global_step: the step being run (set by the loop before each ``step``; the last completed one between).
        data: the data cursor given to :meth:`start` (None before).
    """

    ROLES: tuple[str, ...] = ()
    CHECKPOINTED_ROLES: tuple[str, ...] = ()
    global_step: int = 0
    data: Any = None

    # ------------------------------------------------------------------ declared before Ray (classmethods)
    @classmethod
    def roles(cls, config: Any) -> dict[str, Role]:
        """The worker groups ``config`` needs, by role name (keys within :attr:`ROLES`)."""
        raise NotImplementedError

    @classmethod
    def config_problems(cls, get: Get) -> list[str]:
        """Problems of a config that selects this driver (one line each, led by the dotted key); none by default."""
        return []

    @classmethod
    def build(cls, config: Any, groups: dict[str, Any]) -> "Driver":
        """The driver of a run, from its worker groups (role -> group, as :meth:`roles` asked)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ what a checkpoint holds
    def checkpointed_groups(self) -> dict[str, Any]:
        """Name -> worker group with ``save_checkpoint(path)``/``load_checkpoint(path)`` (saved in
        ``<ckpt>/<name>``); the names are the roles :meth:`roles` marks ``checkpointed``."""
        return {}

    def checkpointed_state(self) -> dict[str, Any]:
        """Name -> driver-side object with ``state_dict()``/``load_state_dict(state)`` (in ``trainer_state.pt``)."""
        return {}

    # ------------------------------------------------------------------ the loop's calls
    def start(self, data: Any, step: int) -> None:
        """Called once by the loop after resuming (``step``: the step training continues from, 0 when fresh),
        before the first :meth:`step`; ``data`` is the loop's data cursor."""
        self.data = data

    def take_batch(self) -> DataProto:
        """The input of the next :meth:`step`: by default the next prompt batch of the cursor."""
        return self.data.next()

    @property
    def data_position(self) -> int:
        """Prompt batches taken from the cursor so far (its position)."""
        return self.data.position

    def next_batch(self) -> DataProto:
        """The next prompt batch of the cursor (advances the data position), e.g. DAPO's extra batches."""
        return self.data.next()

    def batches_in_flight(self) -> int:
        """Prompt batches taken from the cursor but not trained on yet (not counted as consumed in a checkpoint,
        so a resumed run takes them again)."""
        return 0

    def step(self, batch: DataProto) -> dict[str, float]:
        """One iteration of the algorithm on ``batch`` (from :meth:`take_batch`); returns its metrics."""
        raise NotImplementedError

    def validate(self, val_data: DataProto) -> dict[str, float]:
        """Validation metrics (``val/score`` ...) of the current policy on ``val_data``."""
        raise NotImplementedError


def _check_driver(name: str, obj: Any) -> None:
    if not (isinstance(obj, type) and issubclass(obj, Driver)):
        raise TypeError(f"driver {name!r} must be a subclass of hybridflow.trainer.driver.Driver, got {obj!r}")


DRIVERS: Registry = Registry("driver", check=_check_driver, config_section="algorithm")
_ORDER: list[str] = []  # driver names in registration order (built-ins first), for messages
_loaded = False


def register_driver(name: str, **meta: Any) -> Callable[[type], type]:
    """Class decorator registering a :class:`Driver` subclass as ``algorithm.driver=name`` (metadata: see the module
    docstring).

    Raises:
        ValueError: the name is taken by another class.
        TypeError: the class is not a :class:`Driver` subclass, or a ``dataflow`` value is not a ``Dataflow``.
    """
    flows = meta.pop("dataflow", None) or {}
    if flows:  # the auto-mapper's planned algorithms this driver runs (hybridflow.mapping.flows)
        import dataclasses

        from hybridflow.mapping.flows import register_dataflow

        for planned, flow in flows.items():  # the plan writes this driver for it
            register_dataflow(planned, dataclasses.replace(flow, driver=name) if flow.driver is None else flow)
        meta["planned_as"] = tuple(meta.get("planned_as", ())) + tuple(p for p in flows if p not in
                                                                         meta.get("planned_as", ()))
    register = DRIVERS.register(name, **meta)

    def decorator(cls: type) -> type:
        register(cls)
        if name not in _ORDER:
            _ORDER.append(name)
        return cls

    return decorator


def driver_names() -> list[str]:
    """The registered driver names: the built-in ones in the order of :data:`BUILTIN_DRIVER_MODULES`, then the
    others in registration order."""
    driver_registry()

    def rank(name: str) -> int:
        module = getattr(DRIVERS.get(name), "__module__", "")
        return BUILTIN_DRIVER_MODULES.index(module) if module in BUILTIN_DRIVER_MODULES else len(BUILTIN_DRIVER_MODULES)

    return sorted(_ORDER, key=rank)  # stable: registration order within a rank


def driver_registry() -> Registry:
    """:data:`DRIVERS` with the built-in drivers registered (their modules are imported on the first call)."""
    global _loaded
    if not _loaded:
        for module in BUILTIN_DRIVER_MODULES:
            importlib.import_module(module)
        _loaded = True
    return DRIVERS


def get_driver(name: str) -> type:
    """The driver class registered as ``name``.

    Raises:
        UnknownNameError: no such driver (the message lists the registered ones and the nearest).
    """
    return driver_registry().get(name)


def all_roles() -> tuple[str, ...]:
    """Every role any registered driver may ask for, in order of first appearance (drivers in registration
    order)."""
    seen: dict[str, None] = {}
    for name in driver_names():
        seen.update(dict.fromkeys(get_driver(name).ROLES))
    return tuple(seen)


def all_checkpointed_roles() -> tuple[str, ...]:
    """Every role any registered driver may checkpoint, in order of first appearance."""
    return tuple(dict.fromkeys(r for name in driver_names() for r in get_driver(name).CHECKPOINTED_ROLES))


def drivers_with(feature: str) -> list[str]:
    """Names of the registered drivers whose metadata ``features`` holds ``feature`` (registration order)."""
    return [n for n in driver_names() if feature in DRIVERS.meta(n, "features", ())]


def driver_for_plan(algorithm: str) -> Optional[str]:
    """The driver whose metadata ``planned_as`` holds the auto-mapper's workload ``algorithm`` (None: none)."""
    return next((n for n in driver_names() if algorithm in DRIVERS.meta(n, "planned_as", ())), None)


class SharedWithPPO:
    """A driver attribute that lives on the :class:`~hybridflow.trainer.ppo.PPOTrainer` the driver holds as ``self.ppo`` (``global_step``,
    ``data``), so the PPO phases it calls see the loop's step and cursor."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        return self if obj is None else getattr(obj.ppo, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.ppo, self.name, value)

"""The one Registry: metadata, filtered names, nearest-name errors, re-registration rules."""

import pytest

from hybridflow.errors import UserError
from hybridflow.registry import Registry, UnknownNameError


def test_metadata_and_filtered_names():
    reg = Registry("estimator")
    reg.register("gae", needs_values=True)(lambda: 1)
    reg.register("grpo")(lambda: 2)
    assert reg.meta("gae", "needs_values") is True
    assert reg.meta("grpo", "needs_values", False) is False
    assert reg.meta("gae") == {"needs_values": True}
    assert reg.names(needs_values=True) == ["gae"]
    assert reg.names() == ["gae", "grpo"] and len(reg) == 2


def test_unknown_name_lists_known_and_nearest():
    reg = Registry("rollout backend")
    reg.register("vllm")(object)
    reg.register("hf")(int)
    with pytest.raises(UnknownNameError) as err:
        reg.get("vlm")
    assert str(err.value) == "unknown rollout backend 'vlm'; known: hf, vllm (did you mean 'vllm'?)"
    assert isinstance(err.value, (KeyError)) and isinstance(err.value, ValueError)
    assert isinstance(err.value, UserError)
    with pytest.raises(UnknownNameError, match=r"known: hf, vllm$"):
        reg.meta("zzzzzz")


def test_check_refuses_wrong_kind():
    def must_be_class(name, obj):
        if not isinstance(obj, type):
            raise TypeError(f"{name}: expected a class")

    reg = Registry("engine", check=must_be_class)
    with pytest.raises(TypeError, match="x: expected a class"):
        reg.register("x")(len)
    assert "x" not in reg

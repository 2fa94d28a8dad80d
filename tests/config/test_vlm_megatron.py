"""A vision-language model with strategy=megatron is refused when the config is checked (before Ray), one line;
and by the megatron engine at load."""

import pytest

from hybridflow.config import load_config
from hybridflow.config.loader import ConfigError
from hybridflow.models.vlm import VisionModelError, refuse_vision_model
from tests.helpers.vlm import save_tiny_vlm


def test_megatron_with_a_vlm_is_refused(tmp_path):
    path = save_tiny_vlm(str(tmp_path / "vlm"))
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.actor.strategy=megatron"])
    lines = [line for line in str(info.value).splitlines() if "vision-language" in line]
    assert len(lines) == 1  # the actor and its reference share the actor's strategy: one line
    assert "actor_rollout_ref.actor.strategy=megatron" in lines[0] and path in lines[0]
    with pytest.raises(VisionModelError, match=r"^actor: .* is a vision-language model; strategy megatron"):
        refuse_vision_model(path, "megatron", "actor")
    load_config(None, [f"actor_rollout_ref.model.path={path}"])  # fsdp2: accepted

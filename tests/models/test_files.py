"""Weight files hybridflow writes are readable like the files beside them (safetensors alone writes 0600)."""

import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hybridflow.models.files import match_umask, umask_file_mode


@pytest.fixture
def umask():
    """Set the process umask for the test; the previous one is restored after it."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield os.umask
    os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_weights_get_the_umask_mode_of_their_siblings(tmp_path, umask, mask, expected):
    umask(mask)
    assert umask_file_mode() == expected
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    assert _mode(tmp_path / "model.safetensors") == 0o600  # what safetensors does on its own
    changed = match_umask(tmp_path)
    assert changed == ([tmp_path / "model.safetensors"] if expected != 0o600 else [])
    assert _mode(tmp_path / "model.safetensors") == expected == _mode(tmp_path / "config.json")


def test_an_exported_checkpoint_is_readable_under_umask_022(tmp_path, umask):
    import shutil

    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridflow.models.builtin import resolve_model_path
    from hybridflow.models.export import export_checkpoint

    umask(0o022)
    base = resolve_model_path("builtin:tiny-arith")
    actor = tmp_path / "global_step_1" / "actor"
    shutil.copytree(base, actor / "hf", ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(actor))  # as the FSDP2 engine's sharded save
    out = Path(export_checkpoint(str(tmp_path / "global_step_1"), str(tmp_path / "export")))
    assert _mode(out / "model.safetensors") == 0o644 == _mode(out / "config.json")

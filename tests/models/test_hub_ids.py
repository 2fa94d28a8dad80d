"""A Hugging Face hub id as a model path resolves to its snapshot in the hub cache; offline and not cached it is one
line. The cache is built by hand in a temporary directory in huggingface_hub's layout; nothing is downloaded."""

import pytest

from hybridflow.errors import UserError
from hybridflow.models.builtin import BUILTIN_MODELS, HubModelError, is_hub_id, resolve_model_path
from hybridflow.models.hf import load_tokenizer

REVISION = "0123456789abcdef0123456789abcdef01234567"  # a commit hash, as the cache's refs/main holds


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """``<cache>/models--org--tiny/snapshots/<rev>/`` with the tiny-arith files, ``refs/main`` naming ``<rev>``;
    HF_HUB_OFFLINE=1 and HF_HUB_CACHE pointing there (read when a path is resolved, not at import)."""
    import shutil

    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(BUILTIN_MODELS["tiny-arith"], snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # no local folder named org/...
    return snapshot


def test_a_cached_hub_id_resolves_to_its_snapshot_offline(hub_cache):
    assert is_hub_id("org/tiny")
    assert resolve_model_path("org/tiny") == str(hub_cache)
    tokenizer = load_tokenizer("org/tiny")  # what the trainer does with actor_rollout_ref.model.path
    assert tokenizer.decode(tokenizer("1 + 2 = 3")["input_ids"], skip_special_tokens=True) == "1 + 2 = 3"


def test_an_uncached_hub_id_offline_is_one_line(hub_cache):
    with pytest.raises(HubModelError) as info:
        resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct")
    message = str(info.value)
    assert isinstance(info.value, UserError) and isinstance(info.value, FileNotFoundError) and "\n" not in message
    assert "'Qwen/Qwen2.5-0.5B-Instruct'" in message and str(hub_cache.parents[2]) in message
    assert "HF_HUB_OFFLINE=1" in message


def test_local_paths_and_builtins_are_no_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert not is_hub_id("org/local")  # an existing relative folder stays a local path
    assert resolve_model_path("org/local") == "org/local"
    for path in (str(tmp_path / "org" / "name"), "./org/name", "builtin:tiny-arith", "a/b/c", "name"):
        assert not is_hub_id(path), path
    assert resolve_model_path("builtin:tiny-arith") == BUILTIN_MODELS["tiny-arith"]


def test_hybridflow_plan_reads_a_hub_ids_config_from_the_cache(hub_cache):
    """`hybridflow plan --actor org/tiny` sizes the cached snapshot's model, as training would load it; an uncached
    id offline is the hub's one line as a SpecError (plan's error type)."""
    import json

    from hybridflow.mapping.specs import SpecError, get_model

    config = json.loads((hub_cache / "config.json").read_text())
    spec = get_model("org/tiny")
    assert (spec.hidden, spec.layers) == (config["hidden_size"], config["num_hidden_layers"])
    with pytest.raises(SpecError, match="HF_HUB_OFFLINE=1"):
        get_model("nobody/uncached")

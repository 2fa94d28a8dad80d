"""Device, cluster, model and workload specs: presets, parsing, HF configs and their errors."""

import json

import pytest

from hybridflow.mapping.specs import (
    MODEL_PRESETS,
    ClusterSpec,
    ModelSpec,
    SpecError,
    Workload,
    get_device,
    get_model,
    parse_cluster,
)

LLAMA2_7B_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
                    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
                    "vocab_size": 32000, "tie_word_embeddings": False}


def test_parse_cluster():
    c = parse_cluster("16x8:A100-80G")
    assert (c.nodes, c.devices_per_node, c.n_devices, c.device.name) == (16, 8, 128, "A100-80G")
    assert parse_cluster(" 1 x 4 : CPU ").device.name == "cpu"
    with pytest.raises(SpecError, match="NODESxDEVICES"):
        parse_cluster("128:A100")
    with pytest.raises(SpecError, match="presets: A100-80G, H100, H200, cpu"):
        parse_cluster("2x8:V100")
    with pytest.raises(SpecError, match=">= 1 node"):
        ClusterSpec(0, 8, get_device("H100"))
    shared = parse_cluster("1x4:cpu@2")
    assert (shared.n_devices, shared.cores_per_node, str(shared)) == (4, 2, "1x4:cpu@2")
    assert parse_cluster("1x4:cpu").cores_per_node is None and str(parse_cluster("2x8:H100")) == "2x8:H100"
    with pytest.raises(SpecError, match="cores_per_node must be >= 1"):
        parse_cluster("1x4:cpu@0")


def test_device_presets():
    assert get_device("h200").mem_bytes == 141e9 and get_device("H200").mem_bw == 4.8e12
    assert get_device("H100").peak_flops == 989e12
    assert get_device("cpu").dtype_bytes == 4


def test_model_from_hf_config_dir_matches_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B_CONFIG))
    spec = get_model(str(tmp_path))
    assert spec.n_params == MODEL_PRESETS["7B"].n_params == 6_738_415_616
    assert get_model(str(tmp_path / "config.json")).layers == 32


def test_model_errors(tmp_path):
    with pytest.raises(SpecError, match="not a preset .*7B, 13B, 34B, 70B"):
        get_model("8B")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(SpecError, match="missing 'num_attention_heads'"):
        get_model(str(tmp_path))
    with pytest.raises(SpecError, match="divisible"):
        ModelSpec("bad", 2, 100, 3, 1, 10, 10)


def test_value_head_and_tied_embeddings():
    m = MODEL_PRESETS["7B"]
    assert m.n_params - m.as_value_model().n_params == 32000 * 4096 - 4096
    tiny = MODEL_PRESETS["tiny-arith"]  # tied: one vocab x hidden matrix
    assert tiny.n_params == 512 * 128 + 4 * tiny.layer_params + 128


def test_workload_validation():
    w = Workload("grpo", batch=64, n=8)
    assert (w.sequences, w.seq_len, w.roles) == (512, 2048, ("actor", "reference", "reward"))
    with pytest.raises(SpecError, match="unknown algorithm 'dpo'"):
        Workload("dpo")
    with pytest.raises(SpecError, match="batch=0"):
        Workload(batch=0)
    with pytest.raises(SpecError, match="3 equal mini-batches"):
        Workload(batch=64, ppo_updates=3)

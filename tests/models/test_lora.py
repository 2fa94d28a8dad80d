"""LoRA helpers (hybridflow.models.lora), one process: config keys and their validation, which parameters train,
the merged weights against peft's own merge, the reference as the base with adapters disabled, the sync probe.

References are independent of the code under test: peft's ``merge_and_unload``, a separately loaded base model,
and the base architecture's module counts.
"""

import pytest
import torch

pytest.importorskip("peft")

from hybridflow.config import load_config  # noqa: E402
from hybridflow.config.loader import ConfigError  # noqa: E402
from hybridflow.models import lora  # noqa: E402
from hybridflow.models.hf import load_causal_lm  # noqa: E402
from hybridflow.workers.optim import build_optimizer  # noqa: E402

BASE = "builtin:tiny-arith"
LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]


def _wrapped(**overrides):
    cfg = load_config(None, LORA + [f"actor_rollout_ref.model.{k}={v}" for k, v in overrides.items()])
    torch.manual_seed(0)
    model = lora.apply_lora(load_causal_lm(BASE, torch.float32), cfg.actor_rollout_ref.model)
    with torch.no_grad():  # B starts at zero (a no-op adapter): make the adapters do something
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.05)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))


def test_lora_is_off_by_default():
    cfg = load_config(None, [])
    assert cfg.actor_rollout_ref.model.lora_rank == 0 and not lora.lora_enabled(cfg.actor_rollout_ref.model)
    assert cfg.actor_rollout_ref.rollout.lora_sync == "merged"


@pytest.mark.parametrize("overrides,needle", [
    (["actor_rollout_ref.model.lora_rank=-1"], "lora_rank must be >= 0"),
    (LORA + ["actor_rollout_ref.model.lora_alpha=0"], "lora_alpha must be > 0"),
    (LORA + ["actor_rollout_ref.model.lora_dropout=1.0"], "lora_dropout must be in [0, 1)"),
    (LORA + ["actor_rollout_ref.model.target_modules=[]"], "target_modules must be"),
    (LORA + ["actor_rollout_ref.rollout.lora_sync=adapters"], "lora_sync must be one of merged | adapter"),
    (LORA + ["actor_rollout_ref.actor.tensor_model_parallel_size=2"], "tensor_model_parallel_size > 1 is not"),
    (["reward_model.model.lora_rank=4"], "implemented for the actor and the critic"),
    (["critic.model.lora_rank=4", "critic.model.lora_alpha=0"], "critic.model.lora_alpha must be > 0"),
    (["actor_rollout_ref.model.lora_rank=1024", "actor_rollout_ref.rollout.name=vllm",
      "actor_rollout_ref.rollout.lora_sync=adapter"], "vllm rollout: it takes ranks up to 512"),
])
def test_bad_lora_config_is_one_clear_line(overrides, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert needle in str(info.value)


def test_only_adapters_train_and_get_optimizer_state():
    base = load_causal_lm(BASE, torch.float32)
    linears = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    model = _wrapped()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(linears)
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimizer = build_optimizer(model, load_config(None, []).actor_rollout_ref.actor.optim)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 2 * len(linears)


def test_target_and_exclude_modules_are_applied():
    model = _wrapped(target_modules="[q_proj,v_proj]", exclude_modules="[model.layers.0.self_attn.q_proj]")
    names = {n.split(".lora_")[0].removeprefix(lora.PEFT_PREFIX) for n, p in model.named_parameters()
             if p.requires_grad}
    n_layers = model.config.num_hidden_layers
    assert len(names) == 2 * n_layers - 1 and "model.layers.0.self_attn.q_proj" not in names
    assert all(n.endswith(("q_proj", "v_proj")) for n in names)


def test_merged_state_equals_peft_merge_and_logits():
    model = _wrapped().eval()
    ids = _ids()
    with torch.no_grad():
        expected_logits = model(input_ids=ids).logits
    merged = dict(lora.merge_lora_stream(model.state_dict().items(), lora.lora_scaling(model.peft_config["default"])))
    reference = model.merge_and_unload().state_dict()  # peft's own merge (consumes the adapters)
    assert merged.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.allclose(merged[name], value, atol=1e-6, rtol=0), name
    fresh = load_causal_lm(BASE, torch.float32).eval()
    fresh.load_state_dict(merged)
    with torch.no_grad():
        diff = (fresh(input_ids=ids).logits - expected_logits).abs().max()
    assert diff <= 1e-4, diff  # fp32 rounding of (W + sBA)x vs Wx + sB(Ax), |logits| ~ 5


def test_merged_names_layout_matches_merged_stream():
    model = _wrapped()
    scaling = lora.lora_scaling(model.peft_config["default"])
    stream = [(n, tuple(t.shape)) for n, t in lora.merge_lora_stream(model.state_dict().items(), scaling)]
    assert [(n, tuple(t.shape)) for n, t in lora.merged_names(model.state_dict().items())] == stream


def test_disabled_adapter_is_the_base_model():
    model = _wrapped().eval()
    ids = _ids()
    with torch.no_grad():
        base = torch.log_softmax(load_causal_lm(BASE, torch.float32).eval()(input_ids=ids).logits, -1)
        with model.disable_adapter():
            disabled = torch.log_softmax(model(input_ids=ids).logits, -1)
        adapted = torch.log_softmax(model(input_ids=ids).logits, -1)
    assert (disabled - base).abs().max() <= 1e-6
    assert (adapted - base).abs().max() > 1e-3  # the adapters are back on after the context


def test_verify_sync_catches_stale_rollout():
    model = _wrapped().eval()
    scaling = lora.lora_scaling(model.peft_config["default"])
    rollout = load_causal_lm(BASE, torch.float32)  # the initial policy: the adapters never arrived
    with pytest.raises(RuntimeError, match="LoRA weight sync failed"):
        lora.verify_sync(model, rollout, model.config.vocab_size)
    rollout.load_state_dict(dict(lora.merge_lora_stream(model.state_dict().items(), scaling)))
    metrics = lora.verify_sync(model, rollout, model.config.vocab_size)
    assert metrics["sync/verified"] == 1.0 and metrics["sync/probe_max_abs_diff"] <= 1e-5


def test_vllm_adapter_dir_loads_with_peft_and_matches(tmp_path):
    """The adapter directory the vllm backend loads each sync is a plain peft adapter: PeftModel.from_pretrained on
    the base gives the trainer's logits."""
    from peft import PeftModel

    from hybridflow.rollout.vllm_lora import vllm_max_lora_rank, write_peft_adapter

    model = _wrapped().eval()
    count = write_peft_adapter(lora.adapter_items(model.state_dict().items()), 8, 16.0, str(tmp_path))
    assert count == sum(".lora_A." in n or ".lora_B." in n for n, _ in model.named_parameters())
    loaded = PeftModel.from_pretrained(load_causal_lm(BASE, torch.float32), str(tmp_path)).eval()
    ids = _ids()
    with torch.no_grad():
        assert (loaded(input_ids=ids).logits - model(input_ids=ids).logits).abs().max() <= 1e-5
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 512)] == [1, 8, 8, 16, 512]
    with pytest.raises(ValueError, match="above vLLM's largest LoRA rank"):
        vllm_max_lora_rank(513)


def test_rollout_probe_check_cuts_to_the_rollout_context():
    """A rollout whose context is shorter than the probe answers for a prefix; a stale prefix still fails."""
    from hybridflow.models import lora_sync

    model = _wrapped().eval()
    ids = lora.probe_ids(model.config.vocab_size, "cpu")
    expected = lora.greedy_logprobs(model, ids)[1]
    prefix = lora.greedy_logprobs(model, ids[:, :5])[1]  # causal: the first 5 positions of the full probe
    # float rounding only: a 5-token and a full-length forward block their matmuls differently (1.6e-6 seen on a
    # Xeon with AMX, 0 elsewhere)
    assert lora_sync.check_probe(expected, prefix, "float32")["sync/probe_max_abs_diff"] <= 1e-5
    stale = lora.greedy_logprobs(load_causal_lm(BASE, torch.float32), ids[:, :5])[1]
    with pytest.raises(RuntimeError, match="LoRA weight sync failed"):
        lora_sync.check_probe(expected, stale, "float32")


def test_verify_sync_in_bf16_passes_merged_weights_and_catches_a_stale_rollout():
    """bf16 trainer and rollout: the merged weights round differently from the trainer's W x + s B A x (the
    tolerance's reason, docs/how-to/lora.md), a rollout without the adapters is still caught."""
    model = _wrapped().to(torch.bfloat16).eval()
    scaling = lora.lora_scaling(model.peft_config["default"])
    rollout = load_causal_lm(BASE, torch.bfloat16)
    with pytest.raises(RuntimeError, match="LoRA weight sync failed"):
        lora.verify_sync(model, rollout, model.config.vocab_size)
    rollout.load_state_dict(dict(lora.merge_lora_stream(model.state_dict().items(), scaling)))
    metrics = lora.verify_sync(model, rollout, model.config.vocab_size)
    assert metrics["sync/verified"] == 1.0 and metrics["sync/probe_max_abs_diff"] <= lora.PROBE_ATOL["bfloat16"]

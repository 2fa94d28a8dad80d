"""Driver pieces without Ray: prompt uids, the ReMax baseline hand-off, Safe-RLHF's Lagrangian advantage worked
by hand, and what a Safe-RLHF checkpoint carries."""

import math
import os

import numpy as np
import pytest
import torch

from hybridflow.config import load_config
from hybridflow.protocol import DataProto
from hybridflow.trainer.driver import Driver
from hybridflow.trainer.loop import TrainLoop
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.trainer.safe_rlhf import SafeRLHFTrainer
from hybridflow.trainer.steps import compute_advantage


class StubGroup:
    """Stands in for a worker group in checkpoint tests: writes a marker file, remembers what it loaded."""

    def __init__(self):
        self.loaded = None

    def save_checkpoint(self, path):
        os.makedirs(path, exist_ok=True)
        open(os.path.join(path, "marker"), "w").close()

    def load_checkpoint(self, path):
        self.loaded = path


def _prompts(b=3, p=4):
    return DataProto.from_dict(
        tensors={"input_ids": torch.ones(b, p, dtype=torch.long), "attention_mask": torch.ones(b, p, dtype=torch.long),
                 "position_ids": torch.arange(p).expand(b, -1)},
        non_tensors={"ground_truth": np.array(["1", "2", "1"], dtype=object)})


def test_samples_of_a_prompt_share_its_uid_even_with_identical_prompts(tmp_path):
    cfg = load_config("grpo_quickstart", [f"trainer.default_local_dir={tmp_path}"])
    trainer = PPOTrainer(cfg, None, None, None)
    batch = _prompts()  # rows 0 and 2 have identical prompt tensors and ground truth
    prompts = trainer.pop_prompts(batch)
    assert sorted(prompts.batch) == ["attention_mask", "input_ids", "position_ids"]
    uid = batch.repeat(4, interleave=True).non_tensor_batch["uid"]
    assert [len(set(uid[i * 4:(i + 1) * 4])) for i in range(3)] == [1, 1, 1]
    assert len(set(uid)) == 3


def test_compute_advantage_hands_the_greedy_baselines_to_remax():
    cfg = load_config("remax_quickstart")
    data = DataProto.from_dict(tensors={
        "token_level_rewards": torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]),
        "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
        "reward_baselines": torch.tensor([0.25, 1.0])})
    compute_advantage(data, cfg.algorithm)
    # return-to-go minus the sample's greedy baseline, on valid tokens
    assert torch.allclose(data.batch["advantages"], torch.tensor([[0.75, 0.75, 0.0], [-1.0, -1.0, -1.0]]))


def _safe_config(tmp_path, *extra):
    return load_config("safe_rlhf_quickstart", [
        f"trainer.default_local_dir={tmp_path}", "algorithm.kl_ctrl.kl_coef=0.5",
        "algorithm.lagrangian.threshold=0.25", "algorithm.lagrangian.lambda_init=1.0",
        "algorithm.lagrangian.lambda_lr=1.0", *extra])


def test_safe_rlhf_advantage_worked_by_hand(tmp_path):
    trainer = SafeRLHFTrainer(_safe_config(tmp_path), None, None, None, None, None)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    batch = DataProto.from_dict(tensors={
        "response_mask": mask,
        "token_level_scores": torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]]),
        "token_level_cost_scores": torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]),
        "old_log_probs": torch.tensor([[-1.0, -1.0, -1.0], [-0.5, -0.5, 0.0]]),
        "ref_log_prob": torch.tensor([[-1.2, -1.0, -0.8], [-0.5, -0.9, 0.0]]),
        "values": torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.1, 0.0]]),
        "cost_values": torch.tensor([[0.3, 0.3, 0.3], [0.1, 0.0, 0.0]])})
    metrics = trainer.lagrangian_advantages(batch)
    b = batch.batch
    # beta * KL (k1 = old - ref) with beta 0.5: [[0.1, 0, -0.1], [0, 0.2, 0]]
    assert torch.allclose(b["token_level_rewards"], torch.tensor([[-0.1, 0.0, 1.1], [0.0, 0.3, 0.0]]))
    assert torch.allclose(b["token_level_costs"], torch.tensor([[0.1, 0.0, 0.9], [0.0, 0.2, 0.0]]))
    # gamma = lam = 1: returns are the returns-to-go; advantages are returns minus values
    assert torch.allclose(b["returns"], torch.tensor([[1.0, 1.1, 1.1], [0.3, 0.3, 0.0]]))
    assert torch.allclose(b["cost_returns"], torch.tensor([[1.0, 0.9, 0.9], [0.2, 0.2, 0.0]]))
    reward_adv = [0.5, 0.6, 0.6, 0.1, 0.2]  # valid tokens, row-major
    cost_adv = [0.7, 0.6, 0.6, 0.1, 0.2]
    # lambda steps before use: window costs [1, 0] -> mean 0.5 > 0.25 -> log lambda = 0 + 1.0 * 0.25
    lam = math.exp(0.25)
    assert metrics["lagrange/lambda"] == pytest.approx(lam)
    assert metrics["lagrange/window_cost"] == pytest.approx(0.5)
    assert metrics["cost/score/mean"] == pytest.approx(0.5)
    lagrangian = [(r - lam * c) / (1 + lam) for r, c in zip(reward_adv, cost_adv)]
    mean = sum(lagrangian) / 5
    std = math.sqrt(sum((x - mean) ** 2 for x in lagrangian) / 4)
    expected = [(x - mean) / std for x in lagrangian]
    assert torch.allclose(b["advantages"][mask.bool()], torch.tensor(expected), atol=1e-4)
    assert b["advantages"][1, 2] == 0.0


def test_safe_rlhf_checkpoint_carries_the_multiplier_and_the_cost_critic(tmp_path):
    cfg = _safe_config(tmp_path)
    groups = [StubGroup() for _ in range(3)]
    trainer = SafeRLHFTrainer(cfg, *groups, None, None)
    trainer.lagrange.update([1.0, 1.0, 0.0])
    loop = TrainLoop(cfg, trainer)
    loop.global_step = 3
    path = loop.save_checkpoint()
    assert sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d))) == [
        "actor", "cost_critic", "critic"]
    fresh_groups = [StubGroup() for _ in range(3)]
    fresh = SafeRLHFTrainer(cfg, *fresh_groups, None, None)
    assert TrainLoop(cfg, fresh).resume() == 3
    assert fresh.lagrange.state_dict() == trainer.lagrange.state_dict()
    assert [g.loaded for g in fresh_groups] == [os.path.join(path, n) for n in ("actor", "critic", "cost_critic")]


def test_a_driver_without_worker_groups_checkpoints_and_resumes(tmp_path):
    # a user driver that trains nothing in worker groups: the checkpoint holds the config and the loop's state
    cfg = load_config("quickstart", [f"trainer.default_local_dir={tmp_path}"])
    loop = TrainLoop(cfg, Driver())
    loop.global_step = 2
    path = loop.save_checkpoint()
    assert path == os.path.join(str(tmp_path), "global_step_2")
    assert sorted(os.listdir(path)) == ["config.yaml", "trainer_state.pt"]
    assert TrainLoop(cfg, Driver()).resume() == 2


def test_resuming_another_drivers_checkpoint_names_what_is_missing(tmp_path):
    cfg = load_config("quickstart", [f"trainer.default_local_dir={tmp_path}"])
    ppo = TrainLoop(cfg, PPOTrainer(cfg, StubGroup(), StubGroup(), None))
    ppo.global_step = 1
    ppo.save_checkpoint()
    safe_cfg = _safe_config(tmp_path)
    safe = TrainLoop(safe_cfg, SafeRLHFTrainer(safe_cfg, StubGroup(), StubGroup(), StubGroup(), None, None))
    with pytest.raises(KeyError, match=r"no \['lagrange', 'cost_critic'\].*another algorithm.driver"):
        safe.resume()


def test_safe_rlhf_driver_floors_lambda_at_lagrangian_lambda_min(tmp_path):
    trainer = SafeRLHFTrainer(_safe_config(tmp_path, "algorithm.lagrangian.lambda_min=0.5"),
                              None, None, None, None, None)
    # threshold 0.25, lr 1: a zero-cost step would take log lambda from 0 to -0.25 (lambda 0.78), 3 of them to
    # exp(-0.75) = 0.47 < 0.5: held at the floor
    for _ in range(3):
        trainer.lagrange.update([0.0] * 8)
    assert trainer.lagrange.value == pytest.approx(0.5)


class _OverlapActor:
    """The actor's forwards and update on a generated batch (plain DataProto outputs); records the calls."""

    def __init__(self, calls):
        self.calls = calls

    def _logprobs(self, data, *keys):
        self.calls.append("actor_forward")
        zeros = torch.zeros(len(data), data.batch["responses"].shape[1])
        return DataProto.from_dict(tensors={k: zeros for k in keys}, meta_info={f"worker_s/{keys[0]}": 0.5})

    def compute_log_prob(self, data):
        return self._logprobs(data, "old_log_probs")

    def compute_ref_log_prob(self, data):
        return self._logprobs(data, "ref_log_prob")

    def update_actor(self, data):
        self.calls.append("update_actor")
        assert "token_level_scores" in data.batch and "advantages" in data.batch
        return DataProto(meta_info={"metrics": {"actor/pg_loss": 0.0}, "worker_s/update_actor": 0.25})


def test_an_error_of_the_reward_reaches_the_step(tmp_path):
    class FailingReward:
        def compute_rm_score(self, data):
            raise ValueError("the scoring function failed on sample 2")

    cfg = load_config("grpo_quickstart", [f"trainer.default_local_dir={tmp_path}"])
    trainer = PPOTrainer(cfg, _OverlapActor([]), None, FailingReward())
    batch = DataProto.from_dict(tensors={"responses": torch.ones(2, 3, dtype=torch.long),
                                         "response_mask": torch.ones(2, 3, dtype=torch.long)},
                                non_tensors={"uid": np.array(["a", "a"], dtype=object)})
    with pytest.raises(ValueError, match="failed on sample 2"):
        trainer.train_on(batch, {})


class _Mesh:
    dp_size = 2


def test_train_on_balances_the_rows_for_the_actors_dp_ranks(tmp_path):
    class TwoRankActor(_OverlapActor):
        def dispatch_info(self, mesh):
            assert mesh == "actor"
            return _Mesh()

        def update_actor(self, data):
            seen.append(data.batch["attention_mask"].sum(-1).tolist())
            return super().update_actor(data)

    class Reward:
        def compute_rm_score(self, data):
            return DataProto.from_dict(tensors={"token_level_scores": data.batch["response_mask"].float()})

    seen = []
    cfg = load_config("grpo_quickstart", [f"trainer.default_local_dir={tmp_path}"])
    assert cfg.trainer.balance_batch  # verl's default
    lengths = [6, 5, 3, 3]  # 2 prompt tokens + responses of 4, 3, 1, 1: dispatched as is, 11 / 6 tokens per rank
    response_mask = torch.tensor([[1] * (n - 2) + [0] * (6 - n) for n in lengths])
    batch = DataProto.from_dict(
        tensors={"responses": torch.ones(4, 4, dtype=torch.long), "response_mask": response_mask,
                 "attention_mask": torch.cat([torch.ones(4, 2, dtype=torch.long), response_mask], dim=1)},
        non_tensors={"uid": np.array(["a", "b", "c", "d"], dtype=object)})  # one sample per prompt: rows balance
    trainer = PPOTrainer(cfg, TwoRankActor([]), None, Reward())
    out = trainer.train_on(batch, {})
    # by hand: 6 (row 0) -> chunk 0, 5 (row 1) -> chunk 1, 3 (row 2) -> chunk 1 (5 < 6), 3 (row 3) -> chunk 0
    assert seen == [[6, 3, 5, 3]]  # rows 0, 3 | 1, 2: 9 / 8 tokens per rank
    assert out["perf/dp_token_imbalance_before"] == pytest.approx(11 / 8.5)
    assert out["perf/dp_token_imbalance"] == pytest.approx(9 / 8.5)
    assert list(batch.non_tensor_batch["uid"]) == ["a", "d", "b", "c"]




def test_controller_overhead_is_the_step_time_no_worker_method_covers():
    from hybridflow.trainer.steps import add_worker_time, compute_timing_metrics, covered_seconds

    # by hand: [0, 1] and [0.5, 2] join into [0, 2]; [3, 4] is apart; [9, 12] is clipped to the window's end 10
    assert covered_seconds([(3.0, 4.0), (0.5, 2.0), (0.0, 1.0), (9.0, 12.0)], 0.0, 10.0) == pytest.approx(4.0)
    assert covered_seconds([(-5.0, -1.0), (11.0, 12.0)], 0.0, 10.0) == 0.0  # outside the window
    assert covered_seconds([(1.0, 3.0), (1.5, 2.0)], 0.0, 10.0) == pytest.approx(2.0)  # nested
    # a step of 10 s ending at t=110: generation 100-104, values and logprobs overlapping 104-106 (two pools), an
    # update called twice (two critics) 106-107 and 107.5-109: busy 4 + 2 + 1 + 1.5 = 8.5 s -> 15 % overhead,
    # where summing the seconds (4 + 2 + 1.5 + 1 + 1.5 = 10) would have said 0
    meta = {"worker_s/generate_sequences": 4.0, "worker_span/generate_sequences": [(100.0, 104.0)],
            "worker_s/compute_values": 2.0, "worker_span/compute_values": [(104.0, 106.0)],
            "worker_s/compute_log_prob": 1.5, "worker_span/compute_log_prob": [(104.5, 106.0)]}
    add_worker_time(meta, {"worker_s/update_critic": 1.0, "worker_span/update_critic": [(106.0, 107.0)]})
    add_worker_time(meta, {"worker_s/update_critic": 1.5, "worker_span/update_critic": [(107.5, 109.0)]})
    assert meta["worker_s/update_critic"] == 2.5 and len(meta["worker_span/update_critic"]) == 2
    metrics = compute_timing_metrics(meta, 10.0, step_end=110.0)
    assert metrics["timing_s/controller_overhead_frac"] == pytest.approx(0.15)
    assert metrics["timing_worker_s/update_critic"] == 2.5
    # workers that report no spans: step minus the summed seconds
    assert compute_timing_metrics({"worker_s/a": 2.0, "worker_s/b": 3.0}, 10.0)[
        "timing_s/controller_overhead_frac"] == pytest.approx(0.5)

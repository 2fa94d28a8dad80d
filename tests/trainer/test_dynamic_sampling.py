"""DAPO in the PPO driver without Ray: dynamic sampling gathers train_batch_size informative groups over several
generation batches (and the limit cases), the data cursor makes resume continue from the right prompt, and the
overlong penalty depends on the response length alone. The worker groups are small stand-ins that return
hand-chosen responses and scores."""

import os

import numpy as np
import pytest
import torch

from hybridflow.config import load_config
from hybridflow.protocol import DataProto
from hybridflow.trainer.dynamic_sampling import EXTRA_BATCH_SEED_OFFSET, collect_informative_groups
from hybridflow.trainer.loop import DataCursor, TrainLoop
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.trainer.steps import compute_data_metrics

N, R = 2, 4  # samples per prompt, response slots
# the scores of a prompt's 2 samples, by its ground truth: "mixed*" groups are informative, "all*" are not
SCORES = {"all1": [1.0, 1.0], "all0": [0.0, 0.0], "mixed": [1.0, 0.0], "mixed2": [0.0, 1.0], "mixed3": [1.0, 0.0],
          "mixed4": [0.0, 1.0], "mixed5": [1.0, 0.0]}


class FakeActor:
    """Generates full-length responses (N per prompt) and records the sampling seed of every call."""

    def __init__(self, world_size=2):
        self.world_size = world_size
        self.seeds = []

    def generate_sequences(self, prompts):
        self.seeds.append(prompts.meta_info["seed"])
        rows = len(prompts) * N
        mask = torch.ones(rows, R, dtype=torch.long)
        prompt = {k: v.repeat_interleave(N, dim=0) for k, v in prompts.batch.items()}
        return DataProto.from_dict(tensors={
            "prompts": prompt["input_ids"], "responses": torch.ones(rows, R, dtype=torch.long), "response_mask": mask,
            "input_ids": torch.cat([prompt["input_ids"], torch.ones(rows, R, dtype=torch.long)], 1),
            "attention_mask": torch.cat([prompt["attention_mask"], mask], 1),
            "position_ids": torch.cat([prompt["position_ids"], prompt["position_ids"][:, -1:] + 1 + torch.arange(R)], 1)})


class FakeReward:
    """Scores sample j of a prompt with SCORES[ground_truth][j], on the last response token."""

    def compute_rm_score(self, batch):
        mask = batch.batch["response_mask"]
        scores = torch.zeros(mask.shape)
        for i, truth in enumerate(batch.non_tensor_batch["ground_truth"]):
            scores[i, int(mask[i].sum()) - 1] = SCORES[truth][i % N]
        return DataProto.from_dict(tensors={"token_level_scores": scores})


def _prompts(*truths, width=3):
    """Prompts of ``width`` tokens (ids 5), each prompt batch padded to its own width as the data loader does."""
    b = len(truths)
    return DataProto.from_dict(
        tensors={"input_ids": torch.full((b, width), 5), "attention_mask": torch.ones(b, width, dtype=torch.long),
                 "position_ids": torch.arange(width).expand(b, -1)},
        non_tensors={"ground_truth": np.array(truths, dtype=object)})


def _trainer(tmp_path, *overrides, world_size=2):
    cfg = load_config("dapo_quickstart", [
        f"trainer.default_local_dir={tmp_path}", "data.train_batch_size=4", f"actor_rollout_ref.rollout.n={N}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "reward_model.overlong_buffer.enable=false", *overrides])
    return PPOTrainer(cfg, FakeActor(world_size), None, FakeReward())


def _collect(trainer, first, *more):
    trainer.start(DataCursor(lambda position: iter(more)), 0)
    return collect_informative_groups(trainer, first, {})


def test_gathers_train_batch_size_informative_groups_over_generation_batches(tmp_path):
    trainer = _trainer(tmp_path)
    # batch 1: groups 0 and 2 informative (2 of the 4 wanted); batch 2: groups 1, 2, 3 informative -> 2 of them kept
    batch, metrics = _collect(trainer, _prompts("mixed", "all1", "mixed2", "all0"),
                              _prompts("all1", "mixed3", "mixed4", "mixed5", width=5),
                              _prompts("mixed", "mixed", "mixed", "mixed"))
    truths = batch.non_tensor_batch["ground_truth"].tolist()
    assert truths == ["mixed", "mixed", "mixed2", "mixed2", "mixed3", "mixed3", "mixed4", "mixed4"]
    uid = batch.non_tensor_batch["uid"]
    assert len(set(uid)) == 4 and all(uid[2 * g] == uid[2 * g + 1] for g in range(4))
    assert metrics == {"dapo/gen_batches": 2.0, "dapo/filtered_groups": 3.0, "dapo/informative_groups": 5.0,
                       "dapo/trained_groups": 4.0}
    assert trainer.data_position == 1  # one extra prompt batch consumed (the third was never touched)
    base = trainer.config.trainer.seed * 100003
    # the first batch samples with the step's seed (as without filtering), the extra one with its data position's
    assert trainer.actor.seeds == [base + 0, base + EXTRA_BATCH_SEED_OFFSET + 1]
    assert batch.batch["token_level_scores"].sum(-1).tolist() == [1, 0, 0, 1, 1, 0, 0, 1]
    # the 3-token prompts of the first batch are left-padded to the second batch's 5 (attention 0, position 0)
    b = batch.batch
    assert b["prompts"].shape == (8, 5) and b["input_ids"].shape == b["attention_mask"].shape == (8, 5 + R)
    assert b["attention_mask"][:4].tolist() == [[0, 0, 1, 1, 1] + [1] * R] * 4
    assert b["attention_mask"][4:].tolist() == [[1] * (5 + R)] * 4
    assert b["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6]
    assert b["input_ids"][0, 2:].tolist() == [5, 5, 5, 1, 1, 1, 1]


def test_at_the_limit_on_limit_error_stops_with_a_clear_message(tmp_path):
    trainer = _trainer(tmp_path, "algorithm.filter_groups.max_num_gen_batches=2",
                       "algorithm.filter_groups.on_limit=error")
    with pytest.raises(RuntimeError, match=r"3 of the 4 groups .*max_num_gen_batches=2 generation batches; raise"):
        _collect(trainer, _prompts("mixed", "all1", "mixed2", "all0"), _prompts("all1", "all0", "mixed3", "all1"))


def test_at_the_limit_train_on_the_groups_found(tmp_path):
    trainer = _trainer(tmp_path, "algorithm.filter_groups.max_num_gen_batches=2",
                       "algorithm.filter_groups.on_limit=train")
    batch, metrics = _collect(trainer, _prompts("mixed", "all1", "mixed2", "all0"),
                              _prompts("all1", "all0", "mixed3", "all1"))
    assert batch.non_tensor_batch["ground_truth"].tolist() == ["mixed", "mixed", "mixed2", "mixed2", "mixed3", "mixed3"]
    assert metrics["dapo/gen_batches"] == 2.0 and metrics["dapo/trained_groups"] == 3.0
    assert metrics["dapo/filtered_groups"] == 5.0


def test_a_short_batch_is_cut_to_whole_groups_that_split_over_the_ranks(tmp_path):
    # 3 informative groups = 6 rows do not split over 4 ranks: 2 groups (4 rows) are trained on
    trainer = _trainer(tmp_path, "algorithm.filter_groups.max_num_gen_batches=1",
                       "algorithm.filter_groups.on_limit=train", "trainer.n_gpus_per_node=1", world_size=4)
    batch, metrics = _collect(trainer, _prompts("mixed", "mixed2", "all1", "mixed3"))
    assert batch.non_tensor_batch["ground_truth"].tolist() == ["mixed", "mixed", "mixed2", "mixed2"]
    assert metrics["dapo/informative_groups"] == 3.0 and metrics["dapo/trained_groups"] == 2.0


def test_no_informative_group_at_the_limit_trains_on_the_last_batch(tmp_path):
    trainer = _trainer(tmp_path, "algorithm.filter_groups.max_num_gen_batches=1",
                       "algorithm.filter_groups.on_limit=train")
    batch, metrics = _collect(trainer, _prompts("all1", "all0", "all1", "all0"))
    assert len(batch) == 8 and metrics["dapo/informative_groups"] == 0.0 and metrics["dapo/filtered_groups"] == 4.0


class StubGroup:
    def save_checkpoint(self, path):
        os.makedirs(path, exist_ok=True)

    def load_checkpoint(self, path):
        pass


class ConsumingDriver(PPOTrainer):
    """A driver whose step pulls one extra prompt batch, as dynamic sampling does; records the batches seen."""

    def __init__(self, cfg):
        super().__init__(cfg, StubGroup(), None, None)
        self.seen = []

    def step(self, batch):
        self.seen += [batch.meta_info["position"], self.next_batch().meta_info["position"]]
        return {}


class NullTracker:
    def log(self, metrics, step):
        pass


def _positions(start):
    for position in range(start, 1000):
        yield DataProto.from_dict(tensors={"x": torch.zeros(1)}, meta_info={"position": position})


def _fit(tmp_path, steps):
    cfg = load_config("dapo_quickstart", [f"trainer.default_local_dir={tmp_path}", "trainer.save_freq=1"])
    driver = ConsumingDriver(cfg)
    loop = TrainLoop(cfg, driver, NullTracker())
    loop.fit(_positions, None, steps)
    return loop, driver.seen


def test_resume_continues_from_the_checkpointed_data_position(tmp_path):
    _, uninterrupted = _fit(tmp_path / "full", 3)
    first, seen_before = _fit(tmp_path / "parts", 2)
    assert first.consumed() == 4  # 2 steps x 2 batches: the position is not the step
    resumed, seen_after = _fit(tmp_path / "parts", 3)
    assert resumed.global_step == 3
    assert seen_before + seen_after == uninterrupted == [0, 1, 2, 3, 4, 5]


def test_overlong_penalty_uses_the_response_length_whatever_the_prompt(tmp_path):
    cfg = load_config("dapo_quickstart", [f"trainer.default_local_dir={tmp_path}", "data.max_response_length=8",
                                          "reward_model.overlong_buffer.len=4"])
    trainer = PPOTrainer(cfg, None, None, FakeReward())
    lengths = torch.tensor([3, 4, 6, 8, 8])  # buffer 4 of 8: 0, 0, (4 - 6) / 4, -1, -1
    response_mask = (torch.arange(8)[None] < lengths[:, None]).long()
    truncated = torch.tensor([False, False, False, True, False])  # the last one ended with an eos in slot 8
    results = []
    for prompt_len in (2, 9):
        batch = DataProto.from_dict(
            tensors={"response_mask": response_mask, "truncated": truncated,
                     "attention_mask": torch.cat([torch.ones(5, prompt_len, dtype=torch.long), response_mask], 1)},
            non_tensors={"ground_truth": np.array(["all1"] * 5, dtype=object)})
        trainer.add_scores(batch, trainer.reward.compute_rm_score(batch))
        results.append(batch)
    for batch in results:
        assert batch.batch["overlong_penalty"].tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]
        # the task score 1 sits on the last response token; the penalty is added to it
        assert batch.batch["token_level_scores"].sum(-1).tolist() == [1.0, 1.0, 0.5, 0.0, 0.0]
        assert batch.batch["token_level_scores"][2, 5].item() == 0.5
    b = results[1]
    b.batch["token_level_rewards"] = b.batch["token_level_scores"]
    b.batch["advantages"] = b.batch["returns"] = torch.zeros(5, 8)
    metrics = compute_data_metrics(b)
    assert metrics["dapo/overlong_penalty_mean"] == pytest.approx(-2.5 / 5)
    assert metrics["dapo/overlong_penalised_frac"] == pytest.approx(3 / 5)
    assert metrics["response_length/clip_ratio"] == pytest.approx(1 / 5)  # the rollout's flag, not length == 8

"""``hybridflow eval``: score a saved model on parquet prompts in-process, checked against a slow reference.

The model is a tiny random GPT-2 with a word-level tokenizer that has no chat template (so prompts are plain
text with BOS prepended) and no pad token (GPT-2 style: bos = eos = ``<|endoftext|>``). The rows use two
test-only data sources scored by exact match, and half of the ground truths are set to the model's own greedy
response computed one prompt at a time with ``transformers``' ``generate`` (no batching, no left padding), so
the expected ``mean@1`` is known in advance.
"""

import json
import logging
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from hybridflow.cli import main as cli_main
from hybridflow.evaluation import evaluate
from hybridflow.rewards import REWARD_REGISTRY, register_reward
from hybridflow.rollout import HFRollout, register_rollout
from hybridflow.rollout.base import _ROLLOUT_REGISTRY

WORDS = ["<|endoftext|>", "<unk>"] + "what is one two three four five plus minus the cat dog sat on a mat".split()
SOURCES = ("test/exact-a", "test/exact-b")
NO_MATCH = "\u0000never generated"
RESPONSE_LENGTH = 6
PROMPTS = [  # (data source, question, ground truth is the reference greedy response?)
    ("test/exact-a", "what is one plus two", True),
    ("test/exact-a", "the cat sat on a mat", True),
    ("test/exact-a", "what is five minus three plus one plus one", True),
    ("test/exact-a", "dog", False),
    ("test/exact-b", "the dog sat on the cat", True),
    ("test/exact-b", "four plus four", False),
]


@pytest.fixture(scope="module", autouse=True)
def exact_match_rewards():
    register_reward(*SOURCES)(lambda source, response, truth, extra=None: float(response.strip() == truth))
    yield
    for source in SOURCES:
        REWARD_REGISTRY.pop(source)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>",
                                        eos_token="<|endoftext|>", unk_token="<unk>")
    tokenizer.save_pretrained(path)
    config = GPT2Config(vocab_size=len(WORDS), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0, initializer_range=0.5)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


def reference_greedy(model_dir, question):
    """One prompt, ``transformers.generate``: plain prompt text with BOS in front (no chat template)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    model = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    ids = torch.tensor([[tokenizer.bos_token_id] + tokenizer(question, add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=RESPONSE_LENGTH, do_sample=False,
                         eos_token_id=0, pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


@pytest.fixture(scope="module")
def data_file(model_dir, tmp_path_factory):
    rows = []
    for i, (source, question, matches) in enumerate(PROMPTS):
        truth = reference_greedy(model_dir, question) if matches else NO_MATCH
        rows.append({"data_source": source, "prompt": [{"role": "user", "content": question}], "ability": "test",
                     "reward_model": {"style": "rule", "ground_truth": truth},
                     "extra_info": {"split": "test", "index": i}})
    path = tmp_path_factory.mktemp("data") / "test.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_greedy_mean_at_1_matches_reference(model_dir, data_file, tmp_path):
    out = tmp_path / "responses.jsonl"
    result = evaluate(str(model_dir), str(data_file), batch_size=4, max_response_length=RESPONSE_LENGTH,
                      output=out)
    assert result["num_prompts"] == 6 and result["num_filtered"] == 0
    assert result["mean@1"] == pytest.approx(4 / 6)
    assert result["by_data_source"] == {"test/exact-a": {"num_prompts": 4, "mean@1": 0.75},
                                        "test/exact-b": {"num_prompts": 2, "mean@1": 0.5}}
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["pass"], r["sample"]) for r in lines] == [(i, "greedy", 0) for i in range(6)]
    assert [r["score"] for r in lines] == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert lines[0]["prompt"] == "what is one plus two"  # no chat template: the plain content


def test_cli_mean_at_k_with_sampling(model_dir, data_file, tmp_path, capsys):
    out = tmp_path / "responses.jsonl"
    argv = ["eval", str(model_dir), str(data_file), "--n", "3", "--temperature", "1.0", "--batch-size", "4",
            "--max-response-length", str(RESPONSE_LENGTH), "--seed", "7", "--output", str(out)]
    assert cli_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mean@1"] == pytest.approx(4 / 6)  # the greedy pass is still there
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    sampled = [r for r in lines if r["pass"] == "sampled"]
    assert len(sampled) == 6 * 3 and sorted({r["sample"] for r in sampled}) == [0, 1, 2]
    assert result["mean@3"] == pytest.approx(sum(r["score"] for r in sampled) / 18)
    for source, count in (("test/exact-a", 4), ("test/exact-b", 2)):
        rows = [r["score"] for r in sampled if r["data_source"] == source]
        assert len(rows) == 3 * count
        assert result["by_data_source"][source]["mean@3"] == pytest.approx(sum(rows) / len(rows))
    # pass@k from the written scores by the closed form of n = 3 (c correct): pass@1 = c/3,
    # pass@2 = 1 - C(3-c, 2)/C(3, 2) (0 correct of the 2 drawn), pass@3 = [c > 0]; on 0/1 scores best@k == pass@k
    by_prompt: dict = {}
    for r in sampled:
        by_prompt.setdefault((r["data_source"], r["index"]), []).append(r["score"])
    closed = {1: lambda c: c / 3, 2: lambda c: 1 - {0: 3, 1: 1, 2: 0, 3: 0}[c] / 3, 3: lambda c: float(c > 0)}
    for k, form in closed.items():
        values = [form(int(sum(s))) for s in by_prompt.values()]
        assert result[f"pass@{k}"] == pytest.approx(sum(values) / len(values)), k
        if k >= 2:
            assert result[f"best@{k}"] == pytest.approx(result[f"pass@{k}"]), k
        a = [form(int(sum(s))) for (src, _), s in by_prompt.items() if src == "test/exact-a"]
        assert result["by_data_source"]["test/exact-a"][f"pass@{k}"] == pytest.approx(sum(a) / len(a)), k
    assert "maj@3" not in result  # the test's exact-match rewards extract no answers: nothing votes
    # same seed -> same samples
    assert cli_main(argv) == 0
    assert json.loads(capsys.readouterr().out)["mean@3"] == result["mean@3"]


def test_prompt_and_response_beyond_the_models_positions_is_one_line(model_dir, data_file):
    """The tiny GPT-2 has 64 positions; the longest prompt is 10 tokens (9 words + BOS): 10 + 60 = 70 > 64."""
    with pytest.raises(ValueError) as info:
        evaluate(str(model_dir), str(data_file), max_response_length=60)
    message = str(info.value)
    assert "\n" not in message and "10" in message and "60 = 70" in message
    assert "max_position_embeddings=64" in message and "--max-response-length" in message
    evaluate(str(model_dir), str(data_file), max_response_length=54)  # 10 + 54 = 64 fits


def test_filtering_long_prompts_is_counted(model_dir, data_file):
    # "what is five minus three plus one plus one" is 9 words + BOS = 10 tokens; every other prompt is <= 7
    result = evaluate(str(model_dir), str(data_file), max_prompt_length=8, truncation="filter",
                      max_response_length=RESPONSE_LENGTH)
    assert (result["num_prompts"], result["num_filtered"]) == (5, 1)
    assert result["mean@1"] == pytest.approx(3 / 5)


def test_cli_errors(model_dir, data_file, tmp_path, capsys):
    assert cli_main(["eval", str(model_dir), str(data_file), "--n", "2"]) == 1
    assert "needs temperature > 0" in capsys.readouterr().err
    rows = [{"data_source": "nobody/registered", "prompt": "what is one", "reward_model": {"ground_truth": "1"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    assert cli_main(["eval", str(model_dir), str(tmp_path / "bad.parquet"), "--max-response-length", "2"]) == 1
    err = capsys.readouterr().err
    assert "'nobody/registered'" in err and "openai/gsm8k" in err
    assert cli_main(["eval", str(tmp_path / "no-model"), str(data_file)]) == 1
    assert "not a local directory" in capsys.readouterr().err


class CountingRollout(HFRollout):
    """The hf backend, registered under another name, recording the prompts of every generate call."""

    calls: list[int] = []

    def generate_sequences(self, prompts):
        CountingRollout.calls.append(len(prompts))
        return super().generate_sequences(prompts)


@pytest.fixture
def counting_rollout():
    register_rollout("test-counting")(CountingRollout)
    CountingRollout.calls = []
    yield CountingRollout
    _ROLLOUT_REGISTRY.pop("test-counting")


def test_cli_rollout_selects_the_registered_backend_with_progress(model_dir, data_file, counting_rollout, capsys,
                                                                  caplog):
    argv = ["eval", str(model_dir), str(data_file), "--rollout", "test-counting", "--batch-size", "4",
            "--max-response-length", str(RESPONSE_LENGTH)]
    with caplog.at_level(logging.INFO, logger="hybridflow.utils.progress"):
        assert cli_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert counting_rollout.calls == [4, 2]  # 6 prompts in batches of 4, through the selected backend
    assert result["mean@1"] == pytest.approx(4 / 6) and result["settings"]["rollout"] == "test-counting"
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("eval (greedy, mean@1): 6/6 prompts (100%)") and "ETA" in line for line in lines)


def _validation_parts(model_dir, data_file, rollout_cls, micro_batch_size):
    """What validate() takes, in-process: a greedy rollout of the tiny model (``rollout_cls``), a reward group
    stand-in scoring with the rule reward the reward worker runs, and the whole data file as one batch."""
    from hybridflow.data.dataset import RLHFDataset, collate_fn, load_rows
    from hybridflow.protocol import DataProto
    from hybridflow.rewards.batch import score_batch
    from hybridflow.workers.reward_worker import place_scores

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tokenizer.pad_token_id = tokenizer.eos_token_id
    model = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    sampling = types.SimpleNamespace(response_length=RESPONSE_LENGTH, n=1, do_sample=False, temperature=0.0,
                                     top_p=1.0, top_k=-1, micro_batch_size=micro_batch_size)
    actor = rollout_cls(model, sampling, eos_token_id=0, pad_token_id=0)

    class Reward:
        def compute_rm_score(self, rows):
            scores = torch.tensor(score_batch(tokenizer, rows))
            return DataProto.from_dict(tensors={"token_level_scores": place_scores(scores,
                                                                                   rows.batch["response_mask"])})

    dataset = RLHFDataset(load_rows(str(data_file)), tokenizer, 64)
    return actor, Reward(), collate_fn([dataset[i] for i in range(len(dataset))], 0)


def test_eval_equals_validation(model_dir, data_file):
    """The same model and data through validate() (the training run's validation) and evaluate()."""
    from hybridflow.config import load_config
    from hybridflow.trainer.validate import validate

    config = load_config("quickstart", [f"data.max_response_length={RESPONSE_LENGTH}", "data.val_batch_size=4"])
    actor, reward, val_data = _validation_parts(model_dir, data_file, HFRollout, 4)
    metrics = validate(config, actor, reward, val_data)
    result = evaluate(str(model_dir), str(data_file), batch_size=4, max_response_length=RESPONSE_LENGTH)
    assert metrics["val/score"] == pytest.approx(result["mean@1"]) == pytest.approx(4 / 6)
    for source in SOURCES:
        assert metrics[f"val/score/{source}"] == pytest.approx(result["by_data_source"][source]["mean@1"])


def test_validation_runs_in_batches_of_train_batch_size_with_progress(model_dir, data_file, counting_rollout,
                                                                      caplog):
    """Without data.val_batch_size, validation generates data.train_batch_size prompts at a time (a progress line
    per batch off a terminal) and scores exactly what one batch of all 6 prompts scores (greedy: 4 of 6 match)."""
    from hybridflow.config import load_config
    from hybridflow.trainer.validate import validate

    actor, reward, val_data = _validation_parts(model_dir, data_file, counting_rollout, 8)
    small = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "critic.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
             "critic.ppo_micro_batch_size_per_gpu=2", f"data.max_response_length={RESPONSE_LENGTH}"]
    with caplog.at_level(logging.INFO, logger="hybridflow.utils.progress"):
        chunked = validate(load_config("quickstart", small), actor, reward, val_data)
    assert counting_rollout.calls == [4, 2]  # 6 prompts, 4 per batch
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("validation (greedy): ")]
    assert len(lines) == 2  # off a terminal: one line at the first batch, one at the end
    assert lines[0].startswith("validation (greedy): 4/6 prompts (67%)")
    assert lines[1].startswith("validation (greedy): 6/6 prompts (100%)")
    counting_rollout.calls.clear()
    whole = validate(load_config("quickstart", [*small, "data.val_batch_size=6"]), actor, reward, val_data)
    assert counting_rollout.calls == [6]
    assert chunked == whole
    assert chunked["val/score"] == pytest.approx(4 / 6)
    assert chunked["val/score/test/exact-a"] == pytest.approx(3 / 4)
    assert chunked["val/score/test/exact-b"] == pytest.approx(1 / 2)


USER_REWARD = '''
def by_truth(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(ground_truth)) + (0.5 if data_source == "nobody/registered" else 0.0)
'''
PLUGIN = '''
from hybridflow.rewards import register_reward

@register_reward("test/plugin-source")
def seven(data_source, solution_str, ground_truth, extra_info=None):
    return 7.0
'''


@pytest.fixture
def unregistered_data(tmp_path):
    """3 prompts of a data source no reward is registered for, ground truths of 1, 2 and 3 characters."""
    rows = [{"data_source": "nobody/registered", "prompt": "what is one", "reward_model": {"ground_truth": truth},
             "extra_info": {"index": i}} for i, truth in enumerate(["a", "bb", "ccc"])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "unregistered.parquet")
    return tmp_path / "unregistered.parquet"


def test_cli_compute_score_and_max_samples(model_dir, unregistered_data, tmp_path, capsys):
    (tmp_path / "my_reward.py").write_text(USER_REWARD)
    base = ["eval", str(model_dir), str(unregistered_data), "--max-response-length", "2"]
    assert cli_main(base) == 1  # the rule rewards know no such data source
    assert "no reward registered for data_source 'nobody/registered'" in capsys.readouterr().err
    assert cli_main([*base, "--compute-score", f"{tmp_path / 'my_reward.py'}:by_truth"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_prompts"] == 3 and result["mean@1"] == pytest.approx((1 + 2 + 3) / 3 + 0.5)
    assert cli_main([*base, "--compute-score", f"{tmp_path / 'my_reward.py'}:by_truth", "--max-samples", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_prompts"] == 2 and result["mean@1"] == pytest.approx((1 + 2) / 2 + 0.5)
    assert cli_main([*base, "--max-samples", "0"]) == 1
    assert capsys.readouterr().err == "error: max_samples must be -1 (all rows) or >= 1, got 0\n"


@pytest.fixture
def plugin_file(tmp_path):
    import sys

    path = tmp_path / "reward_plugin.py"
    path.write_text(PLUGIN)
    yield path
    if "test/plugin-source" in REWARD_REGISTRY:
        REWARD_REGISTRY.pop("test/plugin-source")
    sys.modules.pop("hybridflow_plugin_reward_plugin", None)


def test_plugins_register_a_reward_for_eval(model_dir, plugin_file, tmp_path):
    rows = [{"data_source": "test/plugin-source", "prompt": "the cat", "reward_model": {"ground_truth": "x"}}] * 2
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "plugin.parquet")
    result = evaluate(str(model_dir), str(tmp_path / "plugin.parquet"), max_response_length=2,
                      plugins=[str(plugin_file)])
    assert result["mean@1"] == 7.0 and result["by_data_source"]["test/plugin-source"]["num_prompts"] == 2


def test_cli_ctrl_c_keeps_the_partial_output(model_dir, data_file, tmp_path, capsys, monkeypatch):
    calls = []
    generate = HFRollout.generate_sequences

    def interrupted_after_one_batch(self, prompts):
        calls.append(len(prompts))
        if len(calls) > 1:
            raise KeyboardInterrupt
        return generate(self, prompts)

    monkeypatch.setattr(HFRollout, "generate_sequences", interrupted_after_one_batch)
    out = tmp_path / "partial.jsonl"
    argv = ["eval", str(model_dir), str(data_file), "--batch-size", "4", "--max-response-length",
            str(RESPONSE_LENGTH), "--output", str(out)]
    assert cli_main(argv) == 130
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"interrupted: scored 4/6 prompts in pass greedy; the partial output (4 responses) is "
                            f"in {out}\n")
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in lines] == [0, 1, 2, 3]
    assert [r["score"] for r in lines] == [1.0, 1.0, 1.0, 0.0]  # the first 4 prompts: 3 match their reference


def test_cli_model_dir_without_tokenizer_files(data_file, tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}\n')
    assert cli_main(["eval", str(tmp_path), str(data_file)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: no tokenizer files in {tmp_path}: expected tokenizer.json")
    assert "tokenizer_config.json" in err and err.endswith("it holds config.json\n")
    assert "sentencepiece" not in err

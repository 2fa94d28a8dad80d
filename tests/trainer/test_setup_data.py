"""``build_data`` / ``load_split`` in-process (no Ray): row limits, over-long prompts over several files, data and
tokenizer errors naming their config key.

The model directory holds only a word-level tokenizer without a chat template, so a plain-string prompt of k words
is k + 1 tokens (BOS first): every expected length below is counted by hand.
"""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hybridflow.config import ConfigError, load_config
from hybridflow.errors import DataError, UserError
from hybridflow.trainer.setup import _tokenizer, build_data

WORDS = ["<pad>", "<unk>", "<s>", "</s>", "one", "two", "plus"]
SMALL = ["trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1", "critic.ppo_mini_batch_size=1",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "critic.ppo_micro_batch_size_per_gpu=1"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)
    return path


def _write(path, prompts):
    rows = [{"data_source": "hybridflow/arith", "prompt": p, "reward_model": {"style": "rule", "ground_truth": "2"},
             "extra_info": {"index": i}} for i, p in enumerate(prompts)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _config(tokenizer_dir, train, val, *extra):
    return load_config("quickstart", [f"actor_rollout_ref.model.path={tokenizer_dir}", f"data.train_files={train}",
                                      f"data.val_files={val}", "data.train_batch_size=1", "data.max_prompt_length=4", *SMALL,
                                      *extra])


def test_max_samples_keep_the_first_rows_before_shuffling(tokenizer_dir, tmp_path):
    train = _write(tmp_path / "train.parquet", ["one"] * 5)
    val = _write(tmp_path / "val.parquet", ["two"] * 4)
    batches, val_data, steps = build_data(_config(tokenizer_dir, train, val, "data.train_max_samples=3",
                                                  "data.val_max_samples=2"))
    assert steps == 3  # 3 rows kept, 1 prompt per step
    it = batches(0)
    seen = sorted(int(next(it).non_tensor_batch["index"][0]) for _ in range(steps))
    assert seen == [0, 1, 2]  # one (shuffled) epoch over the first 3 rows only
    assert val_data.non_tensor_batch["index"].tolist() == [0, 1]
    _, all_val, all_steps = build_data(_config(tokenizer_dir, train, val))  # -1 (default): every row
    assert (all_steps, len(all_val)) == (5, 4)


@pytest.mark.parametrize("value", [0, -2])
def test_max_samples_zero_or_below_minus_one_is_a_config_error(value):
    with pytest.raises(ConfigError) as info:
        load_config("quickstart", [f"data.val_max_samples={value}"])
    assert info.value.problems == [f"data.val_max_samples: must be -1 (all rows) or >= 1, got {value}"]


def test_over_long_prompts_of_several_files_are_one_line_naming_the_longest(tokenizer_dir, tmp_path):
    train = _write(tmp_path / "train.parquet", ["one"] * 2)
    # tokens with BOS: a: 2, 6, 4; b: 3, 7, 5 -> 3 rows over 4, the longest (7) is b.parquet row 1
    a = _write(tmp_path / "a.parquet", ["one", "one two one two plus", "one two plus"])
    b = _write(tmp_path / "b.parquet", ["one two", "one two one two plus one", "one two one two"])
    with pytest.raises(DataError) as info:
        build_data(_config(tokenizer_dir, train, f"[{a},{b}]"))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"data.val_files: {b} row 1: prompt has 7 tokens > max_prompt_length=4")
    for text in ("3 of 6 prompts", "data.max_prompt_length >= 7", "data.truncation (one of error, left, right, filter)"):
        assert text in message


def test_a_missing_data_file_names_the_key(tokenizer_dir, tmp_path):
    val = _write(tmp_path / "val.parquet", ["one"])
    missing = tmp_path / "nowhere.parquet"
    with pytest.raises(DataError) as info:
        build_data(_config(tokenizer_dir, missing, val))
    assert str(info.value) == f"data.train_files: parquet file not found: {missing}"


def test_a_model_directory_without_tokenizer_files_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}\n')
    with pytest.raises(UserError) as info:
        _tokenizer(str(tmp_path), False)
    message = str(info.value)
    assert "\n" not in message and message.startswith("actor_rollout_ref.model.path / tokenizer_path: ")
    assert f"no tokenizer files in {tmp_path}" in message and message.endswith("it holds config.json")
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json"):
        assert name in message
    with pytest.raises(UserError, match=f"no tokenizer files in {tmp_path}"):  # the same through build_data
        build_data(load_config("quickstart", [f"actor_rollout_ref.model.path={tmp_path}"]))

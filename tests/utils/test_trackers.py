"""Tracker backends against the real libraries in their offline/local modes: what each stored, read back with the
library's own reader (or its documented file format), equals metrics.jsonl; the config is the hyper-parameters.

wandb offline and swanlab offline write a LevelDB-log journal of protobuf records (``run-<id>.wandb`` /
``run-<id>.swanlab``: a 7-byte file header, then 32 KiB blocks of records framed as crc32 (4 bytes), length (2),
type (1: full, 2: first, 3: middle, 4: last)); ``_journal_records`` reads that framing and the libraries' own
protobuf classes decode the records. mlflow is read through ``MlflowClient`` from a file store; tensorboard
through its ``EventAccumulator``.
"""

import json
import math
import struct

import pytest
import yaml
from omegaconf import OmegaConf

from helpers.quickstart_run import tracker_env
from hybridflow.config import ConfigError, load_config
from hybridflow.utils.tracking import Tracking

BLOCK, HEADER = 32 * 1024, 7

CONFIG = OmegaConf.create({"trainer": {"project_name": "proj", "seed": 3, "dir": "out/${trainer.project_name}"},
                          "data": {"sizes": [1, 2], "lr": 0.5}})
# the hyper-parameters a flat tracker must get: dotted keys, the interpolation resolved, lists as their str
FLAT_CONFIG = {"trainer.project_name": "proj", "trainer.seed": 3, "trainer.dir": "out/proj",
               "data.sizes": "[1, 2]", "data.lr": 0.5}
# val/score next to val/score/arith: a name that is another's prefix (MLflow's file store keeps names as paths)
STEPS = {1: {"critic/score/mean": 0.1, "rollout/kl": 0.003, "val/mean@2": 0.7, "val/score": 0.5,
             "val/score/arith": 0.25},
         2: {"critic/score/mean": 0.30000000000000004, "rollout/kl": -1e-5, "timing_s/step": 2.5}}


def _journal_records(path):
    """The records of a LevelDB-log journal (wandb's .wandb, swanlab's .swanlab), as bytes."""
    data = path.read_bytes()
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is zero padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    return records


def _jsonl_scalars(run_dir):
    """(step, metric) -> value of every metrics.jsonl line."""
    scalars = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        step = row.pop("step")
        row.pop("timestamp")  # the row's wall-clock time: metrics.jsonl's own field, no tracker scalar
        scalars.update({(step, name): value for name, value in row.items()})
    return scalars


def _assert_same(read_back, expected, rel=0.0):
    assert sorted(read_back) == sorted(expected)
    for key, value in expected.items():
        got = read_back[key]
        assert (math.isnan(got) and math.isnan(value)) or got == pytest.approx(value, rel=rel, abs=0), key


def _wandb_scalars_and_config(run_dir):
    from wandb.proto import wandb_internal_pb2

    (journal,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    scalars, config = {}, {}
    for raw in _journal_records(journal):
        record = wandb_internal_pb2.Record.FromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                     for item in record.history.item}
            step = items.pop("_step")
            scalars.update({(step, name): value for name, value in items.items() if not name.startswith("_")})
        elif kind == "run":
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update if u.key != "_wandb"}
    return scalars, config


def _mlflow_scalars_and_params(tracking_uri, project, names):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(project).experiment_id])
    assert run.info.status == "FINISHED"
    scalars = {(m.step, name): m.value for name, key in names.items()
               for m in client.get_metric_history(run.info.run_id, key)}
    return scalars, run.data.params


def _tensorboard_scalars_and_hparams(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {(e.step, tag): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    return scalars, {k: (v.number_value if v.HasField("number_value") else v.string_value) for k, v in hparams.items()}


def _swanlab_scalars_and_config(run_dir):
    from swanlab.proto.swanlab.record.v1 import record_pb2

    (journal,) = (run_dir / "swanlog").glob("run-*/run-*.swanlab")
    scalars = {}
    for raw in _journal_records(journal):
        record = record_pb2.Record.FromString(raw)
        # swanlab's own system monitor (``__swanlab__.cpu.pct``, ...; it samples when a run outlasts its interval,
        # as a run on a loaded machine does) logs no metric of the run
        if record.HasField("scalar") and not record.scalar.key.startswith("__swanlab__."):
            scalars[(record.scalar.step, record.scalar.key)] = record.scalar.value.number
    (config_file,) = (run_dir / "swanlog").glob("run-*/files/config.yaml")
    config = {key: entry["value"] for key, entry in yaml.safe_load(config_file.read_text()).items()}
    return scalars, config


def _log_two_steps(tmp_path, backend):
    run_dir = tmp_path / "run"
    tracker = Tracking("proj", "exp", run_dir, backends=("jsonl", backend), config=CONFIG)
    for step, metrics in STEPS.items():
        tracker.log(metrics, step=step)
    tracker.finish()
    return run_dir


@pytest.fixture
def offline_trackers(tmp_path, monkeypatch):
    """wandb and swanlab offline, mlflow in a file store under tmp_path; returns the mlflow tracking URI."""
    uri = (tmp_path / "mlruns").as_uri()
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "SWANLAB_MODE": "offline",
                        "MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": "true"}.items():
        monkeypatch.setenv(name, value)
    return uri


def test_wandb_offline_run_holds_the_jsonl_scalars_and_the_config(tmp_path, offline_trackers):
    pytest.importorskip("wandb")
    run_dir = _log_two_steps(tmp_path, "wandb")
    scalars, config = _wandb_scalars_and_config(run_dir)
    _assert_same(scalars, _jsonl_scalars(run_dir))
    assert config == {"trainer": {"project_name": "proj", "seed": 3, "dir": "out/proj"},
                      "data": {"sizes": [1, 2], "lr": 0.5}}


def test_mlflow_file_store_holds_the_jsonl_scalars_and_the_config(tmp_path, offline_trackers):
    pytest.importorskip("mlflow")
    run_dir = _log_two_steps(tmp_path, "mlflow")
    # MLflow refuses '@' in metric names: it becomes '_at_'; a file store gets '.' for '/'
    names = {"critic/score/mean": "critic.score.mean", "rollout/kl": "rollout.kl", "val/mean@2": "val.mean_at_2",
             "val/score": "val.score", "val/score/arith": "val.score.arith", "timing_s/step": "timing_s.step"}
    scalars, params = _mlflow_scalars_and_params(offline_trackers, "proj", names)
    _assert_same(scalars, _jsonl_scalars(run_dir))
    assert params == {key: str(value) for key, value in FLAT_CONFIG.items()}  # MLflow keeps params as strings


def test_tensorboard_events_hold_the_jsonl_scalars_and_the_config(tmp_path):
    pytest.importorskip("tensorboard")
    run_dir = _log_two_steps(tmp_path, "tensorboard")
    scalars, hparams = _tensorboard_scalars_and_hparams(run_dir)
    _assert_same(scalars, _jsonl_scalars(run_dir), rel=1e-6)  # event files store float32
    assert hparams == FLAT_CONFIG


def test_swanlab_offline_run_holds_the_jsonl_scalars_and_the_config(tmp_path, offline_trackers):
    pytest.importorskip("swanlab")
    run_dir = _log_two_steps(tmp_path, "swanlab")
    scalars, config = _swanlab_scalars_and_config(run_dir)
    _assert_same(scalars, _jsonl_scalars(run_dir))
    assert config == {"trainer": {"project_name": "proj", "seed": 3, "dir": "out/proj"},
                      "data": {"sizes": [1, 2], "lr": 0.5}}


def test_a_tracker_that_fails_to_start_is_a_clear_error_and_closes_the_files(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.exceptions import MlflowException

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # MLflow >= 3.x refuses a file store then
    opened = []
    real_open = open

    def recording_open(*args, **kwargs):
        handle = real_open(*args, **kwargs)
        opened.append(handle)
        return handle

    monkeypatch.setattr("builtins.open", recording_open)
    with pytest.raises(MlflowException):
        Tracking("proj", "exp", tmp_path / "run", backends=("jsonl", "mlflow"))
    jsonl = [h for h in opened if str(getattr(h, "name", "")).endswith("metrics.jsonl")]
    assert jsonl and all(h.closed for h in jsonl)


def test_logger_names_are_checked_at_load():
    with pytest.raises(ConfigError, match=r"trainer.logger: 'wandbb' is not one of .*wandb, mlflow, swanlab"):
        load_config("quickstart", ["trainer.logger=[console,wandbb]"])
    assert list(load_config("quickstart", ["trainer.logger=[wandb,mlflow,swanlab,tensorboard]"]).trainer.logger) == [
        "wandb", "mlflow", "swanlab", "tensorboard"]


@pytest.mark.slow
def test_train_two_steps_every_tracker_reads_back_metrics_jsonl(quickstart_run, monkeypatch):
    """``hybridflow train`` with all trackers (the shared quickstart run, tests/helpers/quickstart_run.py, which logs
    to every installed one): each one's scalars equal metrics.jsonl; the run leaves curves.png."""
    for package in ("wandb", "mlflow", "tensorboard", "swanlab"):
        pytest.importorskip(package)
    assert quickstart_run.returncode == 0, quickstart_run.output[-3000:]
    run_dir = quickstart_run.run_dir
    for name, value in tracker_env(run_dir.parent).items():  # the readers' settings are the run's
        monkeypatch.setenv(name, value)
    expected = _jsonl_scalars(run_dir)
    assert {step for step, _ in expected} == {0, 1, 2} and len(expected) > 60  # val at 0 and 2, two train steps
    resolved = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    assert resolved.pop("run_info")["hybridflow_version"]  # provenance: config.yaml's own section, not config

    scalars, config = _wandb_scalars_and_config(run_dir)
    _assert_same(scalars, expected)
    assert config == resolved
    names = {name: name.replace("@", "_at_").replace("/", ".") for _, name in expected}  # file store names
    scalars, params = _mlflow_scalars_and_params(quickstart_run.mlflow_uri, "hybridflow", names)
    _assert_same(scalars, expected)
    assert params["trainer.default_local_dir"] == str(run_dir) and params["data.train_batch_size"] == "8"
    scalars, hparams = _tensorboard_scalars_and_hparams(run_dir)
    _assert_same(scalars, expected, rel=1e-6)
    assert hparams["actor_rollout_ref.actor.ppo_mini_batch_size"] == 4
    scalars, config = _swanlab_scalars_and_config(run_dir)
    _assert_same(scalars, expected)
    assert config["trainer"]["default_local_dir"] == str(run_dir)
    assert (run_dir / "curves.png").is_file()


def test_flattened_config():
    from hybridflow.utils.tracking import flatten_config

    assert flatten_config(CONFIG) == FLAT_CONFIG
    assert flatten_config(None) == {} and flatten_config({}) == {}
    assert flatten_config({"a": {}, "b": None}) == {"a": "{}", "b": "None"}


def test_mlflow_metric_names():
    from hybridflow.utils.tracking import mlflow_metric_name

    assert mlflow_metric_name("val/mean@4/hybridflow/arith") == "val/mean_at_4/hybridflow/arith"  # servers, databases
    assert mlflow_metric_name("val/mean@4/x", file_store=True) == "val.mean_at_4.x"
    assert mlflow_metric_name("a b:c-d.e/(f)#1") == "a b:c-d.e/_f__1"  # MLflow: [\w\-. :/] only

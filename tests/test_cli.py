"""The hybridflow command line: config errors exit 2 fast (before Ray), --print-config, dispatch to run_ppo."""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from hybridflow.cli import COMMANDS, main
from hybridflow.config import config_to_dict, load_config

REPO = Path(__file__).resolve().parent.parent
TYPO = "actor_rollout_ref.actor.ppo_mini_batchsize=4"


def test_config_error_exits_2_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "hybridflow", "train", "recipes/quickstart.yaml", TYPO],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "actor_rollout_ref.actor.ppo_mini_batchsize" in proc.stderr
    assert "did you mean actor_rollout_ref.actor.ppo_mini_batch_size?" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


REGISTRY_LOOKUPS = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=hff"]  # imports the registries


@pytest.mark.parametrize("overrides", [[TYPO], [TYPO, *REGISTRY_LOOKUPS]], ids=["typo", "typo+registry-lookups"])
def test_config_error_does_not_import_ray(overrides):
    code = ("import sys; from hybridflow.cli import main; "
            f"rc = main(['train', 'recipes/quickstart.yaml', *{overrides!r}]); print(rc, 'ray' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc.stderr


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["train", "--help"], ["eval", "--help"]])
def test_help_and_version_load_neither_torch_nor_ray(argv):
    """``hybridflow --help`` / ``--version`` answer at once: the package and the parser import no torch, Ray or
    transformers (each takes seconds to import)."""
    code = ("import sys; from hybridflow.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit as exc:\n    code = exc.code\n"
            "print('HEAVY', code, sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines()[-1] == "HEAVY 0 []", proc.stdout + proc.stderr


@pytest.fixture
def fake_trainer(monkeypatch):
    """Stand-in for hybridflow.trainer.main that records the configs run_ppo receives."""
    module = types.ModuleType("hybridflow.trainer.main")
    module.calls = []
    module.run_ppo = module.calls.append
    monkeypatch.setitem(sys.modules, "hybridflow.trainer.main", module)
    return module


def test_valid_config_reaches_run_ppo(fake_trainer):
    assert main(["train", "quickstart", "trainer.total_training_steps=3"]) == 0
    (cfg,) = fake_trainer.calls
    assert cfg.trainer.total_training_steps == 3
    assert config_to_dict(cfg) == config_to_dict(load_config("quickstart", ["trainer.total_training_steps=3"]))


def test_invalid_config_does_not_reach_run_ppo(fake_trainer, capsys):
    assert main(["train", "quickstart", "data.train_batch_size=abc"]) == 2
    assert fake_trainer.calls == []
    err = capsys.readouterr().err
    assert err.startswith("invalid config (1 problem):")
    assert "data.train_batch_size: expected int, got 'abc'" in err


def test_print_config_prints_the_resolved_yaml(fake_trainer, capsys):
    overrides = ["trainer.project_name=p", "trainer.default_local_dir=out/${trainer.project_name}"]
    assert main(["train", "quickstart", overrides[0], "--print-config", overrides[1]]) == 0
    assert fake_trainer.calls == []
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["default_local_dir"] == os.path.abspath("out/p")  # made absolute at load
    assert printed == config_to_dict(load_config("quickstart", overrides))


def test_help_and_usage_errors(capsys):
    assert set(COMMANDS) >= {"train"}
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert "train" in capsys.readouterr().out
    for argv in ([], ["train"], ["train", "quickstart", "--print-cfg"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2


WARN = ("import warnings\n"
        "warnings.warn('Transformer Engine and Apex are not installed. Falling back to Torch optimizers.')\n"
        "warnings.warn_explicit('full scope is deprecated. Use empty cuda_graph_scope', UserWarning, 'c.py', 1,\n"
        "                       module='megatron.core.transformer.transformer_config')\n"
        "warnings.warn_explicit('full scope is deprecated (elsewhere)', UserWarning, 'm.py', 2, module='mine')\n"
        "warnings.warn('hybridflow: a warning of our own', UserWarning)\n")


def test_known_third_party_warnings_are_hidden_here_and_in_started_processes(monkeypatch):
    """Megatron's Apex notice is hidden in the CLI's process and in the processes it starts (Ray's workers inherit
    PYTHONWARNINGS); a module-scoped entry hides only that module's warning; other warnings are shown."""
    import warnings

    from hybridflow.cli import quiet_third_party_warnings

    monkeypatch.setenv("PYTHONWARNINGS", "error::ResourceWarning")  # the user's own setting stays, and last
    with warnings.catch_warnings(record=True) as shown:
        warnings.resetwarnings()
        quiet_third_party_warnings()
        quiet_third_party_warnings()  # main() may run twice in one process: nothing is added twice
        exec(compile(WARN, "w.py", "exec"), {})
    assert [str(w.message) for w in shown] == ["full scope is deprecated (elsewhere)",
                                               "hybridflow: a warning of our own"]
    entries = os.environ["PYTHONWARNINGS"].split(",")
    assert entries[-1] == "error::ResourceWarning" and len(entries) == len(set(entries))
    assert "ignore:Apex is not installed:UserWarning:" in entries
    child = subprocess.run([sys.executable, "-c", WARN], capture_output=True, text=True, timeout=60)
    assert "Apex" not in child.stderr and "cuda_graph_scope" not in child.stderr, child.stderr
    assert "full scope is deprecated (elsewhere)" in child.stderr and "a warning of our own" in child.stderr

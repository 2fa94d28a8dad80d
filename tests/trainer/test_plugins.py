"""``trainer.plugins``: a user module reaches the driver's config validation and every Ray worker.

(a) a driver written in a user file, registered with ``@register_driver`` and named by ``algorithm.driver``, runs
2 steps through ``hybridflow train``, with a hyper-parameter its registration declares; (b) a policy loss registered
in a user module runs inside the actor's Ray workers (it leaves a marker file with its process id, which is not the
driver's, and the value of the key its registration declares); (c) a misspelled plugin stops
``hybridflow train`` with one line before Ray starts.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.config import ConfigError, load_config
from hybridflow.errors import UserError

REPO = Path(__file__).resolve().parents[2]
SHORT = ["trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
         "trainer.save_freq=-1", "trainer.logger=[jsonl]", "trainer.plot_curves=false", "data.train_batch_size=8",
         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
         "actor_rollout_ref.rollout.n=2", "data.builtin_val_size=8"]

USER_DRIVER = '''
"""A user driver: critic-free, built from the PPO driver's phases; logs the step it ran and its own
hyper-parameter (algorithm.my_reinforce.bonus, declared with the registration)."""
from dataclasses import dataclass, field

from hybridflow.trainer.driver import Driver, register_driver
from hybridflow.trainer.ppo import PPOTrainer, common_roles
from hybridflow.utils.timer import timer


@dataclass
class BonusSection:
    bonus: float = 0.0  # logged as my_reinforce/bonus


@dataclass
class MyReinforceConfig:
    my_reinforce: BonusSection = field(default_factory=BonusSection)


@register_driver("my_reinforce", config=MyReinforceConfig)
class MyReinforce(Driver):
    ROLES = ("actor", "reward", "reward_model")
    CHECKPOINTED_ROLES = ("actor",)

    @classmethod
    def roles(cls, config):
        return common_roles(config)

    @classmethod
    def config_problems(cls, get):
        return [] if get("actor_rollout_ref.rollout.n") > 1 else ["actor_rollout_ref.rollout.n: my_reinforce needs groups"]

    @classmethod
    def build(cls, config, groups):
        return cls(PPOTrainer(config, groups["actor"], None, groups["reward"]), config.algorithm.my_reinforce.bonus)

    def __init__(self, ppo, bonus):
        self.ppo, self.bonus = ppo, bonus

    def checkpointed_groups(self):
        return {"actor": self.ppo.actor}

    def step(self, batch):
        t = {}
        self.ppo.global_step = self.global_step
        with timer("step", t):
            batch = self.ppo.generate_and_score(batch, t)
            metrics = self.ppo.train_on(batch, t, scored=True)
        metrics["my_reinforce/step"] = float(self.global_step)
        metrics["my_reinforce/bonus"] = self.bonus
        return self.ppo.step_metrics(batch, metrics, t)

    def validate(self, val_data):
        return self.ppo.validate(val_data)
'''


def _marker_loss_module(marker: Path) -> str:
    return textwrap.dedent(f'''
        """A user policy loss: the vanilla PPO-clip loss that records the process it runs in and its own key."""
        import os
        from dataclasses import dataclass

        from hybridflow.algorithms import compute_policy_loss_vanilla, register_policy_loss


        @dataclass
        class MarkerConfig:
            marker_tag: str = "unset"  # written into the marker file


        @register_policy_loss("marked_vanilla", config=MarkerConfig)
        def marked_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                           config=None, rollout_log_probs=None, **agg_kwargs):
            with open({str(marker)!r} + "." + str(os.getpid()), "w") as f:
                f.write(f"{{os.getpid()}} {{config.marker_tag}}")
            return compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                               config, rollout_log_probs=rollout_log_probs, **agg_kwargs)
    ''')


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.slow
def test_user_driver_from_a_plugin_file_runs_two_steps_through_hybridflow_train(tmp_path):
    plugin = tmp_path / "my_driver.py"
    plugin.write_text(USER_DRIVER)
    out = tmp_path / "run"
    rc = main(["train", "grpo_quickstart", *SHORT, f"trainer.plugins=[{plugin}]", "algorithm.driver=my_reinforce",
               "algorithm.my_reinforce.bonus=0.5", f"trainer.default_local_dir={out}"])
    assert rc == 0
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["my_reinforce/step"] for r in rows] == [1.0, 2.0]  # the user driver's step made them
    assert [r["my_reinforce/bonus"] for r in rows] == [0.5, 0.5]  # its own key, set like a built-in one
    assert all("actor/pg_loss" in r for r in rows)


def test_user_driver_config_check_runs_at_load(tmp_path):
    plugin = tmp_path / "my_driver_check.py"
    plugin.write_text(USER_DRIVER.replace("my_reinforce", "my_reinforce_check"))
    try:
        with pytest.raises(ConfigError, match="my_reinforce_check needs groups"):
            load_config("grpo_quickstart", [f"trainer.plugins=[{plugin}]", "algorithm.driver=my_reinforce_check",
                                            "actor_rollout_ref.rollout.n=1"])
        with pytest.raises(ConfigError, match=r"did you mean algorithm\.my_reinforce_check\.bonus\?"):
            load_config("grpo_quickstart", [f"trainer.plugins=[{plugin}]", "algorithm.driver=my_reinforce_check",
                                            "algorithm.my_reinforce_check.bnus=1"])
    finally:  # later tests list the registered drivers
        from hybridflow.trainer.driver import DRIVERS, _ORDER

        DRIVERS.unregister("my_reinforce_check")
        _ORDER.remove("my_reinforce_check")
        sys.modules.pop("hybridflow_plugin_my_driver_check", None)


@pytest.mark.slow
def test_policy_loss_from_a_plugin_module_runs_in_the_actor_workers(tmp_path):
    marker = tmp_path / "called"
    (tmp_path / "my_losses_plugin.py").write_text(_marker_loss_module(marker))
    # a module name (not a path), importable through PYTHONPATH; a fresh process starts its own Ray cluster,
    # whose workers inherit that PYTHONPATH
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hybridflow", "train", "grpo_quickstart", *SHORT,
                             "trainer.plugins=[my_losses_plugin]", "actor_rollout_ref.actor.policy_loss=marked_vanilla",
                             "actor_rollout_ref.actor.marker_tag=seen",
                             f"trainer.default_local_dir={out}"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, output[-3000:]
    records = [p.read_text().split() for p in tmp_path.glob("called.*")]
    assert records and all(tag == "seen" for _, tag in records)  # the loss's own key reached the workers
    pids = {int(pid) for pid, _ in records}
    assert pids, "the plugin's loss never ran"
    assert proc.pid not in pids and os.getpid() not in pids  # it ran in the workers, not in the driver
    assert len(pids) == 2  # one per actor rank (trainer.n_gpus_per_node=2)
    assert [r["step"] for r in _rows(out)] == [1, 2]


def test_misspelled_plugin_fails_in_one_line_before_ray_starts(tmp_path):
    code = ("import sys; from hybridflow.cli import main; "
            "rc = main(['train', 'quickstart', 'trainer.plugins=[my_lossess_plugin]', "
            f"'trainer.default_local_dir={tmp_path}']); print(rc, 'ray' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["1", "False"], proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["error: trainer.plugins: cannot import 'my_lossess_plugin': No module named "
                     "'my_lossess_plugin' (a plugin is a module on PYTHONPATH or the path of a .py file)"]


def test_plugin_file_that_raises_names_the_file(tmp_path):
    bad = tmp_path / "broken_plugin.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(UserError, match=r"trainer.plugins: importing '.*broken_plugin.py' failed: RuntimeError: boom"):
        load_config("quickstart", [f"trainer.plugins=[{bad}]"])
    with pytest.raises(UserError, match=r"is not a file"):
        load_config("quickstart", [f"trainer.plugins=[{tmp_path / 'missing.py'}]"])

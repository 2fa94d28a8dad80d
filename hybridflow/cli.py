"""Command line: ``hybridflow train RECIPE [key=value ...]`` (also ``python -m hybridflow``).

Subcommands live in ``COMMANDS`` (name -> help, argument setup, handler); a handler takes the parsed arguments
and returns the exit status. A config problem prints the ``ConfigError`` message to stderr and exits with 2,
before anything heavy (Ray, models) starts. ``train``: bad data (a :class:`~hybridflow.errors.UserError`: a missing
column, an empty file, an over-long prompt, an unknown ``data_source``) or a bad path prints ``error: <message>``
and exits with 1, before Ray starts; Ctrl-C prints one line (last complete step, latest checkpoint, the command
that resumes) and exits with 130; a worker-group call past ``trainer.call_timeout_s`` prints the same line led by
the group, method and ranks that did not answer, and exits with 124. A config that cannot resume the checkpoint in the run directory
(``IncompatibleCheckpointError``, found before Ray starts) prints one line and exits with 2. Any other exception is a bug and keeps its
traceback. ``eval``: bad data, a bad path or a reward option that does not load prints ``error: <message>`` and
exits with 1; Ctrl-C prints one line (prompts scored, where the partial output is) and exits with 130.
:func:`run_script` gives the benchmark scripts the same one-line reports.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

from omegaconf import OmegaConf

from hybridflow.config import ConfigError, available_recipes, load_config
from hybridflow.errors import TrainingInterrupted, TrainingTimedOut, UserError
from hybridflow.mapping import plan_cli
from hybridflow.utils import startup
from hybridflow.utils.progress import terminal_logging

EXIT_CONFIG_ERROR = 2  # same status as argparse's usage errors
EXIT_USER_ERROR = 1  # bad data or paths, reported in one line
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), the shell's convention
EXIT_TIMED_OUT = 124  # a worker-group call ran past trainer.call_timeout_s (timeout(1)'s status)
USER_ERRORS = (UserError, FileNotFoundError, NotADirectoryError, FileExistsError)


class Command(NamedTuple):
    """A subcommand: one-line help, a function adding its arguments to its subparser, and its handler."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", metavar="RECIPE",
                        help=f"YAML file, or a shipped recipe name ({', '.join(available_recipes()) or 'none'})")
    parser.add_argument("overrides", metavar="key=value", nargs="*",
                        help="config overrides, e.g. data.train_batch_size=64 trainer.logger=[console]")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML and exit without training")


def run_script(main: Callable[[], object]) -> int:
    """Run a script's ``main()`` (the benchmarks: ``sys.exit(run_script(main))``) with ``train``'s reports: a
    ``ConfigError`` (a typo in an override) prints its message and returns 2; bad data or a bad path
    (:data:`USER_ERRORS`) prints ``error: <message>`` and returns 1; anything else propagates with its traceback.
    Returns 0 when ``main`` returns."""
    try:
        main()
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def _run_train(args: argparse.Namespace) -> int:
    """``hybridflow train`` (see the module docstring). An exception raised in the user's own code (a reward
    function, a plugin, also inside a worker: a :class:`~hybridflow.errors.UserCodeError`) prints
    ``error: [<group> rank <r>: ]<where>: <ExceptionType>: <message>`` and the user's own frames, and returns 1;
    hybridflow's own errors keep their tracebacks."""
    startup.begin(from_process_start=True)
    startup.mark("imports")
    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except UserError as exc:  # a trainer.plugins module that does not import: one line, before Ray
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    if args.print_config:
        print(OmegaConf.to_yaml(cfg, resolve=True), end="")
        return 0
    startup.mark("config")
    from hybridflow.errors import report_lines
    from hybridflow.trainer.checkpoint import IncompatibleCheckpointError
    from hybridflow.trainer.main import run_ppo  # Ray and the models load only from here on

    startup.mark("driver imports")

    try:
        with terminal_logging():
            run_ppo(cfg)
    except IncompatibleCheckpointError as exc:  # the run directory holds another config's checkpoint
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except USER_ERRORS as exc:  # bad data or paths: one line, no traceback; programming errors keep theirs
        logging.getLogger("hybridflow").debug("train failed", exc_info=True)
        print("\n".join(report_lines(exc)), file=sys.stderr)  # (a UserCodeError: the user's frames under it)
        return EXIT_USER_ERROR
    except TrainingInterrupted as exc:  # Ctrl-C, or a call past trainer.call_timeout_s (TrainingTimedOut)
        print(_interrupted_line(exc, args), file=sys.stderr)
        return EXIT_TIMED_OUT if isinstance(exc, TrainingTimedOut) else EXIT_INTERRUPTED
    except Exception as exc:  # a worker's UserError (e.g. the user's reward raised): one line + the user's frames
        user = getattr(exc, "user_error", None)  # (a WorkerError's; any other exception is a bug: traceback)
        if user is None:
            raise
        logging.getLogger("hybridflow").debug("train failed", exc_info=True)
        print("\n".join(report_lines(user, where=exc.location)), file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def _interrupted_line(exc: TrainingInterrupted, args: argparse.Namespace) -> str:
    """One line for Ctrl-C or a worker-group call past ``trainer.call_timeout_s`` (a :class:`TrainingTimedOut`,
    whose reason comes first: the group, the method, the ranks that did not answer): the last complete step, the
    latest complete checkpoint and the command that resumes from it (the same command line;
    ``trainer.resume_mode=auto``, the default, picks the latest checkpoint)."""
    overrides = [o for o in args.overrides if not o.startswith("trainer.resume_mode=")]
    if any(o.startswith("trainer.resume_mode=") and o != "trainer.resume_mode=auto" for o in args.overrides):
        overrides.append("trainer.resume_mode=auto")
    command = shlex.join(["hybridflow", "train", args.recipe, *overrides])
    what = (f"{exc.reason}; stopped" if isinstance(exc, TrainingTimedOut) else "interrupted")
    if exc.checkpoint is None:
        return (f"{what} after step {exc.step}/{exc.total}; no complete checkpoint (trainer.save_freq "
                f"sets how often one is saved); start again with: {command}")
    return (f"{what} after step {exc.step}/{exc.total}; latest complete checkpoint: {exc.checkpoint}; "
            f"resume with: {command}")


def _add_data_arguments(parser: argparse.ArgumentParser) -> None:
    from hybridflow.data.preprocess import DATASETS

    parser.add_argument("dataset", choices=sorted(DATASETS),
                        help="gsm8k: jsonl rows with question/answer ('#### N'); math: problem/solution (\\boxed{}); "
                             "geometry3k: parquet rows with images/problem/answer (hiyouga/geometry3k)")
    parser.add_argument("--input", required=True, metavar="FILE",
                        help="original file: .jsonl, .json (list) or .parquet")
    parser.add_argument("--output", required=True, metavar="DIR", help="writes DIR/<split>.parquet (verl schema)")
    parser.add_argument("--split", default=None, help="split name (default: the input file name, e.g. test)")
    parser.add_argument("--skip-bad", action="store_true", help="skip and count malformed rows instead of failing")


def _run_data(args: argparse.Namespace) -> int:
    from hybridflow.data.preprocess import convert

    try:
        result = convert(args.dataset, args.input, args.output, split=args.split, skip_bad=args.skip_bad)
    except (ValueError, FileNotFoundError) as exc:  # MalformedRowError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {result.num_rows} rows to {result.output}; skipped {result.num_skipped} malformed rows")
    return 0


def _rollout_name(name: str) -> str:
    """``--rollout``'s type: a registered rollout backend (looked up when the flag is given, so building the parser
    for ``--help`` imports no torch)."""
    from hybridflow.rollout import registered_rollouts  # the registry alone: vLLM is not imported

    if name not in registered_rollouts():
        raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from {', '.join(registered_rollouts())})")
    return name


def _positive_seconds(text: str) -> float:
    """``--reward-timeout``'s type: seconds >= 0 (0: no limit)."""
    seconds = float(text)
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"must be seconds >= 0 (0: no limit), got {text!r}")
    return seconds


def _add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_DIR",
                        help="local Hugging Face model directory, hub id (org/name) or builtin:NAME")
    parser.add_argument("data", metavar="DATA.parquet", nargs="+", help="prompts in verl's parquet schema")
    parser.add_argument("--n", type=int, default=1,
                        help="responses per prompt; > 1 adds a sampled pass: mean@n, pass@k, best@k, maj@n")
    parser.add_argument("--pass-threshold", type=float, default=1.0, metavar="SCORE",
                        help="with --n > 1: a response with a score >= SCORE counts as correct in pass@k")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1, help="-1 disables top-k")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per generation call")
    parser.add_argument("--max-prompt-length", type=int, default=None, help="prompt tokens (default: no limit)")
    parser.add_argument("--truncation", choices=("error", "left", "right", "filter"), default="error",
                        help="what to do with prompts over --max-prompt-length")
    parser.add_argument("--max-response-length", type=int, default=512, help="generated tokens per response")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled pass")
    parser.add_argument("--rollout", type=_rollout_name, default="hf", metavar="{hf,vllm,...}",
                        help="rollout backend, as actor_rollout_ref.rollout.name in training (vllm needs vLLM)")
    parser.add_argument("--output", metavar="FILE.jsonl", default=None, help="write every response and its score")
    parser.add_argument("--max-samples", type=int, default=-1, metavar="N",
                        help="score the first N prompt rows only (-1: all), as data.val_max_samples")
    parser.add_argument("--compute-score", default="default", metavar="FILE.py:FN|MODULE:FN",
                        help="scoring function fn(data_source, solution_str, ground_truth, extra_info), as "
                             "reward_model.compute_score (default: the reward registered for each data_source)")
    parser.add_argument("--error-score", type=float, default=None,
                        help="score of a response whose scoring function raises or times out, as "
                             "reward_model.error_score")
    parser.add_argument("--reward-timeout", type=_positive_seconds, default=300.0, metavar="SECONDS",
                        help="seconds one response's scoring call may take (0: no limit), as reward_model.timeout_s")
    parser.add_argument("--plugins", action="append", default=[], metavar="MODULE|FILE.py",
                        help="a module or .py file to import first (registers rewards, rollouts), as an entry of "
                             "trainer.plugins; repeat for several")


def _run_eval(args: argparse.Namespace) -> int:
    import json

    from hybridflow.errors import EvalInterrupted
    from hybridflow.evaluation import evaluate  # torch and the model load only from here on

    try:
        result = evaluate(
            args.model, args.data, n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            batch_size=args.batch_size, max_prompt_length=args.max_prompt_length, truncation=args.truncation,
            max_response_length=args.max_response_length, dtype=args.dtype, device=args.device, seed=args.seed,
            output=args.output, rollout=args.rollout, compute_score=args.compute_score,
            error_score=args.error_score, plugins=args.plugins, max_samples=args.max_samples,
            reward_timeout_s=args.reward_timeout or None, pass_threshold=args.pass_threshold,
        )
    except (ValueError, *USER_ERRORS) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except EvalInterrupted as exc:  # Ctrl-C: one line, the partial output kept
        print(exc, file=sys.stderr)
        return EXIT_INTERRUPTED
    print(json.dumps(result))
    return 0


def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a global_step_<N> directory (or its actor/)")
    parser.add_argument("out", metavar="OUT_DIR", help="where to write the Hugging Face model directory")
    parser.add_argument("--adapter-only", action="store_true",
                        help="LoRA checkpoints: write the peft adapter directory instead of the merged model")


def _run_export(args: argparse.Namespace) -> int:
    from hybridflow.models.export import export_checkpoint  # torch loads only from here on

    try:
        print(export_checkpoint(args.checkpoint, args.out, adapter_only=args.adapter_only))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", metavar="RUN_DIR", nargs="+",
                        help="run directories (trainer.default_local_dir) with a metrics.jsonl; several are overlaid")
    parser.add_argument("--metrics", metavar="METRIC", nargs="+", default=None,
                        help="one panel per metric, e.g. critic/score/mean val/score (default: the standard panels)")
    parser.add_argument("--out", metavar="FILE.png", default=None,
                        help="where to write the PNG (default: RUN_DIR/curves.png for one run, curves.png for several)")


def _run_plot(args: argparse.Namespace) -> int:
    import os

    from hybridflow.utils.plot import CURVES_FILE, plot_runs  # matplotlib loads only from here on

    out = args.out or (os.path.join(args.runs[0], CURVES_FILE) if len(args.runs) == 1 else CURVES_FILE)
    try:
        plot_runs(args.runs, metrics=args.metrics, out=out)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


COMMANDS: dict[str, Command] = {
    "train": Command("train a policy with a recipe and key=value overrides", _add_train_arguments, _run_train),
    "data": Command("convert a public dataset (gsm8k, math) to parquet in verl's schema", _add_data_arguments,
                    _run_data),
    "eval": Command("score a model on parquet prompts with the rule rewards (or --compute-score), without training",
                    _add_eval_arguments, _run_eval),
    "plan": Command(plan_cli.HELP, plan_cli.add_arguments, plan_cli.run),
    "export": Command("write a checkpoint's actor as a Hugging Face model directory", _add_export_arguments,
                      _run_export),
    "plot": Command("draw training curves of one or more runs (metrics.jsonl) into a PNG", _add_plot_arguments,
                    _run_plot),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``hybridflow`` argument parser with one subparser per entry of ``COMMANDS``."""
    parser = argparse.ArgumentParser(
        prog="hybridflow",
        description="RL fine-tuning of language models with a hybrid single controller.",
        epilog="example: hybridflow train quickstart trainer.total_training_steps=10",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.metadata.version('hybridflow')}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        sub = subparsers.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


# Warnings of other packages that every run of a recipe would print and a user cannot act on: (start of the message,
# category, module that warns or "" for any). Megatron-core on a machine without Transformer Engine / Apex, and
# the deprecated torch.distributed names it calls.
THIRD_PARTY_WARNINGS: tuple[tuple[str, str, str], ...] = (
    ("Transformer Engine and Apex are not installed", "UserWarning", ""),
    ("Apex is not installed", "UserWarning", ""),
    ("full scope is deprecated", "UserWarning", "megatron.core.transformer.transformer_config"),
    ("The .grad attribute of a Tensor that is not a leaf Tensor", "UserWarning", "megatron.core.optimizer.optimizer"),
    ("`torch.distributed.reduce_scatter_tensor` is deprecated", "FutureWarning", "torch.distributed.c10d_logger"),
    ("`torch.distributed.all_gather_into_tensor` is deprecated", "FutureWarning", "torch.distributed.c10d_logger"),
)


def quiet_third_party_warnings() -> None:
    """Hide :data:`THIRD_PARTY_WARNINGS` in this process (filters appended after the ones already set, so a
    user's ``-W`` / ``PYTHONWARNINGS`` still wins) and in the processes it starts, Ray's workers included (entries
    put before the user's own in ``PYTHONWARNINGS``, where the last matching entry wins). Every other warning,
    hybridflow's own among them, is shown as before."""
    import builtins
    import os
    import re
    import warnings

    entries = []
    for message, category, module in THIRD_PARTY_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=getattr(builtins, category),
                                module=re.escape(module) + r"\Z" if module else "", append=True)
        entries.append(f"ignore:{message}:{category}:{module}")
    given = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e]  # (ours too, after an earlier call)
    os.environ["PYTHONWARNINGS"] = ",".join([e for e in entries if e not in given] + given)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand and return its exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_third_party_warnings()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse stops filling a nargs="*" positional at the first option: keep overrides given after an option.
    if extra and hasattr(args, "overrides") and not any(arg.startswith("-") for arg in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.run(args)

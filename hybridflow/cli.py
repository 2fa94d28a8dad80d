"""Command line: ``hybridflow train RECIPE [key=value ...]`` (also ``python -m hybridflow``).

Subcommands live in ``COMMANDS`` (name -> help, argument setup, handler); a handler takes the parsed arguments
and returns the exit status. A config problem prints the ``ConfigError`` message to stderr and exits with 2,
before anything heavy (Ray, models) starts.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

from omegaconf import OmegaConf

from hybridflow.config import ConfigError, available_recipes, load_config

EXIT_CONFIG_ERROR = 2  # same status as argparse's usage errors


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


def _run_train(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if args.print_config:
        print(OmegaConf.to_yaml(cfg, resolve=True), end="")
        return 0
    from hybridflow.trainer.main import run_ppo  # Ray and the models load only from here on

    run_ppo(cfg)
    return 0


COMMANDS: dict[str, Command] = {
    "train": Command("train a policy with a recipe and key=value overrides", _add_train_arguments, _run_train),
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


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand and return its exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse stops filling a nargs="*" positional at the first option: keep overrides given after an option.
    if extra and hasattr(args, "overrides") and not any(arg.startswith("-") for arg in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.run(args)

"""The ``pdserve`` command line.

Subcommands register themselves in ``COMMANDS``: each entry is a name, a one-line
help, a function that adds its arguments to a parser, and a function that runs it
(``args -> exit code``). To add one (``serve``, ``generate``, ...)::

    register("generate", "generate text offline", _add_generate_args, _run_generate)

Imports of heavy modules (torch, ray) happen inside the run functions, so
``pdserve --help`` stays fast.

This module is the command line's composition root: the one place that assembles every
command group (the router's, the simulator's, the benchmarks') into ``pdserve``. It is
the top layer of the import contracts (pyproject.toml, ``[tool.importlinter]``) and no
module of pdserve imports it; below it, no product module imports ``pdserve.bench``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.model.tiny import make_tiny_model  # light: its torch is lazy


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def register(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int]) -> None:
    if name in COMMANDS:
        raise ValueError(f"command {name!r} is already registered")
    COMMANDS[name] = Command(name, help, add_arguments, run)


# ---- make-tiny-model ------------------------------------------------------------

def _add_make_tiny_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="folder to write (created if needed)")
    p.add_argument("--variant", choices=["llama", "mistral-swa"], default="llama",
                   help="llama (GQA) or mistral-swa (sliding window 32)")
    p.add_argument("--size", choices=["tiny", "small"], default="tiny",
                   help="tiny (~5M parameters) or small (~80M)")


def _run_make_tiny_model(args: argparse.Namespace) -> int:
    out = make_tiny_model(args.dir, variant=args.variant, size=args.size)
    print(f"wrote {args.variant}/{args.size} model to {out}")
    return 0


register("make-tiny-model", "write the built-in deterministic model as a HF folder",
         _add_make_tiny_model_args, _run_make_tiny_model)


# serve, generate, status, scale: the cluster service's commands live with the router.
from pdserve.router.cli_commands import register_commands  # noqa: E402

register_commands(register)

# bench serve | compare-modes | kv-transfer | choices: the benchmarks live in bench/.
from pdserve.bench.commands import register_commands as _register_bench  # noqa: E402

_register_bench(register)

# simulate: the cluster simulator lives in simulator/.
from pdserve.simulator.cli import register_commands as _register_simulate  # noqa: E402

_register_simulate(register)


# ---- entry point ---------------------------------------------------------------

def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser, or with ``only`` that command's arguments alone (the
    others listed by name): building a command's arguments may import its modules (the
    benchmarks load torch), which a client command such as ``status`` should not wait for."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        if only is None or cmd.name == only:
            cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    # the command is the first word; `pdserve --help` lists the commands without building any
    only = words[0] if words and words[0] in COMMANDS else ""
    args = build_parser(only).parse_args(words)
    # This process's own command line, for a command that re-executes itself (serve);
    # None when called in-process with a list: that caller's process must not be replaced.
    args.process_argv = list(sys.argv[1:]) if argv is None else None
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

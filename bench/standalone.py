"""`python -m pdserve.bench.X`: the same arguments as `pdserve bench X`."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def standalone_main(doc: str, add_args: Callable, run: Callable) -> Callable[..., int]:
    """A ``main(argv)`` for a bench module that has ``add_args(parser)`` and ``run(args)``."""

    def main(argv: list[str] | None = None) -> int:
        p = argparse.ArgumentParser(description=doc.splitlines()[0])
        add_args(p)
        return int(run(p.parse_args(argv)) or 0)

    return main

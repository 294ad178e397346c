"""Checks declared beside a dataclass's fields, and the one function that runs them.

A settings class says what each field accepts where the field is declared::

    max_num_seqs: int = checked(64, Integer(ge=1))
    prefill_watermark: float = checked(0.9, Number(ge=0, le=1))
    max_model_len: int | None = checked(None, OrNone(Integer(ge=1)))

and its check method calls ``check_fields(self)``. A refused value is a ValueError whose
text starts with the field's name, ``<field> must be <what>, got <value>``: callers that
know where the settings came from prefix it (router/config.py: ``prefill.engine.``).
Rules between fields stay explicit methods of their classes, run after these.

The lowest layer (scheduler/): no torch, nothing from the rest of pdserve, so the
scheduler's, the engine's and any other settings class can use it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Protocol

_KEY = "pdserve.check"  # the metadata key a field's check is kept under
REQUIRED: Any = MISSING  # checked()'s default for a field without one


class Check(Protocol):
    def problem(self, value: Any) -> str | None:
        """None when ``value`` is accepted, else what it must be (``>= 1``)."""


def checked(default: Any, check: Check) -> Any:
    """A dataclass field with ``default`` (REQUIRED: none) that ``check`` guards."""
    return field(default=default, metadata={_KEY: check})


def check_fields(obj: Any) -> None:
    """ValueError for the first field of ``obj`` (in declaration order, inherited fields
    first) that its declared check refuses."""
    for f in fields(obj):
        check = f.metadata.get(_KEY)
        value = getattr(obj, f.name)
        wanted = check.problem(value) if check is not None else None
        if wanted is not None:
            raise ValueError(f"{f.name} must be {wanted}, got {value!r}")


# Bounds written as what must hold, so NaN (every comparison false) fails each of them.
_BOUNDS: tuple[tuple[str, str, Callable[[Any, Any], bool]], ...] = (
    ("ge", ">=", operator.ge), ("gt", ">", operator.gt),
    ("le", "<=", operator.le), ("lt", "<", operator.lt),
)


@dataclass(frozen=True)
class Number:
    """An int or a float within the bounds given. A bool is refused (``True`` would pass
    as 1). The message names the one thing wrong: the type, or the bound crossed."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    types: ClassVar[tuple[type, ...]] = (int, float)
    noun: ClassVar[str] = "a number"

    def problem(self, value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, self.types):
            return self.noun
        for name, sign, holds in _BOUNDS:
            bound = getattr(self, name)
            if bound is not None and not holds(value, bound):
                return f"{sign} {bound}"
        return None


@dataclass(frozen=True)
class Integer(Number):
    """An int (not a bool, not a float) within the bounds given."""

    types: ClassVar[tuple[type, ...]] = (int,)
    noun: ClassVar[str] = "an integer"


@dataclass(frozen=True)
class Bool:
    """True or False itself: a YAML ``"no"`` or a 0 is refused, not taken as false."""

    def problem(self, value: Any) -> str | None:
        return None if isinstance(value, bool) else "true or false"


@dataclass(frozen=True)
class OneOf:
    """One of a fixed tuple of strings (the message lists them in their order)."""

    choices: tuple[str, ...]

    def problem(self, value: Any) -> str | None:
        return None if value in self.choices else f"one of {', '.join(self.choices)}"


@dataclass(frozen=True)
class OrNone:
    """None, or what ``check`` accepts (None means "not set": a default decided later)."""

    check: Check

    def problem(self, value: Any) -> str | None:
        wanted = None if value is None else self.check.problem(value)
        return None if wanted is None else f"{wanted} or None"

"""Every setting is defined once: two config dataclasses that declare a field of the same
name declare the same default (issue 29, item 4).

Walks every dataclass whose name ends in Config (and the parts they are built from,
``...Settings``, ``...Policy``) in engine/, scheduler/, rank/, kv_transfer/, planner/ and
router/config.py. A field a class inherits counts as its own (it is the same
declaration, so it always agrees); a field required in one class and defaulted in
another is a difference too, unless listed in ``DERIVED`` with the reason.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "scheduler", "rank", "kv_transfer", "planner")
MODULES = ("pdserve.router.config",)
SUFFIXES = ("Config", "Settings", "Policy")

# Same name, different meaning on purpose: the user's setting on one side, the value the
# engine resolved from it on the other.
DERIVED = {
    # EngineSettings: None = the model's max_position_embeddings;
    # SchedulerConfig: the length the engine resolved (always given).
    "max_model_len": {"SchedulerConfig"},
}

REQUIRED = "<required>"


def _modules() -> list[str]:
    names = list(MODULES)
    for package in PACKAGES:
        for info in pkgutil.iter_modules([str(ROOT / package)]):
            names.append(f"pdserve.{package}.{info.name}")
    return names


def _config_classes() -> list[type]:
    found: dict[str, type] = {}
    for name in _modules():
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (isinstance(value, type) and dataclasses.is_dataclass(value)
                    and value.__module__ == module.__name__
                    and value.__name__.endswith(SUFFIXES)):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return list(found.values())


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return REQUIRED


def declared_defaults() -> dict[str, dict[str, object]]:
    """field name -> {class name: its default}"""
    table: dict[str, dict[str, object]] = {}
    for cls in _config_classes():
        for f in dataclasses.fields(cls):
            if f.init:
                table.setdefault(f.name, {})[cls.__qualname__] = _default(f)
    return table


def conflicts(table: dict[str, dict[str, object]]) -> list[str]:
    out = []
    for name, by_class in sorted(table.items()):
        classes = {c: d for c, d in by_class.items() if c not in DERIVED.get(name, ())}
        values = []
        for default in classes.values():
            if default not in values:
                values.append(default)
        if len(values) > 1:
            out.append(f"{name}: " + ", ".join(f"{c}={d!r}" for c, d in sorted(classes.items())))
    return out


def test_the_walk_finds_the_config_classes():
    names = {cls.__qualname__ for cls in _config_classes()}
    assert {"SchedulerPolicy", "SchedulerConfig", "EngineSettings", "EngineConfig",
            "RouterConfig", "PoolConfig"} <= names


def test_no_setting_has_two_defaults():
    found = conflicts(declared_defaults())
    assert not found, "settings declared with different defaults:\n" + "\n".join(found)


def test_the_check_catches_a_second_default():
    @dataclasses.dataclass
    class AConfig:
        max_num_seqs: int = 64

    @dataclasses.dataclass
    class BConfig:
        max_num_seqs: int = 256

    table = {"max_num_seqs": {c.__qualname__: _default(f) for c in (AConfig, BConfig)
                              for f in dataclasses.fields(c)}}
    assert conflicts(table) == [
        "max_num_seqs: test_the_check_catches_a_second_default.<locals>.AConfig=64, "
        "test_the_check_catches_a_second_default.<locals>.BConfig=256"]


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(
    importlib.import_module("pdserve.scheduler.config").SchedulerPolicy)])
def test_every_scheduler_policy_is_an_engine_setting(name):
    """Reachable from a serve config's engine: mapping and LLM(...) (both take
    EngineSettings fields), with the one default."""
    from pdserve.engine.config import EngineSettings
    from pdserve.scheduler.config import SchedulerPolicy

    engine = {f.name: f for f in dataclasses.fields(EngineSettings)}
    policy = {f.name: f for f in dataclasses.fields(SchedulerPolicy)}
    assert name in engine and _default(engine[name]) == _default(policy[name])

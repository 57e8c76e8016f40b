"""The public surface is exactly what we intend to support."""

import lightning_rl as lrl

EXPECTED = {
    "ConfigurationError", "InMemoryStore", "InvalidRewardError", "LLMCall", "LightningRLError",
    "MissingDependencyError", "Mode",
    "NotAStoreError", "NotInRolloutError", "Reward", "RewardSource", "Rollout", "RolloutNotFoundError",
    "RolloutStatus", "SQLiteStore", "Sample", "SchemaTooNewError", "Span", "Store", "StoreError",
    "TaskNotSerializableError", "TokenIdsSource", "ToolCall", "Trajectory", "UnknownNameError",
    "__version__", "agent_scope", "command", "configure", "current_endpoint", "current_rollout_id", "emit_reward", "flush", "open_store",
    "register_credit", "rollout_overrides", "set_policy_version", "stats", "tool_span", "trace",
}


def test_exported_members():
    assert set(lrl.__all__) == EXPECTED
    for name in lrl.__all__:
        assert hasattr(lrl, name), name


def test_errors_share_one_root_and_match_builtins():
    for name, builtin in [("ConfigurationError", ValueError), ("InvalidRewardError", ValueError),
                          ("NotInRolloutError", RuntimeError), ("TaskNotSerializableError", TypeError),
                          ("NotAStoreError", ValueError), ("SchemaTooNewError", RuntimeError),
                          ("RolloutNotFoundError", KeyError), ("UnknownNameError", KeyError),
                          ("MissingDependencyError", ImportError)]:
        cls = getattr(lrl, name)
        assert issubclass(cls, lrl.LightningRLError) and issubclass(cls, builtin), name


def test_records_forbid_unknown_fields_and_carry_schema_version():
    for cls in (lrl.Rollout, lrl.Span, lrl.Reward, lrl.LLMCall, lrl.Trajectory, lrl.Sample):
        assert cls.model_config.get("extra") == "forbid", cls
        assert "schema_version" in cls.model_fields, cls


def _every_module():
    """Import every module of the package (those of a missing optional dependency are skipped)."""
    import importlib
    import pkgutil

    for info in pkgutil.walk_packages(lrl.__path__, "lightning_rl."):
        try:
            importlib.import_module(info.name)
        except ImportError:
            continue


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_error_is_under_the_root_in_errors_and_in_the_drawn_tree():
    import builtins
    import re

    from lightning_rl import errors

    _every_module()
    found = set(_subclasses(errors.LightningRLError))
    assert {c.__module__ for c in found} == {"lightning_rl.errors"}, "errors are defined in lightning_rl/errors.py"
    drawn = dict(re.findall(r"[└├]── (\w+)(?: \((\w+)\))?", errors.__doc__))
    assert {c.__name__ for c in found} == set(drawn), "the tree in errors.py's docstring lists exactly these"
    for cls in found:  # the builtin drawn beside a class is one it derives from
        if drawn[cls.__name__]:
            assert issubclass(cls, getattr(builtins, drawn[cls.__name__])), cls
    # every error class defined anywhere in the package (not only our root's) is in the tree: none escapes it
    escaped = [f"{m.__name__}.{name}" for m in _loaded_modules() for name, obj in vars(m).items()
               if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == m.__name__
               and not name.startswith("_") and not issubclass(obj, errors.LightningRLError)]
    assert escaped == []


def _loaded_modules():
    import sys

    return [m for name, m in list(sys.modules.items()) if name.startswith("lightning_rl") and m is not None]

"""The public surface is exactly what we intend to support."""

import subprocess
import sys
import types

import lightning_rl as lrl


def test_all_is_exactly_what_the_package_exposes():
    """In the style of httpx's tests/test_exported_members.py: ``__all__`` lists, sorted, every public name
    the package holds (the names it loads on first use too), and nothing else; submodules are not names."""
    modules = {name for name, value in vars(lrl).items() if isinstance(value, types.ModuleType)}
    exposed = {name for name in dir(lrl) if not name.startswith("_") and name not in modules} | {"__version__"}
    assert lrl.__all__ == sorted(exposed)
    for name in lrl.__all__:
        assert getattr(lrl, name) is not None, name
    assert {"Trainer", "LocalConfig", "ContinuousTrainer", "TrainResult", "replay"} <= set(lrl.__all__)
    assert lrl.Trainer.__module__ == "lightning_rl.trainer_bridge.trainer"


def test_importing_the_package_loads_neither_torch_nor_the_trainer():
    code = ("import sys, lightning_rl as lrl; names = ('torch', 'transformers', 'peft', 'lightning_rl.trainer_bridge'); "
            "before = [m for m in names if m in sys.modules]; lrl.LocalConfig; "
            "print(before, [m for m in names if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split("] [")[0] == "[", done.stdout  # nothing heavy at import
    assert "torch" not in done.stdout.split("] [")[1], done.stdout  # the settings need no torch either


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

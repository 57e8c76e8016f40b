"""Every ``LIGHTNING_RL_*`` environment variable the package reads or sets is a constant of
``settings.py``, documented once in its docstring."""

import ast
import re
from pathlib import Path

from lightning_rl import settings

PACKAGE = Path(settings.__file__).resolve().parent
VARIABLE = re.compile(r"_?LIGHTNING_RL_[A-Z_]+")


def test_no_module_but_settings_spells_a_variable_name_in_code():
    spelled = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "settings.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and VARIABLE.fullmatch(node.value):
                spelled.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value}")
    assert spelled == [], "use the constant from lightning_rl.settings"


def test_every_variable_constant_is_documented_in_the_settings_docstring():
    constants = {name: value for name, value in vars(settings).items()
                 if name.startswith("ENV_") and isinstance(value, str)}
    assert len(constants) >= 20
    for name, value in constants.items():
        assert VARIABLE.fullmatch(value), name
        assert f"``{value}``" in settings.__doc__, f"{value} ({name}) is not documented in settings.py"
    documented = set(re.findall(r"``(_?LIGHTNING_RL_[A-Z_]+)``", settings.__doc__))
    assert documented == set(constants.values())

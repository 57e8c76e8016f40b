"""Every ``LIGHTNING_RL_*`` environment variable the package reads or sets is a constant of
``settings.py``, documented once in its docstring."""

import ast
import re
from pathlib import Path

import pytest

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
    clis = set(settings.ENV_CLI_BINARY.values())  # one per coding-agent CLI
    assert all(VARIABLE.fullmatch(value) for value in clis)
    documented = set(re.findall(r"``(_?LIGHTNING_RL_[A-Z_]+)``", settings.__doc__))
    assert documented == set(constants.values()) | clis


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ`` (``from os import environ``)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "environ")


def _named_key(node: ast.AST | None) -> bool:
    """A key that is not a literal string: a settings constant (``ENV_STORE``, ``ENV_CLI_BINARY[p]``) or a
    variable that may hold one."""
    return node is not None and not (isinstance(node, ast.Constant) and isinstance(node.value, str))


def environment_reads(source: str) -> list[int]:
    """The lines of ``source`` that read the environment by a name that is not a string literal:
    ``os.environ.get(X)``, ``os.environ[X]`` (not as an assignment target), ``os.environ.pop/setdefault(X)``,
    ``os.getenv(X)``. Writes for a child process (``os.environ[ENV_X] = ...``, ``{**os.environ, ENV_X: ...}``)
    are not reads."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            environ_call = func.attr in ("get", "pop", "setdefault") and _is_environ(func.value)
            getenv = func.attr == "getenv" and isinstance(func.value, ast.Name) and func.value.id == "os"
            if (environ_call or getenv) and _named_key(node.args[0] if node.args else None):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getenv":
            if _named_key(node.args[0] if node.args else None):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            if _named_key(node.slice):
                lines.append(node.lineno)
    return sorted(lines)


def test_no_module_but_settings_reads_a_variable_from_the_environment():
    """A ``LIGHTNING_RL_*`` value is read through ``settings.py`` (``Settings.from_env`` or a function there,
    read when called), never by a module's own ``os.environ.get(ENV_...)``."""
    reads = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "settings.py" and path.parent == PACKAGE:
            continue
        reads += [f"{path.relative_to(PACKAGE)}:{line}" for line in environment_reads(path.read_text())]
    assert reads == [], "read the variable through lightning_rl.settings (add a function there)"


def test_the_read_check_finds_reads_and_passes_writes():
    reads = environment_reads(
        "import os\nfrom os import environ, getenv\n"
        "a = os.environ.get(ENV_STORE)\n"             # 3
        "b = os.environ[ENV_SPILL_DIR]\n"             # 4
        "c = os.getenv(settings.ENV_MODE, 'x')\n"     # 5
        "d = environ.get(ENV_CLI_BINARY['claude'])\n"  # 6
        "e = os.environ.pop(name, None)\n"            # 7
        "f = getenv(ENV_MODEL)\n"                     # 8
        "os.environ[ENV_STORE_TOKEN] = 'secret'\n"    # a write for a child: allowed
        "env = {**os.environ, ENV_TASK: '{}'}\n"
        "env.pop(ENV_STORE, None)\n"                  # a child's env dict, not the environment
        "g = os.environ.get('OPENAI_API_KEY')\n"      # not one of ours: a literal name
    )
    assert reads == [3, 4, 5, 6, 7, 8]


def test_a_secret_variable_is_read_from_the_secrets_file_when_not_in_the_environment(monkeypatch, tmp_path):
    """``train verl`` hands verl's processes the store's URL and token in a file (Ray logs their environment)."""
    import json

    from lightning_rl.errors import ConfigurationError
    from lightning_rl.settings import store_token, store_url

    path = tmp_path / "secrets.json"
    path.write_text(json.dumps({"LIGHTNING_RL_STORE": "postgresql://u:pw@db/x", "LIGHTNING_RL_STORE_TOKEN": "t0k",
                                "LIGHTNING_RL_MODE": "eval"}))
    for name in ("LIGHTNING_RL_STORE", "LIGHTNING_RL_STORE_TOKEN", "LIGHTNING_RL_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LIGHTNING_RL_SECRETS_FILE", str(path))
    assert (store_url(), store_token()) == ("postgresql://u:pw@db/x", "t0k")
    assert lrl_mode() == "train"  # only the secret variables come from the file
    monkeypatch.setenv("LIGHTNING_RL_STORE_TOKEN", "from-env")
    assert store_token() == "from-env"  # the environment wins
    monkeypatch.setenv("LIGHTNING_RL_SECRETS_FILE", str(tmp_path / "missing.json"))
    monkeypatch.delenv("LIGHTNING_RL_STORE_TOKEN")
    with pytest.raises(ConfigurationError, match=r"missing.json does not exist on this machine.*SECRETS_DIR"):
        store_token()


def lrl_mode() -> str:
    from lightning_rl.settings import Settings

    return Settings.from_env().mode

"""``lightning-rl policies rollback``'s mistakes, caught before the server is touched (the rollback itself,
on a real vLLM server with a running trainer: test_gate_vllm.py)."""

from __future__ import annotations

from click.testing import CliRunner

from lightning_rl.cli import main
from lightning_rl.store import SQLiteStore


def _run(*args):
    return CliRunner().invoke(main, list(args))


def _store(tmp_path):
    db = tmp_path / "runs.db"
    folder = tmp_path / "adapters" / "v00000"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    with SQLiteStore(db) as store:
        store.record_policy("policy", 0, adapter=str(folder))
        store.record_policy("policy", 1, adapter=str(tmp_path / "adapters" / "v00001"))  # folder gone
        store.record_policy("policy", 2, adapter=None)
    return str(db)


def test_an_unknown_version_or_served_name_names_the_value_and_the_fix(tmp_path):
    db = _store(tmp_path)
    unknown = _run("policies", "rollback", "--to", "7", "--store", db, "--server-url", "http://127.0.0.1:9")
    assert unknown.exit_code == 1 and "version 7 of 'policy' was never published" in unknown.output
    assert "(published: [0, 1, 2]); give one of them to --to" in unknown.output
    other = _run("policies", "rollback", "--to", "0", "--store", db, "--server-url", "http://127.0.0.1:9",
                 "--served-name", "planner")
    assert other.exit_code == 1 and "no publish of 'planner' (it holds ['policy'])" in other.output
    assert "--served-name" in other.output
    negative = _run("policies", "rollback", "--to", "-1", "--store", db, "--server-url", "http://127.0.0.1:9")
    assert negative.exit_code == 1 and "int >= 0, got -1" in negative.output


def test_a_missing_adapter_folder_names_the_path_and_nothing_is_recorded(tmp_path):
    db = _store(tmp_path)
    for version, shown in (("1", str(tmp_path / "adapters" / "v00001")), ("2", "None")):
        gone = _run("policies", "rollback", "--to", version, "--store", db, "--server-url", "http://127.0.0.1:9")
        assert gone.exit_code == 1 and f"version {version} of 'policy' has no adapter folder at" in gone.output
        assert shown in gone.output and "put the folder back at that path" in gone.output
    with SQLiteStore(db) as store:
        assert [p.version for p in store.policies("policy")] == [0, 1, 2] and store.decisions() == []


def test_an_unreachable_server_fails_in_one_line_and_records_nothing(tmp_path):
    db = _store(tmp_path)
    down = _run("policies", "rollback", "--to", "0", "--store", db, "--server-url", "http://127.0.0.1:9")
    assert down.exit_code == 1 and "cannot reach http://127.0.0.1:9/v1/load_lora_adapter" in down.output
    assert "Traceback" not in down.output
    with SQLiteStore(db) as store:
        assert [p.version for p in store.policies("policy")] == [0, 1, 2] and store.decisions() == []


def test_the_server_url_is_required_or_read_from_the_environment(tmp_path, monkeypatch):
    db = _store(tmp_path)
    monkeypatch.delenv("LIGHTNING_RL_BASE_URL", raising=False)
    missing = _run("policies", "rollback", "--to", "0", "--store", db)
    assert missing.exit_code == 2 and "--server-url" in missing.output
    monkeypatch.setenv("LIGHTNING_RL_BASE_URL", "http://127.0.0.1:9")
    assert "cannot reach http://127.0.0.1:9" in _run("policies", "rollback", "--to", "0", "--store", db).output

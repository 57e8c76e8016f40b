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

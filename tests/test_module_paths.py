"""Modules split at their seams keep their import paths: every name a module defined before its split is still
importable from it, and is the very object its new module holds (not a copy that could drift)."""

from __future__ import annotations

import importlib

import pytest

# old module path -> {name: the module that holds it now}
MOVED = {
    "lightning_rl.records": {
        "SCHEMA_VERSION": "rollouts", "Mode": "rollouts", "RolloutStatus": "rollouts", "TRANSITIONS": "rollouts",
        "check_transition": "rollouts", "allowed_from": "rollouts", "RewardSource": "rollouts", "Rollout": "rollouts",
        "ROLLOUT_SORTS": "rollouts", "RolloutQuery": "rollouts", "RolloutRow": "rollouts", "RolloutPage": "rollouts",
        "Reward": "rollouts", "QuarantinedRecord": "rollouts", "SpanTokens": "spans", "Span": "spans",
        "pack_ids": "spans", "unpack_ids": "spans", "pack_logprobs": "spans", "unpack_logprobs": "spans",
        "PackedTokens": "spans", "SpanRow": "spans", "PolicyRecord": "policies", "Decision": "policies",
        "PolicyDecision": "policies", "QueueStatus": "queue", "SAMPLING_KEYS": "queue",
        "QUEUE_OVERRIDE_KEYS": "queue", "QueueEntry": "queue", "TokenIdsSource": "trajectories",
        "ToolCall": "trajectories", "LLMCall": "trajectories", "Trajectory": "trajectories", "Sample": "trajectories",
    },
    "lightning_rl.store.wire": {
        **dict.fromkeys(["API_PREFIX", "CLIENT_BATCH_OPS", "MAX_BATCH_OPS", "MAX_ID_CHARS", "TOKEN_ID_LIMIT",
                         "SPAN_KINDS", "STATUS_CODES", "SpanAttributes", "WireTokens", "WireListTokens", "WireSpan",
                         "StartRolloutOp", "SpanOp", "RewardOp", "FinishRolloutOp", "WireOp", "Batch", "BatchResult",
                         "RewardIn", "EnqueueIn", "LeaseIn", "MAX_LEASE_WAIT", "HeartbeatIn", "CompleteIn",
                         "DecisionIn", "PolicyIn", "RewardedSince", "GroupsIn", "RolloutIdsIn", "Ok",
                         "DeleteRolloutsIn", "Deleted", "RolloutData", "QUEUE_ENTRIES", "queue_entry_json", "ROLLOUTS",
                         "SPANS", "REWARDS", "ROLLOUT_DATA"], "models"),
        "check_ops": "checks", "op_indices": "checks",
        **dict.fromkeys(["ExpireTryOp", "QuarantineOp", "SpillOp", "SPILL_LINE", "to_ops", "decode", "encode",
                         "batch_body"], "codec"),
    },
    "lightning_rl.store.kit.base": {
        "Batch": "lightning_rl.store.kit.batch", "sort_ops": "lightning_rl.store.kit.batch",
        "finished": "lightning_rl.store.kit.batch", "expired": "lightning_rl.store.kit.batch",
        "ImmediateWriter": "lightning_rl.store.kit.in_process", "DictQueueView": "lightning_rl.store.kit.in_process",
    },
    "lightning_rl.trainer_bridge.runner": {
        "LoopThread": "lightning_rl.trainer_bridge.loop_thread",
        "agent_reference": "lightning_rl.trainer_bridge.agent_loading",
        "load_agent": "lightning_rl.trainer_bridge.agent_loading",
    },
    "lightning_rl.capture.exchange": dict.fromkeys(["HOSTED", "takes_token_fields", "Server", "resend_without_token_fields",
                                                   "refused_token_fields"], "lightning_rl.capture.token_fields"),
    "lightning_rl.adapters.http_clients": dict.fromkeys(["endpoint_of", "instrumented_request", "seen", "done",
                                                        "failed"], "lightning_rl.adapters.http_bypass"),
    "lightning_rl.store.postgres.store": dict.fromkeys(["DEFAULT_SCHEMA", "SCHEMES", "parse_url", "is_record_error"],
                                                       "lightning_rl.store.postgres.connection"),
    "lightning_rl.tracer.provider": dict.fromkeys(["CaptureProvider", "RolloutSpanProcessor", "otel_sdk_disabled"],
                                                  "lightning_rl.tracer.processor"),
    "lightning_rl.tracer.decorator": {"rollout_overrides": "lightning_rl.tracer.tasks"},
    "lightning_rl.trainer_bridge.sources": {
        "StepBatch": "interface", "SampleSource": "interface", "read_groups": "interface", "LiveGroups": "groups",
        "StoredGroups": "groups", "ProductionStream": "production",
    },
}


@pytest.mark.parametrize("old,name,new", [(old, name, new) for old, names in MOVED.items()
                                          for name, new in names.items()])
def test_a_moved_name_is_importable_from_its_old_module(old, name, new):
    new = new if new.startswith("lightning_rl.") else f"{old}.{new}"
    assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new), name)


# the verl bridge's modules, moved into trainer_bridge/verl/ (issue 54): the old path is the same module
VERL_MOVED = {"verl_data": "data", "verl_export": "export", "verl_launch": "launch", "verl_rows": "rows",
              "verl_agent_loop": "agent_loop", "verl_trainer": "trainer", "verl_main": "main"}


@pytest.mark.parametrize("old,new", sorted(VERL_MOVED.items()))
def test_a_verl_module_is_importable_from_its_old_path(old, new):
    if new in ("agent_loop", "trainer", "main"):  # they import verl (and Hydra)
        pytest.importorskip("verl")
    module = importlib.import_module(f"lightning_rl.trainer_bridge.verl.{new}")
    assert importlib.import_module(f"lightning_rl.trainer_bridge.{old}") is module
    from lightning_rl.trainer_bridge import verl

    assert verl.to_dataproto is importlib.import_module("lightning_rl.trainer_bridge.verl.dataproto").to_dataproto


def test_the_continuous_trainer_keeps_its_going_live_decisions():
    from lightning_rl.trainer_bridge.continuous import ContinuousTrainer
    from lightning_rl.trainer_bridge.going_live import GoingLive

    assert issubclass(ContinuousTrainer, GoingLive)
    assert not {"_judge", "_start_canary", "_watch", "_follow_live"} - set(dir(ContinuousTrainer))


def test_a_backend_answers_with_its_own_methods_not_the_kits():
    from lightning_rl.store.http.client import HttpStore
    from lightning_rl.store.http.queries import ServerQueries
    from lightning_rl.store.http.server_queue import ServerQueue
    from lightning_rl.store.postgres.queue_methods import PostgresQueue
    from lightning_rl.store.postgres.store import PostgresStore

    for store, base in ((HttpStore, ServerQueries), (HttpStore, ServerQueue), (PostgresStore, PostgresQueue)):
        methods = [name for name, value in vars(base).items() if callable(value) and not name.startswith("__")]
        assert methods and all(getattr(store, name) is getattr(base, name) for name in methods), base

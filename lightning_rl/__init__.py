"""lightning-rl: train the LLM agents you already have with reinforcement learning.

Decorate an agent's entry function with ``@trace``; every LLM call inside it (OpenAI client,
LangChain, AutoGen) is captured with the serving engine's token ids and logprobs, stored durably
(SQLite by default), and assembled into trajectories with rewards, ready for training.

What a training script needs is here too, loaded on first use (``import lightning_rl`` loads neither
torch nor the trainer bridge): ``Trainer`` and ``LocalConfig`` (train over a task set, ``fit`` returning a
``TrainResult``), ``ContinuousTrainer`` (from production traffic), ``replay`` and ``StoredGroups`` (train
on a stored run), ``GroupJudge`` (reward what the agent leaves unrewarded), ``VLLMServer`` (serve the model
with LoRA hot-loading on this machine) and ``plot_metrics``.
"""

from importlib import import_module as _import_module
from typing import Any as _Any

from ._api import command, configure, flush, open_store, set_policy_version, stats
from .adapters import install as _instrument_frameworks
from .adapters.openai import instrument as _instrument_openai
from .errors import (
    ConfigurationError,
    InvalidRewardError,
    LightningRLError,
    MissingDependencyError,
    NotAStoreError,
    NotInRolloutError,
    RolloutNotFoundError,
    SchemaTooNewError,
    StoreError,
    TaskNotSerializableError,
    UnknownNameError,
)
from .records import (
    LLMCall,
    Mode,
    Reward,
    RewardSource,
    Rollout,
    RolloutStatus,
    Sample,
    Span,
    TokenIdsSource,
    ToolCall,
    Trajectory,
)
from .store import InMemoryStore, SQLiteStore, Store, register_credit, samples, trajectories, trajectory
from . import sandbox  # noqa: F401 - callable: lrl.sandbox() is the try's sandbox (lightning_rl/sandbox/__init__.py)
from .tracer import agent_scope, current_endpoint, current_rollout_id, emit_reward, rollout_overrides, tool_span, trace

__version__ = "0.1.0"

#: Public names loaded on first use: name -> the module that defines it.
_LAZY = {
    "ContinuousTrainer": "lightning_rl.trainer_bridge.continuous",
    "GroupJudge": "lightning_rl.judge",
    "LocalConfig": "lightning_rl.trainer_bridge.config",
    "SandboxPool": "lightning_rl.sandbox.pool",
    "Snapshot": "lightning_rl.sandbox.layers",
    "StoredGroups": "lightning_rl.trainer_bridge.sources",
    "TrainResult": "lightning_rl.trainer_bridge.trainer",
    "Trainer": "lightning_rl.trainer_bridge.trainer",
    "VLLMServer": "lightning_rl.vllm_server",
    "claude_code": "lightning_rl.gateway.coding_agents",
    "codex": "lightning_rl.gateway.coding_agents",
    "opencode": "lightning_rl.gateway.coding_agents",
    "plot_metrics": "lightning_rl.trainer_bridge.plotting",
    "replay": "lightning_rl.trainer_bridge.replay",
    "sandboxes": "lightning_rl.sandbox.tries",
}


def __getattr__(name: str) -> _Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_rl' has no attribute {name!r}")
    value = getattr(_import_module(module), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


_instrument_openai()
_instrument_frameworks()  # LangChain and AutoGen: now if imported, else the moment they are

__all__ = [
    "ConfigurationError",
    "ContinuousTrainer",
    "GroupJudge",
    "InMemoryStore",
    "InvalidRewardError",
    "LLMCall",
    "LightningRLError",
    "LocalConfig",
    "MissingDependencyError",
    "Mode",
    "NotAStoreError",
    "NotInRolloutError",
    "Reward",
    "RewardSource",
    "Rollout",
    "RolloutNotFoundError",
    "RolloutStatus",
    "SQLiteStore",
    "Sample",
    "SandboxPool",
    "SchemaTooNewError",
    "Snapshot",
    "Span",
    "Store",
    "StoreError",
    "StoredGroups",
    "TaskNotSerializableError",
    "TokenIdsSource",
    "ToolCall",
    "TrainResult",
    "Trainer",
    "Trajectory",
    "UnknownNameError",
    "VLLMServer",
    "__version__",
    "agent_scope",
    "claude_code",
    "codex",
    "command",
    "configure",
    "current_endpoint",
    "current_rollout_id",
    "emit_reward",
    "flush",
    "open_store",
    "opencode",
    "plot_metrics",
    "register_credit",
    "replay",
    "rollout_overrides",
    "samples",
    "sandboxes",
    "set_policy_version",
    "stats",
    "tool_span",
    "trace",
    "trajectories",
    "trajectory",
]

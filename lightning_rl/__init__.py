"""lightning-rl: train the LLM agents you already have with reinforcement learning.

Decorate an agent's entry function with ``@trace``; every LLM call inside it (OpenAI client,
LangChain, AutoGen) is captured with the serving engine's token ids and logprobs, stored durably
(SQLite by default), and assembled into trajectories with rewards, ready for training.
"""

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
from .store import InMemoryStore, SQLiteStore, Store, register_credit
from .tracer import agent_scope, current_endpoint, current_rollout_id, emit_reward, rollout_overrides, tool_span, trace

__version__ = "0.1.0"

_instrument_openai()
_instrument_frameworks()  # LangChain and AutoGen: now if imported, else the moment they are

__all__ = [
    "ConfigurationError",
    "InMemoryStore",
    "InvalidRewardError",
    "LLMCall",
    "LightningRLError",
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
    "SchemaTooNewError",
    "Span",
    "Store",
    "StoreError",
    "TaskNotSerializableError",
    "TokenIdsSource",
    "ToolCall",
    "Trajectory",
    "UnknownNameError",
    "__version__",
    "agent_scope",
    "command",
    "configure",
    "current_endpoint",
    "current_rollout_id",
    "emit_reward",
    "flush",
    "open_store",
    "register_credit",
    "rollout_overrides",
    "set_policy_version",
    "stats",
    "tool_span",
    "trace",
]

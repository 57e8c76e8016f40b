"""The store server's wire format, shared by the server (validation) and the HTTP client (encoding).

A write is a batch of ops, applied in one transaction and idempotent, so a client can retry any
batch it is unsure about:

* ``start_rollout``: inserted once per ``rollout_id`` (a repeat is ignored);
* ``span``: one row per ``(rollout_id, seq)`` (a repeat is ignored);
* ``reward``: one row per ``uid`` (a repeat is ignored);
* ``finish_rollout``: a status transition (a repeat is refused by the lifecycle rules, harmlessly).

They are the writer's own operations (``store/ops.py``) as JSON: :func:`encode` writes one (also what a
spill file holds, one per line, with two more that never travel: ``expire_try`` and ``quarantine``),
:func:`to_ops` turns a validated batch back into them, :func:`decode` reads a spill line.

Types are checked strictly (``"5"`` is not an int); :func:`check_ops` adds the rules types cannot
say (hex ids, token ids, finite log-probs, ...). Every problem is reported with its path in the batch.

In three parts, every name importable from here (``wire.encode``, ``wire.Batch``, ...):

* ``models.py``: the types (the ops, the batch, the other endpoints' bodies) and the limits;
* ``checks.py``: the server's checks beyond types (``check_ops``, ``op_indices``);
* ``codec.py``: ops as JSON lines and back (``encode``, ``batch_body``, ``to_ops``, ``decode``; the spill ops).
"""

from .checks import check_ops, op_indices
from .codec import SPILL_LINE, ExpireTryOp, QuarantineOp, SpillOp, batch_body, decode, encode, to_ops
from .models import (
    API_PREFIX, CLIENT_BATCH_OPS, MAX_BATCH_OPS, MAX_CANCEL_IDS, MAX_ID_CHARS, MAX_LEASE_WAIT, QUEUE_ENTRIES,
    REWARDS, ROLLOUT_DATA, ROLLOUTS, SPAN_KINDS, SPANS, STATUS_CODES, TOKEN_ID_LIMIT, Batch, BatchResult, CancelIn,
    Cancelled, CompleteIn, DecisionIn, DeleteRolloutsIn, Deleted, EnqueueIn, FinishRolloutOp, GroupsIn, HeartbeatIn,
    LeaseIn, Ok, PolicyIn, RewardedSince, RewardIn, RewardOp, RolloutData, RolloutIdsIn, SpanAttributes, SpanOp,
    StartRolloutOp, WireListTokens, WireOp, WireSpan, WireTokens, queue_entry_json,
)

__all__ = [
    "API_PREFIX", "Batch", "BatchResult", "CLIENT_BATCH_OPS", "CancelIn", "Cancelled", "CompleteIn", "DecisionIn",
    "DeleteRolloutsIn", "Deleted", "EnqueueIn", "ExpireTryOp", "FinishRolloutOp", "GroupsIn", "HeartbeatIn",
    "LeaseIn", "MAX_BATCH_OPS", "MAX_CANCEL_IDS", "MAX_ID_CHARS", "MAX_LEASE_WAIT", "Ok", "PolicyIn",
    "QUEUE_ENTRIES", "QuarantineOp", "REWARDS", "ROLLOUTS", "ROLLOUT_DATA", "RewardIn", "RewardOp", "RewardedSince",
    "RolloutData", "RolloutIdsIn", "SPANS", "SPAN_KINDS", "SPILL_LINE", "STATUS_CODES", "SpanAttributes", "SpanOp",
    "SpillOp", "StartRolloutOp", "TOKEN_ID_LIMIT", "WireListTokens", "WireOp", "WireSpan", "WireTokens",
    "batch_body", "check_ops", "decode", "encode", "op_indices", "queue_entry_json", "to_ops",
]

"""Sample sources: what ``Trainer.fit`` trains on, behind one interface.

A source hands the trainer whole groups of rollouts, one batch per update (``next_batch``), and
hears when the update's weights are published (``published``). The trainer does the rest the same
way whatever the source: failures (``failures.py``), samples, samples too stale to use, the update,
the publish, the metrics line.

* ``LiveGroups``: tasks queued n times (one group each) and run by the trainer's runner against the
  served model. Synchronous (``max_staleness=0``): a step's groups are queued, run to the end, then
  trained on, and the next step's are queued after the publish. Overlapped (``max_staleness=k``): the
  runner keeps working while the trainer updates; up to ``k + 1`` steps' groups are queued ahead, a
  batch is the first ``tasks_per_step`` groups to complete, and new weights go live while rollouts are
  in flight. Both are the same code: k = 0 queues one step ahead, so nothing runs during an update.
* ``StoredGroups``: replay. The batches of a run already in a store, rebuilt from what each published
  version was trained on (``PolicyRecord.trained_on``), or else the store's train groups in the order
  they were queued; nothing runs. Same store, seed and settings: the same loss sequence.
* ``ProductionStream``: continuous mode. Production rollouts (``mode="prod"``) as their rewards arrive,
  late or never; a batch is every fresh rewarded rollout once ``min_new`` wait, each its own group, with
  the samples the trainer can reproduce chosen by the source (``StepBatch.samples``). Its state is
  resumable; ``continuous.py`` (``lightning-rl train continuous``) trains from it without end.

In three parts, every name importable from here (``from lightning_rl.trainer_bridge.sources import StepBatch``):
``interface.py`` (``SampleSource``, ``StepBatch``, ``read_groups``), ``groups.py`` (``LiveGroups``,
``StoredGroups``) and ``production.py`` (``ProductionStream``).
"""

from .groups import LiveGroups, StoredGroups
from .interface import SampleSource, StepBatch, read_groups
from .production import ProductionStream

__all__ = ["LiveGroups", "ProductionStream", "SampleSource", "StepBatch", "StoredGroups", "read_groups"]

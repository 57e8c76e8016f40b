"""Sample sources: what ``Trainer.fit`` trains on, behind one interface.

A source hands the trainer whole groups of rollouts, one batch per update (``next_batch``), and
hears when the update's weights are published (``published``). The trainer does the rest the same
way whatever the source: failures (``failures.py``), samples, samples too stale to use, the update,
the publish, the metrics line.

* ``LiveGroups`` (tasks queued n times and run, synchronous or overlapped with bounded staleness) and
  ``StoredGroups`` (replay of a run already in a store): ``groups.py``.
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

"""The store kit: what every backend shares, so that a new one is a folder of storage primitives.

* ``backends.py``: URL scheme -> backend, the one registry every choice of store goes through
  (``open_store``, the store server, the CLI, the verl launch).
* ``base.py``: ``KitStore``, the sink funnel, ingest, the task queue and the scan-backed queries written
  once over a dozen storage primitives.
* ``batch.py``: ``sort_ops``, the one dispatch of the writer's ops into a ``Batch``; ``finished``, ``expired``.
* ``in_process.py``: ``ImmediateWriter`` and ``DictQueueView``, for a store that keeps everything in this process.
* ``rollout_sql.py``: the rollout queries of the SQL backends, built once for each SQL dialect.

``docs/extending.md`` ("Add a store backend") walks through adding one.
"""

from .backends import STORE_BACKENDS, StoreBackend, register_store_backend
from .base import Batch, DictQueueView, ImmediateWriter, KitStore, expired, finished, sort_ops

__all__ = ["Batch", "DictQueueView", "ImmediateWriter", "KitStore", "STORE_BACKENDS", "StoreBackend", "expired",
           "finished", "register_store_backend", "sort_ops"]

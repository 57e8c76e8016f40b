"""Tasks to verl's dataset files (``lightning-rl train verl --tasks tasks.jsonl [--val-tasks ...]``).

verl's trainer reads parquet rows (its ``RLHFDataset``): ``prompt`` (chat messages), ``data_source``,
``ability``, ``reward_model``, ``extra_info``. ``write_verl_dataset(tasks, path)`` writes one row per task
with the task itself as JSON text in ``extra_info.task_json`` (any JSON value: parquet cannot hold a column
whose rows have different shapes), which the agent loop hands the agent unchanged (``agent_loop.task_of``),
and ``agent_name: lightning_rl`` (verl's agent loop for the row). The agent never sees ``prompt``: verl
needs one (its dataset tokenizes it for lengths and logging), so it is a short text that names the task.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...errors import ConfigurationError

PROMPT_CHARS = 200  # of the task's JSON in the row's prompt (verl's logs and length filter read it)


def verl_rows(tasks: Sequence[Any], *, split: str) -> list[dict[str, Any]]:
    rows = []
    for i, task in enumerate(tasks):
        try:
            text = json.dumps(task, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"task {i} ({task!r:.60}) is not JSON ({exc}); give JSON values") from None
        rows.append({"data_source": "lightning_rl", "agent_name": "lightning_rl", "ability": "agent",
                     "prompt": [{"role": "user", "content": text[:PROMPT_CHARS]}],
                     "reward_model": {"style": "lightning_rl", "ground_truth": ""},
                     "extra_info": {"index": i, "split": split, "task_json": text}})
    return rows


def write_verl_dataset(tasks: Sequence[Any], path: str | Path, *, split: str = "train") -> Path:
    """Write ``tasks`` as a verl parquet file at ``path`` (module doc); returns the path."""
    if not tasks:
        raise ConfigurationError(f"no task to write to {str(path)!r}; give at least one")
    try:
        import pandas as pd
    except ImportError as exc:  # the CLI turns it into one line naming the extra (errors.missing_dependency)
        raise ImportError("writing verl's parquet needs pandas and pyarrow: pip install 'lightning-rl[verl]'",
                          name=exc.name or "pandas") from exc
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(verl_rows(tasks, split=split)).to_parquet(path, index=False)
    return path

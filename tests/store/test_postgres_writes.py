"""The PostgreSQL store's write path: new rows by COPY, a batch with a row already there written again by
INSERT ... ON CONFLICT DO NOTHING, with the guarantees of ``postgres_sql.py``'s module doc."""

from __future__ import annotations

import time

import pytest

from lightning_rl.diagnostics import counters
from lightning_rl.records import Reward, RewardSource, RolloutStatus
from lightning_rl.store.ops import EncodedSpan, FinishRollout, StartRollout, WriteReward
from lightning_rl.store.rows import span_record_values

from .helpers import llm_span, rollout

@pytest.fixture
def pg(pg_url):
    from lightning_rl.store.postgres.store import PostgresStore

    store = PostgresStore(pg_url, retry_for=5.0)
    yield store
    store.close()


def _ops(rollout_id: str, spans: int, rewards: list[float]) -> list:
    return ([StartRollout(rollout(rollout_id))]
            + [EncodedSpan(span_record_values(llm_span(rollout_id, seq, seq, [1, 2, 3 + seq], [7, seq])))
               for seq in range(spans)]
            + [WriteReward(Reward(rollout_id=rollout_id, name="step", value=v, source=RewardSource.EMITTED,
                                  uid=f"{rollout_id}-{i}")) for i, v in enumerate(rewards)]
            + [FinishRollout(rollout_id, RolloutStatus.SUCCEEDED, time.time(), None)])


def _counts(store, rollout_id: str) -> tuple[int, int, int]:
    def read(conn):
        return tuple(conn.execute(f"SELECT count(*) FROM {table} WHERE rollout_id = %s", (rollout_id,)).fetchone()[0]
                     for table in ("rollouts", "spans", "rewards"))

    return store._with(read, what="test")


def test_a_batch_written_again_changes_nothing(pg):
    ops = _ops("r1", 5, [0.1, 0.2])
    pg.write_batch(ops)
    before = counters().get("pg_batches_rewritten", 0)
    pg.write_batch(ops)  # the retry after a lost answer, on this or another server
    assert counters()["pg_batches_rewritten"] == before + 1
    assert _counts(pg, "r1") == (1, 5, 2)
    assert [s.seq for s in pg.spans("r1")] == [0, 1, 2, 3, 4]
    assert pg.get_rollout("r1").status == "succeeded"


def test_a_batch_with_some_rows_there_already_writes_the_new_ones(pg):
    first = _ops("r1", 3, [0.5])
    pg.write_batch(first[:3])  # the start and two spans made it; the answer was lost
    pg.write_batch(first + _ops("r2", 2, [1.0]))
    assert _counts(pg, "r1") == (1, 3, 1) and _counts(pg, "r2") == (1, 2, 1)
    assert pg.get_rollout("r1").status == pg.get_rollout("r2").status == "succeeded"
    assert pg.quarantined() == []  # a row that is there already is not a bad record


def test_rewards_of_a_batch_take_ids_in_the_order_written(pg):
    values = [0.9, 0.1, 0.5, 0.3, 0.7]
    pg.write_batch(_ops("r1", 1, values))
    assert [r.value for r in pg.rewards("r1")] == values  # read in reward id order


def test_a_refused_finish_in_a_batch_is_counted_and_the_first_one_stands(pg):
    before = counters().get("rejected_status_transitions", 0)
    pg.write_batch([StartRollout(rollout("r1")), FinishRollout("r1", RolloutStatus.FAILED, time.time(), "boom"),
                    FinishRollout("r1", RolloutStatus.SUCCEEDED, time.time(), None),
                    FinishRollout("nobody", RolloutStatus.SUCCEEDED, time.time(), None)])
    assert pg.get_rollout("r1").status == "failed"
    assert counters()["rejected_status_transitions"] == before + 2


def test_a_nul_in_text_is_stored_as_a_replacement_character_and_counted(pg):
    before = counters().get("text_nul_replaced", 0)
    span = llm_span("r1", 0, 0, [1], [2]).model_copy(update={"name": "chat\x00tiny"})
    pg.write_batch([StartRollout(rollout("r1")), EncodedSpan(span_record_values(span))])
    assert pg.spans("r1")[0].name == "chat\ufffdtiny"
    assert counters()["text_nul_replaced"] == before + 1

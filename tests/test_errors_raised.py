"""Errors from ``errors.py``'s tree where lightning-rl once raised a bare ``RuntimeError``: each is still a
``RuntimeError`` (callers that catch that keep working), and its first line names the value and the fix."""

from __future__ import annotations

import concurrent.futures
import stat

import pytest

from lightning_rl.errors import (ConfigurationError, EngineStartError, LightningRLError, RunnerStoppedError,
                                 StoreClosedError)
from lightning_rl.store.sqlite.store import SQLiteStore
from lightning_rl.store.writer import BackgroundWriter
from lightning_rl.trainer_bridge.sources import LiveGroups
from lightning_rl.vllm_server import VLLMServer


def _script(tmp_path, body: str):
    path = tmp_path / "fake-python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_vllm_server_that_exits_at_start_is_an_engine_start_error(tmp_path):
    log = tmp_path / "vllm.log"
    server = VLLMServer(model="/no/such/model", python=_script(tmp_path, "echo no such model >&2; exit 3"),
                        log_path=log, port=1)
    with pytest.raises(EngineStartError) as caught:
        server.start()
    first, _, tail = str(caught.value).partition("\n")
    assert "'/no/such/model' exited with code 3" in first and "start it again" in first
    assert "no such model" in tail  # the server's log follows
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value, LightningRLError)


def test_a_vllm_server_never_ready_is_an_engine_start_error_and_is_stopped(tmp_path):
    server = VLLMServer(model="tiny", python=_script(tmp_path, "exec sleep 60"), port=1, ready_timeout=1.0)
    with pytest.raises(EngineStartError, match=r"not ready after ready_timeout=1.0s .*give it longer"):
        server.start()
    assert server.process.poll() is not None  # stopped, not left running


def test_the_kv_cache_size_reaches_vllm_and_a_bad_one_is_refused(tmp_path):
    seen = tmp_path / "seen"
    python = _script(tmp_path, f'echo "$@" > {seen}; env > {seen}.env; exit 3')
    with pytest.raises(EngineStartError):
        VLLMServer(model="m", python=python, kv_cache_mib=256, port=1).start()
    assert "--kv-cache-memory-bytes 268435456" in seen.read_text()
    # the CPU build lets $VLLM_CPU_KVCACHE_SPACE override the option: it is not passed on
    assert "VLLM_CPU_KVCACHE_SPACE" not in (tmp_path / "seen.env").read_text()
    for bad in (0, 0.5, True, "256"):
        with pytest.raises(ConfigurationError, match=rf"kv_cache_mib must be a whole number of MiB.*got {bad!r}"):
            VLLMServer(model="m", python=python, kv_cache_mib=bad, port=1).start()


def test_a_write_after_the_writer_is_closed_is_a_store_closed_error():
    writer = BackgroundWriter(lambda ops: None, name="test-writer")
    writer.close()
    for put in (lambda: writer.put("op"), lambda: writer.put_many(["op"])):
        with pytest.raises(StoreClosedError, match="test-writer is closed: .*open the store again"):
            put()
    assert issubclass(StoreClosedError, RuntimeError)


def test_a_runner_that_stops_while_groups_are_queued_is_a_runner_stopped_error(tmp_path):
    store = SQLiteStore(tmp_path / "s.db")
    ended: concurrent.futures.Future = concurrent.futures.Future()
    ended.set_result(0)  # the runner's work() returned: it ran no try
    live = LiveGroups(store, [{"t": 1}], n=2, tasks_per_step=1, steps=1, work=lambda: ended, poll=0.01)
    live.start()
    with pytest.raises(RunnerStoppedError, match=r"1 group\(s\) were still queued \(first: '.+'\); stop it only"):
        live.next_batch()
    store.close()

"""Helpers for driving verl 0.9.1's V1 trainer code on CPU: a local Ray with a real TransferQueue, verl's V1
agent-loop worker, its replay buffer and the trainer step's own advantage and metrics functions."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
import traceback
from types import SimpleNamespace

import pytest

from ..conftest import ensure_tiny_model


@pytest.fixture(scope="module")
def transfer_queue():
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"storage_backend": "SimpleStorage",
                                          "SimpleStorage": {"total_storage_size": 1000, "num_data_storage_units": 1}}}))
    yield tq
    tq.close()
    ray.shutdown()


def within(seconds: float, fn, *args, **kwargs):
    """``fn``'s result, or a test failure after ``seconds``: verl's replay buffer and TransferQueue calls wait
    without a limit, and a test must fail, not hang, when what they wait for never comes.

    ``within(s, asyncio.run, coro)`` runs the coroutine on one event loop that lives as long as the process,
    as verl's agent-loop worker (a Ray actor) runs every prompt on its one loop. A new loop per prompt, as
    ``asyncio.run`` makes, is not what TransferQueue's client expects (its socket pool keeps sockets per
    loop and sweeps a closed loop's): on such loops one controller request in about four runs of
    ``test_verls_v1_worker_runs_our_loop...`` was never answered and the test hung (2026-11-27). At the
    limit the failure shows where every thread waits and, for a coroutine, where each task of the loop is
    suspended."""
    if fn is asyncio.run:
        (coro,) = args
        loop = _worker_loop()
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(seconds)
        except concurrent.futures.TimeoutError:
            waits = _waits(None, [loop])
            future.cancel()  # not left running on the loop the next test uses
            if "transfer_queue/client.py" in waits and "in _request_controller" in waits:
                raise TransferQueueNoReply(f"{coro!r} did not finish within {seconds} s: a TransferQueue "
                                           f"controller request was never answered\n{waits}\n"
                                           f"{sockets_waiting()}\n{controller_stacks()}") from None
            pytest.fail(f"{coro!r} did not finish within {seconds} s\n{waits}")
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not finish within {seconds} s\n{_waits(thread, [])}")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class TransferQueueNoReply(AssertionError):
    """A request of TransferQueue's client to its controller was never answered: it waits without a limit
    (TransferQueue 0.1.11). Seen in about one verl suite in three on this machine, always in verl's
    ``_agent_loop_postprocess`` -> ``async_kv_batch_put`` -> ``async_kv_retrieve_meta``, after our loop returned
    its rows. Found (2026-11-27, docs/verl.md "Close your agent's AsyncOpenAI client"): the controller answered
    and the answer sat in the client's socket, whose descriptor its event loop no longer watched
    (``sockets_waiting``): the test agents' ``AsyncOpenAI`` clients were never closed, and the one openai closes
    when it is collected aborts a connection whose socket was already closed, unregistering a descriptor number
    that by then was TransferQueue's. The agents now close their clients; this stays to name a recurrence."""


def _thread_stacks(_actor=None) -> str:
    """Every thread's stack in this process (run inside the controller's actor by ``controller_stacks``)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"controller thread {names.get(ident, ident)}:\n"
                     + "".join(traceback.format_list(traceback.extract_stack(frame)[-10:]))
                     for ident, frame in sys._current_frames().items())


def sockets_waiting() -> str:
    """Each pyzmq asyncio socket with a receive pending: whether a message is there (``POLLIN``) and whether its
    event loop watches its file descriptor (asyncio's selector map, and the kernel's epoll set read from
    ``/proc/self/fdinfo``). Found so, 2026-11-27: TransferQueue's controller had answered (the controller idle
    in ``recv``, the answer in the client's socket), but that socket's descriptor was in neither, so its loop was
    never woken for it; calling pyzmq's handler by hand delivered the answer."""
    try:
        import gc

        import zmq
        import zmq.asyncio
    except ImportError:
        return "(pyzmq is not installed)"
    lines = []
    for sock in gc.get_objects():
        try:
            if not isinstance(sock, zmq.asyncio.Socket) or sock.closed or not sock._recv_futures:
                continue
            loop, fd = sock._current_loop, sock._shadow_sock.FD
            selector = loop._selector
            in_map = fd in selector.get_map()
            with open(f"/proc/self/fdinfo/{selector._selector.fileno()}") as f:
                in_epoll = any(line.split()[1] == str(fd) for line in f if line.startswith("tfd:"))
            lines.append(f"zmq socket {sock.getsockopt(zmq.IDENTITY)!r} to {sock.getsockopt(zmq.LAST_ENDPOINT)!r}: "
                         f"message waiting {bool(sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)}, fd {fd} watched by its "
                         f"loop: asyncio {in_map}, epoll {in_epoll}")
        except Exception as exc:  # noqa: BLE001 - a report of a failure must not fail itself
            lines.append(f"(a zmq socket could not be read: {type(exc).__name__}: {exc})")
    return "\n".join(lines) or "(no zmq socket with a receive pending)"


def controller_stacks(timeout: float = 15.0) -> str:
    """Where each thread of TransferQueue's controller (a Ray actor) is, read through Ray: its requests are
    answered one at a time by one thread, so a request never answered is either lost on the way or behind a
    handler that does not return; this says which."""
    try:
        import ray
        from transfer_queue import interface

        controller = interface._TQ_CONTROLLER
        if controller is None:
            return "(no TransferQueue controller in this process to ask)"
        return ray.get(controller.__ray_call__.remote(_thread_stacks), timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - a report of a failure must not fail itself
        return f"(the controller's stacks could not be read: {type(exc).__name__}: {exc})"


_LOOP: list = []


def _worker_loop() -> asyncio.AbstractEventLoop:
    """The process's one loop for verl's worker coroutines, run by a daemon thread."""
    if not _LOOP:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="verl-worker-loop", daemon=True).start()
        _LOOP.append(loop)
    return _LOOP[0]


def _waits(thread: threading.Thread | None, loops: list) -> str:
    """Where each task of ``loops`` is suspended and where each thread of the process waits."""
    out = []
    for loop in loops:
        for _ in range(3):  # the set may change while it is read
            try:
                tasks = list(asyncio.all_tasks(loop))
                break
            except RuntimeError:
                tasks = []
        for task in tasks:
            chain, coro = [], task.get_coro()
            while coro is not None and len(chain) < 30:  # the await chain, outermost first
                frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                if frame is not None:
                    chain.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}\n")
                coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
            out.append(f"task {task.get_name()}:\n{''.join(chain) or '  (done)'}")
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        mark = " (the one waited for)" if thread is not None and ident == thread.ident else ""
        stack = "".join(traceback.format_list(traceback.extract_stack(frame)[-8:]))
        out.append(f"thread {names.get(ident, ident)}{mark}:\n{stack}")
    return "\n".join(out)


def compose_config(db, *, prompt_length: int, response_length: int, n: int, agent: str, **lightning):
    """Our packaged config composed with verl's own (as ``train verl`` runs it), for the tiny model."""
    from hydra import compose, initialize_config_dir

    from lightning_rl.trainer_bridge.verl.launch import CONFIG_DIR, CONFIG_NAME

    overrides = [f"actor_rollout_ref.model.path={ensure_tiny_model()}",
                 f"actor_rollout_ref.rollout.prompt_length={prompt_length}",
                 f"actor_rollout_ref.rollout.response_length={response_length}", f"actor_rollout_ref.rollout.n={n}",
                 f"lightning_rl.agent={agent}", f"lightning_rl.store=sqlite:///{db}", "lightning_rl.model=tiny"]
    overrides += [f"lightning_rl.{k}={v}" for k, v in lightning.items()]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(CONFIG_NAME, overrides=overrides)


def v1_worker(config, tokenizer=None):
    """verl's V1 agent-loop worker (its class under ray.remote), without the actor. With a tokenizer: only the
    methods that put outputs into the TransferQueue; without: verl's own constructor (tools, registry, tq)."""
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    cls = AgentLoopWorkerTQ.__ray_metadata__.modified_class.__ray_actor_class__
    if tokenizer is None:
        return cls(config, llm_client=None)
    worker = cls.__new__(cls)
    worker.config, worker.rollout_config = config, config.actor_rollout_ref.rollout
    worker.tokenizer, worker.processor, worker.hf_model_type = tokenizer, None, "qwen2"
    worker.reward_loop_worker_handles, worker.distillation_enabled, worker.mm_processor_kwargs = None, False, {}
    return worker


def train_step(tq, config, *, uids: int, global_steps: int, advantage=None):
    """V1's sync step on what the workers put: the replay buffer's sample, the actor's old log-probs (here the
    engine's: its GPU recomputation is the one step not run), the advantage (``advantage(trainer, batch,
    metrics)``: lightning-rl's, as ``LightningRLSyncTrainer`` runs it, unless given verl's own
    ``PPOTrainer._compute_advantage``) and ``_compute_metrics``. Returns (the batch, its metrics, the response
    masks and advantages by key)."""
    from tensordict import TensorDict
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer, RolloutMoELoadBalanceMetricsAccumulator

    buffer = ReplayBuffer(trainer_mode="sync", trainer_config=config.trainer.v1.get("sync", {}),
                          max_off_policy_threshold=None, max_off_policy_strategy="drop",
                          sampler_kwargs=config.trainer.v1.sampler, poll_interval=0.1, train_batch_size=uids)
    batch, _ = within(300, buffer.sample, global_steps=global_steps, partition_id="train", batch_size=uids)
    engine = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["rollout_log_probs"])
    tq.kv_batch_put(keys=batch.keys, partition_id="train",
                    fields=TensorDict({"old_log_probs": engine["rollout_log_probs"]}, batch_size=len(batch.keys)))
    trainer = SimpleNamespace(config=config, use_critic=False, _get_n_gpus_for_throughput=lambda: 1,
                              _rollout_moe_lb_metrics_accumulator=RolloutMoELoadBalanceMetricsAccumulator(
                                  model_config=config.actor_rollout_ref.model))
    metrics: dict = {}
    if advantage is None:
        from lightning_rl.trainer_bridge.verl.advantage import compute_advantage as advantage
    batch = advantage(trainer, batch, metrics)
    PPOTrainer._compute_metrics(trainer, batch, metrics, {"step": 1.0}, global_steps=global_steps, epoch=0)
    data = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["response_mask", "advantages"])
    by_key = {k: (m, a) for k, m, a in zip(batch.keys, data["response_mask"], data["advantages"])}
    return batch, metrics, by_key


def verls_grpo(tq, config, keys: list[str]) -> dict:
    """verl's own V1 GRPO (``compute_advantage_for_multi_trajectories``) on the rows ``keys`` as the workers put them
    (their ``rm_scores``, response masks and uids): the advantages by key, from verl's code alone."""
    import numpy as np
    from verl.protocol import DataProto
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    data = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["uid", "response_mask", "rm_scores"])
    data = DataProto(batch=data.to_padded_tensor())
    data.non_tensor_batch["uid"] = np.array(data.batch.pop("uid").tolist(), dtype=object)
    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    data = compute_advantage_for_multi_trajectories(data, batch_keys=keys, adv_estimator="grpo",
                                                    num_repeat=config.actor_rollout_ref.rollout.n)
    return dict(zip(keys, data.batch["advantages"]))

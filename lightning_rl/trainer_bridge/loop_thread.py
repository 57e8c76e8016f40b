"""``LoopThread``: one asyncio event loop in a thread of its own, shared by every runner of a trainer (and the
gate's); ``runner.py`` re-exports it from its old path."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
from typing import Any


class LoopThread:
    """One asyncio event loop in a thread of its own, for every runner of a trainer.

    ``run(coro)`` waits for a coroutine there; ``submit(coro)`` starts one and returns a
    ``concurrent.futures.Future`` (the overlapped loop runs its runner so while it updates). Both run
    the coroutine in a copy of the caller's context. One loop for the whole run: async clients (an
    AsyncOpenAI connection pool) are bound to the loop they first ran on."""

    def __init__(self, name: str = "lightning-rl-loop") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Any) -> "concurrent.futures.Future[Any]":
        ctx = contextvars.copy_context()
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def settle(task: asyncio.Task) -> None:
            if task.cancelled():
                future.set_exception(asyncio.CancelledError())
            elif task.exception() is not None:
                future.set_exception(task.exception())
            else:
                future.set_result(task.result())

        def start() -> None:
            if not future.set_running_or_notify_cancel():
                coro.close()
                return
            self._loop.create_task(coro, context=ctx).add_done_callback(settle)

        self._loop.call_soon_threadsafe(start)
        return future

    def run(self, coro: Any) -> Any:
        return self.submit(coro).result()

    def close(self) -> None:
        """Cancel what still runs there, then stop and close the loop."""
        if self._loop.is_closed():
            return

        async def cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
            await self._loop.shutdown_asyncgens()

        self.run(cancel_rest())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

"""Time limits for the coding-agent CLIs' runs, derived from what this machine takes now, not constants.

A CLI run is its process starting, then a few calls to the engine, each with the CLI's whole system prompt and
tools (10,000-18,000 tokens for the tiny model). On a quiet machine Codex's run takes about 10 s; on one whose
cores are busy with other work every part of it takes several times longer, and a fixed limit of 120 s once
killed a run that was only slow. :func:`cli_time_limit` times the two parts right before the run, on the same
engine and the same binary, under whatever load there is then, and scales them: a limit stays a guard against a
hang, never a measure of speed.
"""

from __future__ import annotations

import random
import string
import subprocess
import time

import httpx

from ..conftest import SERVED_NAME

#: how many times the measured time a run may take: the load can grow during the run, and a CLI does work of
#: its own between calls (its tool, its sandbox), so the factor is wide; a hang still ends in minutes
SLACK = 5.0
#: the shortest limit: a CLI's own start (configuration, session, plugins) is more than printing its version, and a
#: call measured at its fastest leaves no room for the CLI's pauses
FLOOR_S = 30.0


def call_seconds(engine: str, prompt_tokens: int = 18_000, max_tokens: int = 16) -> float:
    """Seconds the engine takes now for one call of ``prompt_tokens`` fresh tokens (random text, so that its
    prefix cache cannot shorten it; the tiny model's tokens are single characters) and ``max_tokens`` out."""
    text = "".join(random.choices(string.ascii_letters + " ", k=prompt_tokens))
    began = time.monotonic()
    answer = httpx.post(engine.rstrip("/") + "/chat/completions", timeout=600, json={
        "model": SERVED_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True})
    answer.raise_for_status()
    return time.monotonic() - began


def start_seconds(binary: str) -> float:
    """Seconds the CLI takes now to start and print its version."""
    began = time.monotonic()
    subprocess.run([binary, "--version"], capture_output=True, check=True, timeout=600)
    return time.monotonic() - began


def cli_time_limit(engine: str, binary: str, *, calls: int, prompt_tokens: int = 18_000) -> float:
    """A limit for a run of ``binary`` that makes about ``calls`` engine calls of ``prompt_tokens`` tokens
    (module doc): ``SLACK`` times the measured start and calls, at least ``FLOOR_S``."""
    start, call = start_seconds(binary), call_seconds(engine, prompt_tokens)
    return max(FLOOR_S, SLACK * (start + calls * call))

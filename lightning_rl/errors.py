"""Errors raised by lightning-rl.

Every error derives from :class:`LightningRLError` and also from the builtin that matches its
meaning, so ``except ValueError`` keeps working in user code::

    LightningRLError
    ├── ConfigurationError (ValueError)       a setting, URL or argument that cannot work
    ├── UnknownNameError (KeyError)           a registry name that is not registered
    ├── NotInRolloutError (RuntimeError)      emit_reward() / agent-only calls outside @trace
    ├── InvalidRewardError (ValueError)       a reward that is not a finite number
    ├── TaskNotSerializableError (TypeError)  a traced call's task that JSON cannot store
    ├── MissingDependencyError (ImportError)  an optional dependency is not installed (names the extra)
    ├── StoreError
    │   ├── NotAStoreError (ValueError)       a file that is not a lightning-rl store
    │   ├── SchemaTooNewError (RuntimeError)  a store written by a newer lightning-rl
    │   ├── RolloutNotFoundError (KeyError)   an unknown rollout id
    │   └── StoreClosedError (RuntimeError)   a write to a store (its background writer) after close()
    ├── PublishError (RuntimeError)           the served model refused or missed a weight update
    ├── JudgeHTTPError (RuntimeError)         the judge's server refused its request (after retries)
    ├── CommandFailed (RuntimeError)          a command agent (lightning_rl.command) exited non-zero
    ├── TranslationError (ValueError)         a request another protocol's dialect cannot carry
    ├── EngineRefusal (RuntimeError)          an engine answered an LLM call with an error status
    ├── EngineStartError (RuntimeError)       a vLLM server lightning-rl started exited or was not ready in time
    ├── RunnerStoppedError (RuntimeError)     a trainer's runner ended while the groups it was to run were queued
    ├── WorkersFailed (RuntimeError)          a trainer's worker processes (processes=) exited non-zero
    ├── SandboxError (RuntimeError)           a sandbox could not start or died (an infrastructure failure)
    ├── UpstreamError (ConnectionError)       the gateway could not reach an engine, or lost it
    ├── GatewayError                          a request the gateway refuses (carries its HTTP status)
    └── OTLPDecodeError (ValueError)          a body that is not an OTLP trace export request
        └── OTLPTooLarge                      a compressed body that inflates beyond the limit

Every class here is public: ``tests/test_public_api.py`` walks the subclasses of
:class:`LightningRLError` and holds them to this tree.

Messages say what happened, show the offending value (truncated) and say how to fix it.
"""

from __future__ import annotations

_MAX_SHOWN = 200


def shown(value: object) -> str:
    """The ``repr`` of ``value``, truncated for error messages."""
    text = repr(value)
    if len(text) > _MAX_SHOWN:
        text = text[: _MAX_SHOWN - 3] + "..."
    return text


class LightningRLError(Exception):
    """Root of every error raised by lightning-rl."""


class ConfigurationError(LightningRLError, ValueError):
    """A setting, URL or argument that cannot work."""


class UnknownNameError(LightningRLError, KeyError):
    """A name that no registry knows. The message lists the known names."""

    def __str__(self) -> str:  # KeyError would print the message inside quotes
        return str(self.args[0]) if self.args else ""


class NotInRolloutError(LightningRLError, RuntimeError):
    """A call that needs an active rollout was made outside any ``@trace``-decorated call."""


class InvalidRewardError(LightningRLError, ValueError):
    """A reward that is not a finite real number."""


class TaskNotSerializableError(LightningRLError, TypeError):
    """The arguments of a traced call cannot be stored as JSON."""


class MissingDependencyError(LightningRLError, ImportError):
    """A module of an optional dependency is not installed; the message names the extra to install."""


#: The extra that installs each optional top-level module (pyproject.toml's optional dependencies;
#: tests/test_packaging.py holds the two to each other).
EXTRA_OF_MODULE = {
    "torch": "local", "transformers": "local", "peft": "local", "safetensors": "local", "numpy": "local",
    "tqdm": "local", "matplotlib": "local",
    "verl": "verl", "ray": "verl", "cachetools": "verl", "transfer_queue": "verl", "tensordict": "verl", "hydra": "verl",
    "omegaconf": "verl",
    "pandas": "verl",
    "jsonschema": "rewards", "pyarrow": "data", "psycopg": "postgres", "psycopg_pool": "postgres",
    "tensorboard": "trackers", "mlflow": "trackers", "wandb": "trackers",
    "langchain": "langchain", "langchain_core": "langchain", "langchain_openai": "langchain", "langgraph": "langchain",
    "autogen_agentchat": "autogen", "autogen_core": "autogen", "autogen_ext": "autogen",
    "vllm": "vllm",
}


def missing_dependency(exc: ImportError) -> MissingDependencyError | None:
    """The one-line error for an optional module that is not installed (None: not one of ours)."""
    name = (getattr(exc, "name", None) or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(name)
    if extra is None:
        return None
    return MissingDependencyError(f"this needs the optional module {name!r}, which is not installed; install it with: "
                                  f"pip install 'lightning-rl[{extra}]'")


class StoreError(LightningRLError):
    """A problem with the store."""


class NotAStoreError(StoreError, ValueError):
    """The file exists but is not a lightning-rl store."""


class SchemaTooNewError(StoreError, RuntimeError):
    """The store was written by a newer lightning-rl whose schema this version does not know."""


class RolloutNotFoundError(StoreError, KeyError):
    """No rollout with this id exists in the store."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StoreClosedError(StoreError, RuntimeError):
    """A write to a store that was closed (its background writer takes nothing more)."""


class PublishError(LightningRLError, RuntimeError):
    """The served model refused or could not be reached for a weight update."""


class JudgeHTTPError(LightningRLError, RuntimeError):
    """The judge's server refused the request (after retries, where the status was worth one)."""


class CommandFailed(LightningRLError, RuntimeError):
    """A command agent exited with a non-zero status (its rollout is recorded as failed)."""


class TranslationError(LightningRLError, ValueError):
    """A request that chat completions cannot carry (answered 400, naming what it cannot carry)."""


class EngineRefusal(LightningRLError, RuntimeError):
    """An engine's answer other than 200, as the entry points hand it to the capture core's resend and
    record it on the call (``status_code``; the text says which field it refused)."""

    def __init__(self, status_code: int, text: str) -> None:
        super().__init__(f"the engine answered {status_code}: {text[:500]}")
        self.status_code = status_code
        self.text = text


class EngineStartError(LightningRLError, RuntimeError):
    """A vLLM server started by lightning-rl (``VLLMServer``) exited, or did not answer ``/health`` in time."""


class RunnerStoppedError(LightningRLError, RuntimeError):
    """The runner a trainer started in the background ended while groups it was to run were still queued."""


class WorkersFailed(LightningRLError, RuntimeError):
    """Worker processes a trainer ran its sync agent in (``Trainer(processes=k)``) exited non-zero; ``codes``
    holds their exit codes (a negative one: the signal that ended it)."""

    def __init__(self, message: str, codes: list[int | None]) -> None:
        super().__init__(message)
        self.codes = codes


class SandboxError(LightningRLError, RuntimeError):
    """A sandbox itself failed (it could not start, it died): an infrastructure failure, not the command's
    (``lightning_rl.sandbox``)."""


class UpstreamError(LightningRLError, ConnectionError):
    """The engine could not be reached, or the connection to it broke or timed out."""


class GatewayError(LightningRLError):
    """A request the gateway refuses: answered with ``status`` and a message naming the fix."""

    def __init__(self, status: int, error: str, details: list[str] | None = None) -> None:
        super().__init__(error)
        self.status, self.error, self.details = status, error, details or []


class OTLPDecodeError(LightningRLError, ValueError):
    """A body that is not an OTLP trace export request."""


class OTLPTooLarge(OTLPDecodeError):
    """A compressed body that inflates beyond the limit (a compression bomb, or simply too much)."""


def check_reward(value: object, *, what: str = "reward") -> float:
    """Return ``value`` as a float, or raise :class:`InvalidRewardError` naming it."""
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            import numbers

            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                value = float(value)  # numpy / torch scalars
            else:
                raise TypeError
        except TypeError:
            raise InvalidRewardError(
                f"{what} must be a finite real number, got {shown(value)} of type "
                f"{type(value).__name__}; pass a float such as 1.0"
            ) from None
    value = float(value)
    if not math.isfinite(value):
        raise InvalidRewardError(
            f"{what} must be a finite real number, got {value!r}; "
            "replace NaN/inf with a finite value (for example clip it) before recording it"
        )
    return value

"""The trainer's settings: keyword-only, frozen pydantic models, validated in one place.

``ConfigModel`` is the base of every configuration object of the trainer bridge (``LocalConfig``, the
per-policy ``PolicyConfig``, ``Trainer``, ``ContinuousTrainer``): keyword arguments only, unknown
names refused, nothing rewritten after construction (``frozen``; what a trainer derives from its
settings is private). The constraints sit on the fields (``Field(gt=0)``, ``Literal[...]``, strict
ints and floats, so ``True`` is never a count and ``"1e-4"`` never a rate); a value that breaks one
is a :class:`~lightning_rl.errors.ConfigurationError` naming the setting, the value and the fix,
e.g. ``LocalConfig.policy_config['solver'].lr must be > 0, got -1.0; the optimizer's learning rate``.
A check across settings raises its own ``ConfigurationError`` from the model's validator.

``LocalConfig`` holds the local backend's settings. Settings one policy of a team may give itself are
the ``PolicyConfig`` fields, set one way: ``policy_config={"planner-lora": {"lr": 1e-4}}`` (served
name -> the fields it changes); every other policy uses the ``LocalConfig`` values.
"""

from __future__ import annotations

import contextvars
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model

from ..errors import ConfigurationError, LightningRLError, shown

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
DTYPES = ("float32", "bfloat16", "float16")
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Strict numbers: a bool is not a count, a string is not a rate.
Count = Annotated[int, Field(strict=True, ge=1)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]
Positive = Annotated[float, Field(strict=True, gt=0)]
NonNegative = Annotated[float, Field(strict=True, ge=0)]
Flag = Annotated[bool, Field(strict=True)]
Name = Annotated[str, Field(strict=True, min_length=1)]


def _registered(kind: str) -> Callable[[str], str]:
    """A validator: the name is in the ``kind`` registry of ``algorithms.py`` (an unknown name raises
    :class:`~lightning_rl.errors.UnknownNameError` listing the known ones)."""

    def check(name: str) -> str:
        from . import algorithms  # late: the registries are filled where the math is (torch)

        {"adv": algorithms.ADV_ESTIMATORS, "loss": algorithms.POLICY_LOSSES}[kind].get(name)
        return name

    return check


def _credit(name: str) -> str:
    from ..store.credit import get_credit_assigner

    get_credit_assigner(name)  # an unknown rule: UnknownNameError listing the known ones
    return name


def _loggers(loggers: Any) -> Any:
    from .loggers import check_loggers

    check_loggers(loggers)  # unknown names and non-loggers, before a run opens anything
    return loggers


AdvEstimator = Annotated[str, Field(strict=True), AfterValidator(_registered("adv"))]
PolicyLoss = Annotated[str, Field(strict=True), AfterValidator(_registered("loss"))]
Credit = Annotated[str, Field(strict=True), AfterValidator(_credit)]
Loggers = Annotated[typing.Sequence[Any], AfterValidator(_loggers)]


class ConfigModel(BaseModel):
    """Keyword-only, frozen, no unknown names; a bad value is a ``ConfigurationError`` (module doc)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **settings: Any) -> None:
        depth = _DEPTH.set(_DEPTH.get() + 1)
        try:
            super().__init__(**settings)
        except ValidationError as exc:
            if _DEPTH.get() > 1:  # a model inside another's settings: the outer one names the whole path
                raise
            raise _configuration_error(type(self), exc) from None
        finally:
            _DEPTH.reset(depth)


_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("lightning_rl_config_depth", default=0)


def _configuration_error(model: type[BaseModel], exc: ValidationError) -> LightningRLError:
    errors = exc.errors(include_url=False)
    for error in errors:  # a check across settings raised our own error: it says it best
        own = (error.get("ctx") or {}).get("error")
        if isinstance(own, LightningRLError):
            return own
    return ConfigurationError("; ".join(_describe(model, error) for error in errors))


def _number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _describe(model: type[BaseModel], error: dict[str, Any]) -> str:
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    loc = error["loc"]
    where, owner, field = _locate(model, loc[:-1] if kind == "extra_forbidden" else loc)
    bound = next((ctx[k] for k in ("gt", "ge", "le") if k in ctx), None)
    number = "an int" if isinstance(bound, int) else "a number"  # an int field's bounds are ints
    what = {
        "int_type": "must be an int", "int_from_float": "must be an int", "float_type": "must be a number",
        "bool_type": "must be True or False", "string_type": "must be a string",
        "string_too_short": "must be a non-empty string", "too_short": "must not be empty",
        "dict_type": "must be a mapping", "model_type": "must be a mapping of settings",
        "callable_type": "must be callable", "literal_error": f"must be one of {ctx.get('expected')}",
        "greater_than": f"must be {number} > {_number(ctx.get('gt'))}",
        "greater_than_equal": f"must be {number} >= {_number(ctx.get('ge'))}",
        "less_than_equal": f"must be {number} <= {_number(ctx.get('le'))}", "missing": "is required",
    }.get(kind) or error["msg"][:1].lower() + error["msg"][1:]
    if kind == "extra_forbidden":
        return f"{where}.{loc[-1]} is not a setting of {owner.__name__} (got {shown(value)}); its settings are: " \
               f"{', '.join(owner.model_fields)}"
    text = f"{where} {what}" + ("" if kind == "missing" else f", got {shown(value)}")
    hint = field.description if field is not None else None
    return f"{text} ({hint})" if hint else text


def _locate(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[str, type[BaseModel], Any]:
    """The setting at ``loc`` as written (``LocalConfig.policy_config['solver'].lr``), the model holding
    it and the ``FieldInfo`` of the innermost setting on the way."""
    where, owner, field = model.__name__, model, None
    for part in loc:
        info = owner.model_fields.get(part) if isinstance(part, str) else None
        if info is None:  # a key of a mapping setting, whose values are the next model (if any)
            where = f"{where}[{part!r}]"
            continue
        where, field = f"{where}.{part}", info
        owner = _model_in(info.annotation) or owner
    return where, owner, field


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


class LocalConfig(ConfigModel):
    """The local backend's settings (``trainer_bridge/local.py`` says what each does in the update)."""

    lr: Positive = Field(2e-4, description="the optimizer's learning rate, e.g. 2e-4")
    #: per policy (served name -> the PolicyConfig fields it sets), for agents whose samples differ in
    #: number or noise: {"planner-lora": {"lr": 1e-4, "mini_batch_size": 64}}; other policies use these values
    policy_config: dict[Name, PolicyConfig] = Field(  # noqa: F821 (defined below, from these fields)
        default_factory=dict, description="its keys are served names from policies=, its values the settings "
        "that policy sets for itself, e.g. {'planner-lora': {'lr': 1e-4}}")
    lora_rank: Count = Field(16, description="the LoRA rank, e.g. 16")
    lora_alpha: Count = Field(32, description="the LoRA scale, e.g. 32")
    target_modules: tuple[Name, ...] = Field(TARGET_MODULES, min_length=1,
                                             description="the module names the LoRA adapts, e.g. ('q_proj', 'v_proj')")
    adv_estimator: AdvEstimator = "grpo"
    policy_loss: PolicyLoss = "vanilla"
    loss_agg_mode: Literal[LOSS_AGG_MODES] = "token-mean"  # type: ignore[valid-type]
    clip_ratio: Positive = Field(0.2, description="PPO's clip range, e.g. 0.2")
    kl_coef: NonNegative = Field(0.0, description="the weight of the KL to the base model (0: none)")
    kl_kind: Literal[KL_KINDS] = "low_var_kl"  # type: ignore[valid-type]
    ppo_epochs: Count = Field(1, description="passes over each batch")
    mini_batch_size: Count = Field(16, description="samples per optimizer step: verl's ppo_mini_batch_size")
    micro_batch_size: Count = Field(16, description="samples per forward/backward (memory only)")
    rollout_is: Flag = True  # truncated importance weights proximal/behaviour (the engine's log-probs)
    rollout_is_threshold: Positive = Field(2.0, description="the truncation of the importance weights")
    temperature: Positive = Field(1.0, description="the agents' sampling temperature: the engine's processed "
                                  "log-probs include it")
    max_grad_norm: Positive = Field(1.0, description="the gradient clip norm")
    dtype: Literal[DTYPES] = "float32"  # type: ignore[valid-type]  # "bfloat16" on a GPU
    # glibc (Linux): after each update, hand the heap's freed memory back to the system (malloc_trim).
    # Without it, the heap kept the freed activations of every policy's updates: each policy past the first
    # added ~8x its footprint to the peak RSS; with it the peak stays flat in N, at ~15% slower CPU updates
    # (bench/bench_policy_memory.py). None (default): on when the backend holds several policies.
    malloc_trim: Flag | None = None
    # glibc (Linux): blocks from this many bytes up are mapped on their own and returned to the system when
    # freed; set for the whole process. 65536 takes a third off one policy's peak RSS, but CPU updates took
    # 1.25x-1.9x as long. None (default) leaves the allocator as it is.
    malloc_mmap_threshold: NonNegativeInt | None = Field(None, description="bytes; 65536 for a trainer holding "
                                                         "several policies")
    adv_kwargs: dict[str, Any] = Field(default_factory=dict)

    def for_policy(self, served_name: str) -> LocalConfig:
        """This config with ``served_name``'s ``policy_config`` entry applied (the config its updates use)."""
        own = self.policy_config.get(served_name)
        return self if own is None else self.model_copy(update=own.model_dump(exclude_unset=True))

    def check_policies(self, served_names: typing.Collection[str]) -> None:
        """``policy_config`` names only policies in ``served_names`` (a ``ConfigurationError`` naming the others)."""
        unknown = sorted(set(self.policy_config) - set(served_names))
        if unknown:
            raise ConfigurationError(f"LocalConfig.policy_config names policies that are not trained here: {unknown}; "
                                     f"its keys are served names from policies= ({sorted(served_names)})")

    def scalars(self) -> dict[str, Any]:
        """The settings that are numbers, strings or flags (what experiment trackers record)."""
        return {k: v for k, v in self.model_dump().items() if isinstance(v, (int, float, str, bool)) or v is None}


#: The LocalConfig fields a policy may set for itself (``policy_config``): what one update reads. The
#: model's shape (LoRA rank, target modules, dtype) and the process's allocator are shared by all policies.
POLICY_FIELDS = ("lr", "adv_estimator", "policy_loss", "loss_agg_mode", "clip_ratio", "kl_coef", "kl_kind",
                 "ppo_epochs", "mini_batch_size", "micro_batch_size", "rollout_is", "rollout_is_threshold",
                 "temperature", "max_grad_norm", "adv_kwargs")


def _optional(name: str) -> tuple[Any, Any]:
    info = LocalConfig.model_fields[name]
    kind = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    return kind | None, Field(None, description=info.description)


#: What one policy sets for itself: the ``POLICY_FIELDS`` of ``LocalConfig``, with their constraints, each
#: optional (left out: the ``LocalConfig`` value).
PolicyConfig = create_model("PolicyConfig", __base__=ConfigModel, __module__=__name__,
                            **{name: _optional(name) for name in POLICY_FIELDS})
LocalConfig.model_rebuild()

"""A CPU platform for verl 0.9.1's platform plugin layer (verl/plugin/platform).

Loaded in every process that imports verl through VERL_USE_EXTERNAL_MODULES=verl_cpu_platform
(with this folder on PYTHONPATH) and selected with VERL_PLATFORM=cpu.
"""

import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Optional

import torch

from verl.plugin.platform import PlatformBase, PlatformRegistry

# Ray resource that stands for one "device" slot (a CPU training/rollout slot). It must be a Ray
# *accelerator* resource, so "GPU": verl/single_controller/ray/base.py
# ResourcePoolManager._check_resource_available only counts "GPU"/"NPU", and
# verl/workers/rollout/vllm_rollout/vllm_async_server.py launch_servers (line 1348) reads
# ray.get_runtime_context().get_accelerator_ids()[resource][0], which has no custom resources.
# Declared as logical GPUs with +ray_kwargs.ray_init.num_gpus=N (Ray accepts logical GPUs on a
# machine without any; it then sets CUDA_VISIBLE_DEVICES, which CPU torch ignores).
CPU_DEVICE_RESOURCE = os.environ.get("VERL_CPU_DEVICE_RESOURCE", "GPU")


class _CPUDeviceModule(ModuleType):
    """torch.cpu plus the torch.cuda-style functions verl calls on get_torch_device()
    (memory_reserved, mem_get_info, empty_cache, get_rng_state, ...), as CPU no-ops / host figures."""

    def __init__(self):
        super().__init__("verl_cpu_device_module")

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def set_device(device=None):
        return None

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def get_device_name(device=None):
        return "cpu"

    @staticmethod
    def synchronize(device=None):
        return None

    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def ipc_collect():
        return None

    @staticmethod
    def set_per_process_memory_fraction(fraction, device=None):
        return None

    @staticmethod
    def memory_allocated(device=None):
        return 0

    @staticmethod
    def memory_reserved(device=None):
        return 0

    @staticmethod
    def max_memory_allocated(device=None):
        return 0

    @staticmethod
    def max_memory_reserved(device=None):
        return 0

    @staticmethod
    def reset_peak_memory_stats(device=None):
        return None

    @staticmethod
    def mem_get_info(device=None):
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @staticmethod
    def get_rng_state(device=None):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device=None):
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed):
        torch.manual_seed(seed)


_DEVICE_MODULE = _CPUDeviceModule()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"

    def current_device(self):
        # verl passes get_device_id() straight to .to()/device= (e.g. verl/utils/fsdp_utils.py:507
        # model.to(device=get_device_id())); an int there means "accelerator N", so return the
        # CPU device itself.
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # what Ray sets for logical GPUs; ignored by CPU torch

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return CPU_DEVICE_RESOURCE

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        if CPU_DEVICE_RESOURCE == "GPU":
            return {"num_gpus": num_gpus}
        return {"resources": {CPU_DEVICE_RESOURCE: num_gpus}}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        keep = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "HF_HUB_OFFLINE", "VLLM_TARGET_DEVICE")
        return {k: os.environ[k] for k in keep if k in os.environ}

    def cudart(self) -> Any:
        return None


# ---------------------------------------------------------------------------------------------
# HACK 1 (torch-level shim, not a verl extension point): verl/utils/distributed.py
# initialize_global_process_group_ray() (and initialize_global_process_group()) build the backend
# string f"cpu:gloo,{device}:{backend}", which for device "cpu" is "cpu:gloo,cpu:gloo"; torch's
# BackendConfig rejects a duplicate device type. Collapse duplicate "dev:backend" pairs.
# ---------------------------------------------------------------------------------------------
import torch.distributed as _dist  # noqa: E402

_orig_init_process_group = _dist.init_process_group


def _dedup_backend(backend):
    if isinstance(backend, str) and "," in backend and ":" in backend:
        seen, parts = set(), []
        for part in backend.split(","):
            dev = part.split(":", 1)[0].strip()
            if dev in seen:
                continue
            seen.add(dev)
            parts.append(part.strip())
        return ",".join(parts)
    return backend


def _init_process_group(*args, **kwargs):
    if "backend" in kwargs:
        kwargs["backend"] = _dedup_backend(kwargs["backend"])
    elif args:
        args = (_dedup_backend(args[0]),) + tuple(args[1:])
    return _orig_init_process_group(*args, **kwargs)


if os.environ.get("VERL_CPU_PATCH_PG_BACKEND", "1") == "1" and not getattr(
    _dist.init_process_group, "_verl_cpu_patched", False
):
    _init_process_group._verl_cpu_patched = True
    _dist.init_process_group = _init_process_group
    import torch.distributed.distributed_c10d as _c10d

    _c10d.init_process_group = _init_process_group


# ---------------------------------------------------------------------------------------------
# HACK 2 (vLLM-CPU shim, active only in processes that import vLLM): vLLM-CPU's
# UnquantizedLinearMethod.process_weights_after_loading (vllm/model_executor/layers/linear.py)
# calls dispatch_cpu_unquantized_gemm(layer, remove_weight=True), which packs the weight into a
# oneDNN/SGL kernel handle and replaces layer.weight with an empty Parameter without a
# weight_loader. verl's weight sync (verl/workers/rollout/vllm_rollout/utils.py
# vLLMColocateWorkerExtension._update_weights -> model.load_weights) then fails with
# "AttributeError: 'Parameter' object has no attribute 'weight_loader'" (linear.py load_weights),
# and for the tied lm_head (remove_weight=False) the packed copy would silently go stale.
# Keep the weights as live Parameters and compute with F.linear on them instead.
# ---------------------------------------------------------------------------------------------
import importlib.abc  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402

_VLLM_UTILS = "vllm.model_executor.layers.utils"


def _patch_vllm_cpu_gemm(mod):
    if getattr(mod, "_verl_cpu_patched", False):
        return
    orig = mod.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return orig(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    mod.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
    mod._verl_cpu_patched = True


def _patch_verl_fsdp_engine(mod):
    """HACK 3: verl/workers/engine/fsdp/transformer_impl.py _build_fsdp_module gives the forward-only
    (reference) model CPUOffloadPolicy(pin_memory=True); pinning needs an accelerator
    ("RuntimeError: Cannot access accelerator device when none is available" in
    torch/distributed/fsdp/_fully_shard/_fsdp_param.py). On CPU, never pin."""
    if getattr(mod, "_verl_cpu_patched", False) or getattr(mod, "CPUOffloadPolicy", None) is None:
        return
    orig = mod.CPUOffloadPolicy

    class CPUOffloadPolicyNoPin(orig):
        def __init__(self, pin_memory=True, *args, **kwargs):
            super().__init__(False, *args, **kwargs)

    mod.CPUOffloadPolicy = CPUOffloadPolicyNoPin
    mod._verl_cpu_patched = True


_POST_IMPORT_PATCHES = {}
if os.environ.get("VERL_CPU_PATCH_VLLM_GEMM", "1") == "1":
    _POST_IMPORT_PATCHES[_VLLM_UTILS] = _patch_vllm_cpu_gemm
if os.environ.get("VERL_CPU_PATCH_REF_PIN", "1") == "1":
    _POST_IMPORT_PATCHES["verl.workers.engine.fsdp.transformer_impl"] = _patch_verl_fsdp_engine


class _PostImportPatcher(importlib.abc.MetaPathFinder):
    """Runs a patch function right after one of the modules in _POST_IMPORT_PATCHES is imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _POST_IMPORT_PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        orig_exec = spec.loader.exec_module
        patch = _POST_IMPORT_PATCHES[fullname]

        loader = spec.loader

        def exec_module(module, _orig=orig_exec, _patch=patch):
            _orig(module)
            _patch(module)

        loader.exec_module = exec_module
        return spec


if _POST_IMPORT_PATCHES:
    _missing = False
    for _name, _fn in _POST_IMPORT_PATCHES.items():
        if _name in sys.modules:
            _fn(sys.modules[_name])
        else:
            _missing = True
    if _missing:
        sys.meta_path.insert(0, _PostImportPatcher())

"""One base model, one LoRA adapter per policy (PEFT multi-adapter) in the local backend: each policy
trains as a backend of its own would, leaves the others untouched, and is saved alone. One policy is one
named adapter, the same way."""

from __future__ import annotations

import pytest
import torch

from lightning_rl.errors import ConfigurationError

from ..conftest import ensure_tiny_model
from .test_local_loss import _samples

pytest.importorskip("peft")


def _backend(**kw):
    from lightning_rl.trainer_bridge.config import LocalConfig
    from lightning_rl.trainer_bridge.local import LocalBackend

    return LocalBackend(ensure_tiny_model(), LocalConfig(lr=5e-3), seed=0, device="cpu", **kw)


def _weights(backend, adapter: str) -> dict[str, torch.Tensor]:
    return {n.replace(f".{adapter}.", "."): p.detach().clone() for n, p in backend.model.named_parameters()
            if "lora_" in n and f".{adapter}." in n}


def test_each_policy_trains_as_its_own_backend_and_leaves_the_other_alone():
    alone, team = _backend(), _backend(policies=["planner", "solver"])
    assert _weights(alone, "policy0").keys() == _weights(team, "policy0").keys()
    solver_before = _weights(team, "policy1")
    samples = _samples()
    expected = alone.update(samples)
    got = team.update(samples, policy="planner")
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert got["pg_clipfrac"] == pytest.approx(expected["pg_clipfrac"])
    trained, reference = _weights(team, "policy0"), _weights(alone, "policy0")
    assert all(torch.allclose(trained[k], reference[k], atol=1e-6) for k in reference)
    solver_after = _weights(team, "policy1")
    assert all(torch.equal(solver_before[k], solver_after[k]) for k in solver_before)  # not touched
    assert all(not v.any() for k, v in solver_after.items() if "lora_B" in k)  # still the base model

    memory = team.memory()
    planner, solver = memory["policies"]["planner"], memory["policies"]["solver"]
    assert planner["adapter_mb"] == solver["adapter_mb"] > 0
    assert planner["optimizer_mb"] == pytest.approx(2 * planner["adapter_mb"], rel=1e-3)  # AdamW: 2 moments (+ steps)
    assert solver["optimizer_mb"] == 0  # never stepped
    assert memory["base_mb"] == alone.memory()["base_mb"] > 0  # the base is held once, however many policies


def test_a_policy_with_its_own_learning_rate_trains_as_a_backend_with_that_rate():
    from lightning_rl.trainer_bridge.config import LocalConfig
    from lightning_rl.trainer_bridge.local import LocalBackend

    alone = LocalBackend(ensure_tiny_model(), LocalConfig(lr=5e-4), seed=0, device="cpu")
    team = LocalBackend(
        ensure_tiny_model(), LocalConfig(lr=5e-3, policy_config={"planner": {"lr": 5e-4}}), seed=0, device="cpu",
        policies=["planner", "solver"])
    samples = _samples()
    expected = alone.update(samples)
    planner = team.update(samples, policy="planner")
    assert planner["lr"] == expected["lr"] == 5e-4 and team.update(samples, policy="solver")["lr"] == 5e-3
    assert planner["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    trained, reference = _weights(team, "policy0"), _weights(alone, "policy0")
    assert all(torch.allclose(trained[k], reference[k], atol=1e-6) for k in reference)


@pytest.mark.parametrize("policy_config, named", [
    ({"critic": {"lr": 1e-4}}, "['critic']; its keys are served names from policies="), ({"solver": {"lr": 0}}, "policy_config['solver'].lr must be a number > 0, got 0"),
    ({"solver": {"lr": "fast"}}, "policy_config['solver'].lr must be a number, got 'fast'"),
    (1e-4, "policy_config must be a mapping, got 0.0001 (its keys are served names")])
def test_a_learning_rate_for_an_unknown_policy_or_not_a_rate_is_refused(policy_config, named):
    from lightning_rl.trainer_bridge.config import LocalConfig
    from lightning_rl.trainer_bridge.local import LocalBackend

    with pytest.raises(ConfigurationError, match="policy_config") as info:
        LocalBackend(ensure_tiny_model(), LocalConfig(policy_config=policy_config), seed=0, device="cpu",
                     policies=["planner", "solver"])
    assert named in str(info.value)


def test_a_rate_is_set_one_way():
    from lightning_rl.trainer_bridge.config import LocalConfig

    with pytest.raises(ConfigurationError, match=r"LocalConfig.policy_lr is not a setting of LocalConfig \(got "
                                                 r"\{'solver': 0.0002\}\); its settings are: lr, policy_config"):
        LocalConfig(policy_lr={"solver": 2e-4})


def test_a_policy_with_its_own_config_trains_as_a_backend_with_that_config():
    from lightning_rl.trainer_bridge.config import LocalConfig
    from lightning_rl.trainer_bridge.local import LocalBackend

    own = {"lr": 5e-4, "mini_batch_size": 4, "clip_ratio": 0.1}
    alone = LocalBackend(ensure_tiny_model(), LocalConfig(**own), seed=0, device="cpu")
    team = LocalBackend(ensure_tiny_model(), LocalConfig(lr=5e-3, policy_config={"planner": own}), seed=0,
                        device="cpu", policies=["planner", "solver"])
    samples = _samples()
    expected, planner = alone.update(samples), team.update(samples, policy="planner")
    solver = team.update(samples, policy="solver")
    assert planner["optimizer_steps"] == expected["optimizer_steps"] == -(-len(samples) // 4)
    assert solver["optimizer_steps"] == -(-len(samples) // 16) and solver["lr"] == 5e-3  # the shared config
    assert planner["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert planner["pg_clipfrac"] == pytest.approx(expected["pg_clipfrac"])
    trained, reference = _weights(team, "policy0"), _weights(alone, "policy0")
    assert all(torch.allclose(trained[k], reference[k], atol=1e-6) for k in reference)


@pytest.mark.parametrize("config, named", [
    ({"policy_config": {"critic": {"lr": 1e-4}}}, "critic"),
    ({"policy_config": {"solver": {"lora_rank": 4}}}, "policy_config['solver'].lora_rank is not a setting of "
                                                      "PolicyConfig (got 4); its settings are: lr, adv_estimator"),
    ({"policy_config": {"solver": 1e-4}}, "policy_config['solver'] must be a mapping of settings, got 0.0001"),
    ({"policy_config": {"solver": {"lr": -1.0}}}, "-1.0"),
    ({"policy_config": [("solver", {"lr": 1e-4})]}, "policy_config must be a mapping"),
    ({"policy_config": {"solver": {"mini_batch_size": 0}}}, "policy_config['solver'].mini_batch_size must be an int "
                                                            ">= 1, got 0"),
    ({"policy_config": {"solver": {"adv_estimator": "ppo"}}}, "unknown advantage estimator 'ppo'; known: "),
])
def test_a_policy_config_that_cannot_apply_is_refused(config, named):
    from lightning_rl.errors import LightningRLError
    from lightning_rl.trainer_bridge.config import LocalConfig
    from lightning_rl.trainer_bridge.local import LocalBackend

    with pytest.raises(LightningRLError, match="policy_config|advantage estimator") as info:
        LocalBackend(ensure_tiny_model(), LocalConfig(**config), seed=0, device="cpu", policies=["planner", "solver"])
    assert named in str(info.value)


def test_a_saved_policy_is_its_adapter_alone(tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    team = _backend(policies=["planner", "solver"])
    team.update(_samples(), policy="solver")
    team.adapter("solver").save_pretrained(tmp_path / "solver")
    team.adapter("planner").save_pretrained(tmp_path / "planner")
    ids = torch.tensor([[5, 17, 42, 8, 9]])
    for policy, folder in (("solver", "solver"), ("planner", "planner")):
        base = AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model()), dtype=torch.float32)
        loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / folder)).eval()
        team._use(policy)
        team.model.eval()
        with torch.no_grad():
            assert torch.allclose(loaded(input_ids=ids).logits, team.model(input_ids=ids).logits, atol=1e-5)
    with torch.no_grad(), team.model.disable_adapter():
        base_logits = team.model(input_ids=ids).logits
    team._use("planner")
    with torch.no_grad():  # the planner never trained: its adapter is the base model (B = 0)
        assert torch.allclose(team.model(input_ids=ids).logits, base_logits, atol=1e-6)


def test_naming_the_policy_is_required_and_checked():
    team = _backend(policies=["planner", "solver"])
    with pytest.raises(ConfigurationError, match="name the one to use"):
        team.update(_samples(8))
    with pytest.raises(ConfigurationError, match="no adapter for policy 'critic'"):
        team.update(_samples(8), policy="critic")
    with pytest.raises(ConfigurationError, match="distinct served names"):
        _backend(policies=["planner", "planner"])


def test_the_allocator_threshold_is_set_where_glibc_is_and_bad_values_are_refused():
    import platform
    import subprocess
    import sys

    from lightning_rl.trainer_bridge.local import set_malloc_mmap_threshold

    assert set_malloc_mmap_threshold(None) is False  # None: the allocator is left alone
    if platform.libc_ver()[0] == "glibc":  # in a process of its own: the setting is process-wide
        code = "from lightning_rl.trainer_bridge.local import set_malloc_mmap_threshold as s; print(s(65536))"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert done.stdout.strip() == "True"
    for bad in (-1, "64k", True):
        with pytest.raises(ConfigurationError, match="malloc_mmap_threshold") as info:
            set_malloc_mmap_threshold(bad)
        assert repr(bad) in str(info.value) and "65536" in str(info.value)


def test_freed_heap_memory_goes_back_to_the_system_after_each_update(monkeypatch):
    import platform
    import subprocess
    import sys

    from lightning_rl.trainer_bridge import local

    calls = []
    monkeypatch.setattr(local, "release_freed_memory", lambda: calls.append(1) or True)
    backend = _backend(policies=["planner", "solver"])
    assert backend.config.malloc_trim is None  # the default: on with several policies
    backend.update(_samples(8), policy="planner")
    backend.update(_samples(8), policy="solver")
    assert len(calls) == 2
    backend.config = backend.config.model_copy(update={"malloc_trim": False})
    backend.update(_samples(8), policy="planner")
    assert len(calls) == 2
    alone = _backend()  # one policy: off by default (its peak does not grow), on when asked
    alone.update(_samples(8))
    assert len(calls) == 2
    alone.config = alone.config.model_copy(update={"malloc_trim": True})
    alone.update(_samples(8))
    assert len(calls) == 3

    if platform.libc_ver()[0] == "glibc":  # a process of its own: 200 MB of small blocks, freed but for the last
        code = """if True:
            import torch
            from lightning_rl.trainer_bridge.local import release_freed_memory
            def rss_mb():
                return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
            blocks = [torch.ones(25_000) for _ in range(2_000)]  # 100 KB each, under glibc's mmap threshold
            del blocks[:-1]  # the last one keeps the heap's top in use: free() alone cannot shrink it
            before = rss_mb()
            print(release_freed_memory(), round(before - rss_mb()))"""
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        released, mb = done.stdout.split()
        assert released == "True" and int(mb) > 150, done.stdout

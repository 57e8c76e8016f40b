"""The ``vllm_full`` publisher: a merged model folder loaded into running vLLM OpenAI servers.

Where a policy is served as full weights (no LoRA at serving time), each version is saved as a plain
Hugging Face model folder ``weights_dir/vNNNNN`` (a PEFT model is merged first, on a copy:
``merge_and_unload``) and every server in ``server_url`` reloads its weights from that folder, in place,
under the name it already serves. The route is vLLM 0.32's in-place reload, reached through the
development routes (the server runs with ``VLLM_SERVER_DEV_MODE=1``; ``VLLMServer(dev_mode=True)``):

1. ``POST /pause?mode=wait`` — requests in flight finish on the old weights, new ones wait; the prefix
   cache is cleared (its entries were computed with the old weights);
2. ``POST /collective_rpc`` ``{"method": "reload_weights", "kwargs": {"weights_path": FOLDER}}`` — each
   worker reads the folder's checkpoint into the loaded model;
3. ``POST /update_weight_version`` ``{"new_version": "N"}`` — the server's own answer (``GET /weight_info``);
4. ``POST /resume`` (always, also after a failed reload).

Then, unless ``verify=False``, the served log-probs of a fixed prompt (tokenized by the server) at
temperature 0 must match the published model's own within ``tolerance``: the replica serves these weights.

Rules:

- The folder must be readable by every server at the same path (a shared filesystem); it is checked here
  first (``config.json`` and weight files, and the same architecture and shapes as the server's model
  where the server's model folder is readable here), because vLLM 0.32's engine dies on a reload it
  cannot read (a missing folder stops the server).
- Servers are checked once, before the first load: a server that is not vLLM, that lacks the development
  routes, or that does not serve ``served_name`` as its base model is refused with a
  :class:`ConfigurationError` naming it and the flag to add; nothing is loaded anywhere then.
- Each server is loaded with up to ``retries`` tries (connection errors and 5xx answers; ``retry_wait``
  doubling between). When any server still fails, every other server is still loaded, and a
  :class:`PublishError` names each failed server and why; ``publish_and_record`` then records nothing.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from ..diagnostics import count, report_failure
from ..errors import ConfigurationError, PublishError
from ..tracer.provider import tracing
from .publishers import register_publisher

DEV_FLAG = "VLLM_SERVER_DEV_MODE=1 in the vLLM server's environment (VLLMServer(dev_mode=True))"
VERIFY_TEXT = "The quick brown fox jumps over the lazy dog. 0123456789"
# files a servable folder needs beside the weights; copied from the base model's folder when it is local
_BESIDE_WEIGHTS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "chat_template.jinja", "added_tokens.json")
_SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "vocab_size", "tie_word_embeddings")


def _failure(message: str, status: int | None) -> PublishError:
    """A PublishError of an HTTP call, with its ``status`` (None: not reached); retried when None or >= 500."""
    error = PublishError(message)
    error.status = status  # type: ignore[attr-defined]
    return error


def _retryable(error: PublishError) -> bool:
    status = getattr(error, "status", 0)  # 0: not an HTTP call's failure (a check that failed)
    return status is None or status >= 500


def _call(method: str, url: str, body: dict[str, Any] | None = None, *, timeout: float) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        detail = " ".join(exc.read().decode(errors="replace").split())[:300]
        raise _failure(f"{method} {url} answered {exc.code}: {detail}", exc.code) from None
    except OSError as exc:
        raise _failure(f"cannot reach {url}: {exc}", None) from None
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


def model_folder_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a model folder vLLM can reload from, or None."""
    if not folder.is_dir():
        return "it is not a folder"
    if not (folder / "config.json").is_file():
        return "it has no config.json" + ("; it is a LoRA adapter folder (merge it first: lightning-rl "
                                          "export-model)" if (folder / "adapter_config.json").is_file() else "")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*.bin")):
        return "it has no weights (*.safetensors or pytorch_model*.bin)"
    return None


def save_full_model(model: Any, weights_dir: Path, version: int) -> tuple[str, Any]:
    """Save ``model`` as a plain model folder ``weights_dir/vNNNNN``: a PEFT model is merged on a copy
    (the trainer's model keeps its adapter), tokenizer files come from its base model's folder when local.
    Returns the folder's absolute path and the model that was saved. The local trainer's
    ``AdapterWeights`` (one adapter of its multi-adapter model) is merged with that adapter alone."""
    from .local import AdapterWeights

    path = (weights_dir / f"v{version:05d}").resolve()
    adapter = None
    if isinstance(model, AdapterWeights):
        model, adapter = model.model, model.name
    if hasattr(model, "merge_and_unload"):
        adapter = adapter or getattr(model, "active_adapter", "default")
        source = getattr(getattr(model, "peft_config", {}).get(adapter), "base_model_name_or_path", None)
        model = copy.deepcopy(model).merge_and_unload(adapter_names=[adapter])
    else:
        source = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not hasattr(model, "save_pretrained"):
        raise ConfigurationError(f"vllm_full publishes a transformers or PEFT model, or a model folder; got "
                                 f"{type(model).__name__}")
    model.save_pretrained(str(path), safe_serialization=True)
    if source and Path(source).is_dir():
        for name in _BESIDE_WEIGHTS:
            if (Path(source) / name).is_file() and not (path / name).exists():
                shutil.copy2(Path(source) / name, path / name)
    return str(path), model


@register_publisher("vllm_full")
class VLLMFullPublisher:
    """Save each version as a merged model folder and reload every server's weights from it in place."""

    def __init__(self, *, server_url: str | Sequence[str], weights_dir: str | Path, served_name: str = "policy",
                 drain: Literal["wait", "abort", "keep"] = "wait", retries: int = 3, retry_wait: float = 1.0,
                 verify: bool = True, tolerance: float = 1e-3, timeout: float = 300.0) -> None:
        server_url = getattr(server_url, "urls", server_url)  # a replica set (replicas.Replicas) too
        urls = [u.strip() for u in server_url.split(",")] if isinstance(server_url, str) else list(server_url)
        if not urls:
            raise ConfigurationError("vllm_full needs at least one server_url (http://host:port)")
        for url in urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigurationError(f"server_url must be http(s)://host:port (or a list of them), got {url!r}")
        if drain not in ("wait", "abort", "keep"):
            raise ConfigurationError(f"drain must be 'wait', 'abort' or 'keep' (vLLM's /pause modes), got {drain!r}")
        if retries < 1:
            raise ConfigurationError(f"retries must be >= 1 (tries per server), got {retries!r}")
        self.server_urls = [u.rstrip("/").removesuffix("/v1") for u in urls]
        self.weights_dir = Path(weights_dir)
        self.served_name = served_name
        self.drain, self.retries, self.retry_wait = drain, retries, retry_wait
        self.verify, self.tolerance, self.timeout = verify, tolerance, timeout
        self._checked: dict[str, str] = {}  # server -> its model folder (as the server names it)
        self.last_deviation: dict[str, float] = {}  # server -> max |served - expected| log-prob of the last verify

    # -- checks --------------------------------------------------------------------------------------
    def check_server(self, url: str) -> str:
        """``url`` is a vLLM server with the development routes serving ``served_name`` as its base model;
        returns the folder it loaded at start. Raises a :class:`ConfigurationError` naming what to fix."""
        if url in self._checked:
            return self._checked[url]
        try:
            answer = _call("GET", f"{url}/version", timeout=30)
        except PublishError as exc:
            if getattr(exc, "status", None) is None:
                raise
            answer = None
        if not isinstance(answer, dict) or "version" not in answer:
            raise ConfigurationError(f"{url} is not a vLLM OpenAI server (GET /version answered {str(answer)[:80]!r}); "
                                     "give the URL of `python -m vllm.entrypoints.openai.api_server`")
        try:
            _call("GET", f"{url}/is_paused", timeout=30)
        except PublishError as exc:
            if getattr(exc, "status", None) != 404:
                raise
            raise ConfigurationError(f"{url} (vLLM {answer['version']}) has no /pause and /collective_rpc routes; "
                                     f"start it with {DEV_FLAG}") from None
        listed = {m.get("id"): m for m in (_call("GET", f"{url}/v1/models", timeout=30) or {}).get("data", [])}
        model = listed.get(self.served_name)
        if model is None or model.get("parent") is not None:
            raise ConfigurationError(
                f"{url} does not serve {self.served_name!r} as its base model (it serves {sorted(listed)}); give "
                "vllm_full the name vLLM serves its base model under (`vllm serve --served-model-name`; "
                "`train run --weights full --served-name NAME`): full weights replace the base model")
        self._checked[url] = str(model.get("root") or "")
        return self._checked[url]

    def check_folder(self, folder: Path, server_model: str) -> None:
        """``folder`` is a model folder with the architecture and shapes of ``server_model`` (when that
        folder is readable here). Raises a :class:`ConfigurationError` naming it."""
        problem = model_folder_problem(folder)
        if problem:
            raise ConfigurationError(f"{str(folder)!r} is not a model folder vLLM can load: {problem}; give a "
                                     "folder written by save_pretrained (or a transformers/PEFT model)")
        served_config = Path(server_model) / "config.json"
        if not served_config.is_file():
            return
        new, served = json.loads((folder / "config.json").read_text()), json.loads(served_config.read_text())
        differ = {k: (served.get(k), new.get(k)) for k in _SHAPE_KEYS if served.get(k) != new.get(k)}
        if new.get("architectures") != served.get("architectures"):
            differ["architectures"] = (served.get("architectures"), new.get("architectures"))
        if differ:
            raise ConfigurationError(f"{str(folder)!r} is not the served model's shape ({server_model}): "
                                     f"{differ} (served, new); publish weights of the model the server loaded")

    # -- the publish -----------------------------------------------------------------------------------
    def publish(self, model: Any, version: int) -> str:
        """``model``: a transformers model, a PEFT model (merged on a copy) or a model folder. Saves it as
        ``weights_dir/vNNNNN`` (a folder is used where it is), loads it into every server, sets ``version``
        for this process's tracer; returns the folder."""
        roots: dict[str, str] = {}
        failed: dict[str, str] = {}
        for url in self.server_urls:  # a misconfigured server stops the publish before any load
            try:
                roots[url] = self._retried(lambda url=url: self.check_server(url))
            except PublishError as exc:  # not reached (or failing): the others are still loaded
                failed[url] = str(exc)
        if isinstance(model, (str, Path)):
            path, saved = str(Path(model).resolve()), None
        else:
            path, saved = save_full_model(model, self.weights_dir, version)
        for url in roots:
            self.check_folder(Path(path), roots[url])
        expected = self._expected(saved, path, next(iter(roots))) if self.verify and roots else None
        for url in roots:
            try:
                self._load_with_retries(url, path, version, expected)
            except PublishError as exc:
                failed[url] = str(exc)
        for url, why in failed.items():
            count("full_publish_failures")
            report_failure(f"vllm_full load into {url}",
                           message=f"lightning-rl: vllm_full could not load v{version:05d} into {url}: {why}")
        if failed:
            served = [u for u in self.server_urls if u not in failed]
            raise PublishError(f"v{version:05d} ({path}) failed on {len(failed)} of {len(self.server_urls)} "
                               f"server(s): " + "; ".join(f"{u}: {why}" for u, why in failed.items())
                               + f" (loaded on {served or 'none'}); fix or restart those and publish again")
        tracing.set_policy_version(version, model=self.served_name)
        return path

    def _load_with_retries(self, url: str, path: str, version: int, expected: Any) -> None:
        def load_and_verify() -> None:
            self.load(url, path, version)
            if expected is not None:
                self._verify(url, version, expected)

        self._retried(load_and_verify)

    def _retried(self, call: Callable[[], Any]) -> Any:
        """``call()``, tried up to ``retries`` times while the server is not reached or answers 5xx."""
        wait = self.retry_wait
        for attempt in range(1, self.retries + 1):
            try:
                return call()
            except PublishError as exc:
                if not _retryable(exc):
                    raise
                if attempt == self.retries:
                    raise PublishError(f"{exc} (try {attempt} of {self.retries})") from None
                count("full_publish_retries")
                time.sleep(wait)
                wait *= 2
        raise AssertionError("unreachable")

    def load(self, url: str, path: str, version: int) -> None:
        """Pause ``url`` (draining as ``drain`` says), reload its weights from ``path``, stamp ``version`` as
        its weight version, resume it (also when the reload failed)."""
        _call("POST", f"{url}/pause?mode={self.drain}&clear_cache=true", timeout=self.timeout)
        try:
            _call("POST", f"{url}/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}},
                  timeout=self.timeout)
            _call("POST", f"{url}/update_weight_version", {"new_version": str(version)}, timeout=30)
        finally:
            try:
                _call("POST", f"{url}/resume", timeout=30)
            except PublishError as exc:
                report_failure(f"vllm_full resume of {url}", exc)

    # -- verification ----------------------------------------------------------------------------------
    def _expected(self, saved: Any, path: str, url: str) -> tuple[list[int], list[float]]:
        """Token ids of the fixed prompt (``url``'s tokenizer) and the published model's log-prob of each
        next token."""
        import torch

        ids = _call("POST", f"{url}/tokenize", {"model": self.served_name, "prompt": VERIFY_TEXT},
                    timeout=30)["tokens"]
        if saved is None:
            from transformers import AutoModelForCausalLM

            saved = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        device = next(saved.parameters()).device
        with torch.no_grad():
            logits = saved(torch.tensor([ids], device=device)).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        return ids, [logprobs[i, ids[i + 1]].item() for i in range(len(ids) - 1)]

    def _verify(self, url: str, version: int, expected: tuple[list[int], list[float]]) -> None:
        info = _call("GET", f"{url}/weight_info", timeout=30)
        if not isinstance(info, dict) or info.get("weight_version") != str(version):
            raise PublishError(f"{url} reports weight version {info!r} after loading v{version:05d}")
        ids, want = expected
        got = served_prompt_logprobs(url, self.served_name, ids)
        deviation = max(abs(a - b) for a, b in zip(got, want, strict=True))
        self.last_deviation[url] = deviation
        if deviation > self.tolerance:
            raise PublishError(f"{url} does not serve v{version:05d}'s weights: its log-probs of a fixed prompt "
                               f"differ from the published model's by up to {deviation:.3g} (> tolerance "
                               f"{self.tolerance}); raise tolerance= where server and trainer use different dtypes")


def served_prompt_logprobs(url: str, served_name: str, ids: Sequence[int], *, timeout: float = 60.0) -> list[float]:
    """The log-prob the server at ``url`` gives each next token of the prompt ``ids`` (temperature 0)."""
    base = url.rstrip("/").removesuffix("/v1")
    answer = _call("POST", f"{base}/v1/completions", {"model": served_name, "prompt": list(ids), "max_tokens": 1,
                                                      "temperature": 0, "prompt_logprobs": 0}, timeout=timeout)
    positions = answer["choices"][0]["prompt_logprobs"][1:]
    return [entry[str(token)]["logprob"] for entry, token in zip(positions, ids[1:], strict=True)]

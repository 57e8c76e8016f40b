"""The store kit: backends by URL scheme through one registry, and the page that tells how to add one."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from lightning_rl.errors import ConfigurationError
from lightning_rl.store import open_store
from lightning_rl.store.kit import KitStore, StoreBackend, register_store_backend
from lightning_rl.store.uri import same_store, store_backend

from .helpers import rollout
from .toy_store import ToyStore

EXTENDING = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def test_a_registered_scheme_opens_its_backend_and_an_unknown_one_lists_every_scheme():
    with open_store("toy://a") as store:
        store.start_rollout(rollout("r1"))
        assert isinstance(store, ToyStore) and store.get_rollout("r1").rollout_id == "r1"
    assert not same_store("toy://a", "toy://a")  # each open is a new store, as memory://
    assert store_backend("runs.db").name == "sqlite" and store_backend("postgresql://u@h/d").shared
    with pytest.raises(ConfigurationError, match=r"'nope'.*toy://NAME"):
        open_store("nope://x")


def test_a_scheme_is_claimed_once():
    with pytest.raises(ConfigurationError, match="belongs to the 'postgres' backend"):
        register_store_backend(StoreBackend("pg2", ("postgresql",), lambda where, **options: None))


def test_the_page_lists_every_primitive_a_backend_implements():
    primitives = sorted(name for name, value in vars(KitStore).items()
                        if callable(value) and name.startswith("_") and not name.startswith("__")
                        and "raise NotImplementedError" in inspect.getsource(value))
    documented = sorted(re.findall(r"^\| `(_\w+)\(", EXTENDING.read_text(), re.M))
    assert documented == primitives and len(primitives) <= 12

"""Moved to ``store/postgres/store.py``; this module path stays importable: it is that module (not a copy)."""

import sys

from .postgres import store as _moved

sys.modules[__name__] = _moved

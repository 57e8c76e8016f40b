"""Moved to ``store/http/client.py``; this module path stays importable: it is that module (not a copy)."""

import sys

from .http import client as _moved

sys.modules[__name__] = _moved

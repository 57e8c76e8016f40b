"""Moved to ``store/http/server.py``; this module path stays importable: it is that module (not a copy)."""

import sys

from .http import server as _moved

sys.modules[__name__] = _moved

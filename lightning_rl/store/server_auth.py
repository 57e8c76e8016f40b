"""Moved to ``store/http/auth.py``; this module path stays importable: it is that module (not a copy)."""

import sys

from .http import auth as _moved

sys.modules[__name__] = _moved

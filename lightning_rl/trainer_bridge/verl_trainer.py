"""Moved to ``lightning_rl.trainer_bridge.verl.trainer``; this path stays (the same module)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("lightning_rl.trainer_bridge.verl.trainer")

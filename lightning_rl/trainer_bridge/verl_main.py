"""Moved to ``lightning_rl.trainer_bridge.verl.main``; this path stays (the same module, and ``python -m`` runs it)."""

import importlib
import sys

if __name__ == "__main__":
    from lightning_rl.trainer_bridge.verl.main import main

    main()
else:
    sys.modules[__name__] = importlib.import_module("lightning_rl.trainer_bridge.verl.main")

"""``python -m lightning_rl.cli``: the ``lightning-rl`` command."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())

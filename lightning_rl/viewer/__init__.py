"""The trajectory viewer (``lightning-rl view``): a read-only web UI over any store (``app.py``)."""

from .app import BackgroundViewer, create_app, serve

__all__ = ["BackgroundViewer", "create_app", "serve"]

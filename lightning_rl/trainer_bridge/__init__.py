"""Trajectories to training batches and new weights back to the served model (see DESIGN.md)."""

from ..errors import PublishError
from .publishers import PUBLISHERS, Publisher, VLLMLoRAPublisher, make_publisher, register_publisher

__all__ = ["PUBLISHERS", "PublishError", "Publisher", "VLLMLoRAPublisher", "make_publisher", "register_publisher"]

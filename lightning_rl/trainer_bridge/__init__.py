"""Trajectories to training batches and new weights back to the served model (see DESIGN.md)."""

from ..errors import PublishError
from .publishers import PUBLISHERS, Publisher, VLLMLoRAPublisher, make_publisher, register_publisher
from .publishers_full import VLLMFullPublisher  # registers vllm_full

__all__ = ["PUBLISHERS", "PublishError", "Publisher", "VLLMFullPublisher", "VLLMLoRAPublisher", "make_publisher",
           "register_publisher"]

"""The gateway: trace agents in any language or process (``lightning-rl gateway``, ``lrl.command``).

``proxy.py`` is the OpenAI-compatible proxy and the command agents; ``otlp.py`` decodes the spans an
agent's OpenTelemetry SDK sends (OTLP/HTTP, protobuf or JSON).
"""

from .proxy import (BackgroundGateway, CommandFailed, Gateway, GatewayError, check_bind, command, create_app,
                    local_gateway, serve)

__all__ = ["BackgroundGateway", "CommandFailed", "Gateway", "GatewayError", "check_bind", "command", "create_app",
           "local_gateway", "serve"]

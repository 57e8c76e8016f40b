"""The gateway: trace agents in any language or process (``lightning-rl gateway``, ``lrl.command``).

``proxy.py`` holds the gateway's state and says what each route does; ``auth.py`` who may do what;
``rollouts.py`` the rollouts opened over HTTP and the spans sent to them; ``forwarding.py`` the calls to
the engines (captured by ``capture/exchange.py``, in the dialects of ``capture/dialects``);
``upstream.py`` the keep-alive client to the engines; ``otlp.py`` decodes an agent's OpenTelemetry
spans; ``app.py`` serves it all; ``command.py`` is ``lrl.command``.
"""

from .app import BackgroundGateway, create_app, serve
from ..errors import CommandFailed, GatewayError
from .command import command, local_gateway
from .proxy import Gateway

__all__ = ["BackgroundGateway", "CommandFailed", "Gateway", "GatewayError", "command", "create_app",
           "local_gateway", "serve"]

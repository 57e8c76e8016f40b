"""A tiny MCP server (the ``mcp`` SDK's ``MCPServer``, FastMCP before mcp 2) for the MCP tool-span tests.

Run: ``python mcp_server.py`` (stdio) or ``python mcp_server.py http PORT`` (streamable HTTP on
127.0.0.1:PORT, path ``/mcp``). Tools:

* ``calculator(expression)``: ``"12+30"`` -> ``"42"`` (text only);
* ``divide(a, b)``: ``a / b`` with structured content (``{"result": ...}``); ``b == 0`` raises ``ToolError``,
  which the server answers with ``isError: true`` and the error's text;
* ``sleep(seconds)``: returns after sleeping (a client timeout raises on the caller's side).
"""

from __future__ import annotations

import sys
import time
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.tools import Tool
from pydantic import Field

SERVER_NAME = "lrl-test-tools"
# a bounded pattern and no other keys: a model forced to call the tool is held to them (vLLM's guided decoding),
# so its call always parses and ends well inside max_tokens
PATTERN = "^[0-9]{1,3}[+][0-9]{1,3}$"


def calculator(expression: Annotated[str, Field(pattern=PATTERN)]) -> str:
    """Evaluate an addition like 12+30."""
    a, b = expression.split("+")
    return str(int(a) + int(b))


_calculator = Tool.from_function(calculator)
_calculator.parameters["additionalProperties"] = False
server = MCPServer(SERVER_NAME, log_level="WARNING", tools=[_calculator])


@server.tool()
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    if b == 0:
        raise ToolError("cannot divide by zero")  # its text reaches the client (other exceptions' do not)
    return a / b


@server.tool()
def sleep(seconds: float) -> str:
    """Sleep, then say so."""
    time.sleep(seconds)
    return "slept"


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()

"""A tiny MCP server over stdio (the ``mcp`` SDK's ``MCPServer``) with one tool, ``calculator``, for the
OpenAI Agents SDK's MCP support (``agents.mcp.MCPServerStdio``). Run: python agents_mcp_server.py"""

from typing import Annotated

from mcp.server import MCPServer
from pydantic import Field

PATTERN = "^[0-9]{1,3}[+][0-9]{1,3}$"
server = MCPServer("calculator")


@server.tool()
def calculator(expression: Annotated[str, Field(pattern=PATTERN)]) -> str:
    """Evaluate an arithmetic expression."""
    a, b = expression.split("+")
    return str(int(a) + int(b))


if __name__ == "__main__":
    server.run("stdio")

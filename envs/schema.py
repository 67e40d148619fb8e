"""Tool schemas in the OpenAI function format, as chat templates (and OpenEnv's MCP listing) render them."""

from __future__ import annotations

from typing import Any

__all__ = ["function_schema"]


def function_schema(name: str, description: str, params: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """One tool's schema: ``{"type": "function", "function": {name, description, parameters}}``.

    Args:
        name: the tool's name, as the model calls it.
        description: one line the model reads.
        params: parameter name -> (JSON Schema type, description), in the order the model sees them; all are
            required.
    """
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": t, "description": d} for p, (t, d) in params.items()},
                "required": list(params),
            },
        },
    }

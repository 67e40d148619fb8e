"""Server side of the tool environment (``ToolEnvironment``; the app lives in ``.app``)."""

from .tool_environment import ToolEnvironment

__all__ = ["ToolEnvironment"]

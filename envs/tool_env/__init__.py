"""Tool-use environment: price-arithmetic episodes solved with lookup/add/subtract/multiply/submit.

Layout follows OpenEnv's: ``models`` (wire types), ``tasks`` (pure task generation, tool execution
and a scripted solver), ``demos`` (the solver's episodes, the embedded default policy's warm-start data),
``client`` (WebSocket client), ``server`` (environment and FastAPI app).
"""

from .client import ToolEnvClient
from .models import ToolAction, ToolObservation, ToolState
from .tasks import TOOL_SCHEMAS, Task, execute, make_task, solve

__all__ = [
    "TOOL_SCHEMAS",
    "Task",
    "ToolAction",
    "ToolEnvClient",
    "ToolObservation",
    "ToolState",
    "execute",
    "make_task",
    "solve",
]

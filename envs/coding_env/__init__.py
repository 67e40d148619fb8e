"""Coding environment: write or fix a small Python function in a workspace, with visible and hidden tests.

Layout follows OpenEnv's: ``models`` (wire types), ``tasks`` (hand-written and generated tasks, a scripted
solver), ``tools`` (tool schemas and execution), ``sandbox`` (contained execution of the model's code), ``demos``
(the scripted solver's episodes, the warm-start data of the embedded default policy), ``client``
(WebSocket client), ``server`` (environment and FastAPI app). ``python -m envs.coding_env.server --port 8001``
serves it; a run plays it with ``[env] server_module = "envs.coding_env.server"`` (``configs/coding.toml``).
"""

from .client import CodingEnvClient
from .models import CodingAction, CodingObservation, CodingState
from .sandbox import SandboxLimits, SandboxPolicy, isolation, run_sandboxed
from .tasks import FAMILIES, HANDWRITTEN, CodingTask, make_task, solve
from .tools import TOOL_SCHEMAS, ToolOutcome, execute

__all__ = [
    "FAMILIES",
    "HANDWRITTEN",
    "TOOL_SCHEMAS",
    "CodingAction",
    "CodingEnvClient",
    "CodingObservation",
    "CodingState",
    "CodingTask",
    "SandboxLimits",
    "SandboxPolicy",
    "ToolOutcome",
    "execute",
    "isolation",
    "make_task",
    "run_sandboxed",
    "solve",
]

"""A minimal third env package, in OpenEnv's layout, that the core plays with no edit of its own (the env contract
of ``composer_diloco.rollout.env_package``): say a word back with the ``echo`` tool.

``models`` (wire types, its own: the contract is the protocol's JSON field names, not ``envs.protocol``'s classes),
``client`` (WebSocket client), ``demos`` (scripted demonstrations, the scripted teacher, reason hints), ``server``
(environment and FastAPI app). With ``tests/`` on the import path (pytest's ``pythonpath``), ``python -m
echo_env.server --port 8002`` serves it.
"""

from .client import EchoEnvClient
from .models import EchoAction, EchoObservation, EchoState
from .tasks import TOOL_SCHEMAS, execute, word_of

__all__ = ["TOOL_SCHEMAS", "EchoAction", "EchoEnvClient", "EchoObservation", "EchoState", "execute", "word_of"]

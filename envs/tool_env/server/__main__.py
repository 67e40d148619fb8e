"""``python -m envs.tool_env.server --host 127.0.0.1 --port 8000`` serves the tool environment."""

from .app import main

main()

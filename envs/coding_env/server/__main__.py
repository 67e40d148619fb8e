"""``python -m envs.coding_env.server --host 127.0.0.1 --port 8001`` serves the coding environment."""

from .app import main

main()

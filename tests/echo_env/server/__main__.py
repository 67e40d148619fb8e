"""``python -m echo_env.server --host 127.0.0.1 --port 8002`` serves the echo env (``tests/`` on the import path)."""

from .app import main

main()

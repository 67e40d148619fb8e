"""Server side of the echo env (``EchoEnvironment``; the app lives in ``.app``)."""

from .echo_environment import EchoEnvironment

__all__ = ["EchoEnvironment"]

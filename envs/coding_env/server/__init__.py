"""Server side of the coding environment (``CodingEnvironment``; the app lives in ``.app``)."""

from .coding_environment import CodingEnvironment

__all__ = ["CodingEnvironment"]

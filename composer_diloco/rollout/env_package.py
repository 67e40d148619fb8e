"""The env contract: what the core takes from an environment package, found from ``[env] server_module``.

The core names no concrete env. An env package ``P`` (``[env] server_module = "P.server"``) is an OpenEnv env in
OpenEnv's layout (``models.py``, ``client.py``, ``server/``, ``openenv.yaml``) and may add, in ``P/demos.py``:

- ``demonstration(seed, index, error_rate) -> envs.demonstration.Demonstration``: the scripted solver's episodes,
  the warm-start data of the embedded default policy;
- ``script(seed, episode_id, question) -> [(tool, arguments), ...] | None``: the solver's error-free calls for an
  episode (None when the question is not that episode's), followed by the DPO channel's ``"scripted"`` teacher;
- ``REASON_HINTS``: ``{reason: hint template}`` for tool errors whose metadata carries a ``reason`` (SDPO hints).

Every entry is optional: a package without ``demos.py`` trains with a real ``--model`` and no scripted teacher.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, ModuleType
from typing import Any

ToolCall = tuple[str, dict[str, Any]]
DemonstrationFn = Callable[[int, int, float], Any]
ScriptFn = Callable[[int, str, str], "list[ToolCall] | None"]


class EnvPackageError(ValueError):
    """An ``[env] server_module`` that names no importable env package, or a package that breaks the contract."""


@dataclass(frozen=True)
class EnvPackage:
    """One env package's side of the contract (see the module docstring).

    Attributes:
        package: the package's import name (``"envs.tool_env"``).
        server_module: the module a node runs as ``python -m`` to serve it (``"envs.tool_env.server"``).
        demonstration: scripted demonstrations (warm start), or None.
        script: the scripted solver's calls for an episode (DPO ``"scripted"`` teacher), or None.
        reason_hints: hint templates by error ``reason`` (SDPO), empty when the env has none.
    """

    package: str
    server_module: str
    demonstration: DemonstrationFn | None = None
    script: ScriptFn | None = None
    reason_hints: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


def package_of(server_module: str) -> str:
    """``"P.server"`` -> ``"P"``; a name without ``.server`` is taken as the package itself."""
    return server_module[: -len(".server")] if server_module.endswith(".server") else server_module


def _optional_module(name: str, package: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if exc.name not in (name, package, package.split(".")[0]):
            raise  # the module exists but one of its own imports failed: that is a real error
        return None


def load_env_package(server_module: str) -> EnvPackage:
    """The `EnvPackage` of ``server_module``'s package.

    Raises:
        EnvPackageError: the package cannot be imported, or ``demos.py`` defines an entry that is not callable.
    """
    package = package_of(server_module)
    if _optional_module(package, package) is None:
        raise EnvPackageError(f"[env] server_module {server_module!r}: package {package!r} is not importable "
                              "(expected an OpenEnv env package whose server runs as `python -m <package>.server`)")
    demos = _optional_module(f"{package}.demos", package)
    entries = {}
    for name in ("demonstration", "script"):
        value = getattr(demos, name, None)
        if value is not None and not callable(value):
            raise EnvPackageError(f"{package}.demos.{name} is {type(value).__name__}: expected a function")
        entries[name] = value
    hints = getattr(demos, "REASON_HINTS", None) or {}
    return EnvPackage(package=package, server_module=server_module, reason_hints=MappingProxyType(dict(hints)),
                      **entries)

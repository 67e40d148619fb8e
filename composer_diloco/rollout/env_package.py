"""The env contract: what the core takes from an environment package, found from ``[env] server_module``.

The core names no concrete env: it imports nothing from ``envs`` and finds everything below from the one string
``[env] server_module``. Adding an env means writing a package; no file of ``composer_diloco/`` changes
(``tests/echo_env`` is such a package, played through the core by ``tests/test_env_contract.py``).

**The package.** ``[env] server_module = "P.server"`` names an OpenEnv env package ``P`` in OpenEnv's layout
(``models.py``, ``client.py``, ``server/``, ``openenv.yaml``). A node serves it as ``python -m P.server --host H
--port N`` (`composer_diloco.rollout.env_process.start_env_server`), which must answer ``GET /health`` and play
episodes over OpenEnv's WebSocket ``/ws`` (``create_app``), or plays an already running one (``--env-url``).

**The session: one of two wire protocols**, detected per URL by `composer_diloco.rollout.sessions.open_env_sessions`
(no package import, so a node can play a remote fleet whose package it lacks):

- the typed tool-call protocol, played by `composer_diloco.rollout.episodes.OpenEnvSession` over OpenEnv's
  ``GenericEnvClient``. These JSON field names are the whole contract (``envs/protocol.py`` has pydantic models and
  a typed client for them, which this project's envs subclass; an env may use its own models):

  - ``reset(seed, episode_id, max_tool_calls, **[env] reset_kwargs)``: the same ``(seed, episode_id)`` gives the
    same episode (trace-replay DPO replays episodes); its observation holds ``question`` (str, the user prompt) and
    ``tools`` (tool schemas in OpenAI function format, as the chat template renders them);
  - a step action is ``{"tool": str, "arguments": object}``; its observation holds ``content`` (str, the tool
    message the policy sees), ``error_kind`` (null on success, else ``"tool_not_found"``, ``"invalid_args"``,
    ``"execution_error"`` or ``"timeout"``: the keys of the SDPO hints) and ``error_meta`` (object: ``tool``,
    ``message`` and per kind ``available_tools``, ``expected_schema``, ``reason``, ``timeout_s``), plus OpenEnv's
    ``reward`` (null counts 0.0) and ``done`` (the episode's reward is that of its first ``done`` step);
  - the server's ``GET /schema`` (every OpenEnv app serves it) shows an action with ``tool`` and ``arguments`` and
    observations with the five fields above: that is how it is told apart from an MCP server and from envs of other
    protocols, which are refused with one line (`composer_diloco.rollout.mcp.detect_env_protocol`); a reset with an
    empty ``question`` or ``tools`` is an error too;

- OpenEnv's MCP tool protocol (``ListToolsAction`` / ``CallToolAction``), played by
  `composer_diloco.rollout.mcp.McpEnvSession` (its module docstring lists what it expects).

**Scripted data, optional**, in ``P/demos.py``:

- ``demonstration(seed, index, error_rate) -> Demonstration``: the scripted solver's episodes, the warm-start data of
  the embedded default policy. A ``Demonstration`` (``envs.demonstration``) has ``question``, ``tools``, ``calls``
  (``[(tool, arguments), ...]``), ``replies`` (str per call), ``imitate`` (bool per call) and, optionally, ``errors``
  (``(error_kind, error_meta)`` per failed call, None per other call: what ``[warmstart] hint_rate`` makes hints
  of);
- ``ERROR_RATE``: the default fraction of demonstrations with one failed call and its recovery;
- ``script(seed, episode_id, question) -> [(tool, arguments), ...] | None``: the solver's error-free calls for an
  episode (None when the question is not that episode's), followed by the DPO channel's ``"scripted"`` teacher;
- ``REASON_HINTS``: ``{reason: hint template}`` for tool errors whose metadata carries a ``reason`` (SDPO hints).

Every entry is optional: a package without ``demos.py`` trains with a real ``--model`` and no scripted teacher.

**A tokenizer for the embedded default, optional**: ``P/policy_tokenizer/`` (``save_pretrained`` files of a tokenizer
built by ``composer_diloco.policy.tokenizer.build_tokenizer`` from the package's own episodes) is what the embedded
default plays ``P`` with; without it, the project's (`composer_diloco.policy.load.embedded_tokenizer_dir`). Found
by path, without importing the package.

**A tokenizer recipe, optional**, in ``P/tokenizer_recipe.py``: ``corpus() -> [Demonstration, ...]`` and
``domain_words() -> (str, ...)``, with ``VOCAB_SIZE`` (int, default 1000) and ``BUILDS_THE_PROJECT_TOKENIZER`` (bool,
default False: the recipe builds ``P/policy_tokenizer/``; True: the project's ``composer_diloco/assets/tokenizer/``,
which tool_env's recipe builds). ``python -m composer_diloco.policy build-tokenizer --env P`` rebuilds it
(`load_tokenizer_recipe`, `composer_diloco.policy.tokenizer.build_env_tokenizer`); no run path imports it.

**Evaluation in process, optional**: `EnvPackage.local_session` plays the one ``Environment`` subclass that
``P/server/__init__.py`` exports (built with no arguments) in this process, through the same protocol fields, for
evaluating a policy on the env without a server.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

from composer_diloco.rollout.openenv_import import import_openenv_core

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
        error_rate: the demonstrations' default fraction with one failed call and its recovery (``demos.ERROR_RATE``),
            or None.
    """

    package: str
    server_module: str
    demonstration: DemonstrationFn | None = None
    script: ScriptFn | None = None
    reason_hints: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    error_rate: float | None = None


    def local_session(self, *, max_tool_calls: int, reset_kwargs: Mapping[str, Any] | None = None) -> Any:
        """A `composer_diloco.rollout.episodes.LocalEnvSession` on a new instance of the package's environment:
        episodes played in this process without a server (evaluation, tests).

        The environment is the one ``Environment`` subclass that ``P.server`` exports (OpenEnv's layout:
        ``server/<name>_environment.py``, re-exported by ``server/__init__.py``), built with no arguments.

        Args:
            max_tool_calls: the call budget per episode.
            reset_kwargs: more keywords for every ``reset``.
        Raises:
            EnvPackageError: ``P.server`` is not importable or exports no, or several, ``Environment`` subclasses.
        """
        from openenv.core.env_server.interfaces import Environment

        from composer_diloco.rollout.episodes import LocalEnvSession

        name = f"{self.package}.server"
        server = _optional_module(name, self.package)
        if server is None:
            raise EnvPackageError(f"{name} is not importable: expected the package's server (OpenEnv layout)")
        found = sorted({v for v in vars(server).values()
                        if isinstance(v, type) and issubclass(v, Environment) and v is not Environment},
                       key=lambda c: c.__name__)
        if len(found) != 1:
            raise EnvPackageError(f"{name} exports {len(found)} Environment subclasses "
                                  f"({', '.join(c.__name__ for c in found) or 'none'}): expected exactly one")
        return LocalEnvSession(found[0](), max_tool_calls=max_tool_calls, reset_kwargs=reset_kwargs)


def package_of(server_module: str) -> str:
    """The package of a server module: ``"P.server"`` -> ``"P"``; a name without ``.server`` is the package itself.

    Args:
        server_module: ``[env] server_module``, e.g. ``"envs.tool_env.server"``.
    Returns:
        The package's import name, e.g. ``"envs.tool_env"``.
    """
    return server_module[: -len(".server")] if server_module.endswith(".server") else server_module


def _optional_module(name: str, package: str) -> ModuleType | None:
    """``name`` imported, or None when it (or its package) does not exist; an import error inside it propagates."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if exc.name not in (name, package, package.split(".")[0]):
            raise  # the module exists but one of its own imports failed: that is a real error
        return None


@dataclass(frozen=True)
class TokenizerRecipe:
    """An env package's tokenizer recipe (``P/tokenizer_recipe.py``, see the module docstring).

    Attributes:
        package: the package's import name.
        package_dir: its folder (where its ``policy_tokenizer/`` goes).
        corpus: the episodes the BPE is trained on (``envs.demonstration.Demonstration`` or any object with
            ``question``, ``tools``, ``calls``, ``replies``).
        domain_words: the nouns that become atomic tokens, in id order.
        vocab_size: the BPE's target vocabulary (tokens).
        builds_the_project_tokenizer: True when the recipe builds the project's shipped tokenizer rather than the
            package's own ``policy_tokenizer/``.
    """

    package: str
    package_dir: Path
    corpus: Callable[[], list[Any]]
    domain_words: Callable[[], tuple[str, ...]]
    vocab_size: int = 1000
    builds_the_project_tokenizer: bool = False


def load_tokenizer_recipe(env: str) -> TokenizerRecipe:
    """The tokenizer recipe of ``env``'s package (``P/tokenizer_recipe.py``).

    Args:
        env: ``[env] server_module`` or its package, e.g. ``"envs.coding_env"``.
    Raises:
        EnvPackageError: the package is not importable, has no ``tokenizer_recipe.py``, or the module's ``corpus`` /
            ``domain_words`` are not functions or ``VOCAB_SIZE`` is not a positive int (naming the entry and value).
        ImportError: ``tokenizer_recipe.py`` exists but one of its own imports fails.
    """
    package = package_of(env)
    if _optional_module(package, package) is None:
        raise EnvPackageError(f"env {env!r}: package {package!r} is not importable")
    module = _optional_module(f"{package}.tokenizer_recipe", package)
    if module is None:
        raise EnvPackageError(f"env {env!r} has no tokenizer recipe: expected {package}.tokenizer_recipe with "
                              "corpus() and domain_words()")
    for name in ("corpus", "domain_words"):
        if not callable(getattr(module, name, None)):
            raise EnvPackageError(f"{package}.tokenizer_recipe.{name} is {getattr(module, name, None)!r:.80}: "
                                  "expected a function")
    vocab_size = getattr(module, "VOCAB_SIZE", 1000)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise EnvPackageError(f"{package}.tokenizer_recipe.VOCAB_SIZE is {vocab_size!r}: expected a positive int")
    return TokenizerRecipe(package, Path(module.__file__).resolve().parent, module.corpus, module.domain_words,
                           vocab_size, bool(getattr(module, "BUILDS_THE_PROJECT_TOKENIZER", False)))


def load_env_package(server_module: str) -> EnvPackage:
    """The `EnvPackage` of ``server_module``'s package: imports the package and its optional ``demos`` module.

    Args:
        server_module: ``[env] server_module``, e.g. ``"envs.coding_env.server"`` (or the package name itself).
    Returns:
        The package's entries; those ``demos.py`` does not define (or a package without ``demos.py``) are None/empty.

    Raises:
        EnvPackageError: the package cannot be imported, ``demos.py`` defines ``demonstration`` or ``script`` as
            something not callable, ``REASON_HINTS`` as something not a mapping of strings, or ``ERROR_RATE`` outside
            [0, 1]; the message names the entry and its value.
        ImportError: ``demos.py`` exists but one of its own imports fails.
    """
    import_openenv_core()  # before the package imports openenv.core: without its gradio web UI

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
    if not isinstance(hints, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in hints.items()):
        raise EnvPackageError(f"{package}.demos.REASON_HINTS is {hints!r:.200}: expected a mapping of reason -> hint "
                              "template (strings)")
    error_rate = getattr(demos, "ERROR_RATE", None)
    if error_rate is not None and (isinstance(error_rate, bool) or not isinstance(error_rate, (int, float))
                                   or not 0.0 <= error_rate <= 1.0):
        raise EnvPackageError(f"{package}.demos.ERROR_RATE is {error_rate!r}: expected a number in [0, 1]")
    return EnvPackage(package=package, server_module=server_module, reason_hints=MappingProxyType(dict(hints)),
                      error_rate=None if error_rate is None else float(error_rate), **entries)

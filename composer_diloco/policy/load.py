"""Loading a run's policy: the embedded default (warm-started once per machine, cached per user) or any causal LM."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast, Qwen3Config

from composer_diloco.channels.hints import HintRegistry
from composer_diloco.malloc import heap_for_training
from composer_diloco.policy.cache import CACHE_ENV, cache_root, get_or_build
from composer_diloco.policy.errors import PolicyLoadError
from composer_diloco.policy.model_name import check_model_name
from composer_diloco.policy.tiny_model import build_tiny_model, tiny_model_config
from composer_diloco.policy.tokenizer import DEFAULT_TOKENIZER_DIR, ENV_TOKENIZER_FOLDER, load_default_tokenizer
from composer_diloco.policy.warmstart import (
    DEFAULT_WARMSTART_ENV,
    WARMSTART_BATCH_SIZE,
    WARMSTART_ERROR_RATE,
    WARMSTART_LR,
    env_demonstrations,
    warm_start,
)
from composer_diloco.rollout.env_package import load_env_package, package_of

if TYPE_CHECKING:
    from composer_diloco.config import RunConfig

__all__ = ["embedded_tokenizer_dir", "load_embedded_tokenizer", "load_policy", "load_run_policy", "policy_skeleton",
           "warmstart_cache_dir"]

logger = logging.getLogger(__name__)

_CACHE_KEY_VERSION = 2  # bump when the warm-start recipe changes in a way the key does not see


def _find_package_dir(env: str) -> Path | None:
    """The directory of ``env``'s package (``"envs.tool_env.server"`` -> ``envs/tool_env``), found without importing
    it or its parents where a plain path search finds it (this project's ``envs/__init__.py`` imports OpenEnv's core:
    ~2 s of CPU); None when no package of that name is found."""
    def find(name: str, path: list[str] | None = None):
        try:  # a top-level name is found, not run; PathFinder runs nothing either
            return importlib.machinery.PathFinder.find_spec(name, path) if path else importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None

    package = package_of(env)
    top, *rest = package.split(".")
    spec = find(top)
    for part in rest:
        spec = find(part, list(spec.submodule_search_locations)) if spec and spec.submodule_search_locations else None
    if spec is None or not spec.submodule_search_locations:
        spec = find(package)  # a package only the import system proper finds (a custom finder): imports its parents
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _package_dir(env: str) -> Path:
    """`_find_package_dir`, for an env that must be a package.

    Raises:
        PolicyLoadError: (one line, from ``env_demonstrations``) ``env`` is not an importable package.
    """
    found = _find_package_dir(env)
    if found is None:
        env_demonstrations(env)  # imports it: raises the one-line error naming the env
        raise PolicyLoadError(f"env {env!r}: not a package (expected a folder with demos.py beside server.py)")
    return found


def embedded_tokenizer_dir(env: str = DEFAULT_WARMSTART_ENV) -> Path:
    """The tokenizer folder of the embedded default policy when it plays ``env``: the env package's own
    ``policy_tokenizer/`` when it ships one (``ENV_TOKENIZER_FOLDER``; the coding env does), else the project's
    (``DEFAULT_TOKENIZER_DIR``, built from tool_env). Never raises: an env that is not a package here (a remote
    fleet's name, say) gets the project's.

    Args:
        env: ``[env] server_module`` or its package, e.g. ``"envs.coding_env.server"``.
    """
    package = _find_package_dir(env)
    if package is not None and (package / ENV_TOKENIZER_FOLDER / "tokenizer.json").is_file():
        return package / ENV_TOKENIZER_FOLDER
    return DEFAULT_TOKENIZER_DIR


def load_embedded_tokenizer(env: str = DEFAULT_WARMSTART_ENV) -> PreTrainedTokenizerFast:
    """The embedded default policy's tokenizer for ``env`` (:func:`embedded_tokenizer_dir`): a coordinator and its
    nodes load the same one from the run's ``[env] server_module``.

    Raises:
        PolicyLoadError: the folder's files are missing.
    """
    return load_default_tokenizer(embedded_tokenizer_dir(env))


def _default_cache_key(seed: int, steps: int, config: Qwen3Config, env: str = DEFAULT_WARMSTART_ENV,
                       tokenizer_dir: Path = DEFAULT_TOKENIZER_DIR, hint_rate: float = 0.0,
                       hints: Mapping[str, str] | None = None, peer_demo: bool = False) -> str:
    """Short hash of what determines the default warm-started weights: seed, steps, the warm-start
    recipe (with ``hint_rate > 0``: the rate, the ``[hints]`` templates and ``peer_demo`` too; without, the key of warm starts made
    before hints existed), the model config, the tokenizer files (``tokenizer_dir``), the source of the env
    package's top-level modules (tasks, tools, demonstrations) and the torch and transformers versions (a new
    release may change the kernels' numerics or the trainer's defaults, so an entry built under another version
    would not be the weights this install builds)."""
    import torch
    import transformers

    h = hashlib.sha256()
    cfg = config.to_dict()
    cfg.pop("transformers_version", None)
    recipe = dict(batch_size=WARMSTART_BATCH_SIZE, lr=WARMSTART_LR, error_rate=WARMSTART_ERROR_RATE,
                  version=_CACHE_KEY_VERSION)
    if hint_rate:
        recipe.update(hint_rate=hint_rate, hints=dict(sorted((hints or {}).items())), peer_demo=peer_demo)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    h.update(json.dumps({"seed": seed, "steps": steps, "recipe": recipe, "config": cfg, "versions": versions},
                        sort_keys=True).encode())
    for path in sorted(_package_dir(env).glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    for name in sorted(os.listdir(tokenizer_dir)):
        h.update(name.encode())
        h.update((tokenizer_dir / name).read_bytes())
    return h.hexdigest()[:16]


def _load_pretrained(source: str, *, local: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """``from_pretrained`` for model and tokenizer, fp32, CPU, eval mode.

    Raises:
        PolicyLoadError: the tokenizer has no chat template (episodes are rendered and parsed with it), checked
            before the weights are read.
    """
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
    if not getattr(tokenizer, "chat_template", None):
        raise PolicyLoadError(f"policy {source!r}: its tokenizer has no chat template (expected chat_template.jinja or "
                              "a chat_template in tokenizer_config.json; episodes are rendered with it)")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, local_files_only=local)
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to("cpu").float().eval(), tokenizer


_WARMSTART_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                    "chat_template.jinja", "warmstart.json")
"""Files every warm-start cache entry holds (``warm_start`` writes them; one missing = a damaged entry)."""


def warmstart_cache_dir() -> Path:
    """Where the embedded default's warm starts are cached: ``cache_root() / "warmstart"``, one ``<key>`` folder
    each (see ``composer_diloco.policy.cache``)."""
    return cache_root() / "warmstart"


def _load_default(seed: int, warmstart_steps: int, env: str, hint_rate: float = 0.0,
                  hints: Mapping[str, str] | None = None,
                  peer_demo: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The embedded default, warm-started into (or reused from) ``warmstart_cache_dir() / <key>``."""
    tokenizer_dir = embedded_tokenizer_dir(env)
    tokenizer = load_default_tokenizer(tokenizer_dir)
    config = tiny_model_config(tokenizer, seed)
    if warmstart_steps > 0:
        # The env's demonstrations are imported (and checked again) by `warm_start` only when the entry is built:
        # importing an env package costs every process ~2 s of CPU (OpenEnv's core), and a cached entry's key covers
        # the package's source. No package, or no demos module: the one-line error, before any cache folder.
        package = _package_dir(env)
        if not ((package / "demos.py").is_file() or (package / "demos" / "__init__.py").is_file()):
            env_demonstrations(env)  # raises the one-line error naming the env
        env = package_of(env)  # one key, and one warmstart.json "env", per env package
    else:
        env = DEFAULT_WARMSTART_ENV  # untrained weights depend on the env only through its tokenizer (in the key)
        hint_rate, peer_demo = 0.0, False

    def build(out_dir: Path) -> None:
        logger.info("warm-starting the default policy on %s (%d steps, seed %d%s) into %s", env, warmstart_steps,
                    seed, f", hints in {hint_rate:.0%} of the demonstrations" if hint_rate else "", out_dir)
        registry = None
        if hint_rate:
            registry = HintRegistry.from_config(hints, reason_hints=load_env_package(env).reason_hints)
        with heap_for_training():  # in the coordinator, whose mmap threshold is pinned (composer_diloco/malloc.py)
            warm_start(build_tiny_model(tokenizer, seed), tokenizer, seed=seed, steps=warmstart_steps,
                       out_dir=out_dir, env=env, hint_rate=hint_rate, hints=registry, peer_demo=peer_demo)

    t0 = time.monotonic()
    folder = warmstart_cache_dir()
    try:
        key = _default_cache_key(seed, warmstart_steps, config, env, tokenizer_dir, hint_rate, hints,
                                 peer_demo and bool(hint_rate))
        entry, built = get_or_build(folder / key, build, required=_WARMSTART_FILES)
    except OSError as exc:
        raise PolicyLoadError(f"cannot cache the warm start in {folder}: {exc}; point {CACHE_ENV} at a writable "
                              "folder with space") from exc
    if built:
        logger.info("warm start cached at %s (%.1f s; later runs on this machine reuse it)", entry,
                    time.monotonic() - t0)
    else:
        logger.info("reusing the warm-started default policy at %s", entry)
    return _load_pretrained(str(entry), local=True)


def _hub_offline() -> bool:
    from huggingface_hub import constants as hub_constants

    return hub_constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in (
        "1", "true", "yes", "on")


def _load_named(value: str) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A local ``save_pretrained`` directory, else a Hub id (local cache first, then the Hub unless offline)."""
    path = check_model_name(value)
    if path is not None:
        try:
            return _load_pretrained(str(path), local=True)
        except (OSError, ValueError, KeyError) as exc:
            raise PolicyLoadError(f"policy {value!r}: cannot load model/tokenizer from this directory: {exc}") from exc
    offline = _hub_offline()
    errors = []
    for local in (True,) if offline else (True, False):
        try:
            return _load_pretrained(value, local=local)
        except (OSError, ValueError, KeyError) as exc:  # huggingface_hub errors subclass OSError/ValueError
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    raise PolicyLoadError(f"policy {value!r}: not a local directory and not a loadable Hugging Face Hub model "
                          f"id (cache{'' if offline else ' or Hub'}): {errors[-1]}")


def load_policy(
    model: str | os.PathLike[str] | None,
    *,
    seed: int,
    warmstart_steps: int,
    env: str = DEFAULT_WARMSTART_ENV,
    hint_rate: float = 0.0,
    hints: Mapping[str, str] | None = None,
    peer_demo: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The policy of a run: the embedded default (``model=None``) or a hub id / local directory.

    ``None``: the tiny Qwen3 of ``build_tiny_model`` with the env's shipped tokenizer (:func:`embedded_tokenizer_dir`:
    the env package's own, else the project's), warm-started for
    ``warmstart_steps`` steps on ``env``'s scripted demonstrations (``warm_start``), cached once per machine in
    ``warmstart_cache_dir() / <hash>`` (``$COMPOSER_DILOCO_CACHE``, else ``$XDG_CACHE_HOME/composer_diloco``, else
    ``~/.cache/composer_diloco``, then ``warmstart/``) where the hash covers ``seed``, ``warmstart_steps``, the
    warm-start recipe, the model config, the tokenizer files, the env package's source and the torch and
    transformers versions; a whole cached copy
    is reused by every run and process, concurrent callers compute it once (a file lock), and a damaged one is
    rebuilt with a WARNING (``composer_diloco.policy.cache.get_or_build``). Otherwise ``model`` is a local
    directory (``save_pretrained`` layout) or a Hugging Face Hub id, loaded with ``AutoModelForCausalLM`` /
    ``AutoTokenizer``: first from local files only, then (unless ``HF_HUB_OFFLINE`` is set) from the Hub. A
    tokenizer without a pad token gets eos.

    Args:
        model: ``None``, a directory, or a hub id such as ``"Qwen/Qwen3-0.6B"``.
        seed: seed of the default policy's initialisation and warm start (ignored otherwise).
        warmstart_steps: warm-start optimizer steps of the default policy (ignored otherwise).
        env: the env (``[env] server_module`` or its package) whose demonstrations warm-start the default policy
            (ignored otherwise).
        hint_rate: ``[warmstart] hint_rate``: share of the demonstrations that show the SDPO hint after their failed
            call (`composer_diloco.policy.warmstart.solver_examples`); ignored otherwise.
        hints: the ``[hints]`` templates those hints come from (over the defaults and the env's reason hints).
        peer_demo: those hints start with the demonstration's successful calls (``[loss] sdpo_peer_demo_reward``
            set: SDPO's teacher sees a successful peer attempt).

    Returns:
        ``(model, tokenizer)``, the model in fp32 on CPU in eval mode.

    Raises:
        PolicyLoadError: (one line) if ``model`` names neither a loadable local directory nor a reachable hub
            model, the shipped tokenizer is missing, ``env`` has no demonstrations for a warm start, or the
            warm-start cache cannot be created or written (naming the folder and ``COMPOSER_DILOCO_CACHE``).
    """
    if model is None:
        return _load_default(seed, warmstart_steps, env, hint_rate, hints, peer_demo)
    return _load_named(os.fspath(model))


def load_run_policy(config: RunConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The policy a run starts from: :func:`load_policy` with the run config's ``model``, ``[warmstart]``,
    ``[env] server_module``, ``[hints]`` and ``[loss] sdpo_peer_demo_reward`` (what the coordinator, a LoRA node and ``composer-policy`` load).

    Raises:
        PolicyLoadError: as :func:`load_policy`.
    """
    from composer_diloco.channels.sdpo import SdpoSettings  # the warm start shows SDPO's teacher its hints

    return load_policy(config.model, seed=config.warmstart.seed, warmstart_steps=config.warmstart.steps,
                       env=config.env.server_module, hint_rate=config.warmstart.hint_rate, hints=config.hints,
                       peer_demo=SdpoSettings.of(config.loss).sdpo_peer_demo_reward is not None)


def policy_skeleton(config: RunConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A model of the run's architecture (its weights are replaced by the global model) and its tokenizer.

    With ``[lora]`` the base weights are not part of the global model: the node loads (or warm-starts, cached once
    per machine in ``composer_diloco.policy.load.warmstart_cache_dir()``) the run's base itself, as the coordinator
    does, and wraps it with the adapters (`composer_diloco.policy.lora.apply_lora`); its base hash is checked
    against the run's at the state download. What a node builds at its join, and its standby ahead of it
    (`nodes.standby`).

    Raises:
        PolicyLoadError: as `load_policy` / `load_run_policy`.
    """
    if config.lora is not None:
        from composer_diloco.policy.lora import apply_lora

        model, tokenizer = load_run_policy(config)
        return apply_lora(model, config.lora), tokenizer
    if config.model is None:
        tokenizer = load_embedded_tokenizer(config.env.server_module)  # the coordinator's, for the run's env
        return build_tiny_model(tokenizer, config.warmstart.seed), tokenizer
    return load_policy(config.model, seed=config.seed, warmstart_steps=0)

"""The policy: the embedded default (tiny Qwen3 + shipped tokenizer, warm-started), or any causal LM.

Modules, in the order a run uses them:

* :mod:`~composer_diloco.policy.tokenizer`: :func:`load_default_tokenizer` loads the tokenizer shipped in
  ``composer_diloco/assets/tokenizer/`` (or an env package's own ``policy_tokenizer/``: the coding env ships one);
  :func:`build_tokenizer` builds one (:func:`build_env_tokenizer` rebuilds a shipped one from its env package's
  ``tokenizer_recipe.py``); :func:`tokenize_episode` gives ids and the assistant mask.
* :mod:`~composer_diloco.policy.tiny_model`: :func:`tiny_model_config` / :func:`build_tiny_model`, a
  ~0.9M-parameter ``Qwen3ForCausalLM``.
* :mod:`~composer_diloco.policy.warmstart`: :func:`warm_start`, a short SFT pass with TRL's ``SFTTrainer`` on the run
  env's scripted demonstrations (taken through ``composer_diloco.rollout.env_package``).
* :mod:`~composer_diloco.policy.load`: :func:`load_policy`, the one entry point for the rest of the project
  (:func:`load_embedded_tokenizer` picks the embedded default's tokenizer for the run's env);
  the embedded default's warm start is cached once per machine in :func:`warmstart_cache_dir`
  (:mod:`~composer_diloco.policy.cache`: ``$COMPOSER_DILOCO_CACHE``, else ``$XDG_CACHE_HOME/composer_diloco``, else
  ``~/.cache/composer_diloco``; a file lock, atomic renames).
* :mod:`~composer_diloco.policy.model_name`: :func:`check_model_name` tells a ``--model`` folder from a Hub id without
  importing transformers (the command lines refuse a missing folder before the heavy imports).
* :mod:`~composer_diloco.policy.evaluate`: :func:`evaluate_policy`, fixed fresh episodes against a served env or
  the env package in process (greedy or sampled); ``bench/coding_eval.py`` and the CLI both use it.
* :mod:`~composer_diloco.policy.cli`: ``python -m composer_diloco.policy {build-tokenizer,warm-start,evaluate}``.

No module here names a concrete env: what an env brings comes through ``composer_diloco.rollout.env_package``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> submodule. Imported on first use (PEP 562), so that `composer_diloco.policy.errors` or `.model_name` cost no
# transformers import: the command lines check --model with them before the heavy imports.
_EXPORTS = {
    "PolicyLoadError": "errors",
    "evaluate_policy": "evaluate",
    "embedded_tokenizer_dir": "load",
    "load_embedded_tokenizer": "load",
    "load_policy": "load",
    "load_run_policy": "load",
    "policy_skeleton": "load",
    "warmstart_cache_dir": "load",
    "build_tiny_model": "tiny_model",
    "tiny_model_config": "tiny_model",
    "DEFAULT_TOKENIZER_DIR": "tokenizer",
    "ENV_TOKENIZER_FOLDER": "tokenizer",
    "build_env_tokenizer": "tokenizer",
    "build_tokenizer": "tokenizer",
    "load_default_tokenizer": "tokenizer",
    "tokenize_episode": "tokenizer",
    "trl_qwen3_chat_template": "tokenizer",
    "DEFAULT_WARMSTART_ENV": "warmstart",
    "DEFAULT_WARMSTART_STEPS": "warmstart",
    "env_demonstrations": "warmstart",
    "solver_examples": "warmstart",
    "warm_start": "warmstart",
}

__all__ = [
    "DEFAULT_TOKENIZER_DIR",
    "DEFAULT_WARMSTART_ENV",
    "DEFAULT_WARMSTART_STEPS",
    "ENV_TOKENIZER_FOLDER",
    "PolicyLoadError",
    "build_tiny_model",
    "build_env_tokenizer",
    "build_tokenizer",
    "embedded_tokenizer_dir",
    "env_demonstrations",
    "evaluate_policy",
    "load_default_tokenizer",
    "load_embedded_tokenizer",
    "load_policy",
    "load_run_policy",
    "policy_skeleton",
    "solver_examples",
    "tiny_model_config",
    "tokenize_episode",
    "trl_qwen3_chat_template",
    "warm_start",
    "warmstart_cache_dir",
]
assert sorted(__all__) == sorted(_EXPORTS)

if TYPE_CHECKING:
    from composer_diloco.policy.errors import PolicyLoadError
    from composer_diloco.policy.evaluate import evaluate_policy
    from composer_diloco.policy.load import (
        embedded_tokenizer_dir,
        load_embedded_tokenizer,
        load_policy,
        load_run_policy,
        policy_skeleton,
        warmstart_cache_dir,
    )
    from composer_diloco.policy.tiny_model import build_tiny_model, tiny_model_config
    from composer_diloco.policy.tokenizer import (
        DEFAULT_TOKENIZER_DIR,
        ENV_TOKENIZER_FOLDER,
        build_env_tokenizer,
        build_tokenizer,
        load_default_tokenizer,
        tokenize_episode,
        trl_qwen3_chat_template,
    )
    from composer_diloco.policy.warmstart import (
        DEFAULT_WARMSTART_ENV,
        DEFAULT_WARMSTART_STEPS,
        env_demonstrations,
        solver_examples,
        warm_start,
    )


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value

"""What the shipped tokenizers were built from: each env's episodes and nouns.

- ``composer_diloco/assets/tokenizer/`` (the project's, used by every env without its own) is an artifact of
  tool_env: 2000 of its scripted-solver episodes (``make_task(0, "corpus-i")``, error rate 0.3) and its nouns (items,
  then tool names) as atomic tokens.
- ``envs/coding_env/policy_tokenizer/`` is the coding env's: 2000 of its scripted-solver episodes (the generated
  families, ``"corpus-i"``, error rate 0.3) and its nouns (the families' function names, then tool names). With the
  project's tokenizer a coding episode is ~860 tokens, most of them single characters, and a number or name of the
  task reads as a run of characters far from where the code needs it: a 300-step warm start did not learn to copy
  them (BENCHMARKS.md 1, the coding env). With its own, an episode is ~125 tokens and a name is one token.

This module is that recipe and the one place in the policy package that names a concrete env; it is imported only to
rebuild the files (``python -m composer_diloco.policy build-tokenizer [--env envs.coding_env]``) and by the test that
checks they are current. Nothing that loads, warm-starts or evaluates a policy imports it.

Why not ``load_env_package(...).demonstration``: those are episodes ``"warmstart-i"``, not ``"corpus-i"``; BPE
trained on them gives other merges (measured: a different ``tokenizer.json``), and changing the shipped tokenizer
would change every warm-started weight.
"""

from __future__ import annotations

import random
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from composer_diloco.policy.tokenizer import DEFAULT_TOKENIZER_DIR, ENV_TOKENIZER_FOLDER, build_tokenizer

__all__ = ["CORPUS_EPISODES", "CORPUS_ERROR_RATE", "CORPUS_SEED", "RECIPES", "build_coding_tokenizer",
           "build_default_tokenizer", "build_env_tokenizer", "coding_corpus", "coding_domain_words", "default_corpus",
           "default_domain_words"]

CORPUS_EPISODES = 2000
CORPUS_SEED = 0
CORPUS_ERROR_RATE = 0.3
"""Fraction of corpus episodes with one failed call and its recovery (tool_env's ``ERROR_RATE``)."""


def default_domain_words() -> tuple[str, ...]:
    """tool_env's nouns, items then tool names: the shipped tokenizer's atomic tokens, in id order (from id 9)."""
    from envs.tool_env.tasks import ITEM_VOCAB, TOOL_NAMES

    return tuple(ITEM_VOCAB) + tuple(TOOL_NAMES)


def default_corpus(n_episodes: int = CORPUS_EPISODES, seed: int = CORPUS_SEED,
                   error_rate: float = CORPUS_ERROR_RATE) -> list:
    """tool_env's scripted-solver episodes ``make_task(seed, "corpus-i")``, ``i < n_episodes``, as demonstrations.

    Returns:
        ``n_episodes`` ``envs.demonstration.Demonstration`` (a pure function of the arguments).
    """
    from envs.demonstration import Demonstration
    from envs.tool_env.tasks import TOOL_SCHEMAS, execute, make_task, solve

    corpus = []
    for i in range(n_episodes):
        task = make_task(seed, f"corpus-{i}")
        calls = solve(task, random.Random(f"{seed}:corpus-{i}"), error_rate)
        outcomes = [execute(task, name, args) for name, args in calls]
        corpus.append(Demonstration(task.question, TOOL_SCHEMAS, calls, [o[0] for o in outcomes],
                                    [o[1] is None for o in outcomes]))
    return corpus


def build_default_tokenizer(out_dir: str | Path = DEFAULT_TOKENIZER_DIR) -> PreTrainedTokenizerFast:
    """Rebuild the shipped tokenizer into ``out_dir`` (default: over the shipped files); byte-identical when the
    installed TRL's ``qwen3.jinja`` and tool_env's tasks are unchanged.

    Returns:
        The tokenizer (about 880 tokens).

    Raises:
        FileNotFoundError: if the installed TRL does not ship ``qwen3.jinja``.
    """
    return build_tokenizer(out_dir, default_corpus(), default_domain_words())


def coding_domain_words() -> tuple[str, ...]:
    """The coding env's nouns, the generated families' function names then the tool names: its tokenizer's atomic
    tokens, in id order (from id 9)."""
    from envs.coding_env.tasks import FUNCTION_NAMES
    from envs.coding_env.tools import TOOL_NAMES

    return tuple(FUNCTION_NAMES) + tuple(TOOL_NAMES)


def coding_corpus(n_episodes: int = CORPUS_EPISODES, seed: int = CORPUS_SEED,
                  error_rate: float = CORPUS_ERROR_RATE) -> list:
    """The coding env's scripted-solver episodes on its generated families, ids ``"corpus-i"``, ``i < n_episodes``.

    Returns:
        ``n_episodes`` ``envs.demonstration.Demonstration`` (a pure function of the arguments).
    """
    from envs.coding_env.demos import demonstration

    return [demonstration(seed, i, error_rate, source="generated", prefix="corpus") for i in range(n_episodes)]


def build_coding_tokenizer(out_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Rebuild the coding env's tokenizer into ``out_dir`` (default: over ``envs/coding_env/policy_tokenizer/``);
    byte-identical when the installed TRL's ``qwen3.jinja`` and the coding env's tasks, tools and demos are unchanged.

    Returns:
        The tokenizer (about 1,500 tokens).

    Raises:
        FileNotFoundError: if the installed TRL does not ship ``qwen3.jinja``.
    """
    if out_dir is None:
        import envs.coding_env

        out_dir = Path(envs.coding_env.__file__).resolve().parent / ENV_TOKENIZER_FOLDER
    # A target above what the corpus supports: BPE stops once no pair occurs twice (about 1,500 tokens), as the
    # project's tokenizer does below its target of 1,000.
    return build_tokenizer(out_dir, coding_corpus(), coding_domain_words(), vocab_size=2000)


RECIPES = {"envs.tool_env": build_default_tokenizer, "envs.coding_env": build_coding_tokenizer}
"""Env package -> the function that rebuilds its shipped tokenizer (``out_dir=None``: over the shipped files)."""


def build_env_tokenizer(env: str, out_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Rebuild the shipped tokenizer of ``env`` (a package of `RECIPES`, or its server module).

    Raises:
        ValueError: ``env`` has no recipe here (naming the ones that do).
    """
    package = env[: -len(".server")] if env.endswith(".server") else env
    if package not in RECIPES:
        raise ValueError(f"no tokenizer recipe for env {env!r}; expected one of {', '.join(RECIPES)}")
    build = RECIPES[package]
    return build(out_dir) if out_dir is not None else build()

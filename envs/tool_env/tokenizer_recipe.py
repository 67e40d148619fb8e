"""What the project's shipped tokenizer (``composer_diloco/assets/tokenizer/``) is built from: tool_env's episodes and
nouns (the env contract's optional tokenizer recipe: `composer_diloco.rollout.env_package.TokenizerRecipe`).

2000 of the scripted solver's episodes (``make_task(0, "corpus-i")``, error rate 0.3) and the nouns (items, then tool
names) as atomic tokens. Not ``demos.demonstration``: those are episodes ``"warmstart-i"``; BPE trained on them gives
other merges (measured: a different ``tokenizer.json``), and another shipped tokenizer would change every warm-started
weight. Rebuild with ``python -m composer_diloco.policy build-tokenizer --env envs.tool_env``.
"""

from __future__ import annotations

import random

from envs.demonstration import Demonstration

from .tasks import ITEM_VOCAB, TOOL_NAMES, TOOL_SCHEMAS, execute, make_task, solve

__all__ = ["BUILDS_THE_PROJECT_TOKENIZER", "CORPUS_EPISODES", "CORPUS_ERROR_RATE", "CORPUS_SEED", "VOCAB_SIZE",
           "corpus", "domain_words"]

BUILDS_THE_PROJECT_TOKENIZER = True
"""This env ships no ``policy_tokenizer/``: its recipe builds the project's, which every such env plays with."""
CORPUS_EPISODES = 2000
CORPUS_SEED = 0
CORPUS_ERROR_RATE = 0.3
"""Fraction of corpus episodes with one failed call and its recovery (the env's ``ERROR_RATE``)."""
VOCAB_SIZE = 1000
"""Target vocabulary; BPE stops earlier (about 880 tokens) once no pair occurs twice."""


def domain_words() -> tuple[str, ...]:
    """tool_env's nouns, items then tool names: the tokenizer's atomic tokens, in id order (from id 9)."""
    return tuple(ITEM_VOCAB) + tuple(TOOL_NAMES)


def corpus(n_episodes: int = CORPUS_EPISODES, seed: int = CORPUS_SEED,
           error_rate: float = CORPUS_ERROR_RATE) -> list[Demonstration]:
    """The scripted solver's episodes ``make_task(seed, "corpus-i")``, ``i < n_episodes``; a pure function of the
    arguments."""
    episodes = []
    for i in range(n_episodes):
        task = make_task(seed, f"corpus-{i}")
        calls = solve(task, random.Random(f"{seed}:corpus-{i}"), error_rate)
        outcomes = [execute(task, name, args) for name, args in calls]
        episodes.append(Demonstration(task.question, TOOL_SCHEMAS, calls, [o[0] for o in outcomes],
                                      [o[1] is None for o in outcomes]))
    return episodes

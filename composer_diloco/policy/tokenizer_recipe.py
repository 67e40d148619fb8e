"""What the shipped tokenizer (``composer_diloco/assets/tokenizer/``) was built from: tool_env's episodes and nouns.

The shipped files are an artifact of tool_env: 2000 of its scripted-solver episodes (``make_task(0, "corpus-i")``,
error rate 0.3) and its nouns (items, then tool names) as atomic tokens. This module is that recipe and the one
place in the policy package that names a concrete env; it is imported only to rebuild the files
(``python -m composer_diloco.policy build-tokenizer``) and by the test that checks they are current. Nothing that
loads, warm-starts or evaluates a policy imports it.

Why not ``load_env_package(...).demonstration``: those are episodes ``"warmstart-i"``, not ``"corpus-i"``; BPE
trained on them gives other merges (measured: a different ``tokenizer.json``), and changing the shipped tokenizer
would change every warm-started weight.
"""

from __future__ import annotations

import random
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from composer_diloco.policy.tokenizer import DEFAULT_TOKENIZER_DIR, build_tokenizer

__all__ = ["CORPUS_EPISODES", "CORPUS_ERROR_RATE", "CORPUS_SEED", "build_default_tokenizer", "default_corpus",
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

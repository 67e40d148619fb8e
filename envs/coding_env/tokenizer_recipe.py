"""What the coding env's tokenizer (``policy_tokenizer/``) is built from: its episodes and nouns (the env contract's
optional tokenizer recipe: `composer_diloco.rollout.env_package.TokenizerRecipe`).

2000 of the scripted solver's episodes on the generated families (ids ``"corpus-i"``, error rate 0.3) and the nouns
(the families' function names, then tool names) as atomic tokens. With the project's tokenizer a coding episode is
~860 tokens, most of them single characters, and a number or name of the task reads as a run of characters far from
where the code needs it: a 300-step warm start did not learn to copy them (BENCHMARKS.md 1, the coding env). With its
own, an episode is ~125 tokens and a name is one token. Rebuild with
``python -m composer_diloco.policy build-tokenizer --env envs.coding_env``.
"""

from __future__ import annotations

from envs.demonstration import Demonstration

from .demos import demonstration
from .tasks import FUNCTION_NAMES
from .tools import TOOL_NAMES

__all__ = ["CORPUS_EPISODES", "CORPUS_ERROR_RATE", "CORPUS_SEED", "VOCAB_SIZE", "corpus", "domain_words"]

CORPUS_EPISODES = 2000
CORPUS_SEED = 0
CORPUS_ERROR_RATE = 0.3
VOCAB_SIZE = 2000
"""A target above what the corpus supports: BPE stops once no pair occurs twice (about 1,500 tokens)."""


def domain_words() -> tuple[str, ...]:
    """The generated families' function names, then the tool names: the tokenizer's atomic tokens, in id order
    (from id 9)."""
    return tuple(FUNCTION_NAMES) + tuple(TOOL_NAMES)


def corpus(n_episodes: int = CORPUS_EPISODES, seed: int = CORPUS_SEED,
           error_rate: float = CORPUS_ERROR_RATE) -> list[Demonstration]:
    """The scripted solver's episodes on the generated families, ids ``"corpus-i"``, ``i < n_episodes``; a pure
    function of the arguments."""
    return [demonstration(seed, i, error_rate, source="generated", prefix="corpus") for i in range(n_episodes)]

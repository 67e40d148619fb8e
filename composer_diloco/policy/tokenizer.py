"""The embedded default's tokenizer: building it, loading the shipped copy, and tokenizing episodes for training.

The shipped tokenizer (``composer_diloco/assets/tokenizer/``) is a byte-level BPE over rendered tool episodes with
one token per digit, Qwen3's special tokens, atomic domain words, and TRL's Qwen3 chat template verbatim, so TRL
recognises it (``supports_tool_calling``, ``add_response_schema``, ``get_training_chat_template``). An env package may
ship its own, built the same way from its own episodes, in a ``policy_tokenizer/`` folder (`ENV_TOKENIZER_FOLDER`):
the embedded default playing that env uses it (``composer_diloco.policy.load.embedded_tokenizer_dir``).
:func:`build_tokenizer` is the generic builder (any demonstrations, any domain words);
Each env package's ``tokenizer_recipe.py`` holds the inputs its shipped files were built from (`build_env_tokenizer`).

Text format (the "no-think" Qwen3 form): every assistant turn is exactly
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>`` after the generation prompt
``<|im_start|>assistant\\n``. That is how ``qwen3.jinja`` renders every assistant turn of an episode that
ends with a tool message, so re-rendering a history with the template gives back the tokens the policy
generated. Do not pass ``enable_thinking=False`` (it appends an empty think block the warm start never
shows), and do not re-render histories with TRL's ``qwen3_training.jinja`` (it adds ``<think>\\n\\n</think>``
to every assistant turn); token-carrying rollouts (TRL's GRPO tool loop) are fine either way.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from composer_diloco.policy.errors import PolicyLoadError
from composer_diloco.rollout.chat import episode_messages

__all__ = [
    "DEFAULT_TOKENIZER_DIR",
    "ENV_TOKENIZER_FOLDER",
    "build_env_tokenizer",
    "EOS_TOKEN",
    "MARKUP_TOKENS",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "build_tokenizer",
    "load_default_tokenizer",
    "tokenize_episode",
    "trl_qwen3_chat_template",
]

logger = logging.getLogger(__name__)

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizer"
"""The shipped tokenizer of the embedded default policy (built by ``python -m composer_diloco.policy
build-tokenizer``); built from tool_env's episodes, it is the one every env without its own uses."""

ENV_TOKENIZER_FOLDER = "policy_tokenizer"
"""The folder of an env package that holds its own tokenizer for the embedded default policy (optional; this
project's coding env ships one: ``python -m composer_diloco.policy build-tokenizer --env envs.coding_env``)."""

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Control tokens (``special=True``: dropped by ``decode(skip_special_tokens=True)``), as in Qwen3."""

MARKUP_TOKENS: tuple[str, ...] = (
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
"""Markup tokens: single tokens that survive ``skip_special_tokens`` (``special=False``), as in Qwen3."""

PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"

_MODEL_MAX_LENGTH = 2048  # tokens; the tiny model's max_position_embeddings


def trl_qwen3_chat_template() -> str:
    """The text of TRL's ``trl/chat_templates/qwen3.jinja`` from the installed ``trl`` (build time only).

    Returns:
        The Jinja template, as a str.

    Raises:
        FileNotFoundError: if the installed TRL does not ship the template.
    """
    import trl  # only needed to build the tokenizer; the shipped tokenizer carries the text itself

    return (Path(trl.__file__).resolve().parent / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")


def _bare_tokenizer() -> Tokenizer:
    """An empty byte-level BPE whose pre-tokenizer only isolates digits (one token per digit)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _wrap(tok: Tokenizer, chat_template: str, domain_words: Sequence[str]) -> PreTrainedTokenizerFast:
    """Register the special, markup and domain tokens on ``tok`` and wrap it for transformers."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False, single_word=True) for t in domain_words])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=chat_template,
        model_max_length=_MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer(
    out_dir: str | Path,
    demonstrations: Iterable[Any],
    domain_words: Sequence[str],
    *,
    vocab_size: int = 1000,
) -> PreTrainedTokenizerFast:
    """Build a tokenizer deterministically from rendered demonstrations and save it (``save_pretrained``).

    Method: a byte-level BPE (``tokenizers.models.BPE`` + ``ByteLevel``, as GPT-2/Qwen) trained with a
    target vocabulary of ``vocab_size`` on the demonstrations rendered with TRL's Qwen3 chat template and each
    one's tools; it stops early once no pair occurs twice (the shipped one: about 880 entries from 2000 tool_env
    episodes, see ``envs/tool_env/tokenizer_recipe.py``). The pre-tokenizer only isolates digits (one
    token per digit, so numbers compose and are copied digit by digit), so merges run across words: the fixed text
    of the prompt (the tool schemas block) and of a call (``\\n{"name": "``, ``", "arguments": {"item": "``) become
    a handful of long tokens, and a tool_env episode is about 120 tokens instead of about 700 with word-level
    pre-tokenization, which makes the CPU warm start ~6x cheaper. ``domain_words`` (the env's nouns) are atomic
    tokens (``single_word``), so a noun reads and is written as the same single token and the policy can copy it
    token for token. Other text still tokenizes (byte-level: any string round-trips), just into less natural pieces.

    Ids 0..8: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos), then ``<tool_call>``,
    ``</tool_call>``, ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>``; then the
    domain words in order. The chat template is TRL's ``qwen3.jinja``, byte for byte.

    Args:
        out_dir: directory to write (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``);
            created if missing, files overwritten.
        demonstrations: the corpus, each with ``question``, ``tools``, ``calls`` and ``replies``
            (``envs.demonstration.Demonstration``), rendered in order.
        domain_words: words that become atomic tokens, in id order.
        vocab_size: target vocabulary (tokens, atomic ones included).

    Returns:
        The tokenizer (the same object that was saved).

    Raises:
        FileNotFoundError: if the installed TRL does not ship ``qwen3.jinja``.
        ValueError: from ``episode_messages`` on a demonstration whose calls and replies disagree in length.
    """
    chat_template = trl_qwen3_chat_template()
    bootstrap = _wrap(_bare_tokenizer(), chat_template, domain_words)  # byte-level, no merges: only used to render
    texts = [bootstrap.apply_chat_template(episode_messages(d.question, d.calls, d.replies), tools=d.tools,
                                           tokenize=False)
             for d in demonstrations]
    # Train on the text between the atomic tokens, which take the first ids.
    splitter = re.compile("|".join([re.escape(t) for t in SPECIAL_TOKENS + MARKUP_TOKENS]
                                   + [rf"\b{re.escape(w)}\b" for w in domain_words]))
    pieces = [piece for text in texts for piece in splitter.split(text) if piece]
    tok = _bare_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS + MARKUP_TOKENS + tuple(domain_words)),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(pieces, trainer)
    tokenizer = _wrap(tok, chat_template, domain_words)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    logger.info("built tokenizer: %d tokens from %d episodes -> %s", len(tokenizer), len(texts), out_dir)
    return tokenizer


def load_default_tokenizer(directory: str | Path = DEFAULT_TOKENIZER_DIR) -> PreTrainedTokenizerFast:
    """Load a shipped tokenizer (no TRL files needed): the project's (:data:`DEFAULT_TOKENIZER_DIR`), or an env
    package's ``policy_tokenizer/`` (see ``composer_diloco.policy.load.embedded_tokenizer_dir``).

    Returns:
        The tokenizer (pad ``<|endoftext|>``, eos ``<|im_end|>``, ``model_max_length`` 2048 tokens).

    Raises:
        PolicyLoadError: if the shipped files are missing (rebuild with
            ``python -m composer_diloco.policy build-tokenizer``).
    """
    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        raise PolicyLoadError(
            f"default tokenizer missing at {directory}; "
            "build it with `python -m composer_diloco.policy build-tokenizer`"
        )
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def tokenize_episode(
    tokenizer: PreTrainedTokenizerFast,
    messages: list[dict[str, Any]],
    trained_turns: list[bool] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> dict[str, list[int]]:
    """Token ids of a rendered episode and a mask of the assistant tokens to train on.

    The episode is rendered once with the tokenizer's chat template and ``tools``; an assistant turn is the text
    after each ``<|im_start|>assistant\\n`` up to and including its ``<|im_end|>`` (what generation after the
    prompt ``add_generation_prompt=True`` produces and stops at). Token boundaries fall on the special tokens
    around it, so the masked tokens are exactly the ones generated at inference.

    Args:
        tokenizer: a tokenizer with a Qwen-style chat template (the default one).
        messages: chat messages from :func:`composer_diloco.rollout.chat.episode_messages`.
        trained_turns: per assistant turn, whether its tokens enter the mask (default: all).
        tools: the tool schemas rendered into the system prompt (OpenAI function format); None renders no tools
            block (the assistant turns, and so the mask's tokens, do not depend on it).

    Returns:
        ``{"input_ids": list[int] (T,), "assistant_masks": list[int] (T,)}`` with 1 on trained
        assistant tokens; T is the episode's length in tokens.

    Raises:
        ValueError: if the rendering holds no assistant turn, or ``trained_turns`` has the wrong length.
    """
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    header = "<|im_start|>assistant\n"
    spans = []
    start = text.find(header)
    while start >= 0:
        begin = start + len(header)
        end = text.index(EOS_TOKEN, begin) + len(EOS_TOKEN)
        spans.append((begin, end))
        start = text.find(header, end)
    if not spans:
        raise ValueError("tokenize_episode: the rendered episode holds no assistant turn")
    if trained_turns is not None:
        if len(trained_turns) != len(spans):
            raise ValueError(f"tokenize_episode: {len(trained_turns)} trained_turns for {len(spans)} assistant turns")
        spans = [span for span, keep in zip(spans, trained_turns) if keep]
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    mask = [int(any(b <= lo and hi <= e for b, e in spans)) for lo, hi in enc["offset_mapping"]]
    return {"input_ids": list(enc["input_ids"]), "assistant_masks": mask}


def build_env_tokenizer(env: str, out_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Rebuild the shipped tokenizer of ``env`` from its package's tokenizer recipe (the env contract's
    ``P/tokenizer_recipe.py``: `composer_diloco.rollout.env_package.load_tokenizer_recipe`) with `build_tokenizer`;
    byte-identical to the shipped files when the installed TRL's ``qwen3.jinja`` and the env's episodes are unchanged.

    Args:
        env: ``[env] server_module`` or its package, e.g. ``"envs.coding_env"``.
        out_dir: where to write; default: over the shipped files (the package's ``policy_tokenizer/``, or the
            project's `DEFAULT_TOKENIZER_DIR` for a recipe that builds the project's tokenizer).
    Returns:
        The tokenizer.
    Raises:
        composer_diloco.rollout.env_package.EnvPackageError: the env has no (valid) recipe.
        FileNotFoundError: the installed TRL does not ship ``qwen3.jinja``.
    """
    from composer_diloco.rollout.env_package import load_tokenizer_recipe

    recipe = load_tokenizer_recipe(env)
    if out_dir is None:
        own = recipe.package_dir / ENV_TOKENIZER_FOLDER
        out_dir = DEFAULT_TOKENIZER_DIR if recipe.builds_the_project_tokenizer else own
    return build_tokenizer(out_dir, recipe.corpus(), recipe.domain_words(), vocab_size=recipe.vocab_size)

"""The policy: the embedded default (tiny Qwen3 + shipped tokenizer, warm-started), or any causal LM.

Pieces, in the order a run uses them:

* :func:`build_tokenizer` makes the tokenizer shipped in ``composer_diloco/assets/tokenizer/``
  (``python -m composer_diloco.policy build-tokenizer``); :func:`load_default_tokenizer` loads it.
  It is a byte-level BPE over rendered tool episodes with one token per digit, Qwen3's special tokens,
  and TRL's Qwen3 chat template verbatim, so TRL recognises it (``supports_tool_calling``,
  ``add_response_schema``, ``get_training_chat_template``).
* :func:`tiny_model_config` / :func:`build_tiny_model`: a ~0.9M-parameter ``Qwen3ForCausalLM``.
* :func:`warm_start`: a short supervised pass with TRL's ``SFTTrainer`` on episodes played by the
  run env's scripted solver (``envs/<env>/demos.py``: tool_env's by default, the coding env's for
  ``configs/coding.toml``), so that RL starts from a policy that emits well-formed tool calls and
  sometimes solves the task (reward variance inside GRPO groups).
* :func:`load_policy`: the one entry point for the rest of the project.
* :func:`evaluate_policy`: play fresh episodes in-process against ``execute`` (greedy or sampled).

Measured warm-start curve on tool_env (``warm_start`` defaults: batch 16, lr 1e-3 constant after warmup; success
on 100 fresh episodes, greedy / sampled at temperature 1.0; a shared 2-core CPU, about 0.2 s a step
plus ~5 s of data and trainer setup)::

    steps  seconds  seed 0        seed 1        seed 2        seed 3
       50     ~15   0.01 / 0.00   0.01 / 0.00
      100     ~25   0.02 / 0.00   0.03 / 0.02
      150     ~35   1.00 / 0.22   0.15 / 0.05
      200     ~45   0.99 / 0.54   0.97 / 0.39   0.94 / 0.26   1.00 / 0.67
      250     ~55   1.00 / 0.75   0.89 / 0.59
      300     ~65   1.00 / 0.78   1.00 / 0.77

Before the jump the policy already writes well-formed calls but guesses items and numbers.

Text format (the "no-think" Qwen3 form): every assistant turn is exactly
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>`` after the generation prompt
``<|im_start|>assistant\\n``. That is how ``qwen3.jinja`` renders every assistant turn of an episode that
ends with a tool message, so re-rendering a history with the template gives back the tokens the policy
generated. Do not pass ``enable_thinking=False`` (it appends an empty think block the warm start never
shows), and do not re-render histories with TRL's ``qwen3_training.jinja`` (it adds ``<think>\\n\\n</think>``
to every assistant turn); token-carrying rollouts (TRL's GRPO tool loop) are fine either way.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast, Qwen3Config

from composer_diloco.rollout.chat import episode_messages, parse_tool_call
from envs.tool_env.demos import ERROR_RATE as _ERROR_RATE
from envs.tool_env.tasks import ITEM_VOCAB, TOOL_NAMES, TOOL_SCHEMAS, execute, make_task, solve

__all__ = [
    "DEFAULT_TOKENIZER_DIR",
    "DEFAULT_WARMSTART_ENV",
    "DEFAULT_WARMSTART_STEPS",
    "PolicyLoadError",
    "build_tiny_model",
    "build_tokenizer",
    "evaluate_policy",
    "load_default_tokenizer",
    "load_policy",
    "tiny_model_config",
    "tokenize_episode",
    "warm_start",
]

logger = logging.getLogger(__name__)

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent / "assets" / "tokenizer"
"""The shipped tokenizer of the embedded default policy (built by ``build-tokenizer``)."""

DEFAULT_WARMSTART_STEPS = 200
"""Warm-start optimizer steps of the embedded default: just past the jump from "well-formed calls" to
"copies the right items and numbers", so sampling at temperature 1 succeeds 26-67% of the time (reward
variance for GRPO groups) and greedy decoding 94-100% (measured, seeds 0-3; see :func:`warm_start`)."""

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Control tokens (``special=True``: dropped by ``decode(skip_special_tokens=True)``), as in Qwen3."""

MARKUP_TOKENS: tuple[str, ...] = (
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
"""Markup tokens: single tokens that survive ``skip_special_tokens`` (``special=False``), as in Qwen3."""

PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"

DEFAULT_WARMSTART_ENV = "envs.tool_env.server"
"""The env whose scripted demonstrations warm-start the embedded default unless the run plays another one."""

DOMAIN_WORDS: tuple[str, ...] = tuple(ITEM_VOCAB) + tuple(TOOL_NAMES)
"""The environment's nouns (items, tool names): atomic tokens (``single_word``), so that an item is the
same single token in the question and in a call, and the policy can copy it token for token."""

_TOKENIZER_VOCAB_SIZE = 1000
_TOKENIZER_CORPUS_EPISODES = 2000
_TOKENIZER_CORPUS_SEED = 0
_WARMSTART_BATCH_SIZE = 16
_WARMSTART_LR = 1e-3


class PolicyLoadError(RuntimeError):
    """A policy (model or tokenizer) named by the user could not be loaded; the message names it."""


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def trl_qwen3_chat_template() -> str:
    """The text of TRL's ``trl/chat_templates/qwen3.jinja`` from the installed ``trl`` (build time only).

    Raises:
        FileNotFoundError: if the installed TRL does not ship the template.
    """
    import trl  # only needed to build the tokenizer; the shipped tokenizer carries the text itself

    return (Path(trl.__file__).resolve().parent / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")


def _episode_texts(tokenizer: PreTrainedTokenizerFast, *, seed: int, n_episodes: int,
                   prefix: str, error_rate: float) -> list[str]:
    """Episodes played by the scripted solver, rendered with ``tokenizer``'s chat template + tools."""
    texts = []
    for i in range(n_episodes):
        task = make_task(seed, f"{prefix}-{i}")
        calls = solve(task, random.Random(f"{seed}:{prefix}-{i}"), error_rate)
        results = [execute(task, name, args)[0] for name, args in calls]
        messages = episode_messages(task.question, calls, results)
        texts.append(tokenizer.apply_chat_template(messages, tools=TOOL_SCHEMAS, tokenize=False))
    return texts


def _bare_tokenizer() -> Tokenizer:
    """An empty byte-level BPE whose pre-tokenizer only isolates digits (one token per digit)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _wrap(tok: Tokenizer, chat_template: str) -> PreTrainedTokenizerFast:
    """Register the special, markup and domain tokens on ``tok`` and wrap it for transformers."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False, single_word=True) for t in DOMAIN_WORDS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=chat_template,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer(out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Build the default tokenizer deterministically and save it (``save_pretrained``) into ``out_dir``.

    Method: a byte-level BPE (``tokenizers.models.BPE`` + ``ByteLevel``, as GPT-2/Qwen) trained with a
    target vocabulary of 1000 on 2000 solver episodes (``make_task(0, "corpus-i")``, error rate 0.3)
    rendered with TRL's Qwen3 chat template and ``tools=TOOL_SCHEMAS``; it stops early (about 880
    entries) once no pair occurs twice. The pre-tokenizer only isolates digits (one token per digit,
    so numbers compose and are copied digit by digit), so merges run across words: the fixed text of
    the prompt (the tool schemas block) and of a call (``\n{"name": "``, ``", "arguments": {"item": "``)
    become a handful of long tokens, and an episode is about 120 tokens instead of about 700 with
    word-level pre-tokenization, which makes the CPU warm start ~6x cheaper. The environment's nouns
    (:data:`DOMAIN_WORDS`) are atomic tokens, so an item reads and is written as the same single token.
    Other text still tokenizes (byte-level: any string round-trips), just into less natural pieces.

    Ids 0..8: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos), then ``<tool_call>``,
    ``</tool_call>``, ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>``; then the
    domain words. The chat template is TRL's ``qwen3.jinja``, byte for byte.

    Args:
        out_dir: directory to write (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``);
            created if missing, files overwritten.

    Returns:
        The tokenizer (the same object that was saved).
    """
    chat_template = trl_qwen3_chat_template()
    bootstrap = _wrap(_bare_tokenizer(), chat_template)  # byte-level, no merges: only used to render
    texts = _episode_texts(bootstrap, seed=_TOKENIZER_CORPUS_SEED, n_episodes=_TOKENIZER_CORPUS_EPISODES,
                           prefix="corpus", error_rate=_ERROR_RATE)
    # Train on the text between the atomic tokens, which take the first ids.
    splitter = re.compile("|".join([re.escape(t) for t in SPECIAL_TOKENS + MARKUP_TOKENS]
                                   + [rf"\b{re.escape(w)}\b" for w in DOMAIN_WORDS]))
    pieces = [piece for text in texts for piece in splitter.split(text) if piece]
    tok = _bare_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS + MARKUP_TOKENS + DOMAIN_WORDS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(pieces, trainer)
    tokenizer = _wrap(tok, chat_template)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    logger.info("built tokenizer: %d tokens from %d episodes -> %s", len(tokenizer), len(texts), out_dir)
    return tokenizer


def load_default_tokenizer() -> PreTrainedTokenizerFast:
    """Load the shipped tokenizer from :data:`DEFAULT_TOKENIZER_DIR` (no TRL files needed).

    Raises:
        PolicyLoadError: if the shipped files are missing (rebuild with
            ``python -m composer_diloco.policy build-tokenizer``).
    """
    if not (DEFAULT_TOKENIZER_DIR / "tokenizer.json").is_file():
        raise PolicyLoadError(
            f"default tokenizer missing at {DEFAULT_TOKENIZER_DIR}; "
            "build it with `python -m composer_diloco.policy build-tokenizer`"
        )
    return AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER_DIR, local_files_only=True)


def tokenize_episode(
    tokenizer: PreTrainedTokenizerFast,
    messages: list[dict[str, Any]],
    trained_turns: list[bool] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> dict[str, list[int]]:
    """Token ids of a rendered episode and a mask of the assistant tokens to train on.

    The episode is rendered once with the tokenizer's chat template and ``tools`` (default: tool_env's
    ``TOOL_SCHEMAS``); an
    assistant turn is the text after each ``<|im_start|>assistant\\n`` up to and including its
    ``<|im_end|>`` (what generation after the prompt ``add_generation_prompt=True`` produces and stops
    at). Token boundaries fall on the special tokens around it, so the masked tokens are exactly the
    ones generated at inference.

    Args:
        tokenizer: a tokenizer with a Qwen-style chat template (the default one).
        messages: chat messages from :func:`composer_diloco.rollout.chat.episode_messages`.
        trained_turns: per assistant turn, whether its tokens enter the mask (default: all).
        tools: the tool schemas rendered into the system prompt (OpenAI function format).

    Returns:
        ``{"input_ids": list[int] (T,), "assistant_masks": list[int] (T,)}`` with 1 on trained
        assistant tokens.

    Raises:
        ValueError: if the rendering holds no assistant turn, or ``trained_turns`` has the wrong length.
    """
    text = tokenizer.apply_chat_template(messages, tools=TOOL_SCHEMAS if tools is None else tools, tokenize=False)
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


def demos_module(env: str) -> ModuleType:
    """The ``demos`` module of an env package (scripted demonstrations, see ``envs.demonstration``).

    Args:
        env: the env's server module as in ``[env] server_module`` (``"envs.coding_env.server"``) or its package
            (``"envs.coding_env"``).

    Raises:
        PolicyLoadError: if the package has no ``demos`` module with a ``demonstration`` function.
    """
    package = env[: -len(".server")] if env.endswith(".server") else env
    try:
        module = importlib.import_module(f"{package}.demos")
    except ImportError as exc:
        if exc.name not in (f"{package}.demos", package, package.split(".")[0]):
            raise
        module = None
    if module is None or not callable(getattr(module, "demonstration", None)):
        raise PolicyLoadError(
            f"env {env!r} ships no scripted demonstrations ({package}.demos.demonstration) to warm-start the "
            "embedded default policy on; set [warmstart] steps = 0, or use a real model (--model)")
    return module


def solver_examples(
    tokenizer: PreTrainedTokenizerFast,
    *,
    seed: int,
    n_episodes: int,
    error_rate: float = _ERROR_RATE,
    env: str = DEFAULT_WARMSTART_ENV,
) -> list[dict[str, list[int]]]:
    """Supervised examples from episodes played by an env's scripted solver (the warm start's data).

    Episode ``i`` is ``demos_module(env).demonstration(seed, i, error_rate)``. Labels are the token ids on the
    assistant turns of successful calls and -100 elsewhere: a failed call stays in the context (so the policy
    learns to recover from it) but is not imitated.

    Returns:
        ``n_episodes`` dicts ``{"input_ids": list[int] (T,), "labels": list[int] (T,)}``.

    Raises:
        PolicyLoadError: if ``env`` ships no demonstrations (`demos_module`).
    """
    demos = demos_module(env)
    rows = []
    for i in range(n_episodes):
        demo = demos.demonstration(seed, i, error_rate)
        enc = tokenize_episode(tokenizer, episode_messages(demo.question, demo.calls, demo.replies),
                               trained_turns=demo.imitate, tools=demo.tools)
        labels = [t if m else -100 for t, m in zip(enc["input_ids"], enc["assistant_masks"])]
        rows.append({"input_ids": enc["input_ids"], "labels": labels})
    return rows


# --------------------------------------------------------------------------------------------------
# Tiny model
# --------------------------------------------------------------------------------------------------


def tiny_model_config(tokenizer: PreTrainedTokenizerFast, seed: int = 0, **overrides: Any) -> Qwen3Config:
    """Config of the embedded default policy: a ~0.9M-parameter Qwen3 sized for CPU warm starts.

    Hidden 128, 4 layers, 4 attention heads of 32, 2 key/value heads (GQA), SwiGLU 384, tied
    embeddings, RoPE theta 10000, 1024 positions, fp32. ``seed`` is recorded as
    ``config.init_seed`` (provenance only; :func:`build_tiny_model` seeds the initialisation).

    Args:
        tokenizer: gives the vocabulary size and the pad/eos ids.
        seed: the initialisation seed to record.
        **overrides: any ``Qwen3Config`` field, e.g. ``hidden_size=192``.
    """
    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.02,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        use_cache=True,
        init_seed=seed,
    )
    fields.update(overrides)
    return Qwen3Config(**fields)


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, seed: int, **overrides: Any) -> PreTrainedModel:
    """A freshly initialised ``Qwen3ForCausalLM`` from :func:`tiny_model_config`, fp32 on CPU.

    Initialisation runs under ``torch.manual_seed(seed)`` inside ``torch.random.fork_rng``, so the same
    seed gives the same weights and the caller's global RNG is left untouched.
    """
    config = tiny_model_config(tokenizer, seed, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model.to("cpu")


# --------------------------------------------------------------------------------------------------
# Warm start
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _restored_rng_state() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's global RNG states on exit (``Trainer`` reseeds all three)."""
    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


class _LogCallback(transformers.TrainerCallback):
    """Sends the trainer's periodic logs (loss, grad norm, lr) to this module's logger."""

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: D102 (transformers hook)
        if logs:
            logger.info("warm start step %d/%d: %s", state.global_step, state.max_steps,
                        ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in logs.items()))


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    *,
    seed: int,
    steps: int,
    out_dir: str | Path,
    batch_size: int = _WARMSTART_BATCH_SIZE,
    lr: float = _WARMSTART_LR,
    error_rate: float = _ERROR_RATE,
    env: str = DEFAULT_WARMSTART_ENV,
) -> Path:
    """Supervised warm start on scripted-solver episodes with TRL's ``SFTTrainer``; saves model + tokenizer.

    Data: ``steps * batch_size`` fresh episodes of ``env``'s scripted solver (``demos.demonstration(seed, i,
    error_rate)``: a fraction ``error_rate`` hold one failed call followed by its recovery), rendered with the
    chat template and the env's tool schemas (:func:`solver_examples`). Loss: next-token cross
    entropy on assistant tokens only (labels -100 elsewhere, built by :func:`tokenize_episode`; TRL's
    own ``assistant_only_loss`` would swap in ``qwen3_training.jinja``, whose think blocks the inference
    template does not render). Failed calls of the solver stay in the context but are not trained
    on (see :func:`solver_examples`). Optimiser: AdamW (torch), no weight decay, ``lr`` constant after
    a 5% linear warmup (a cosine decay delayed the jump from "format right" to "copies the right
    item/number" past the budget in our runs), gradient clipping 1.0, fp32 on CPU.

    Measured on a shared 2-core CPU (batch 16, lr 1e-3, seeds 0-3): on tool_env, 200 steps take about 45 s and
    give 94-100% greedy success and 26-67% success sampled at temperature 1.0 (see
    :data:`DEFAULT_WARMSTART_STEPS`); on the coding env (~850-token episodes) a step takes about 2 s.

    Deterministic: the same model weights, ``seed`` and arguments give the same bytes (single process,
    same torch thread count); the caller's ``random``/``numpy``/``torch`` RNG states are restored
    afterwards (the trainer reseeds them). Atomic: training happens in a temporary directory next to ``out_dir``
    which is renamed to ``out_dir`` at the end; ``out_dir`` also receives ``warmstart.json`` (arguments,
    final loss, seconds). ``steps=0`` saves the model unchanged.

    Args:
        model: the policy to train in place (fp32, CPU).
        tokenizer: its tokenizer (saved next to it).
        seed: seeds the episodes, the data order and the trainer.
        steps: optimizer steps (``>= 0``).
        out_dir: the directory to create.
        batch_size: episodes per step.
        lr: peak learning rate.
        error_rate: fraction of episodes with one failed call and its recovery, in [0, 1].
        env: the env whose demonstrations to train on (a server module or env package, see `demos_module`).

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: on a negative ``steps`` or non-positive ``batch_size`` / ``lr``.
        FileExistsError: if ``out_dir`` already exists (nothing is overwritten).
        PolicyLoadError: if ``env`` ships no demonstrations.
    """
    from datasets import Dataset  # heavy imports only for training
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    if steps < 0 or batch_size <= 0 or lr <= 0:
        raise ValueError(f"warm_start: need steps >= 0, batch_size > 0, lr > 0; got {steps}, {batch_size}, {lr}")
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"warm_start: {out_dir} already exists")
    demos_module(env)  # an env without demonstrations fails before any work
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    t0 = time.monotonic()
    try:
        final_loss: float | None = None
        if steps > 0:
            rows = solver_examples(tokenizer, seed=seed, n_episodes=steps * batch_size, error_rate=error_rate,
                                   env=env)
            config = SFTConfig(
                output_dir=str(staging / "trainer"),
                max_steps=steps,
                num_train_epochs=1,
                per_device_train_batch_size=batch_size,
                learning_rate=lr,
                lr_scheduler_type="constant_with_warmup",
                warmup_steps=max(1, steps // 20),
                weight_decay=0.0,
                max_grad_norm=1.0,
                optim="adamw_torch",
                seed=seed,
                data_seed=seed,
                use_cpu=True,
                bf16=False,
                fp16=False,
                activation_checkpointing=False,  # TRL's SFTConfig turns it on by default
                max_length=None,
                report_to="none",
                save_strategy="no",
                logging_strategy="steps",
                logging_steps=max(1, steps // 10),
                disable_tqdm=True,
                dataloader_num_workers=0,
            )
            with _restored_rng_state():
                trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows),
                                     processing_class=tokenizer, callbacks=[_LogCallback()])
                trainer.remove_callback(PrinterCallback)  # it print()s every log; ours logs instead
                result = trainer.train()
            final_loss = next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h),
                              result.training_loss)
            shutil.rmtree(staging / "trainer", ignore_errors=True)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        meta = dict(env=env, seed=seed, steps=steps, batch_size=batch_size, lr=lr, error_rate=error_rate,
                    final_loss=final_loss, train_seconds=round(time.monotonic() - t0, 2),
                    torch=torch.__version__, transformers=transformers.__version__)
        (staging / "warmstart.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        staging.chmod(0o755)  # mkdtemp made it 0700
        os.rename(staging, out_dir)  # atomic; fails if out_dir appeared meanwhile
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("warm start: %d steps in %.1f s, final loss %s -> %s", steps, time.monotonic() - t0,
                final_loss, out_dir)
    return out_dir


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _default_cache_key(seed: int, steps: int, config: Qwen3Config, env: str = DEFAULT_WARMSTART_ENV) -> str:
    """Short hash of what determines the default warm-started weights: seed, steps, the warm-start
    recipe, the model config, the tokenizer files and the source of the env package's top-level modules
    (tasks, tools, demonstrations)."""
    h = hashlib.sha256()
    cfg = config.to_dict()
    cfg.pop("transformers_version", None)
    recipe = dict(batch_size=_WARMSTART_BATCH_SIZE, lr=_WARMSTART_LR, error_rate=_ERROR_RATE, version=2)
    h.update(json.dumps({"seed": seed, "steps": steps, "recipe": recipe, "config": cfg}, sort_keys=True).encode())
    package = Path(demos_module(env).__file__).parent
    for path in sorted(package.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    for name in sorted(os.listdir(DEFAULT_TOKENIZER_DIR)):
        h.update(name.encode())
        h.update((DEFAULT_TOKENIZER_DIR / name).read_bytes())
    return h.hexdigest()[:16]


def _load_pretrained(source: str, *, local: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """``from_pretrained`` for model and tokenizer, fp32, CPU, eval mode."""
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, local_files_only=local)
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to("cpu").float().eval(), tokenizer


def load_policy(
    model: str | os.PathLike[str] | None,
    *,
    run_dir: str | Path,
    seed: int,
    warmstart_steps: int,
    env: str = DEFAULT_WARMSTART_ENV,
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The policy of a run: the embedded default (``model=None``) or a hub id / local directory.

    ``None``: the tiny Qwen3 of :func:`build_tiny_model` with the shipped tokenizer, warm-started for
    ``warmstart_steps`` steps on ``env``'s scripted demonstrations (:func:`warm_start`), cached in
    ``run_dir / "warmstart" / <hash>`` where the hash covers ``seed``, ``warmstart_steps``, the model config,
    the tokenizer files and the env's task code; a cached copy is reused. Otherwise ``model`` is a local directory (``save_pretrained`` layout) or a Hugging
    Face Hub id, loaded with ``AutoModelForCausalLM`` / ``AutoTokenizer``: first from local files only,
    then (unless ``HF_HUB_OFFLINE`` is set) from the Hub. A tokenizer without a pad token gets eos.

    Args:
        model: ``None``, a directory, or a hub id such as ``"Qwen/Qwen3-0.6B"``.
        run_dir: the run's directory (holds the warm-start cache).
        seed: seed of the default policy's initialisation and warm start (ignored otherwise).
        warmstart_steps: warm-start steps of the default policy (ignored otherwise).
        env: the env whose demonstrations warm-start the default policy (see `demos_module`; ignored otherwise).

    Returns:
        ``(model, tokenizer)``, the model in fp32 on CPU in eval mode.

    Raises:
        PolicyLoadError: if ``model`` names neither a loadable local directory nor a reachable hub model,
            the shipped tokenizer is missing, or ``env`` has no demonstrations for a warm start.
    """
    if model is None:
        tokenizer = load_default_tokenizer()
        config = tiny_model_config(tokenizer, seed)
        if warmstart_steps > 0:
            env = demos_module(env).__name__.rsplit(".", 1)[0]  # fails early; one key per env package
        else:
            env = DEFAULT_WARMSTART_ENV  # untrained weights do not depend on the env
        cache = Path(run_dir) / "warmstart" / _default_cache_key(seed, warmstart_steps, config, env)
        if not (cache / "config.json").is_file():
            logger.info("warm-starting the default policy on %s (%d steps, seed %d) into %s", env, warmstart_steps,
                        seed, cache)
            try:
                warm_start(build_tiny_model(tokenizer, seed), tokenizer, seed=seed, steps=warmstart_steps,
                           out_dir=cache, env=env)
            except (FileExistsError, OSError):
                if not (cache / "config.json").is_file():  # not a concurrent writer winning the rename
                    raise
        else:
            logger.info("reusing the warm-started default policy at %s", cache)
        return _load_pretrained(str(cache), local=True)

    value = os.fspath(model)
    path = Path(value).expanduser()
    if path.exists():
        if not (path.is_dir() and (path / "config.json").is_file()):
            raise PolicyLoadError(f"policy {value!r}: expected a model directory with config.json "
                                  "(save_pretrained layout)")
        try:
            return _load_pretrained(str(path), local=True)
        except (OSError, ValueError, KeyError) as exc:
            raise PolicyLoadError(f"policy {value!r}: cannot load model/tokenizer from this directory: {exc}") from exc
    looks_like_path = path.is_absolute() or value.startswith((".", "~")) or value.count("/") > 1 or "\\" in value
    if looks_like_path:
        raise PolicyLoadError(f"policy {value!r}: no such directory (expected a save_pretrained model "
                              "directory or a Hugging Face Hub id like 'org/name')")
    from huggingface_hub import constants as hub_constants

    offline = hub_constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in (
        "1", "true", "yes", "on")
    errors = []
    for local in (True,) if offline else (True, False):
        try:
            return _load_pretrained(value, local=local)
        except (OSError, ValueError, KeyError) as exc:  # huggingface_hub errors subclass OSError/ValueError
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    raise PolicyLoadError(f"policy {value!r}: not a local directory and not a loadable Hugging Face Hub model "
                          f"id (cache{'' if offline else ' or Hub'}): {errors[-1]}")


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_policy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    n_episodes: int,
    seed: int,
    *,
    temperature: float = 0.0,
    max_calls: int = 8,
    max_new_tokens: int = 48,
    batch_size: int = 32,
) -> dict[str, float]:
    """Play fresh episodes end to end in-process: generate, parse, ``execute``, repeat until ``submit``.

    Each turn renders the episode so far with the chat template (``tools=TOOL_SCHEMAS``,
    ``add_generation_prompt=True``), generates one assistant turn (``model.generate``, stopping at
    eos ``<|im_end|>``), parses it with :func:`composer_diloco.rollout.chat.parse_tool_call` and feeds the tool
    result back. An episode ends at the first ``submit`` (success iff the answer equals
    ``task.answer``), at a turn with no parsable tool call (a format failure), or after ``max_calls``
    calls. Episodes are ``make_task(seed, "eval-i")``, batched ``batch_size`` at a time with left padding.

    Args:
        model: a causal LM (any dtype/device; inputs follow ``model.device``).
        tokenizer: its tokenizer, with a chat template that supports tools.
        n_episodes: number of episodes.
        seed: task seed; for ``temperature > 0`` also the sampling seed (global RNG untouched).
        temperature: 0 for greedy decoding, else sampling at this temperature (no top-k/top-p).
        max_calls: tool calls allowed per episode.
        max_new_tokens: generation budget per turn.
        batch_size: episodes generated together.

    Returns:
        ``success_rate`` (fraction of episodes with a correct submit), ``submit_rate`` (any submit),
        ``format_error_rate`` (episodes ended by an unparsable turn), ``tool_error_rate`` (failed
        calls / all calls), ``mean_tool_calls`` (per episode), ``n_episodes``, ``seconds``.
    """
    was_training = model.training
    model.eval()
    t0 = time.monotonic()
    totals = dict(success=0, submitted=0, format_errors=0, tool_errors=0, calls=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for first in range(0, n_episodes, batch_size):
            tasks = [make_task(seed, f"eval-{i}") for i in range(first, min(first + batch_size, n_episodes))]
            calls: list[list[tuple[str, dict]]] = [[] for _ in tasks]
            results: list[list[str]] = [[] for _ in tasks]
            active = list(range(len(tasks)))
            while active:
                prompts = [
                    tokenizer.apply_chat_template(episode_messages(tasks[i].question, calls[i], results[i]),
                                                  tools=TOOL_SCHEMAS, add_generation_prompt=True, tokenize=False)
                    for i in active
                ]
                batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left",
                                  add_special_tokens=False).to(model.device)
                sampling = dict(do_sample=True, temperature=temperature, top_k=None, top_p=None) \
                    if temperature > 0 else dict(do_sample=False)
                out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                     eos_token_id=tokenizer.eos_token_id, **sampling)
                texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
                still = []
                for i, text in zip(active, texts):
                    parsed = parse_tool_call(text)
                    if not parsed.ok:
                        totals["format_errors"] += 1
                        continue
                    content, error_kind, _ = execute(tasks[i], parsed.name, parsed.arguments)
                    calls[i].append((parsed.name, parsed.arguments))
                    results[i].append(content)
                    totals["calls"] += 1
                    totals["tool_errors"] += error_kind is not None
                    if parsed.name == "submit" and error_kind is None:
                        totals["submitted"] += 1
                        totals["success"] += parsed.arguments["answer"] == tasks[i].answer
                    elif len(calls[i]) < max_calls:
                        still.append(i)
                active = still
    model.train(was_training)
    n = max(n_episodes, 1)
    return dict(
        success_rate=totals["success"] / n,
        submit_rate=totals["submitted"] / n,
        format_error_rate=totals["format_errors"] / n,
        tool_error_rate=totals["tool_errors"] / max(totals["calls"], 1),
        mean_tool_calls=totals["calls"] / n,
        n_episodes=n_episodes,
        seconds=round(time.monotonic() - t0, 2),
    )


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m composer_diloco.policy {build-tokenizer,warm-start,evaluate}``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m composer_diloco.policy", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build-tokenizer", help="build the shipped tokenizer")
    p.add_argument("--out", type=Path, default=DEFAULT_TOKENIZER_DIR, help="output directory")
    p = sub.add_parser("warm-start", help="warm-start the tiny default policy into a new directory")
    p.add_argument("--steps", type=int, default=DEFAULT_WARMSTART_STEPS)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=_WARMSTART_BATCH_SIZE)
    p.add_argument("--lr", type=float, default=_WARMSTART_LR)
    p.add_argument("--error-rate", type=float, default=_ERROR_RATE)
    p.add_argument("--env", default=DEFAULT_WARMSTART_ENV,
                   help="env server module or package whose scripted demonstrations to train on")
    p = sub.add_parser("evaluate", help="play fresh episodes with a saved policy")
    p.add_argument("model_dir", help="a save_pretrained directory or hub id")
    p.add_argument("--episodes", type=int, default=100)
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--temperature", type=float, default=None,
                   help="only this temperature (default: greedy, then 1.0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "build-tokenizer":
        tok = build_tokenizer(args.out)
        print(f"tokenizer: {len(tok)} tokens -> {args.out}")
    elif args.command == "warm-start":
        tokenizer = load_default_tokenizer()
        t0 = time.monotonic()
        out = warm_start(build_tiny_model(tokenizer, args.seed), tokenizer, seed=args.seed, steps=args.steps,
                         out_dir=args.out, batch_size=args.batch_size, lr=args.lr, error_rate=args.error_rate,
                         env=args.env)
        print(f"warm start: {args.steps} steps in {time.monotonic() - t0:.1f} s -> {out}")
    else:
        try:
            model, tokenizer = load_policy(args.model_dir, run_dir=Path("."), seed=0, warmstart_steps=0)
        except PolicyLoadError as exc:
            print(f"error: {exc}")
            return 2
        temps = [args.temperature] if args.temperature is not None else [0.0, 1.0]
        for temp in temps:
            stats = evaluate_policy(model, tokenizer, args.episodes, args.seed, temperature=temp)
            print(json.dumps({"temperature": temp, **stats}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

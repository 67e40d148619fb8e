"""``python -m composer_diloco.policy``: build the shipped tokenizer, warm-start the default policy, evaluate a policy.

    python -m composer_diloco.policy build-tokenizer [--env envs.coding_env]
    python -m composer_diloco.policy warm-start --steps 200 --out runs/ws
    python -m composer_diloco.policy evaluate runs/ws --episodes 100
    python -m composer_diloco.policy evaluate runs/ws --env envs.coding_env.server --reset-kwarg source=generated
    python -m composer_diloco.policy merge-lora runs/lora/checkpoints/round-000002 --out runs/merged

Every failure prints one line ``python -m composer_diloco.policy: error: ...`` to stderr and exits 1 (usage errors:
typer's message, exit 2).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from composer_diloco.policy.errors import PolicyLoadError
from composer_diloco.policy.warmstart import (
    DEFAULT_WARMSTART_ENV,
    DEFAULT_WARMSTART_STEPS,
    WARMSTART_BATCH_SIZE,
    WARMSTART_ERROR_RATE,
    WARMSTART_LR,
)

__all__ = ["app", "main"]

PROG = "python -m composer_diloco.policy"

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="The embedded default policy: its tokenizer, its warm start, and evaluating any policy.")


@app.callback()
def _root(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log at INFO level.")] = False) -> None:
    """The embedded default policy: its tokenizer, its warm start, and evaluating any policy."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _fail(exc: BaseException) -> typer.Exit:
    """Print ``exc``'s first line as the command's one-line error; the exit to raise (code 1)."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    typer.echo(f"{PROG}: error: {lines[0]}", err=True)
    logging.getLogger(__name__).info("%s", exc)  # the full message (a server's output tail) with --verbose
    return typer.Exit(1)


@app.command("build-tokenizer")
def build_tokenizer_command(
    env: Annotated[str, typer.Option(help="The env package whose shipped tokenizer to rebuild from its "
                                          "tokenizer_recipe.py: envs.tool_env (the project's, "
                                          "composer_diloco/assets/tokenizer) or envs.coding_env (its "
                                          "policy_tokenizer/).")] = "envs.tool_env",
    out: Annotated[Path | None, typer.Option(help="Output directory (default: over the shipped files).")] = None,
) -> None:
    """Rebuild a shipped tokenizer from its env package's tokenizer_recipe.py (the env contract)."""
    from composer_diloco.policy.tokenizer import build_env_tokenizer

    try:
        tok = build_env_tokenizer(env, out)
    except (OSError, ValueError) as exc:
        raise _fail(exc) from None
    typer.echo(f"tokenizer of {env}: {len(tok)} tokens -> {out or 'the shipped files'}")


@app.command("warm-start")
def warm_start_command(
    out: Annotated[Path, typer.Option(help="Directory to create (must not exist).")],
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = DEFAULT_WARMSTART_STEPS,
    seed: Annotated[int, typer.Option(help="Seeds the initialisation, the episodes and the trainer.")] = 0,
    batch_size: Annotated[int, typer.Option(help="Episodes per step.")] = WARMSTART_BATCH_SIZE,
    lr: Annotated[float, typer.Option(help="Peak learning rate.")] = WARMSTART_LR,
    error_rate: Annotated[float, typer.Option(help="Fraction of episodes with one failed call and its "
                                                   "recovery.")] = WARMSTART_ERROR_RATE,
    env: Annotated[str, typer.Option(help="Env server module or package whose scripted demonstrations to train "
                                          "on.")] = DEFAULT_WARMSTART_ENV,
) -> None:
    """Warm-start the tiny default policy into a new directory."""
    from composer_diloco.policy.load import load_embedded_tokenizer
    from composer_diloco.policy.tiny_model import build_tiny_model
    from composer_diloco.policy.warmstart import warm_start

    t0 = time.monotonic()
    try:
        tokenizer = load_embedded_tokenizer(env)
        result = warm_start(build_tiny_model(tokenizer, seed), tokenizer, seed=seed, steps=steps, out_dir=out,
                            batch_size=batch_size, lr=lr, error_rate=error_rate, env=env)
    except (PolicyLoadError, ValueError, OSError) as exc:  # FileExistsError is an OSError
        raise _fail(exc) from None
    typer.echo(f"warm start: {steps} steps in {time.monotonic() - t0:.1f} s -> {result}")


def _reset_kwargs(pairs: list[str]) -> dict[str, str | int | float | bool]:
    """``["source=generated", "k=3"]`` -> ``{"source": "generated", "k": 3}`` (JSON scalars parsed, else str)."""
    kwargs: dict[str, str | int | float | bool] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="--reset-kwarg")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        kwargs[key] = value if isinstance(value, (str, int, float, bool)) else raw
    return kwargs


@app.command()
def evaluate(
    model_dir: Annotated[str, typer.Argument(help="A save_pretrained directory or a Hugging Face Hub id.")],
    episodes: Annotated[int, typer.Option(help="Episodes per temperature.")] = 100,
    seed: Annotated[int, typer.Option(help="Episode and sampling seed.")] = 12345,
    temperature: Annotated[list[float], typer.Option(help="Temperature (repeat for several; 0 = greedy); default: "
                                                          "greedy, then 1.0.")] = [],
    env: Annotated[str, typer.Option(help="The env's server module; its package's environment is played in this "
                                          "process (no server).")] = DEFAULT_WARMSTART_ENV,
    env_url: Annotated[str, typer.Option(help="A running env server to play instead of --env in process.")] = "",
    reset_kwarg: Annotated[list[str], typer.Option(help="KEY=VALUE passed to every reset (repeatable), e.g. "
                                                        "source=generated for the coding env.")] = [],
    max_calls: Annotated[int, typer.Option(help="Tool calls per episode.")] = 8,
    max_turn_tokens: Annotated[int, typer.Option(help="Tokens generated per assistant turn.")] = 48,
    batch_size: Annotated[int, typer.Option(help="Episodes generated together.")] = 32,
) -> None:
    """Play fixed fresh episodes with a saved policy; print one JSON line per temperature."""
    from composer_diloco.policy.evaluate import evaluate_policy
    from composer_diloco.policy.load import load_policy
    from composer_diloco.rollout.env_package import EnvPackageError
    from composer_diloco.rollout.env_process import EnvServerError
    from composer_diloco.rollout.episodes import EnvProtocolError
    from composer_diloco.rollout.mcp import McpProtocolError, NotAnMcpServer, UnsupportedEnvServer

    kwargs = _reset_kwargs(reset_kwarg)
    where = {"env_url": env_url} if env_url else {"env": env}
    try:
        model, tokenizer = load_policy(model_dir, seed=0, warmstart_steps=0)
        for temp in temperature or [0.0, 1.0]:
            stats = evaluate_policy(model, tokenizer, episodes, seed, **where, temperature=temp, max_calls=max_calls,
                                    max_new_tokens=max_turn_tokens, batch_size=batch_size, reset_kwargs=kwargs)
            typer.echo(json.dumps({"temperature": temp, **stats}))
    except (PolicyLoadError, EnvPackageError, EnvServerError, McpProtocolError, NotAnMcpServer, UnsupportedEnvServer,
            EnvProtocolError, ValueError, OSError) as exc:
        raise _fail(exc) from None


@app.command("merge-lora")
def merge_lora(
    checkpoint: Annotated[Path, typer.Argument(help="A [lora] run's checkpoint folder (a PEFT adapter folder), e.g. "
                                                    "RUN_DIR/checkpoints/round-000003.")],
    out: Annotated[Path, typer.Option(help="Output directory of the merged save_pretrained model.")],
) -> None:
    """Merge a LoRA checkpoint's adapters into the run's base model (peft merge_and_unload) and save_pretrained it."""
    from composer_diloco.checkpoint import CheckpointError, read_outer_state
    from composer_diloco.config import ConfigError, RunConfig
    from composer_diloco.policy.load import load_run_policy
    from composer_diloco.policy.lora import LoraError, base_sha256, merge_adapters

    try:
        state = read_outer_state(checkpoint)
        config = RunConfig.from_json(state["config"])
        if config.lora is None or "base_sha256" not in state:
            raise LoraError(f"checkpoint {str(checkpoint)!r} is not from a [lora] run: it is a full model already")
        base, tokenizer = load_run_policy(config)
        if base_sha256(base) != state["base_sha256"]:
            raise LoraError(f"the base model loaded for {str(checkpoint)!r} has base_sha256 {base_sha256(base)}, the "
                            f"adapters were trained over {state['base_sha256']}")
        merge_adapters(base, checkpoint, out)
        tokenizer.save_pretrained(out)
        typer.echo(str(out))
    except (CheckpointError, ConfigError, PolicyLoadError, KeyError, ValueError, OSError) as exc:
        raise _fail(exc) from None


def main() -> int:
    """Console entry point (``python -m composer_diloco.policy``); returns the exit code."""
    from composer_diloco.lifecycle import run_cli

    return run_cli(app)


if __name__ == "__main__":
    sys.exit(main())

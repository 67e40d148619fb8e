"""`composer-coordinator`: start a run (DHT bootstrap, canonical model, checkpoints) or simulate one locally."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Coordinator of a composer-diloco run: DHT bootstrap, canonical model, checkpoints.")
log = logging.getLogger("composer.coordinator")

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="Run config (TOML); default: built-in defaults.")]
RoundsOpt = Annotated[Optional[int], typer.Option("--rounds", help="Override the config's number of rounds.")]
RunDirOpt = Annotated[Path, typer.Option("--run-dir", help="Checkpoints, metrics and logs go here (the warm start is "
                                                          "cached per user: $COMPOSER_DILOCO_CACHE, else "
                                                          "$XDG_CACHE_HOME/composer_diloco, else "
                                                          "~/.cache/composer_diloco).")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")]
ModelOpt = Annotated[Optional[str], typer.Option("--model", help="Hub id or local model directory (replaces the "
                                                                 "embedded tiny default).")]
SecretFileOpt = Annotated[Optional[Path], typer.Option("--secret-file", help="File holding the run secret that closes "
                                                       "the run (default: $COMPOSER_DILOCO_SECRET; neither: open).")]


def _check(config: Path | None, rounds: int | None, model: str | None, secret_file: Path | None,
           listen: str | None = None, announce: list[str] | None = None):
    """Everything the command line can judge before torch and hivemind are imported (a fraction of a second): the
    config, ``--model`` as a folder or a Hub id, the form of ``--listen`` / ``--announce``, and the run secret.

    Returns:
        ``(config, secret)``: the `RunConfig` and the secret's bytes (None: an open run).
    Raises:
        typer.Exit(1): after printing the one-line error.
    """
    from composer_diloco.config import ConfigError, load_config
    from composer_diloco.outer.address_form import AddressError, check_listen_and_announce
    from composer_diloco.outer.secret import SecretError, load_secret
    from composer_diloco.policy.errors import PolicyLoadError
    from composer_diloco.policy.model_name import check_model_name
    from composer_diloco.report import check_trackers

    try:  # the option forms first: a config that sets [loss] keys imports the loss channels (torch) to check them
        check_listen_and_announce(listen, announce or [])
        secret = load_secret(secret_file)
        cfg = load_config(config, rounds=rounds, model=model)
        if cfg.model is not None:
            check_model_name(cfg.model)
        check_trackers(cfg)
        return cfg, secret
    except (ConfigError, SecretError, PolicyLoadError, AddressError) as e:
        typer.echo(f"composer-coordinator: error: {e}", err=True)
        raise typer.Exit(1) from None


@app.command()
def start(
    config: ConfigOpt = None,
    rounds: RoundsOpt = None,
    model: ModelOpt = None,
    listen: Annotated[Optional[str], typer.Option(help="Multiaddr to listen on, e.g. /ip4/0.0.0.0/tcp/4000 "
                                                       "(default: 127.0.0.1, a free port).")] = None,
    announce: Annotated[list[str], typer.Option(help="Multiaddr other machines dial (repeatable).")] = [],
    run_dir: RunDirOpt = Path("runs/default"),
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the newest checkpoint in --run-dir.")] = False,
    secret_file: SecretFileOpt = None,
    max_idle: Annotated[Optional[float], typer.Option(
        "--max-idle", min=0.0, help="Seconds without a live node after which the run ends with exit code 1 "
                                    "(default: wait for nodes forever).")] = None,
    idle_log: Annotated[float, typer.Option(
        "--idle-log", min=0.1, help="Seconds without a live node before logging what the coordinator waits for, "
                                    "and between two such lines.")] = 60.0,
    verbose: VerboseOpt = False,
) -> None:
    """Start the run: print `peer: <multiaddr>` for the nodes, serve every round, checkpoint, exit 0.

    Exits 1 with one line on an error, when no node was alive for --max-idle seconds ("no node alive for S s
    since round R: ..."), or when the run ended with theta unchanged ("the run ended at round R with theta unchanged
    ..."); 130 when stopped by a signal."""
    cfg, secret = _check(config, rounds, model, secret_file, listen, list(announce))  # before the heavy imports
    from composer_diloco.lifecycle import GracefulStop, setup_logging
    from composer_diloco.malloc import fix_mmap_threshold
    from composer_diloco.reaper import watch_this_process
    from coordinator.coordinator import Coordinator, CoordinatorOptions

    fix_mmap_threshold()  # its big buffers are theta-sized copies; it trains only in a first warm start (malloc.py)
    setup_logging("coordinator", verbose)
    stop = GracefulStop().install()
    watch_this_process()  # hivemind's DHT/averager processes and p2pd die with us, even on SIGKILL
    coordinator = None
    code = 0
    try:
        from composer_diloco.outer.swarm import check_addresses

        check_addresses(listen, list(announce))
        coordinator = Coordinator(CoordinatorOptions(cfg, run_dir, listen, list(announce) or None, resume,
                                                     secret=secret, max_idle_s=max_idle,
                                                     idle_log_s=idle_log), stop)
        peer = coordinator.start()
        print(f"peer: {peer}", flush=True)
        done = coordinator.serve()
        if coordinator.end_error is not None:
            typer.echo(f"composer-coordinator: error: {coordinator.end_error}", err=True)
            code = 1
        elif stop.event.is_set():
            log.info("stopped by signal after %d round(s)", done)
            code = 130
        else:
            log.info("run finished: %d round(s); checkpoints in %s", done, run_dir / "checkpoints")
    except Exception as e:
        if verbose:
            log.exception("coordinator failed")
        typer.echo(f"composer-coordinator: error: {e}", err=True)
        code = 1
    finally:
        if coordinator is not None:
            coordinator.close()
    raise typer.Exit(code)


@app.command()
def simulate(
    nodes: Annotated[int, typer.Option("--nodes", min=1, help="Number of node processes.")] = 2,
    rounds: RoundsOpt = None,
    config: ConfigOpt = None,
    model: ModelOpt = None,
    run_dir: RunDirOpt = Path("runs/simulate"),
    device: Annotated[str, typer.Option(help="--device of every node.")] = "cpu",
    rollout: Annotated[str, typer.Option(help="--rollout of every node: auto, batched or continuous.")] = "auto",
    dtype: Annotated[str, typer.Option(help="--dtype of every node: auto, fp32 or bf16.")] = "auto",
    eval_episodes: Annotated[Optional[int], typer.Option(
        "--eval-episodes", min=0, help="Held-out tasks on which the warm start and the final model are evaluated "
                                       "after the run, sampled and greedy, on this process's CPU (0 = no evaluation; "
                                       "default: 256 for the embedded default, 0 with --model).")] = None,
    secret_file: SecretFileOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Run the coordinator and N nodes as processes on 127.0.0.1; print the per-round table, then the warm start
    against the final model on held-out tasks."""
    from nodes.options import check_device_choice, resolve_rollout_engine

    try:  # what a node would refuse at once about its own options, refused before any process starts
        check_device_choice(device, dtype)
        resolve_rollout_engine(rollout, bf16=dtype == "bf16")
    except ValueError as e:
        typer.echo(f"composer-coordinator: error: {e}", err=True)
        raise typer.Exit(1)
    cfg, secret = _check(config, rounds, model, secret_file)  # before the heavy imports
    from composer_diloco.outer.secret import SECRET_ENV
    from coordinator.simulate import Simulation, run_simulation

    if secret is not None:  # every process it spawns inherits it (never on a command line or in the run dir)
        os.environ[SECRET_ENV] = secret.decode()
    if any(run_dir.glob("*/metrics.jsonl")):
        typer.echo(f"composer-coordinator: error: --run-dir {str(run_dir)!r} already holds a run's metrics "
                   "(pick a new folder)", err=True)
        raise typer.Exit(1)
    sim = Simulation(nodes=nodes, run_dir=run_dir, config_path=config, rounds=rounds, model=model, device=device,
                     rollout=rollout, dtype=dtype, verbose=verbose,
                     eval_episodes=eval_episodes if eval_episodes is not None else (256 if cfg.model is None else 0))
    raise typer.Exit(run_simulation(sim, cfg.rounds))


@app.command()
def status(
    peer: Annotated[list[str], typer.Option("--peer", help="Multiaddr of a peer of the run: the coordinator's `peer:` "
                                                           "line (repeatable).")],
    secret_file: SecretFileOpt = None,
    run_name: Annotated[Optional[str], typer.Option("--run-name", help="Which run (default: the only one on the "
                                                                       "DHT).")] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Redraw every 2 s until Ctrl-C.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=1.0, help="Seconds to reach a peer and read the run "
                                                                      "config before giving up.")] = 15.0,
    verbose: VerboseOpt = False,
) -> None:
    """Print the swarm as the coordinator sees it: each live peer (device, precision, round, phase, last round's
    seconds and samples, heartbeat age), the nodes setting up, the run's round, the last round's agreement and who
    was dropped or screened out. A read-only DHT client: it never counts as a node.

    Exits 1 with one line when --peer is not a multiaddr, when no peer answers within --timeout, or in a closed run
    without its secret (or with a wrong one)."""
    from composer_diloco.outer.address_form import AddressError, check_address_form
    from composer_diloco.outer.secret import SecretError, load_secret

    try:  # before the heavy imports
        for text in peer:
            check_address_form("--peer", text, peer_id=True)
        secret = load_secret(secret_file)
    except (AddressError, SecretError) as e:
        typer.echo(f"composer-coordinator: error: {e}", err=True)
        raise typer.Exit(1) from None
    import signal
    import threading

    from composer_diloco.reaper import watch_this_process
    from coordinator.status import StatusClient, StatusError, run_status

    logging.basicConfig(level=logging.DEBUG if verbose else logging.ERROR, format="%(name)s: %(message)s")
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")  # hivemind's own lines (a failed bootstrap's warning) only with --verbose
    logging.getLogger("hivemind").setLevel(logging.DEBUG if verbose else logging.CRITICAL)
    stop = threading.Event()
    if watch:  # Ctrl-C or a kill ends the redraws at the next tick, never inside a DHT read (a KeyboardInterrupt
        # there left the client's shutdown hanging in CI), then the DHT shuts down
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    else:
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill ends it as Ctrl-C does: the DHT shut down
    watch_this_process()  # the DHT client's process and p2pd die with us, even on SIGKILL
    client = StatusClient(list(peer), secret=secret, run_name=run_name, timeout_s=timeout)
    try:
        run_status(client, watch=watch, stop=stop)
    except StatusError as e:
        typer.echo(f"composer-coordinator: error: {e}", err=True)
        raise typer.Exit(1) from None


@app.command()
def plot(
    run_dir: Annotated[Path, typer.Argument(help="A run's folder, holding <peer>/metrics.jsonl files.")],
    out: Annotated[Optional[Path], typer.Option("--out", help="Folder for the PNGs (default: RUN_DIR/plots).")] = None,
) -> None:
    """Draw a run's per-round figures (reward.png, losses.png, bytes.png, sync.png); print the written paths."""
    from coordinator.plot import PlotError, plot_run

    try:
        paths = plot_run(run_dir, out)
    except (PlotError, OSError) as e:
        typer.echo(f"composer-coordinator: error: {e}", err=True)
        raise typer.Exit(1)
    for path in paths:
        typer.echo(str(path))


def main() -> int:
    """Console-script entry point."""
    from composer_diloco.lifecycle import run_cli

    return run_cli(app)


if __name__ == "__main__":
    sys.exit(main())

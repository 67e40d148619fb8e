"""`composer-node join`: one training peer of a run."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="A training node of a composer-diloco run.")
log = logging.getLogger("composer.node")


@app.callback()
def _root() -> None:
    """A training node of a composer-diloco run."""


@app.command()
def join(
    peer: Annotated[list[str], typer.Option(help="Multiaddr of a peer of the run: the coordinator's `peer:` line "
                                                 "(repeatable: any that answers; the node keeps re-dialing them "
                                                 "all, and waits up to --join-timeout for one at join).")],
    device: Annotated[str, typer.Option(help="auto, cpu or cuda:N.")] = "auto",
    dtype: Annotated[str, typer.Option(help="Training precision: auto (bf16 on a CUDA GPU that supports it, "
                                            "else fp32), fp32 or bf16 (autocast; fp32 master weights, frozen "
                                            "linear weights stored in bf16; on a CPU it rehearses a GPU run).")
                 ] = "auto",
    batch_size: Annotated[int | None, typer.Option(help="Episodes per micro-batch (one forward/backward); "
                                                        "default: the largest micro-batch that fits this node's "
                                                        "memory plan (gradient accumulation makes up the step).")
                          ] = None,
    grad_accum: Annotated[int, typer.Option(help="Micro-batches per inner step; batch-size * grad-accum episodes "
                                                 "per step must be a multiple of num_generations.")] = 1,
    env_url: Annotated[list[str], typer.Option(help="Env server URL (repeat for several, used round-robin): one of "
                                                     "this project's envs or any OpenEnv MCP tool server (detected); "
                                                     "default: start a local env server process.")] = [],
    run_dir: Annotated[Path, typer.Option(help="Where <name>/metrics.jsonl is written.")] = Path("runs/default"),
    name: Annotated[str, typer.Option(help="Unique peer name (default node-<host>-<pid>).")] = "",
    run_name: Annotated[str, typer.Option(help="Run to join when the DHT holds several.")] = "",
    join_timeout: Annotated[float, typer.Option(help="Seconds to wait for the DHT, the run config and a peer "
                                                     "that sends the global model's manifest.")] = 30.0,
    join_deadline: Annotated[str, typer.Option(help="Seconds the global model's download may take at join, or "
                                                    "auto: --join-timeout plus the bytes to move at the run's "
                                                    "[network] state_min_rate_mb_s.")] = "auto",
    state_chunk_size: Annotated[str, typer.Option(help="Bytes per chunk of a state download (each chunk is "
                                                       "retried on its own), e.g. 8MiB; 64KiB to 256MiB.")] = "8MiB",
    secret_file: Annotated[Path | None, typer.Option(help="File holding a closed run's secret (default: "
                                                          "$COMPOSER_DILOCO_SECRET; neither: an open run).")] = None,
    config: Annotated[Path | None, typer.Option(help="The run config (TOML) this node agreed to: it refuses to join "
                                                     "a run whose published config differs.")] = None,
    env_sessions: Annotated[int | None, typer.Option(
        help="Most env sessions (episodes at once) per --env-url; the step's other episodes wait for a free one. "
             "Default: the run config's env.sessions_per_url, else one per episode of a step within each server's "
             "capacity (learnt from OpenEnv's 'Server at capacity: n/n').")] = None,
    task_shard: Annotated[str | None, typer.Option(
        help="K/N: take shard K of N of the rows of the run's task dataset (tasks.path; 0 <= K < N), like a rank and world size. "
             "Default: the node's own seeded order of all rows (rows may repeat across nodes).")] = None,
    listen: Annotated[str | None, typer.Option(
        help="Multiaddr to listen on, e.g. /ip4/0.0.0.0/tcp/4001 (default: 127.0.0.1, a free port: reachable only "
             "from this machine; nodes on other machines must be able to dial every node).")] = None,
    announce: Annotated[list[str], typer.Option(help="Multiaddr other machines dial (repeatable).")] = [],
    gradient_checkpointing: Annotated[bool, typer.Option(
        "--gradient-checkpointing", help="Recompute each layer's activations in backward: less activation memory "
                                         "(see the memory plan logged at start), about a third more compute.")] = False,
    rollout: Annotated[str, typer.Option(
        help="How episodes decode: continuous (transformers continuous batching: a turn that ends goes to its env "
             "while the other episodes keep decoding; fp32 nodes only), batched (one generate() per turn of all "
             "episodes, reproducible), or auto: batched (as fast on an H200, faster on a CPU).")] = "auto",
    standby: Annotated[bool, typer.Option(
        "--standby", help="Run as this node's warm standby (same --run-dir and --name, beside it on its machine): "
                          "import everything, start its env server and build its policy now, then wait; each time "
                          "the node's process ends (a crash, an OOM kill, SIGKILL) fork its next life, same peer ID, "
                          "without a restart's seconds, and stand by that one too. Exits 0 when the node finishes "
                          "the run. See nodes/standby.py.")
    ] = False,
    with_standby: Annotated[bool, typer.Option(
        "--with-standby", help="Run the node under its warm standby, in one command: this process takes the node's "
                               "folder, imports everything, forks the node's first life at once and then stands by "
                               "it as --standby does (one set of imports per node instead of two at the run's "
                               "start). See nodes/standby.py.")
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    """Join a run, train until its last round, and exit 0.

    Exits 1 with one line on an error, or when no episode of any of its rounds produced a parsed tool call
    ("trained on nothing: ..."); 130 when stopped by a signal."""
    from nodes.options import NodeOptions

    options = NodeOptions(peer=peer, device=device, dtype=dtype, batch_size=batch_size, grad_accum=grad_accum,
                          env_urls=list(env_url), run_dir=run_dir, name=name,
                          run_name=run_name or None, join_timeout_s=join_timeout, secret_file=secret_file,
                          expected_config=config, env_sessions=env_sessions, task_shard=task_shard,
                          listen=listen, announce=list(announce), gradient_checkpointing=gradient_checkpointing,
                          join_deadline=join_deadline, state_chunk_size=state_chunk_size, rollout=rollout)
    if standby and with_standby:
        typer.echo("composer-node: error: --standby and --with-standby exclude each other: --standby stands by a node "
                   "started by its own command, --with-standby starts the node itself", err=True)
        raise typer.Exit(1)
    if (standby or with_standby) and not name:
        flag = "--standby" if standby else "--with-standby"
        typer.echo(f"composer-node: error: {flag} needs the --name of the node it stands by (and its --run-dir): "
                   "every life of the node must be the same peer", err=True)
        raise typer.Exit(1)
    try:  # what the options alone can get wrong fails here, in a fraction of a second, before torch is imported
        options.check()
    except ValueError as e:  # every error of check() is one (ConfigError and SecretError included)
        typer.echo(f"composer-node: error: {e}", err=True)
        raise typer.Exit(1)

    own_dir = Path(options.run_dir) / options.name
    if standby:  # is the node it stands by running? Looked at before the imports, which take seconds
        from nodes.standby import StandbyStart

        standby_start = StandbyStart.now(own_dir)
    else:  # the node's folder first, before the imports: a standby started beside it sees it held from now on
        # (--with-standby: this process holds it until it forks the node's first life, which it hands it to)
        from composer_diloco.outer.identity import IDENTITY_FILE, IdentityError, load_or_create_identity
        from nodes.folder_lock import NodeBusy, lock_node_folder

        try:
            folder_lock = lock_node_folder(own_dir, options.name, options.run_dir)
            # a bad key fails here too, in one line: reading it imports hivemind (~4 s of CPU), not the ~13 s of
            # the node's whole stack (its own folder's key: nobody else writes it while we hold the folder)
            load_or_create_identity(own_dir / IDENTITY_FILE, create=False)
        except (NodeBusy, IdentityError, OSError) as e:
            typer.echo(f"composer-node: error: {e}", err=True)
            raise typer.Exit(1)

    from composer_diloco.lifecycle import GracefulStop, setup_logging
    from composer_diloco.reaper import watch_this_process
    from nodes import node as _  # noqa: F401 - imported here, so a standby's forked lives find it imported

    setup_logging(options.name, verbose)
    stop = GracefulStop().install()
    watch_this_process()  # hivemind's DHT/averager processes and p2pd die with us, even on SIGKILL
    if standby or with_standby:  # fork each life of the node (with --standby: each one after its process's end)
        from nodes.node import process_started
        from nodes.standby import Standby, StandbyStart

        started = process_started()  # the first life's join counts from here: the command's start, imports included
        waiting = Standby(own_dir, stop, own_env_server=not options.env_urls, alone_after_s=join_timeout,
                          start=standby_start if standby else StandbyStart(time.time(), held=False),
                          first_life_lock=None if standby else folder_lock)

        def life(lock, prepared, life_stop) -> int:
            if waiting.starting_first_life:  # a fork of this process copies the flag: True in the first life only
                return _node_life(options, life_stop, verbose, lock, None, taken_over=False, started=started)
            return _node_life(options, life_stop, verbose, lock, prepared, taken_over=True)

        raise typer.Exit(waiting.run_lives(life))
    raise typer.Exit(_node_life(options, stop, verbose, folder_lock, None, taken_over=False))


def _node_life(options, stop, verbose: bool, lock, prepared, *, taken_over: bool, started: float | None = None) -> int:
    """One life of the node: join, train until the run's last round, leave; returns the exit code (0: the run
    finished, 130: stopped by a signal, 1: an error, its one line on stderr).

    Args:
        options: the `nodes.options.NodeOptions`; stop: this process's `GracefulStop`.
        lock: the node's folder lock, held (`nodes.folder_lock`), released when the life ends.
        prepared: what a standby built for it (`nodes.standby.Prepared`), or None.
        taken_over: a standby's takeover (its join's seconds count from now, `nodes.node.Node.take_over`), not a
            process started by the command line.
        started: when the command that started this life began (time.time()), for a first life forked by its
            standby (``--with-standby``): its join's ``imports`` count from there, not from the fork. None: this
            process's own start.
    """
    from nodes.node import Node, TrainedOnNothing

    node = Node(options, stop, started=started)
    if taken_over:
        node.take_over(lock, prepared)
    else:
        node.hold_folder(lock)
    code = 0
    try:
        node.join()
        rounds = node.train()
        if stop.event.is_set():
            log.info("stopped by signal after %d round(s)", rounds)
            code = 130
        else:
            from nodes.standby import mark_finished

            mark_finished(node.own_dir, rounds)  # its standby, if any, exits 0 instead of taking over
            log.info("run finished: took part in %d round(s)", rounds)
    except Exception as e:  # every failure: one line naming the cause, non-zero exit
        if verbose:
            log.exception("node failed")
        typer.echo(f"composer-node: error: {e}", err=True)
        code = 1
        if isinstance(e, TrainedOnNothing):  # the run is over: its standby, if any, exits 1 too, not taking over
            from nodes.standby import mark_finished

            mark_finished(node.own_dir, node.peer.round, error=str(e))
    finally:
        node.close()
    return code


def main() -> int:
    """Console-script entry point."""
    from composer_diloco.lifecycle import run_cli

    return run_cli(app)


if __name__ == "__main__":
    sys.exit(main())

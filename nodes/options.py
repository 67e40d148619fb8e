"""`composer-node join`'s options, and the checks that need nothing but the options themselves.

`NodeOptions.check` runs in the command line before torch, transformers, TRL and hivemind are imported (5-8 s of
CPU), so a mistyped ``--dtype`` or ``--task-shard`` costs a fraction of a second. What needs the machine (a GPU
index, bf16 support) or the run (G, the memory plan) is checked later by `nodes.device` and `nodes.node.Node.join`,
still before the node touches the network.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from composer_diloco.config import RunConfig, load_config
from composer_diloco.outer.address_form import check_address_form, check_listen_and_announce
from composer_diloco.outer.secret import load_secret
from composer_diloco.rollout.task_shard import TaskShard

DTYPES = ("auto", "fp32", "bf16")
ROLLOUT_ENGINES = {
    "batched": "lock-step batches, one transformers generate() per assistant turn, KV kept across turns",
    "continuous": "transformers continuous batching: a turn that ends goes to its env while the others decode",
}
"""The engines ``--rollout`` can pick (`composer_diloco.rollout.play.play_episodes`); ``auto``:
`resolve_rollout_engine`."""
ROLLOUTS = ("auto", *ROLLOUT_ENGINES)


class DeviceError(ValueError):
    """``--device`` / ``--dtype`` name a device or precision this machine does not have."""


class BatchError(ValueError):
    """``--batch-size`` / ``--grad-accum`` cannot form whole GRPO groups, or are not positive."""


class OptionError(ValueError):
    """A ``composer-node join`` option with a value of the wrong form (``--env-sessions``, ``--env-url``)."""


def check_device_choice(choice: str, dtype: str) -> str:
    """The form of ``--device`` / ``--dtype``, before anything about the machine is known.

    Returns:
        The GPU index of a ``cuda`` / ``cuda:N`` choice as a string ("0" for plain ``cuda``), "" for auto and cpu.
    Raises:
        DeviceError: ``dtype`` is not one of `DTYPES`, or ``choice`` is not auto, cpu, cuda or cuda:N.
    """
    if dtype not in DTYPES:
        raise DeviceError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if choice in ("auto", "cpu"):
        return ""
    if not choice.startswith("cuda"):
        raise DeviceError(f"--device {choice!r} is not one of auto, cpu, cuda:N")
    index = choice.partition(":")[2] or "0"
    if not index.isdigit() or choice[4:] not in ("", f":{index}"):
        raise DeviceError(f"--device {choice!r}: expected cuda:N with N a GPU index")
    return index


def check_batch_options(batch_size: int | None, grad_accum: int) -> None:
    """Check ``--batch-size`` / ``--grad-accum`` on their own (before the run config is known).

    Raises:
        BatchError: ``batch_size`` (when given) or ``grad_accum`` is below 1.
    """
    if batch_size is not None and batch_size < 1:
        raise BatchError(f"--batch-size {batch_size}: expected a number of episodes >= 1")
    if grad_accum < 1:
        raise BatchError(f"--grad-accum {grad_accum}: expected a number of micro-batches >= 1")


_BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
STATE_CHUNK_RANGE = (64 * 2**10, 256 * 2**20)
"""Bytes a ``--state-chunk-size`` may ask for: 64 KiB to 256 MiB (a serving peer clamps to the same range)."""


def parse_join_deadline(text: str) -> float | None:
    """``--join-deadline``: ``auto`` (None: derived from the state's size, `state_transfer.download_deadline_s`) or a
    number of seconds > 0.

    Raises:
        OptionError: anything else (one line naming the value).
    """
    if text.strip().lower() == "auto":
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise OptionError(f"--join-deadline {text!r}: expected seconds > 0 (e.g. 900), or auto (the state's size at "
                          "the run's state_min_rate_mb_s)")
    return seconds


def parse_chunk_size(text: str) -> int:
    """``--state-chunk-size``: bytes per chunk of a state download, a number with an optional unit (B, KB, MB, GB,
    KiB, MiB, GiB; e.g. ``8MiB``), within `STATE_CHUNK_RANGE`.

    Raises:
        OptionError: another form, or a size out of range (one line naming the value).
    """
    t = text.strip().lower().replace(" ", "")
    digits = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(digits):] or "b"
    try:
        size = int(float(digits) * _BYTE_UNITS[unit])
    except (ValueError, KeyError):
        raise OptionError(f"--state-chunk-size {text!r}: expected a size such as 8MiB, 4MB or 1048576 "
                          "(units B, KB, MB, GB, KiB, MiB, GiB)") from None
    low, high = STATE_CHUNK_RANGE
    if not low <= size <= high:
        raise OptionError(f"--state-chunk-size {text!r} is {size} bytes: expected 64KiB to 256MiB")
    return size


def resolve_rollout_engine(choice: str, *, bf16: bool) -> str:
    """``--rollout``'s engine for a node that trains in bf16 (``bf16``) or fp32.

    ``auto`` is ``batched``: it was as fast as continuous batching on an H200 in fp32 (267 against 268 generated
    tokens a second, Qwen3-0.6B LoRA, 16 episodes), faster on the CPU (BENCHMARKS.md section 9), and keeps a run's
    sampled tokens, so its theta, the same run after run. ``continuous`` runs in fp32 only: transformers' paged KV
    cache holds one dtype, and under bf16 autocast Qwen3's keys come out of their fp32 norm in fp32, its values in
    bf16.

    Raises:
        OptionError: ``choice`` is not one of `ROLLOUTS`, or ``continuous`` on a bf16 node (one line: use
            ``--dtype fp32`` or ``--rollout batched``).
    """
    if choice not in ROLLOUTS:
        raise OptionError(f"--rollout {choice!r}: expected one of {', '.join(ROLLOUTS)}")
    if choice == "continuous" and bf16:
        raise OptionError("--rollout continuous on a bf16 node: transformers' paged KV cache holds one dtype and "
                          "under bf16 autocast the keys and values come out in fp32 and bf16; use --dtype fp32 or "
                          "--rollout batched")
    return "batched" if choice == "auto" else choice


@dataclass(frozen=True)
class CheckedOptions:
    """What `NodeOptions.check` parsed: the ``--task-shard`` (None: not given), the ``--config`` the node agreed to
    (None: not given), the run secret (None: an open run), the ``--join-deadline`` in seconds (None: derived from
    the state's size) and the ``--state-chunk-size`` in bytes."""

    shard: TaskShard | None
    expected_config: RunConfig | None
    secret: bytes | None
    join_deadline_s: float | None = None
    state_chunk_bytes: int = 8 * 2**20


@dataclass
class NodeOptions:
    """The `composer-node join` options.

    Attributes:
        peer: multiaddr of any peer of the run (usually the coordinator's ``peer:`` line), or several (``--peer``
            repeated): the node bootstraps from whichever answers, and keeps re-dialing them all (`peers`).
        device: "auto", "cpu" or "cuda:N".
        dtype: training precision, "auto" (bf16 on a CUDA GPU with native bf16, else fp32), "fp32" or "bf16".
        batch_size: episodes per micro-batch (one forward/backward); None = the run's tasks_per_step * G.
        grad_accum: micro-batches per inner (optimizer) step; batch_size * grad_accum episodes per inner step
            must be a multiple of the run's G (`nodes.device.NodeBatch`).
        env_urls: env server URLs to use round-robin; empty = start a local env server process.
        run_dir: where ``<name>/metrics.jsonl`` goes.
        name: this peer's unique name (default ``node-<host>-<pid>``).
        run_name: which run of the DHT to join (needed only when several runs share it).
        join_timeout_s: seconds to wait for each ``--env-url``'s ``/health``, the DHT and the run config.
        secret_file: file holding a closed run's secret (None: ``$COMPOSER_DILOCO_SECRET``, else an open run).
        expected_config: a TOML run config; joining a run whose published config differs is refused.
        env_sessions: most env sessions (episodes at once) per ``--env-url``; None = the run's
            ``[env] sessions_per_url``, else as many as a step has episodes within each server's capacity.
        task_shard: ``"K/N"``: this node takes shard K of N of the run's ``[tasks]`` rows (`TaskShard`); None = its own
            seeded order of all rows.
        listen: multiaddr this node's DHT and averager listen on (None: 127.0.0.1, a free port).
        announce: multiaddrs other machines dial to reach it (empty: what it listens on).
        gradient_checkpointing: recompute each decoder layer's activations in backward (TRL's
            ``gradient_checkpointing``; less activation memory, about a third more training compute; the same loss).
        join_deadline: seconds the global model's download may take at join, or ``auto`` (`parse_join_deadline`).
        state_chunk_size: bytes per chunk of a state download, e.g. ``8MiB`` (`parse_chunk_size`).
        rollout: how episodes decode, one of `ROLLOUTS` (`resolve_rollout_engine`).
    """

    peer: str | list[str]
    device: str = "auto"
    dtype: str = "auto"
    batch_size: int | None = None
    grad_accum: int = 1
    env_urls: list[str] = field(default_factory=list)
    run_dir: Path = Path("runs/default")
    name: str = ""
    run_name: str | None = None
    join_timeout_s: float = 30.0
    secret_file: Path | None = None
    expected_config: Path | None = None
    env_sessions: int | None = None
    task_shard: str | None = None
    listen: str | None = None
    announce: list[str] = field(default_factory=list)
    gradient_checkpointing: bool = False
    join_deadline: str = "auto"
    state_chunk_size: str = "8MiB"
    rollout: str = "auto"

    def __post_init__(self) -> None:
        if not self.name:
            self.name = f"node-{socket.gethostname()}-{os.getpid()}"

    @property
    def peers(self) -> list[str]:
        """Every ``--peer``, in the order given."""
        return [self.peer] if isinstance(self.peer, str) else list(self.peer)

    def check(self) -> CheckedOptions:
        """Check every option the node can judge alone, and read ``--config`` and the run secret; imports nothing
        heavy and opens no connection. The command line runs it before the heavy imports; `Node.join` uses what it
        returns.

        Raises:
            AddressError (the form of ``--peer`` / ``--listen`` / ``--announce``) / DeviceError / BatchError /
            OptionError (``--env-url``, ``--join-deadline``, ``--state-chunk-size`` ...) / ValueError
            (``--task-shard``) / ConfigError (``--config``) / SecretError: one line naming the option, its value and
            what was expected.
        """
        if not self.peers:
            raise OptionError("--peer: expected at least one multiaddr of a peer of the run (the coordinator's peer: "
                              "line)")
        for peer in self.peers:
            check_address_form("--peer", peer, peer_id=True)
        check_listen_and_announce(self.listen, self.announce)
        check_device_choice(self.device, self.dtype)
        check_batch_options(self.batch_size, self.grad_accum)
        if self.env_sessions is not None and self.env_sessions < 1:
            raise OptionError(f"--env-sessions {self.env_sessions}: expected at least 1 session per env URL")
        for url in self.env_urls:
            if not url.startswith(("http://", "https://")):
                raise OptionError(f"--env-url {url!r} is not a URL: expected http://HOST:PORT (or https://)")
        resolve_rollout_engine(self.rollout, bf16=self.dtype == "bf16")  # --dtype auto: checked again at join
        if self.join_timeout_s <= 0:
            raise OptionError(f"--join-timeout {self.join_timeout_s}: expected seconds > 0")
        deadline, chunk = parse_join_deadline(self.join_deadline), parse_chunk_size(self.state_chunk_size)
        shard, secret = TaskShard.parse(self.task_shard) if self.task_shard else None, load_secret(self.secret_file)
        # the config last: one that sets [loss] keys imports the loss channels (torch) to check them
        return CheckedOptions(shard=shard, secret=secret, join_deadline_s=deadline, state_chunk_bytes=chunk,
                              expected_config=load_config(self.expected_config) if self.expected_config else None)

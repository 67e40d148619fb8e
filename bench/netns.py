"""Throttled links for benchmarks: two Linux network namespaces joined by a veth pair (root only).

Each end of the veth pair is rate-limited on egress with ``tc qdisc add dev X root tbf rate R burst B latency L``,
so both directions carry at most R bit/s. This kernel has no ``netem``, so a fixed one-way delay, when asked for,
comes from `DelayProxy`: a userspace TCP proxy in front of each peer's listening port that holds every chunk it
forwards for ``delay_ms`` before writing it on, in order, in both directions. A connection between the two peers
goes through exactly one proxy (the dialled peer's), whichever side dials, so the application sees a round trip of
``2 * delay_ms`` plus the link's own. What it does not emulate: the kernel TCP of each hop sees the short RTT of
its own hop (TCP windows and slow start do not feel the delay); application-level flow control (libp2p's yamux
stream windows, request/reply protocols) does, as over a real long link.

Used by ``bench/sync_cost.py``; the proxy also runs on its own inside a namespace::

    ip netns exec NS python bench/netns.py proxy --listen 10.77.0.1:4000 --upstream 127.0.0.1:4001 --delay-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PROXY_PORT = 4000  # inside a namespace nothing else listens: fixed ports are safe there
UPSTREAM_PORT = 4001
_CHUNK_BYTES = 64 * 1024
_QUEUE_CHUNKS = 256  # at most 16 MiB held per direction of one proxied connection


class NetnsError(RuntimeError):
    """A namespace, veth or qdisc command failed (the message carries the command and its stderr)."""


@dataclass(frozen=True)
class LinkSpec:
    """One network condition between the two peers.

    Attributes:
        name: as given on the command line: ``loopback``, ``1gbit``, ``100mbit``, ``100mbit+20ms``.
        rate_bit_s: tbf rate in bit/s on each direction (None = loopback, not shaped).
        delay_ms: added one-way delay in milliseconds (0 = none; needs `DelayProxy`).
    """

    name: str
    rate_bit_s: int | None
    delay_ms: float = 0.0

    @property
    def namespaced(self) -> bool:
        """True when the peers run in two namespaces over a veth pair (anything but ``loopback``)."""
        return self.rate_bit_s is not None

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """``loopback`` or ``RATE[+DELAYms]`` with RATE like ``1gbit``, ``100mbit``, ``500kbit``.

        Raises:
            ValueError: naming the text when it is neither.
        """
        if text == "loopback":
            return cls(text, None)
        m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)bit(?:\+(\d+(?:\.\d+)?)ms)?", text.lower())
        if not m:
            raise ValueError(f"link {text!r} is not 'loopback' or RATE[+DELAYms] such as '100mbit' or '100mbit+20ms'")
        rate = float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
        return cls(text, int(rate), float(m.group(3) or 0.0))


def netns_unusable_reason() -> str | None:
    """Why namespaces cannot be used here (not root, no ``ip``/``tc``), or None when they can."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command"
    return None


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` exited {result.returncode}: {result.stderr.strip()}")


class Link:
    """Two namespaces ``{prefix}a`` / ``{prefix}b`` joined by a veth pair, shaped with tbf; a context manager.

    Addresses: ``10.77.{octet}.1`` in a, ``.2`` in b (a /30, private to the two namespaces). ``close`` deletes
    both namespaces (which removes the veth pair with them); it is idempotent and also runs when setup fails
    half-way.

    Args:
        spec: the rate (and delay) of the link; must be namespaced.
        prefix: unique prefix of the namespace and interface names (at most 10 characters: IFNAMSIZ).
        octet: third octet of the subnet, 0-255.
    """

    def __init__(self, spec: LinkSpec, *, prefix: str, octet: int = 0):
        if not spec.namespaced:
            raise ValueError("Link needs a rate; loopback runs without namespaces")
        if len(prefix) > 10:
            raise ValueError(f"prefix {prefix!r} is longer than 10 characters (interface names max 15)")
        self.spec = spec
        self.namespaces = (f"{prefix}a", f"{prefix}b")
        self.addresses = (f"10.77.{octet}.1", f"10.77.{octet}.2")
        self._created: list[str] = []

    def __enter__(self) -> Link:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Create the namespaces, the veth pair, the addresses and the tbf qdiscs. Raises NetnsError."""
        rate = self.spec.rate_bit_s
        assert rate is not None
        # tbf needs a bucket of at least one (GSO) packet; 10 ms of the rate keeps short bursts near the rate
        burst_bytes = max(64 * 1024, rate // 8 // 100)
        veth = [f"{ns}0" for ns in self.namespaces]
        for ns in self.namespaces:
            _run(["ip", "netns", "add", ns])
            self._created.append(ns)
        _run(["ip", "link", "add", veth[0], "netns", self.namespaces[0], "type", "veth",
              "peer", "name", veth[1], "netns", self.namespaces[1]])
        for ns, dev, addr in zip(self.namespaces, veth, self.addresses):
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate}bit",
                  "burst", str(burst_bytes), "latency", "400ms"])

    def wrap(self, side: int, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``side`` (0 = a, 1 = b)."""
        return ["ip", "netns", "exec", self.namespaces[side], *argv]

    def close(self) -> None:
        """Delete the namespaces this link created (and with them the veth pair). Idempotent."""
        while self._created:
            ns = self._created.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# ------------------------------------------------------------------------------------------------------------
# Delay proxy
# ------------------------------------------------------------------------------------------------------------


async def _delayed_pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk written ``delay_s`` seconds after it was read, in order."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=_QUEUE_CHUNKS)

    async def pump() -> None:
        while True:
            data = await reader.read(_CHUNK_BYTES)
            await queue.put((loop.time() + delay_s, data))
            if not data:  # EOF travels with the same delay
                return

    async def drain() -> None:
        while True:
            due, data = await queue.get()
            wait_s = due - loop.time()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    await asyncio.gather(pump(), drain())


async def _serve_connection(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, upstream: tuple[str, int],
                            delay_s: float) -> None:
    try:
        up_r, up_w = await asyncio.open_connection(*upstream)
    except OSError:
        client_w.close()
        return
    tasks = [asyncio.ensure_future(_delayed_pipe(client_r, up_w, delay_s)),
             asyncio.ensure_future(_delayed_pipe(up_r, client_w, delay_s))]
    try:
        # both directions end on EOF; a reset in either one ends the connection
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if any(t.exception() is not None for t in done):
            for t in pending:
                t.cancel()
    finally:
        for t in tasks:
            t.cancel()
        for w in (client_w, up_w):
            w.close()


async def serve_delay_proxy(listen: tuple[str, int], upstream: tuple[str, int], delay_ms: float) -> None:
    """Accept TCP on ``listen`` and forward each connection to ``upstream`` with ``delay_ms`` (ms) each way."""
    server = await asyncio.start_server(
        lambda r, w: _serve_connection(r, w, upstream, delay_ms / 1000.0), *listen, reuse_address=True
    )
    async with server:
        await server.serve_forever()


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def start_proxy(link: Link, side: int, log_path: Path) -> subprocess.Popen:
    """Start the delay proxy of namespace ``side``: ``{address}:PROXY_PORT`` -> ``127.0.0.1:UPSTREAM_PORT``.

    The process leads its own session (stop it with `stop_process`). Its output goes to ``log_path``.
    """
    argv = [sys.executable, str(Path(__file__).resolve()), "proxy", "--listen",
            f"{link.addresses[side]}:{PROXY_PORT}", "--upstream", f"127.0.0.1:{UPSTREAM_PORT}",
            "--delay-ms", str(link.spec.delay_ms)]
    with open(log_path, "ab") as log:
        return subprocess.Popen(link.wrap(side, argv), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_process(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the process group that ``proc`` leads, then SIGKILL it after ``grace_s`` seconds. Idempotent."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    # children of the group that outlive their leader (p2pd, hivemind's averager process)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description="TCP proxy adding a fixed one-way delay in both directions.")
    sub = parser.add_subparsers(dest="command", required=True)
    proxy = sub.add_parser("proxy")
    proxy.add_argument("--listen", required=True, help="HOST:PORT to accept on")
    proxy.add_argument("--upstream", required=True, help="HOST:PORT to forward to")
    proxy.add_argument("--delay-ms", type=float, required=True, help="added one-way delay, milliseconds")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    asyncio.run(serve_delay_proxy(_hostport(args.listen), _hostport(args.upstream), args.delay_ms))


if __name__ == "__main__":
    main()

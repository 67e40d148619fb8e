"""The form of the multiaddrs a user types (``--peer``, ``--listen``, ``--announce``), checked without hivemind.

Its own module, free of hivemind, so that the command lines refuse ``--peer localhost:4000`` in a fraction of a second,
before the heavy imports. It checks only what a mistyped address gets wrong (no leading ``/``, a missing or an extra
``/p2p/<peer id>``); `composer_diloco.outer.swarm` then parses the whole address with hivemind's multiaddr.
"""

from __future__ import annotations

PEER_EXAMPLE = "/ip4/127.0.0.1/tcp/4000/p2p/12D3KooW..."
LISTEN_EXAMPLE = "/ip4/0.0.0.0/tcp/4000"


class AddressError(ValueError):
    """A ``--peer``, ``--listen`` or ``--announce`` value that is not a multiaddr of the expected kind."""


def check_address_form(option: str, text: str, *, peer_id: bool) -> None:
    """Check that ``text`` looks like a multiaddr: it starts with ``/`` and carries a ``/p2p/<peer id>`` part exactly
    when ``peer_id`` (``--peer`` names whom to dial; ``--listen`` / ``--announce`` only where).

    Raises:
        AddressError: one line naming ``option`` and ``text``, with an example of what is expected.
    """
    example = PEER_EXAMPLE if peer_id else LISTEN_EXAMPLE
    if not text.startswith("/"):
        raise AddressError(f"{option} {text!r} is not a multiaddr (expected e.g. {example})")
    names_peer = "/p2p/" in text or "/ipfs/" in text
    if peer_id and not names_peer:
        raise AddressError(f"{option} {text!r} has no /p2p/<peer id> part (copy the whole `peer:` line)")
    if not peer_id and names_peer:
        raise AddressError(f"{option} {text!r} names a peer id: expected only an address, e.g. {example}")


def check_listen_and_announce(listen: str | None, announce: list[str]) -> None:
    """`check_address_form` for ``--listen`` (when given) and every ``--announce``.

    Raises:
        AddressError: naming the first bad value.
    """
    if listen is not None:
        check_address_form("--listen", listen, peer_id=False)
    for text in announce:
        check_address_form("--announce", text, peer_id=False)

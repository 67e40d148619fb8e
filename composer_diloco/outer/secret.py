"""The run secret of a closed run (`composer_diloco.outer.auth`): where it is read from and what it must be.

Its own module, free of hivemind and torch, so that the command lines refuse a bad secret in a fraction of a second,
before the heavy imports.
"""

from __future__ import annotations

import os
from pathlib import Path

SECRET_ENV = "COMPOSER_DILOCO_SECRET"
MIN_SECRET_CHARS = 16


class SecretError(ValueError):
    """The run secret is unreadable, empty or too short (the message names the file or the variable)."""


def load_secret(secret_file: Path | None) -> bytes | None:
    """The run secret: the content of ``secret_file`` (stripped), else ``$COMPOSER_DILOCO_SECRET``, else None.

    Args:
        secret_file: path of a UTF-8 text file holding the secret (``--secret-file``); None to use the variable.
    Returns:
        The secret as bytes, or None for an open run (no file given and the variable unset).
    Raises:
        SecretError: the file cannot be read or is not UTF-8 text, or the secret is empty or shorter than
            ``MIN_SECRET_CHARS`` characters. The message names the file or the variable, never the secret.
    """
    if secret_file is not None:
        where = f"--secret-file {str(secret_file)!r}"
        try:
            text = Path(secret_file).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise SecretError(f"{where} is not UTF-8 text") from None
        except OSError as e:
            raise SecretError(f"{where} cannot be read: {e.strerror or e}") from None
    elif SECRET_ENV in os.environ:
        where, text = SECRET_ENV, os.environ[SECRET_ENV]
    else:
        return None
    secret = text.strip()
    if not secret:
        raise SecretError(f"{where} holds an empty run secret (unset it for an open run)")
    if len(secret) < MIN_SECRET_CHARS:
        raise SecretError(f"{where} holds a run secret shorter than {MIN_SECRET_CHARS} characters "
                          "(make one with: openssl rand -hex 16)")
    return secret.encode()

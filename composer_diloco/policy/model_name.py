"""What ``--model`` names: a local ``save_pretrained`` folder or a Hugging Face Hub id, told apart without importing
transformers, so that a mistyped folder is refused before the heavy imports (`check_model_name`)."""

from __future__ import annotations

from pathlib import Path

from composer_diloco.policy.errors import PolicyLoadError


def check_model_name(value: str) -> Path | None:
    """Tell what ``--model`` names, as ``from_pretrained`` would: an existing path is a local folder, which must hold a
    ``config.json``; anything else must read as a Hub id (``org/name``), not as a path.

    Returns:
        The local folder (``~`` expanded), or None for a Hub id (whether it exists is known only when it loads).
    Raises:
        PolicyLoadError: one line naming ``value``: an existing path that is not a model folder, or a path (absolute,
            starting with ``.`` or ``~``, or with more than one ``/``) that does not exist.
    """
    path = Path(value).expanduser()
    if path.exists():
        if not (path.is_dir() and (path / "config.json").is_file()):
            raise PolicyLoadError(f"policy {value!r}: expected a model directory with config.json "
                                  "(save_pretrained layout)")
        return path
    if path.is_absolute() or value.startswith((".", "~")) or value.count("/") > 1 or "\\" in value:
        raise PolicyLoadError(f"policy {value!r}: no such directory (expected a save_pretrained model "
                              "directory or a Hugging Face Hub id like 'org/name')")
    return None

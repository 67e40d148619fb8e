"""Atomic checkpoints of the canonical global model: ``<run-dir>/checkpoints/round-NNNNNN/``.

A checkpoint named ``round-000003`` holds theta after 3 outer steps (the next round to train is 3):
``save_pretrained`` files of the policy and its tokenizer, plus ``outer.pt`` (round, parameter names, the outer
optimizer's ``state_dict`` and class, theta's SHA-256, the run config). In a ``[lora]`` run the policy is a
``peft.PeftModel``, so the ``save_pretrained`` files are a PEFT adapter folder (``adapter_config.json``,
``adapter_model.safetensors``: ``PeftModel.from_pretrained(base, folder)`` loads it) and ``outer.pt`` also records the
base model's ``base_sha256`` (`composer_diloco.policy.lora`). It is written into a temporary sibling folder and renamed into place, and
``checkpoints/latest`` is replaced atomically after that, so a process killed while writing leaves the previous
checkpoint as the latest loadable one.

With a codec that keeps error feedback (``sparse-2bit``, ``shared-blocks``) a node also has codec state of its own, its error-feedback buffer
(`composer_diloco.outer.sparse.ErrorFeedback`): the part of its pseudo-gradients the swarm has not received yet. It is
not global state (the coordinator holds none), so it lives beside the node's metrics, in
``<run-dir>/<node>/codec_state.pt`` (`save_codec_state` every ``checkpoint_every`` rounds, read back by a node that
restarts under the same name, `load_codec_state`), and in ``outer.pt`` under ``codec_state`` of a checkpoint a node
writes itself (`save_checkpoint`'s ``codec_state``, `read_codec_state`).
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import torch

from composer_diloco import faults
from composer_diloco.outer.global_model import GlobalModel


class CheckpointError(RuntimeError):
    """A checkpoint is missing or unreadable."""


def checkpoint_dir(run_dir: Path) -> Path:
    """``<run_dir>/checkpoints``: where the ``round-NNNNNN`` folders and the ``latest`` pointer live."""
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: Path, round_: int, model: Any, tokenizer: Any, global_model: GlobalModel,
                    config_json: str, codec_state: dict[str, Any] | None = None,
                    model_sha256: str | None = None) -> Path:
    """Write theta_round (and the outer optimizer state) atomically; returns the checkpoint folder.

    Args:
        run_dir: the run's directory.
        round_: outer steps taken so far.
        model: a policy of the run's architecture (its weights are overwritten with theta, on CPU); a
            ``peft.PeftModel`` saves its adapters only.
        tokenizer: saved beside the weights.
        global_model: theta and the outer optimizer (`GlobalModel.checkpoint_state`).
        config_json: the run config (canonical JSON) recorded with the checkpoint.
        codec_state: a node's codec state (`composer_diloco.outer.peer.DiLoCoPeer.codec_state`: the sparse codec's
            error feedback), stored under ``codec_state``; None stores nothing.
        model_sha256: a full-fine-tuning run's base: `composer_diloco.policy.lora.base_sha256` of the ``--model``
            weights theta started from, stored under ``model_sha256`` so that a resumed coordinator still tells
            joiners which base they must hold (`composer_diloco.outer.state_transfer`); None stores nothing.
    Raises:
        OSError: the run dir cannot be written.
    """
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"round-{round_:06d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    global_model.load_into(model)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    base = _lora_base_sha256(model)
    torch.save({
        "round": round_,
        "names": global_model.names,
        **global_model.checkpoint_state(),
        "global_sha256": global_model.sha256(),
        "config": config_json,
        **({"base_sha256": base} if base is not None else {}),
        **({"codec_state": codec_state} if codec_state is not None else {}),
        **({"model_sha256": model_sha256} if model_sha256 is not None else {}),
    }, tmp / "outer.pt")
    _fsync_tree(tmp)
    faults.point("checkpoint_written", round_)
    old = None
    if final.exists():  # a re-save of the same round: move the old copy aside first, delete it after the swap
        old = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    write_atomic(root / "latest", final.name)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint folder, or None when the run has none."""
    root = checkpoint_dir(run_dir)
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / "outer.pt").is_file():
            return candidate
    complete = sorted(p for p in root.glob("round-*") if (p / "outer.pt").is_file())
    return complete[-1] if complete else None


def read_outer_state(folder: Path) -> dict[str, Any]:
    """``outer.pt`` of a checkpoint: round, names, the outer optimizer's state, global_sha256, config (and
    ``base_sha256`` of a LoRA run, ``model_sha256`` of a full-fine-tuning ``--model`` run, ``codec_state``).

    The file is memory-mapped (``torch.load(mmap=True)``): its tensors are read from the page cache when used, so
    reading the round or the config of a 0.6B run's checkpoint costs no 4.8 GB of Delayed Nesterov buffers in RAM.

    Raises:
        CheckpointError: the file is missing or unreadable.
    """
    try:
        return torch.load(Path(folder) / "outer.pt", map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {str(folder)!r} is unreadable: {e}") from None


def restore_outer_state(folder: Path, global_model: GlobalModel, base_sha256: str | None = None) -> int:
    """Load a checkpoint's outer optimizer state into ``global_model`` (theta came with the policy's weights) and
    check theta against the recorded SHA-256; returns the checkpoint's round.

    Args:
        base_sha256: a LoRA run's base hash (`composer_diloco.policy.lora.base_sha256`), checked against the one the
            checkpoint recorded; None: full fine-tuning (nothing to check).
    Raises:
        CheckpointError: unreadable; other parameters than the run's model; an outer optimizer state this run's
            optimizer cannot take (another class, or one written before the optimizer was configurable that is not
            SGD's); weights that do not match their recorded SHA-256; or another LoRA base than ``base_sha256``
            (or a LoRA checkpoint resumed without LoRA, or the reverse). One line, naming the checkpoint.
    """
    state = read_outer_state(folder)
    if state.get("base_sha256") != base_sha256:
        raise CheckpointError(f"checkpoint {str(folder)!r} was trained over base_sha256 {state.get('base_sha256')}, "
                              f"this run's base is {base_sha256}")
    if list(state["names"]) != global_model.names:
        raise CheckpointError(f"checkpoint {str(folder)!r} does not match the run's model parameters")
    try:
        global_model.load_checkpoint_state(state)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {str(folder)!r} cannot resume this run's outer optimizer: {e}") from None
    if global_model.sha256() != state["global_sha256"]:
        raise CheckpointError(f"checkpoint {str(folder)!r}: weights do not match their recorded sha256")
    return int(state["round"])


def load_checkpoint_policy(folder: Path) -> tuple[Any, Any]:
    """The policy a checkpoint holds, as a plain ``transformers`` model or a ``peft.PeftModel``, and its tokenizer.

    A full fine-tuning checkpoint is a ``save_pretrained`` folder; a ``[lora]`` checkpoint holds the adapters only, so
    the run's base (its config's ``model``, or the warm-started default) is loaded and the adapters put on it.

    Raises:
        CheckpointError: no readable ``outer.pt``.
        composer_diloco.policy.errors.PolicyLoadError: the model or the adapters cannot be loaded (one line).
    """
    from composer_diloco.config import RunConfig
    from composer_diloco.policy import load_policy, load_run_policy

    config = RunConfig.from_json(read_outer_state(folder)["config"])
    if config.lora is None:
        return load_policy(str(folder), seed=0, warmstart_steps=0)
    from composer_diloco.policy.lora import apply_lora, load_adapters

    model, tokenizer = load_run_policy(config)
    model = apply_lora(model, config.lora)
    load_adapters(model, folder)
    return model, tokenizer


def read_codec_state(folder: Path) -> dict[str, Any] | None:
    """The ``codec_state`` a checkpoint's ``outer.pt`` holds (a node's error feedback), or None (a coordinator's
    checkpoint, or a run without the sparse codec). Raises CheckpointError: ``outer.pt`` is missing or unreadable."""
    return read_outer_state(folder).get("codec_state")


CODEC_STATE_FILE = "codec_state.pt"


def save_codec_state(path: Path, state: dict[str, Any], round_: int, config_digest: str) -> None:
    """Write a node's codec state (`composer_diloco.outer.peer.DiLoCoPeer.codec_state`) to ``path`` atomically, with
    the round it was settled after and the run config's digest (`RunConfig.digest`).

    Raises:
        OSError: the folder cannot be written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    torch.save({"round": int(round_), "config_digest": config_digest, "codec_state": state}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_codec_state(path: Path, config_digest: str) -> tuple[int, dict[str, Any]] | None:
    """``(round, codec state)`` saved by `save_codec_state`, or None when ``path`` does not exist.

    Raises:
        CheckpointError: unreadable, or saved by a run with another config digest than ``config_digest`` (one line).
    """
    path = Path(path)
    if not path.exists():
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"codec state {str(path)!r} is unreadable: {e}") from None
    if saved.get("config_digest") != config_digest:
        raise CheckpointError(f"codec state {str(path)!r} belongs to run config {saved.get('config_digest')}, this "
                              f"run's is {config_digest}")
    return int(saved["round"]), saved["codec_state"]


def _lora_base_sha256(model: Any) -> str | None:
    from composer_diloco.policy.lora import base_sha256, is_lora

    return base_sha256(model) if is_lora(model) else None


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling, fsync, rename: readers see old or new, never half.
    The temporary name is this process's and this thread's, so two threads writing one file (the coordinator's
    peers.json, from its round loop and its idle watcher) do not rename each other's file away."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(text)
    with open(tmp) as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())

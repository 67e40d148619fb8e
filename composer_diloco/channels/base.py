"""The loss-channel contract: one extra term of the inner loss = one module that subclasses `LossChannel`.

The inner loss of one optimizer step is ``GRPO + sum_c weight_c * L_c`` (GRPO is TRL's own loss, untouched). A
channel ``c`` owns everything about its term:

1. its settings: ``[loss]`` keys declared by its `ChannelSettings` (``settings_type``), which the run config checks with
   the rest of the config (`composer_diloco.config.LossConfig`); whether it is on: `LossChannel.from_context`
   (``None`` = off, its weight is 0);
2. its rows, built from the step's played episodes after TRL scored them: `LossChannel.build`;
3. how its rows split into the K micro-batches of the step, each with a weight, so that
   ``sum_k weight_k * L_c(part_k) == L_c(whole batch)``: `LossChannel.split`;
4. its loss on one part, a scalar mean over the part: `LossChannel.loss`;
5. its metrics: the metrics-line keys, the round table's columns and the plot's panel (`ChannelMetrics`);
6. what it adds to a node's memory plan: `LossChannel.memory` (`ChannelMemory`), counted before the node joins
   (`composer_diloco.policy.memory_plan`).

A channel with one setting is one new module here: its ``ChannelSettings`` subclass, its ``LossChannel`` subclass;
no other file names it.

Register a channel with `register_channel` (a class decorator); the trainer (`composer_diloco.inner.trainer`), the
round statistics (`composer_diloco.inner.round_stats`), the round table (`composer_diloco.metrics`) and the plots
(`coordinator.plot`) loop over `registered_channels`, in registration order (SDPO, then DPO: the order their terms
are added to the loss). A channel registered outside this package (a test, a plug-in) takes part in every step of a
trainer built after the registration; nothing else changes.

Counts (sites kept, pairs skipped, ...) all use one pattern: a dataclass of numbers deriving from `Counts`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from composer_diloco.channels.settings import ChannelSettings, declare_settings, discover_channels, forget_settings
from composer_diloco.policy.memory_sizes import ChannelMemory

if TYPE_CHECKING:
    from composer_diloco.config import RunConfig
    from composer_diloco.policy.memory_sizes import StepShape
    from composer_diloco.rollout.env_package import EnvPackage
    from composer_diloco.rollout.episodes import Episode, EnvSession

__all__ = ["ChannelContext", "ChannelMemory", "ChannelMetrics", "ChannelPart", "ChannelSettings", "Counts",
           "LossChannel", "pad_id", "pad_rows", "register_channel", "registered_channels", "unregister_channel"]


@dataclass
class Counts:
    """Base of every count record (a dataclass whose fields are ints or floats): one way to add them up.

    Subclass it as a ``@dataclass`` with numeric fields defaulting to 0; `add` accumulates in place, ``+`` gives a
    new record, `as_dict` gives the fields by name (for metrics lines).
    """

    def add(self, other: Counts) -> None:
        """Add ``other``'s fields to this record's, in place.

        Raises:
            TypeError: ``other`` is not of this record's type.
        """
        if type(other) is not type(self):
            raise TypeError(f"cannot add a {type(other).__name__} to a {type(self).__name__}")
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def __add__(self, other: Counts) -> Counts:
        if type(other) is not type(self):
            return NotImplemented
        out = type(self)(**self.as_dict())
        out.add(other)
        return out

    def as_dict(self) -> dict[str, Any]:
        """The fields by name, in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class ChannelMetrics:
    """What one channel shows in the metrics line, the round table and the plots.

    Attributes:
        loss_key: the per-round loss key (``"loss_sdpo"``): each node's mean over its inner steps of the step's
            loss value; the table shows the mean over nodes.
        count_key: the per-round count key (``"sdpo_sites"``): rows the channel built in the round; the table shows
            the sum over nodes.
        loss_title, count_title: the round table's column titles.
        loss_format: the table's format of the loss value (``"{:.4f}"``).
        plot_label: the y label of the channel's panel in ``losses.png``.
    """

    loss_key: str
    count_key: str
    loss_title: str
    count_title: str
    plot_label: str
    loss_format: str = "{:.4f}"


@dataclass
class ChannelContext:
    """What a channel may read when it is built (`LossChannel.from_context`), once per trainer.

    Attributes:
        config: the run config.
        model: the policy being trained (a channel keeps a frozen copy if it needs a reference, e.g. DPO).
        tokenizer: the policy's tokenizer (chat template with tool calling).
        sessions: the env sessions of the trainer (replays must not run while episodes are played).
        env: the env package of ``config.env.server_module`` (`composer_diloco.rollout.env_package`).
        hints: the SDPO hint registry (`composer_diloco.channels.hints.HintRegistry`), shared by channels.
    """

    config: RunConfig
    model: torch.nn.Module
    tokenizer: Any
    sessions: Sequence[EnvSession]
    env: EnvPackage
    hints: Any


@dataclass
class ChannelPart:
    """A channel's rows for one micro-batch and its weight.

    Attributes:
        rows: the channel's own row object for this micro-batch (a tensor dict for SDPO and DPO), or None when the
            micro-batch holds no row of the channel (its loss is then not computed).
        count: rows in this part (S_c sites, P_c pairs, ...).
        weight: the part's share of the channel's denominator (T_c / T tokens, P_c / P pairs); the weights of one
            step's parts add up to 1 (0 for an empty part).
    """

    rows: Any = None
    count: int = 0
    weight: float = 0.0


def split_rows(n: int, parts: int, cut: Callable[[torch.Tensor], Any],
               weight: Callable[[torch.Tensor], float]) -> list[ChannelPart]:
    """Deal ``n`` rows into ``parts`` contiguous, near-equal chunks (``torch.tensor_split``; a chunk may be empty),
    one `ChannelPart` per micro-batch, in order.

    Args:
        n: rows of the step (S sites, P pairs, ...).
        parts: K >= 1, micro-batches per optimizer step.
        cut: row indices (long tensor) -> the chunk's row object (e.g. its tensors cut to its longest row).
        weight: row indices -> the chunk's share of the channel's denominator; the shares of all chunks add up to 1.
    Raises:
        ValueError: ``parts`` below 1.
    """
    if parts < 1:
        raise ValueError(f"parts {parts}: expected a number of micro-batches >= 1")
    out = [ChannelPart() for _ in range(parts)]
    for part, rows in zip(out, torch.arange(n).tensor_split(parts), strict=True):
        if len(rows):
            part.rows, part.count, part.weight = cut(rows), len(rows), weight(rows)
    return out


class LossChannel(ABC):
    """One extra loss channel (see the module docstring). Subclass, set the class attributes, register.

    Class attributes:
        name: the channel's short name (``"sdpo"``): a key of the step's rows and of the registry.
        metrics: its `ChannelMetrics`.
        stats_type: its `Counts` type (what `build` counts; ``stats_type()`` is the all-zero record).
        settings_type: its `ChannelSettings` type (its ``[loss]`` keys).

    Attributes:
        weight: the term's coefficient in the composite loss (alpha_sdpo, beta_dpo, ...), > 0 when built.
    """

    name: ClassVar[str]
    metrics: ClassVar[ChannelMetrics]
    stats_type: ClassVar[type[Counts]] = Counts
    settings_type: ClassVar[type[ChannelSettings]]

    def __init__(self, weight: float):
        self.weight = weight

    @classmethod
    @abstractmethod
    def from_context(cls, ctx: ChannelContext) -> LossChannel | None:
        """The channel for this run, or None when the run turns it off (its weight is 0): it then costs nothing."""

    @abstractmethod
    def build(self, model: torch.nn.Module, episodes: Sequence[Episode], stats: Counts) -> Any:
        """The channel's rows for one optimizer step's episodes (all K micro-batches), counting into ``stats``.

        Called once per step, after TRL scored the episodes and before the first micro-batch's loss, channel after
        channel in registration order (a channel that samples from the global RNG must keep its place).

        Args:
            model: the policy (the trainer's ``model``), e.g. for sampling candidates; no gradient is needed.
            episodes: the step's played episodes, in TRL's row order (`composer_diloco.rollout.episodes.Episode`).
            stats: a fresh ``stats_type()`` record the build counts into (summed over the round).
        Returns:
            The channel's row object (passed to `split`), or None when the step holds nothing for this channel.
        """

    @abstractmethod
    def split(self, rows: Any, parts: int) -> list[ChannelPart]:
        """Cut ``rows`` (from `build`, not None) into ``parts`` `ChannelPart` s, one per micro-batch, in order.

        The weights must make ``sum_k weight_k * loss(part_k)`` equal the channel's loss on all rows, so the
        composite loss of one optimizer step does not depend on K.
        """

    @abstractmethod
    def loss(self, model: torch.nn.Module, rows: Any) -> torch.Tensor:
        """The channel's loss on one part's rows (already on the model's device): a scalar tensor with grad."""

    def to_device(self, rows: Any, device: torch.device) -> Any:
        """``rows`` moved to ``device`` (default: a ``{name: tensor}`` dict, tensor by tensor)."""
        return {k: v.to(device) for k, v in rows.items()}

    def after_outer_step(self) -> None:
        """Called right after each outer step (theta of the new round loaded); DPO refreshes its reference here."""

    @classmethod
    def memory(cls, settings: ChannelSettings, config: RunConfig, step: StepShape) -> ChannelMemory:
        """What the channel adds to a node's memory plan when it is on (its weight > 0), before the node joins.

        The default plans it like a GRPO term: one row per episode of the micro-batch, each at the planned length,
        holding fp32 logits twice at its peak (the logits and their log-softmax) and once for backward. A channel
        whose rows or tensors differ overrides it with its own counts (SDPO, DPO).

        Args:
            settings: its ``[loss]`` settings; config: the run config.
            step: the sizes the plan uses (model shape, micro-batch, row length, precision).
        """
        rows = step.micro_batch
        logits = rows * step.seq_len * step.shape.vocab * 4
        return ChannelMemory(name=cls.name, label=cls.name.upper(), rows=rows, backward_rows=rows, peak=2 * logits,
                             kept=logits)

    @classmethod
    def round_record(cls, loss_mean: float, stats: Counts | None) -> dict[str, Any]:
        """The channel's keys of a node's metrics line: ``{loss_key: loss_mean, count_key: rows built}`` plus
        whatever a subclass adds. ``stats`` is None when the channel was off for the whole round."""
        stats = stats if stats is not None else cls.stats_type()
        return {cls.metrics.loss_key: loss_mean, cls.metrics.count_key: int(getattr(stats, cls.metrics.count_key, 0))}


_REGISTRY: dict[str, type[LossChannel]] = {}
_BUILTIN = ("composer_diloco.channels.sdpo", "composer_diloco.channels.dpo")
"""The built-in channels, in the order their terms are added to the loss (a fixed order keeps runs bit-identical)."""


def register_channel(cls: type[LossChannel]) -> type[LossChannel]:
    """Class decorator: add ``cls`` to the channels every new trainer, metrics line, table and plot use.

    Raises:
        TypeError: ``cls`` is not a `LossChannel` subclass with a ``name`` and ``metrics``.
        ValueError: another class is registered under ``cls.name``.
    """
    if not (isinstance(cls, type) and issubclass(cls, LossChannel)) or not isinstance(getattr(cls, "name", None), str) \
            or not isinstance(getattr(cls, "metrics", None), ChannelMetrics) \
            or not (isinstance(getattr(cls, "settings_type", None), type)
                    and issubclass(cls.settings_type, ChannelSettings)
                    and cls.settings_type.weight_key in cls.settings_type.model_fields):
        raise TypeError(f"{cls!r}: expected a LossChannel subclass with a str `name`, a ChannelMetrics `metrics` and a "
                        "ChannelSettings `settings_type` whose weight_key is one of its fields")
    other = _REGISTRY.get(cls.name)
    if other is not None and other is not cls:
        raise ValueError(f"loss channel {cls.name!r} is already registered ({other.__module__}.{other.__qualname__})")
    declare_settings(cls.name, cls.settings_type)  # its [loss] keys: a key another channel declares is refused
    _REGISTRY[cls.name] = cls
    return cls


def unregister_channel(name: str) -> None:
    """Remove the channel registered as ``name`` (tests that register their own). Unknown names are ignored."""
    _REGISTRY.pop(name, None)
    forget_settings(name)


def registered_channels() -> tuple[type[LossChannel], ...]:
    """The registered channel classes: the built-ins first (SDPO, DPO), then the others in registration order.

    Every module of the ``composer_diloco.channels`` package is imported first, so a channel module dropped into the
    package registers itself (its ``@register_channel``) with no other file edited; a channel defined elsewhere
    registers when its module is imported.
    """
    discover_channels()
    builtin = [c for c in _REGISTRY.values() if c.__module__ in _BUILTIN]
    builtin.sort(key=lambda c: _BUILTIN.index(c.__module__))
    return tuple(builtin + [c for c in _REGISTRY.values() if c.__module__ not in _BUILTIN])


def pad_id(tokenizer: Any) -> int:
    """The token id a channel pads its rows with: the tokenizer's pad token, else its EOS (as `load_policy` sets)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``rows`` (N >= 1 token-id lists) into ``(ids, attention_mask)``, both (N, L) long, L the longest row;
    ids padded with ``pad_id``, the mask 1 on real tokens."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(list(r), dtype=torch.long)
        att[i, :len(r)] = 1
    return ids, att

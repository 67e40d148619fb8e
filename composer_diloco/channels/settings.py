"""A loss channel's settings: its keys of the run config's ``[loss]`` table, declared in the channel's own module.

`ChannelSettings` is what a channel subclasses; `composer_diloco.channels.base.register_channel` declares a channel's
settings here (`declare_settings`), and the run config (`composer_diloco.config.LossConfig`) checks and publishes its
``[loss]`` table through `check_loss_keys` and `loss_settings`. This module imports no torch and nothing of the
project, so the config can use it; it finds the channels by importing every module of this package
(`discover_channels`, the same discovery `registered_channels` uses), which is when torch comes in.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from typing import Self

__all__ = ["ChannelSettings", "check_loss_keys", "declare_settings", "discover_channels", "forget_settings",
           "loss_settings"]


class ChannelSettings(BaseModel):
    """A channel's keys of the run config's ``[loss]`` table: subclass with one pydantic field per key.

    ``[loss]`` is one flat table shared by every channel, so a field's name is the key itself: prefix it with the
    channel's name (``sdpo_top_k``). The run config checks each key it holds with the model of the channel that
    declares it (`check_loss_keys`), with the config's one-line errors; a channel reads its values with `of`.

    Class attributes:
        weight_key: the field holding the term's coefficient (``"alpha_sdpo"``); 0 turns the channel off.
        omit_at_default: fields left out of the published config at their default (keys added after runs were
            published: a config that does not set them keeps the JSON and digest it had before them).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    weight_key: ClassVar[str]
    omit_at_default: ClassVar[tuple[str, ...]] = ()

    @property
    def weight(self) -> float:
        """The term's coefficient (the ``weight_key`` field); > 0 when the channel is on."""
        return float(getattr(self, self.weight_key))

    @classmethod
    def of(cls, loss: BaseModel) -> Self:
        """This channel's settings in a run config's ``[loss]`` table (`composer_diloco.config.LossConfig`): the keys
        it sets, the defaults for the rest."""
        return cls.model_validate({k: v for k, v in (loss.model_extra or {}).items() if k in cls.model_fields})


class _NoChannelKey(BaseModel):
    """Checks a key no channel declares: pydantic's own "Extra inputs are not permitted" error, at the key."""

    model_config = ConfigDict(extra="forbid")


_DECLARED: dict[str, type[ChannelSettings]] = {}
"""Channel name -> its settings type, filled by `declare_settings` (`register_channel`)."""


def discover_channels() -> None:
    """Import every module of the ``composer_diloco.channels`` package, so that each channel module dropped into it
    registers itself (its ``@register_channel``) with no other file edited. Imports torch (the channel modules do)."""
    package = importlib.import_module("composer_diloco.channels")
    for info in pkgutil.iter_modules(package.__path__):  # here, not at package import: no import cycle
        importlib.import_module(f"{package.__name__}.{info.name}")


def declare_settings(channel: str, settings_type: type[ChannelSettings]) -> None:
    """Declare ``channel``'s ``[loss]`` keys (the fields of ``settings_type``); called by `register_channel`.

    Raises:
        ValueError: another channel declares one of its keys (``[loss]`` is one flat table).
    """
    taken = {key: name for name, other in _DECLARED.items() if name != channel for key in other.model_fields}
    shared = sorted(set(settings_type.model_fields) & taken.keys())
    if shared:
        raise ValueError(f"loss channel {channel!r}: [loss] key {shared[0]!r} is already declared by channel "
                         f"{taken[shared[0]]!r} (expected keys prefixed with the channel's name)")
    _DECLARED[channel] = settings_type


def forget_settings(channel: str) -> None:
    """Drop ``channel``'s keys (`unregister_channel`); unknown names are ignored."""
    _DECLARED.pop(channel, None)


def _owners() -> dict[str, type[ChannelSettings]]:
    discover_channels()
    return {key: settings_type for settings_type in _DECLARED.values() for key in settings_type.model_fields}


def check_loss_keys(keys: dict[str, Any]) -> dict[str, Any]:
    """Check a ``[loss]`` table: every key by the settings model of the channel that declares it.

    Args:
        keys: the table as written (``{"alpha_sdpo": 0.2, "sdpo_top_k": 8}``).
    Returns:
        The keys whose checked values (coerced by their fields: ``1`` -> ``1.0`` for a float) differ from their
        defaults, in the table's order: one form per meaning, so two tables that mean the same compare equal.
    Raises:
        pydantic.ValidationError: located at the first bad key (``sdpo_top_k``: "Input should be greater than or
            equal to 1"), or "Extra inputs are not permitted" for a key no registered channel declares.
    """
    owners = _owners()
    unknown = {k: v for k, v in keys.items() if k not in owners}
    if unknown:
        _NoChannelKey.model_validate(unknown)
    checked: dict[str, Any] = {}
    for settings in dict.fromkeys(owners[k] for k in keys):
        mine = {k: v for k, v in keys.items() if owners[k] is settings}
        checked.update(settings.model_validate(mine).model_dump(include=set(mine)))
    default = {k: owners[k].model_fields[k].get_default(call_default_factory=True) for k in keys}
    return {k: checked[k] for k in keys if checked[k] != default[k]}


def loss_settings(loss: BaseModel) -> dict[str, Any]:
    """Every ``[loss]`` key of every registered channel with its value in ``loss`` (set or default), as the run
    config publishes them (`ChannelSettings.omit_at_default` keys at their default left out)."""
    discover_channels()
    out: dict[str, Any] = {}
    for settings_type in _DECLARED.values():
        settings = settings_type.of(loss)
        values = settings.model_dump(mode="json")
        for key in settings_type.omit_at_default:
            if getattr(settings, key) == settings_type.model_fields[key].default:
                values.pop(key)
        out.update(values)
    return out

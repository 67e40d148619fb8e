"""Multi-turn agentic episodes: the policy generates a tool call, the OpenEnv server runs it, repeat.

Token ids are carried through the episode and never re-tokenized (INTELLECT-2 / prime-rl, TRL's tool loop):
``completion_ids`` is the concatenation of the policy's generated turns and the chat template's rendering of
each tool reply, ``env_mask`` marks which tokens the policy produced (1) and which the environment did (0,
excluded from the loss), and ``logprobs`` holds the sampler's log-probability of each generated token (0.0 on
environment tokens) for importance ratios.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from composer_diloco.rollout.chat import parse_tool_call
from composer_diloco.timing import PhaseClock

log = logging.getLogger(__name__)

ToolSuffix = Callable[[list[dict[str, Any]]], list[int]]


@dataclass
class Turn:
    """One message of an episode.

    Attributes:
        role: "user", "assistant" or "tool".
        content: the message text (for the assistant: the decoded generated text).
        tool_call: ``{"name", "arguments"}`` the assistant called, or None.
        error_kind: for a tool turn, the env's error kind ("tool_not_found", "invalid_args",
            "execution_error", ...) or None when the call succeeded.
        error_meta: the env's metadata for that error (available tools, expected schema, message).
    """

    role: str
    content: str
    tool_call: dict[str, Any] | None = None
    error_kind: str | None = None
    error_meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """One played episode, as the trainer, the collator and the metrics read it.

    Attributes:
        seed, episode_id: the env's reproducibility key of this episode.
        turns: the chat history, user question first.
        tools: the tool schemas the prompt was rendered with.
        prompt_ids: (P,) int token ids of the rendered prompt (chat template, generation prompt).
        completion_ids: (C,) int token ids of everything after the prompt.
        env_mask: (C,) 1 for policy-generated tokens, 0 for tool-reply tokens.
        logprobs: (C,) float sampler log-probs of generated tokens, 0.0 on tool-reply tokens.
        reward: the env's final reward (0.0 if the episode never submitted).
        end_reason: "done" (env ended it), "no_tool_call", "truncated" (turn hit max tokens),
            "max_tool_calls", "max_seq_len" or "env_error" (the env failed a call: the episode ended with reward 0).
        prompt_text, completion_text: the decoded ids (special tokens kept), set by
            `composer_diloco.rollout.play.play_episodes`.

    The full sequence is ``full_ids = prompt_ids + completion_ids`` with ``full_mask`` (0 on the prompt, then
    ``env_mask``): the policy's own tokens, those GRPO, SDPO and the importance ratios are computed on.
    """

    seed: int
    episode_id: str
    turns: list[Turn]
    tools: list[dict[str, Any]]
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    end_reason: str = ""
    prompt_text: str = ""
    completion_text: str = ""

    @property
    def full_ids(self) -> list[int]:
        """(P + C,) prompt then completion token ids."""
        return self.prompt_ids + self.completion_ids

    @property
    def full_mask(self) -> list[int]:
        """(P + C,) 1 on the policy's generated tokens, 0 on prompt and tool-reply tokens."""
        return [0] * len(self.prompt_ids) + self.env_mask

    @property
    def full_text(self) -> str:
        return self.prompt_text + self.completion_text

    @property
    def tool_calls(self) -> int:
        """Number of assistant turns whose text parsed as a tool call (`Turn.tool_call` set)."""
        return sum(1 for t in self.turns if t.role == "assistant" and t.tool_call is not None)

    @property
    def tool_errors(self) -> int:
        """Number of tool calls that came back with an error."""
        return sum(1 for t in self.turns if t.role == "tool" and t.error_kind is not None)

    def check(self) -> None:
        """Raise ValueError if the per-token fields disagree in length (names both lengths)."""
        n = len(self.completion_ids)
        for name in ("env_mask", "logprobs"):
            m = len(getattr(self, name))
            if m != n:
                raise ValueError(f"episode {self.episode_id}: {name} has {m} entries but completion_ids has {n}")


class EnvSession:
    """What the rollout needs from an environment session: `OpenEnvSession` (typed tool-call envs) and
    `composer_diloco.rollout.mcp.McpEnvSession` (OpenEnv MCP tool servers) implement it; tests use scripted ones."""

    def reset(self, seed: int, episode_id: str) -> tuple[str, list[dict]]:  # pragma: no cover - protocol
        """Start an episode; return (question, tool schemas)."""
        raise NotImplementedError

    def call(self, tool: str, arguments: dict) -> tuple[str, str | None, dict, float, bool]:  # pragma: no cover
        """Run one tool call; return (content, error_kind, error_meta, reward, done)."""
        raise NotImplementedError


class EnvProtocolError(RuntimeError):
    """A typed env answered outside the tool-call protocol (`OpenEnvSession`): a field is missing or of the wrong
    type; the message names the URL, the field and what came instead."""


def _protocol_field(observation: Mapping[str, Any], name: str, kinds: type | tuple[type, ...], url: str,
                    default: Any = None) -> Any:
    """``observation[name]`` checked against ``kinds``; ``default`` when absent (None: required).

    Raises:
        EnvProtocolError: the field is absent without a default, or not of ``kinds``.
    """
    value = observation.get(name, default)
    if not isinstance(value, kinds):
        expected = " or ".join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))
        raise EnvProtocolError(f"env server at {url}: observation field {name!r} should be {expected}, "
                               f"got {value!r:.200}")
    return value


def _reset_task(observation: Mapping[str, Any], url: str, *, need_question: bool = True) -> tuple[str, list[dict]]:
    """(question, tools) of a typed env's reset observation.

    Args:
        need_question: refuse a blank ``question`` (False when the task comes from a dataset row: `start`).

    Raises:
        EnvProtocolError: ``question`` is not a string (or, with ``need_question``, is blank), or ``tools`` is not a
            list or is empty: such an episode cannot carry a learning signal (one line naming the URL and what was
            missing).
    """
    question = _protocol_field(observation, "question", str, url, "" if not need_question else None)
    tools = list(_protocol_field(observation, "tools", list, url))
    if need_question and not question.strip():
        raise EnvProtocolError(f"env server at {url}: the reset observation's 'question' is empty: expected the "
                               f"task text")
    if not tools:
        raise EnvProtocolError(f"env server at {url}: the reset observation lists no tools ('tools' is []): "
                               f"expected at least one tool schema")
    return question, tools


class OpenEnvSession(EnvSession):
    """A WebSocket session (OpenEnv ``GenericEnvClient.sync()``) with any env speaking the typed tool-call protocol,
    one episode at a time.

    The protocol is JSON field names, not classes (``composer_diloco.rollout.env_package`` documents it): a step
    sends ``{"tool": name, "arguments": {...}}``; the reset observation carries ``question`` (str) and ``tools``
    (OpenAI function schemas); a step observation carries ``content`` (str), ``error_kind`` (str or null) and
    ``error_meta`` (object), with OpenEnv's ``reward`` and ``done``. No env package is imported, so a node can play
    a remote env fleet whose package it does not have.

    Args:
        url: the server's base URL (``http(s)://`` or ``ws(s)://``; the client adds ``/ws``).
        max_tool_calls: the call budget per episode, passed to ``reset``.
        reset_kwargs: more keywords for every ``reset`` (``[env] reset_kwargs``, e.g. the coding env's ``source``).

    Raises:
        EnvServerError (from `composer_diloco.rollout.env_process`): the server cannot be reached.
    """

    def __init__(self, url: str, *, max_tool_calls: int, reset_kwargs: Mapping[str, Any] | None = None):
        from composer_diloco.rollout.openenv_import import import_openenv_core

        import_openenv_core()
        from openenv.core.generic_client import GenericEnvClient

        from composer_diloco.rollout.env_process import EnvServerError

        self.url, self.max_tool_calls = url, max_tool_calls
        self.reset_kwargs = dict(reset_kwargs or {})
        self._client = GenericEnvClient(base_url=url).sync()
        try:
            self._client.connect()
        except Exception as e:
            self.close()
            raise EnvServerError(f"env server at {url} not reachable: {e}") from e

    def reset(self, seed: int, episode_id: str) -> tuple[str, list[dict]]:
        """Start episode ``(seed, episode_id)``; return (question, tool schemas).

        Raises:
            EnvProtocolError: the observation lacks a non-empty string ``question`` or a non-empty list ``tools``.
            RuntimeError: ``"Server error: ..."`` from OpenEnv's client when the server's reset raised.
        """
        obs = self._client.reset(seed=seed, episode_id=episode_id, max_tool_calls=self.max_tool_calls,
                                 **self.reset_kwargs).observation
        return _reset_task(obs, self.url)

    def start(self, seed: int, episode_id: str, task_kwargs: Mapping[str, Any]) -> tuple[str, list[dict]]:
        """Start episode ``(seed, episode_id)`` of a dataset task (`composer_diloco.rollout.tasks.TaskEnvSession`):
        reset with ``task_kwargs`` (a row's columns) over the run's ``reset_kwargs``; return (the observation's
        ``question``, ``""`` when it has none, and the tool schemas).

        Raises:
            EnvProtocolError: the observation lists no tools, or a ``question`` that is not a string.
            RuntimeError: ``"Server error: ..."`` from OpenEnv's client when the server's reset raised.
        """
        obs = self._client.reset(seed=seed, episode_id=episode_id, max_tool_calls=self.max_tool_calls,
                                 **{**self.reset_kwargs, **task_kwargs}).observation
        return _reset_task(obs, self.url, need_question=False)

    def probe(self) -> None:
        """Ask the server for the session's state: OpenEnv creates the server-side session when the WebSocket opens and
        refuses it (``Server at capacity: n/n``) at the first message, so opening a session sends this one.

        Raises:
            RuntimeError: ``"Server error: ..."`` from OpenEnv's client (e.g. ``CAPACITY_REACHED``).
        """
        self._client.state()

    def call(self, tool: str, arguments: dict) -> tuple[str, str | None, dict, float, bool]:
        """Run one tool call; return (content, error_kind, error_meta, reward, done); a None reward counts 0.0.

        Raises:
            EnvProtocolError: ``content`` is not a string, ``error_kind`` not a string or null, ``error_meta`` not an
                object.
            RuntimeError: ``"Server error: ..."`` from OpenEnv's client when the server's step raised (e.g. a step
                after the episode ended).
        """
        result = self._client.step({"tool": tool, "arguments": arguments})
        obs = result.observation
        content = _protocol_field(obs, "content", str, self.url, "")
        kind = _protocol_field(obs, "error_kind", (str, type(None)), self.url)
        meta = _protocol_field(obs, "error_meta", dict, self.url, {})
        return content, kind, dict(meta), float(result.reward or 0.0), bool(result.done)

    def close(self) -> None:
        """Close the WebSocket and the server-side session (idempotent; never raises)."""
        try:
            self._client.close()
        except Exception as e:  # closing a dead socket
            log.debug("closing env session %s: %r", self.url, e)


class LocalEnvSession(EnvSession):
    """An env's OpenEnv ``Environment`` run in this process (no server, no socket), read through the same tool-call
    protocol fields as `OpenEnvSession`: for evaluation, and tests, of an env package (`EnvPackage.local_session`).

    Each observation goes through JSON (``model_dump_json``) as on the wire, so the values are those a server sends.

    Args:
        environment: an instance of the env's ``Environment``; its ``step`` must annotate its ``action`` parameter
            with the env's pydantic action class (``tool``, ``arguments``).
        max_tool_calls: the call budget per episode, passed to ``reset``.
        reset_kwargs: more keywords for every ``reset``.

    Raises:
        TypeError: ``environment.step`` has no pydantic action annotation (names the class).
    """

    def __init__(self, environment: Any, *, max_tool_calls: int, reset_kwargs: Mapping[str, Any] | None = None):
        import typing

        action = typing.get_type_hints(type(environment).step).get("action")
        if not (isinstance(action, type) and hasattr(action, "model_validate")):
            raise TypeError(f"{type(environment).__name__}.step: expected its 'action' parameter annotated with a "
                            f"pydantic action class, got {action!r}")
        self._env, self._action = environment, action
        self.url = f"local:{type(environment).__name__}"
        self.max_tool_calls, self.reset_kwargs = max_tool_calls, dict(reset_kwargs or {})

    @staticmethod
    def _wire(observation: Any) -> dict[str, Any]:
        return json.loads(observation.model_dump_json())

    def reset(self, seed: int, episode_id: str) -> tuple[str, list[dict]]:
        """Start episode ``(seed, episode_id)``; return (question, tool schemas).

        Raises:
            EnvProtocolError: the observation lacks a non-empty string ``question`` or a non-empty list ``tools``.
            ValueError, RuntimeError: what the environment's ``reset`` raises.
        """
        obs = self._wire(self._env.reset(seed=seed, episode_id=episode_id, max_tool_calls=self.max_tool_calls,
                                         **self.reset_kwargs))
        return _reset_task(obs, self.url)

    def start(self, seed: int, episode_id: str, task_kwargs: Mapping[str, Any]) -> tuple[str, list[dict]]:
        """As `OpenEnvSession.start`, in this process."""
        obs = self._wire(self._env.reset(seed=seed, episode_id=episode_id, max_tool_calls=self.max_tool_calls,
                                         **{**self.reset_kwargs, **task_kwargs}))
        return _reset_task(obs, self.url, need_question=False)

    def call(self, tool: str, arguments: dict) -> tuple[str, str | None, dict, float, bool]:
        """Run one tool call; return (content, error_kind, error_meta, reward, done), as `OpenEnvSession.call`.

        Raises:
            EnvProtocolError: as `OpenEnvSession.call`.
            RuntimeError: what the environment's ``step`` raises (e.g. a step after the episode ended).
        """
        obs = self._wire(self._env.step(self._action(tool=tool, arguments=arguments)))
        content = _protocol_field(obs, "content", str, self.url, "")
        kind = _protocol_field(obs, "error_kind", (str, type(None)), self.url)
        meta = _protocol_field(obs, "error_meta", dict, self.url, {})
        return content, kind, dict(meta), float(obs.get("reward") or 0.0), bool(obs.get("done"))

    def close(self) -> None:
        """Close the environment (idempotent; never raises)."""
        try:
            self._env.close()
        except Exception as e:
            log.debug("closing local env session %s: %r", self.url, e)


@dataclass
class TurnRules:
    """What happens between two assistant turns of an episode, the same for every rollout engine: record the
    sampled turn, parse its call, run it in the env, append the tool reply's tokens or end the episode.

    Attributes:
        tokenizer: the policy's tokenizer (decodes turns, renders the first prompt, cuts replies).
        tool_suffix_ids: the template's rendering of a tool reply (`composer_diloco.rollout.play.play_episodes`).
        max_turn_tokens, max_seq_len, max_tool_reply_tokens: as in `play_episodes`.
    """

    tokenizer: Any
    tool_suffix_ids: ToolSuffix
    max_turn_tokens: int
    max_seq_len: int
    max_tool_reply_tokens: int | None = None

    def start(self, session: EnvSession, seed: int, episode_id: str) -> Episode:
        """Reset ``session`` for ``(seed, episode_id)`` and render the prompt (the chat template with the tools).

        Raises:
            What ``session.reset`` raises.
        """
        question, tools = session.reset(seed, episode_id)
        prompt_ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tools=tools, add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )
        return Episode(seed, episode_id, [Turn("user", question)], tools, list(prompt_ids))

    def record_turn(self, ep: Episode, ids: list[int], logprobs: list[float]) -> Any:
        """Append a sampled assistant turn (``ids`` up to and including EOS, their sampler log-probs) to ``ep``;
        returns the parsed call to run, or None when the episode ended here (``end_reason`` set: "truncated", no EOS
        within ``max_turn_tokens``; "no_tool_call")."""
        ep.completion_ids += ids
        ep.env_mask += [1] * len(ids)
        ep.logprobs += logprobs
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        call = parse_tool_call(text)
        ep.turns.append(Turn("assistant", text, {"name": call.name, "arguments": call.arguments} if call.ok else None))
        if not ids or ids[-1] != self.tokenizer.eos_token_id:
            ep.end_reason = "truncated"
            return None
        if not call.ok:
            ep.end_reason = "no_tool_call"
            return None
        return call

    @staticmethod
    def call_env(session: EnvSession, call: Any) -> tuple[str, str | None, dict, float, bool] | Exception:
        """``session.call`` of a parsed call; an exception it raises is returned, not raised (`record_reply` ends the
        episode with it). Safe to run in another thread than the episode's."""
        try:
            return session.call(call.name, call.arguments)
        except Exception as e:  # the env failed this episode: end it, keep the step
            return e

    def record_reply(self, ep: Episode, session: EnvSession, call: Any,
                     reply: tuple[str, str | None, dict, float, bool] | Exception) -> bool:
        """Append the env's reply to ``call`` to ``ep``; True when the episode goes on to another assistant turn,
        False when it ended (``end_reason``: "done" with the env's reward, "env_error" with reward 0, "max_seq_len"
        when the reply and one more turn would not fit)."""
        if isinstance(reply, Exception):
            reason = " ".join(str(reply).split())[:300]
            log.warning("episode %s (seed %d): env %s failed the call %s: %s: %s; the episode ends with reward 0",
                        ep.episode_id, ep.seed, getattr(session, "url", "?"), call.name, type(reply).__name__, reason)
            ep.reward, ep.end_reason = 0.0, "env_error"  # no tool turn: the policy made no mistake here
            return False
        content, kind, meta, reward, done = reply
        if self.max_tool_reply_tokens is not None:
            content = cut_reply(self.tokenizer, content, self.max_tool_reply_tokens)
        ep.turns.append(Turn("tool", content, None, kind, meta))
        if done:
            ep.reward, ep.end_reason = reward, "done"
            return False
        suffix = self.tool_suffix_ids([{"role": "tool", "name": call.name, "content": content}])
        if len(ep.prompt_ids) + len(ep.completion_ids) + len(suffix) + self.max_turn_tokens > self.max_seq_len:
            ep.end_reason = "max_seq_len"
            return False
        ep.completion_ids += suffix
        ep.env_mask += [0] * len(suffix)
        ep.logprobs += [0.0] * len(suffix)
        return True


def play_wave(model: nn.Module, sessions: Sequence[EnvSession], keys: Sequence[tuple[int, str]], turn: TurnRules, *,
               max_tool_calls: int, temperature: float, clock: PhaseClock | None = None) -> list[Episode]:
    """The batched engine (`composer_diloco.rollout.play.play_episodes`): at most ``len(sessions)`` keys, all at once,
    in lock-step turns, each turn sampled by `generate_turns`; returns their episodes in the order of ``keys``."""
    env_phase = (lambda: clock.phase("env")) if clock is not None else contextlib.nullcontext
    with env_phase():
        episodes = [turn.start(session, seed, episode_id) for session, (seed, episode_id) in zip(sessions, keys)]
    active = list(range(len(episodes)))
    cache = TurnCache()  # each turn encodes only what the last one appended (`generate_turns`)
    for _ in range(max_tool_calls):
        if not active:
            break
        contexts = [episodes[i].prompt_ids + episodes[i].completion_ids for i in active]
        generated, logps = generate_turns(model, turn.tokenizer, contexts, turn.max_turn_tokens, temperature,
                                          cache=cache)
        still = []
        for i, ids, lp in zip(active, generated, logps):
            call = turn.record_turn(episodes[i], ids, lp)
            if call is None:
                continue
            with env_phase():
                reply = turn.call_env(sessions[i], call)
            if turn.record_reply(episodes[i], sessions[i], call, reply):
                still.append(i)
        active = still
    for i in active:
        episodes[i].end_reason = "max_tool_calls"
    return episodes


CUT_MARK = " ..."
"""What `cut_reply` appends to a reply it cut."""


def cut_reply(tokenizer: Any, content: str, max_tokens: int) -> str:
    """A tool reply of at most ``max_tokens`` tokens (``[env] max_tool_reply_tokens``): unchanged when it fits, else its
    first ``max_tokens`` tokens decoded, then `CUT_MARK` (a few tokens more; the memory plan counts them,
    `composer_diloco.policy.memory_plan.REPLY_SLACK`).

    Args:
        tokenizer: the policy's tokenizer.
        content: the env's reply text.
        max_tokens: the cap, >= 1.
    """
    ids = tokenizer(content, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return content
    return tokenizer.decode(ids[:max_tokens], skip_special_tokens=False) + CUT_MARK


@dataclass
class TurnCache:
    """The KV cache of one lock-step batch of episodes, kept from one assistant turn to the next by `generate_turns`.

    Every earlier turn of an episode is already in the cache, so a turn encodes only what was appended since the
    last one (the tool reply and the next assistant header) instead of the whole history. The batch stays one
    tensor: rows are left-padded as in the first turn, and what a turn appends to each row is right-aligned with
    padding in between (``mask`` 0 there); position ids follow the mask (transformers' generate counts positions
    from ``attention_mask.cumsum``), so every real token sits at the position it has in the unpadded sequence.

    Attributes:
        ids: (B, T) int64 token ids of every position the batch holds (padding included).
        mask: (B, T) int64 attention mask: 1 on real tokens, 0 on padding and on what was sampled after a row's EOS.
        past: the model's cache (transformers ``DynamicCache``) of the first T - 1 positions.
        real: per row, its real tokens in order (what a context must start with to reuse the row).
    """

    ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    past: Any = None
    real: list[list[int]] = field(default_factory=list)

    def compact(self) -> None:
        """Drop the padding inside every row: each row's cached positions are gathered, in order, to the right of
        a left padding as wide as the longest row needs, so the next turn attends over no more columns than
        re-encoding the contexts would. Keys carry their rotary positions already (they were computed from the
        mask), so moving a key to another column changes nothing it holds. `generate_turns` keeps only caches
        whose layers are all transformers' plain ``DynamicLayer`` (`reusable`).
        """
        layers = self.past.layers
        cached = layers[0].keys.shape[-2]  # every column but the last is in the cache
        mask = self.mask[:, :cached]
        counts = mask.sum(dim=1)
        width = int(counts.max())
        if width == cached:
            return
        # source column of each target column: row r's real columns right-aligned, column 0 under the padding
        order = torch.argsort(mask, dim=1, stable=True)[:, cached - width:]  # (B, width): its 0s first, then 1s
        keep = torch.arange(width).unsqueeze(0) >= (width - counts).unsqueeze(1)  # (B, width) the real columns
        order = torch.where(keep, order, torch.zeros_like(order))
        for layer in layers:
            index = order.to(layer.keys.device)[:, None, :, None].expand(-1, layer.keys.shape[1], -1,
                                                                          layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, index)
            layer.values = layer.values.gather(2, index)
        self.ids = torch.cat([torch.where(keep, self.ids[:, :cached].gather(1, order), 0), self.ids[:, cached:]], 1)
        self.mask = torch.cat([keep.long(), self.mask[:, cached:]], dim=1)

    @staticmethod
    def reusable(past: Any) -> bool:
        """True for a cache whose layers are all plain ``DynamicLayer``s. A sliding-window layer (Gemma 3, Mistral)
        counts padded columns against its window, so padding inside a row would evict real tokens: such a model
        re-encodes every turn (checked: a Gemma 3 with a 128-token window sampled other tokens when its cache was
        kept)."""
        layers = getattr(past, "layers", None)
        return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)

    def rows_for(self, contexts: Sequence[Sequence[int]]) -> list[int] | None:
        """The cached row each context continues, in order (a context continues a row when it starts with the row's
        real tokens; rows are taken first come, first served), or None when some context continues none."""
        if self.past is None:
            return None
        taken: set[int] = set()
        rows = []
        for context in contexts:
            row = next((r for r, real in enumerate(self.real) if r not in taken and len(real) <= len(context)
                        and list(context[:len(real)]) == real), None)
            if row is None:
                return None
            taken.add(row)
            rows.append(row)
        return rows


def _left_padded(contexts: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), both (B, max length) int64: each context right-aligned after padding."""
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for row, c in enumerate(contexts):
        if c:
            ids[row, width - len(c):] = torch.tensor(list(c))
            mask[row, width - len(c):] = 1
    return ids, mask


def sampling_kwargs(temperature: float) -> dict[str, Any]:
    """transformers generation settings of a rollout's sampler, shared by both engines (`generate_turns`,
    `composer_diloco.rollout.continuous`): the temperature-scaled softmax of the logits, no top-k or top-p;
    ``temperature`` 0 decodes greedily."""
    if temperature > 0:
        return dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    return dict(do_sample=False)


def generate_turns(model: nn.Module, tokenizer: Any, contexts: list[list[int]], max_new_tokens: int,
                   temperature: float, cache: TurnCache | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Sample one assistant turn for each context, as one left-padded batch (transformers ``generate``).

    Args:
        model: causal LM; sampling runs on its device.
        tokenizer: supplies ``pad_token_id`` and ``eos_token_id``.
        contexts: per episode, every token id so far (prompt, earlier turns, tool replies).
        max_new_tokens: tokens per turn at most.
        temperature: sampling temperature (no top-k / top-p); 0.0: greedy decoding (log-probs of the untempered
            distribution).
        cache: the batch's `TurnCache`, updated in place: when every context continues one of its rows (the usual
            next turn of the same episodes), only the appended tokens are encoded; otherwise the contexts are
            encoded from scratch. None: no cache is kept.

    Returns:
        ``(ids, logprobs)`` per context: the new token ids (up to and including EOS) and the sampler's log-prob of
        each under the temperature-scaled distribution.

    The sampled tokens are those of re-encoding every context each turn, up to float rounding: on the warm-started
    default (16 tool_env episodes of 2-11 turns, seed 123) every token matched and the log-probs differed by at most
    1.4e-06 (`tests/test_rollout_cache.py`).
    """
    device = next(model.parameters()).device
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    rows = cache.rows_for(contexts) if cache is not None else None
    if rows is None:
        ids, mask = _left_padded(contexts, pad)
        past = None
    else:  # keep the rows still playing, then append each row's new tokens right-aligned
        keep = torch.tensor(rows)
        past = cache.past
        past.batch_select_indices(keep.to(device))
        tail_ids, tail_mask = _left_padded([c[len(cache.real[r]):] for c, r in zip(contexts, rows)], pad)
        ids = torch.cat([cache.ids.cpu()[keep], tail_ids], dim=1)
        mask = torch.cat([cache.mask.cpu()[keep], tail_mask], dim=1)
    width = ids.shape[1]
    sampling = sampling_kwargs(temperature)
    out = model.generate(
        input_ids=ids.to(device), attention_mask=mask.to(device), past_key_values=past, max_new_tokens=max_new_tokens,
        pad_token_id=pad, eos_token_id=eos, output_scores=True, return_dict_in_generate=True, use_cache=True,
        **sampling,
    )
    new_dev = out.sequences[:, width:]  # (B, T_new) on the model's device
    # the sampled tokens' log-probs on the device: (B, T_new) comes back, not the (B, T_new, V) scores
    token_logps = torch.stack([torch.log_softmax(step.float(), dim=-1).gather(-1, new_dev[:, t, None]).squeeze(-1)
                               for t, step in enumerate(out.scores)], dim=1).cpu()  # temperature already applied
    new = new_dev.cpu()
    new_mask = torch.ones_like(new)
    ids_out, lps_out = [], []
    for row in range(new.shape[0]):
        row_ids = new[row].tolist()
        if eos in row_ids:
            row_ids = row_ids[: row_ids.index(eos) + 1]
            new_mask[row, len(row_ids):] = 0  # what generate padded after EOS is no token of the episode
        ids_out.append(row_ids)
        lps_out.append(token_logps[row, : len(row_ids)].tolist())
    if cache is not None and TurnCache.reusable(out.past_key_values):
        cache.ids, cache.mask, cache.past = out.sequences.cpu(), torch.cat([mask, new_mask], dim=1), out.past_key_values
        cache.real = [list(c) + i for c, i in zip(contexts, ids_out)]
        cache.compact()
    return ids_out, lps_out

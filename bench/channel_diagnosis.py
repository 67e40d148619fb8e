"""Why the SDPO and DPO channels hurt the embedded default: measured on the warm-start policy, no training.

Plays ``--episodes`` fresh training-like episodes of the run config's env with the warm start (sampled at the run's
temperature, as a node's rollout does), then measures both channels at the sites they would train on:

SDPO (Hübotter et al., arXiv 2601.20802): a site is the assistant turn right after a failed tool call
(`composer_diloco.channels.sdpo_sites.SiteFinder.sites_from_episode`); the teacher is the same policy with a hint about
the error inserted before that turn. SDPO's premise is that the hinted teacher recovers better than the student. At
every site, ``--samples`` continuations are sampled from the student context and as many from the teacher context
(same RNG stream, one batch), and each is replayed in the env from the episode's ``(seed, episode_id)``
(`composer_diloco.channels.replay.score_candidate`):

- ``accepted``: the call ran without a tool error (the env's verdict on that one action);
- ``correct``: the call is one of the env's scripted solver's calls not yet made successfully at that point (the
  DPO ``"scripted"`` teacher's script), i.e. a recovery that leads towards the answer;
- ``logp(correct)``: log-probability (nats, summed over its tokens) of that scripted call under each context, a
  noise-free version of the same question: does the hint make the right recovery more likely?

DPO (Rafailov et al., arXiv 2305.18290): the trace-replay pairs `composer_diloco.channels.dpo_pairs.collect_pairs`
builds from the same episodes, with the run's ``[preference]`` settings and every error site (no ``max_sites`` cap):
pair counts by chosen/rejected source, how often the chosen call is a useful one (as ``correct`` above: a call of the
scripted solution not yet made; the pairing's own score only asks whether the call ran without error), chosen and
rejected token lengths, and the policy's summed and per-token log-probabilities of each. At the round start the policy is its own reference, so the DPO logit is 0; what the
lengths decide is how hard each side is pushed: the gradient of a summed log-ratio grows with the tokens it sums.
``dpo_script_progress`` repeats this with ``[loss] dpo_score = "script_progress"`` (the same candidates' draws).

A teacher that knows more (issue 40): ``--hint-rate R`` diagnoses the warm start whose demonstrations show the hint
after their failed call in a share R (``[warmstart] hint_rate``: a policy taught to read hints); ``--peer-demo-reward
X`` gives the teacher a successful attempt of the task's GRPO group too (``[loss] sdpo_peer_demo_reward``: the
episodes are then played in groups of ``num_generations``, and the summary splits the sites with a peer attempt from
those without).

Usage (about 20 s on 2 quiet CPU cores; the warm start comes from the cache, `composer_diloco.policy.load`):

    python bench/channel_diagnosis.py --episodes 256 --samples 8 --out runs/channel-diagnosis.json
    python bench/channel_diagnosis.py --episodes 256 --samples 8 --hint-rate 0.5 --peer-demo-reward 1.0
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from composer_diloco.channels.dpo_pairs import collect_pairs
from composer_diloco.channels.replay import Candidate, ReplayError, score_candidate
from composer_diloco.channels.dpo_teachers import make_teachers, render_tool_call, script_progress
from composer_diloco.channels.losses import sequence_logprobs
from composer_diloco.config import RunConfig, load_config
from composer_diloco.channels.sdpo_sites import SdpoStats, SiteFinder, peer_demos, successful_calls
from composer_diloco.channels.sdpo import SdpoSettings
from composer_diloco.inner.trainer import ComposerGRPOTrainer, grpo_args, play_rollout
from composer_diloco.policy.load import load_run_policy
from composer_diloco.rollout.chat import parse_tool_call
from composer_diloco.rollout.env_package import load_env_package
from composer_diloco.rollout.episodes import generate_turns

__all__ = ["diagnose", "main"]


def _mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (sample std / sqrt(n)); (nan, nan) for no values."""
    if not values:
        return math.nan, math.nan
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, math.sqrt(var / n)


@torch.no_grad()
def _logp(model: torch.nn.Module, context: list[int], response: list[int]) -> float:
    """log p(response | context) in nats, summed over the response's tokens (one forward pass)."""
    ids = torch.tensor([context + response])
    mask = torch.zeros_like(ids)
    mask[0, len(context):] = 1
    return float(sequence_logprobs(model(input_ids=ids).logits, ids, mask)[0])


def _remaining(script, episode, turn: int) -> set[str]:
    """The scripted solver's calls not yet made successfully before ``turn`` (JSON keys ``[name, arguments]``): any
    of them is a useful next call (the script's order of the two lookups is arbitrary)."""
    calls = script(episode.seed, episode.episode_id, episode.turns[0].content) or []
    left = [json.dumps([n, a], sort_keys=True) for n, a in calls]
    for name, args in successful_calls(episode.turns[:turn + 1]):
        made = json.dumps([name, args], sort_keys=True)
        if made in left:
            left.remove(made)
    return set(left)


def _sdpo(model, tok, episodes, session, hints, scripted, script, samples: int, max_turn_tokens: int,
          temperature: float, max_seq_len: int, peer_demo_reward: float | None = None) -> dict[str, Any]:
    """The SDPO half of `diagnose` (see the module docstring)."""
    collator = SiteFinder(tok, hints=hints, max_length=max_seq_len)
    stats = SdpoStats()
    demos = peer_demos(episodes, peer_demo_reward) if peer_demo_reward is not None else [None] * len(episodes)
    found = [(ep, site, demo is not None) for ep, demo in zip(episodes, demos)
             for site in collator.sites_from_episode(ep, stats, demo)]
    sites = [site for _, site, _ in found]
    episode_of = [ep for ep, _, _ in found]
    requests, owners = [], []
    for k, site in enumerate(sites):
        student = site.student_ids[:site.student_idx[0]]  # up to and including the recovery turn's header
        teacher = site.teacher_ids[:site.teacher_idx[0]]
        for _ in range(samples):
            requests += [student, teacher]
            owners += [(k, "student"), (k, "teacher")]
    generated = generate_turns(model, tok, requests, max_turn_tokens, temperature)[0] if requests else []
    rows: list[dict[str, Any]] = [dict(error_kind=s.error_kind, student=[], teacher=[]) for s in sites]
    for (k, who), ids in zip(owners, generated):
        rows[k][who].append(ids)
    per_site = []
    for site, row, ep, (_, _, with_demo) in zip(sites, rows, episode_of, found):
        proposal = scripted(ep, site.turn)
        useful = _remaining(script, ep, site.turn)
        out: dict[str, Any] = dict(error_kind=site.error_kind, hint=site.hint, with_demo=with_demo,
                                   error=ep.turns[site.turn - 1].content, recorded=ep.turns[site.turn].content,
                                   samples={w: [tok.decode(i, skip_special_tokens=True) for i in row[w][:2]]
                                            for w in ("student", "teacher")})
        for who in ("student", "teacher"):
            accepted, correct = [], []
            for ids in row[who]:
                text = tok.decode(ids, skip_special_tokens=False)
                call = parse_tool_call(text) if ids and ids[-1] == tok.eos_token_id else parse_tool_call("")
                try:
                    score = score_candidate(session, ep, site.turn, Candidate(who, text, list(ids), call))
                except ReplayError:
                    score = math.nan
                accepted.append(score)
                correct.append(float(call.ok and json.dumps([call.name, call.arguments], sort_keys=True) in useful))
            out[f"{who}_accepted"] = sum(accepted) / len(accepted)
            out[f"{who}_correct"] = sum(correct) / len(correct)
        if proposal is not None:
            _, resp = render_tool_call(tok, *proposal)
            out["student_logp_correct"] = _logp(model, site.student_ids[:site.student_idx[0]], resp)
            out["teacher_logp_correct"] = _logp(model, site.teacher_ids[:site.teacher_idx[0]], resp)
        per_site.append(out)
    summary: dict[str, Any] = dict(sites=len(sites), counts=stats.as_dict(),
                                   error_kinds=dict(Counter(s.error_kind for s in sites)))
    for key in ("accepted", "correct"):
        s = [r[f"student_{key}"] for r in per_site]
        t = [r[f"teacher_{key}"] for r in per_site]
        summary[f"student_{key}"] = _mean_se(s)
        summary[f"teacher_{key}"] = _mean_se(t)
        summary[f"teacher_minus_student_{key}"] = _mean_se([b - a for a, b in zip(s, t)])
        summary[f"sites_teacher_better_{key}"] = sum(b > a for a, b in zip(s, t))
        summary[f"sites_teacher_worse_{key}"] = sum(b < a for a, b in zip(s, t))
    lp = [r for r in per_site if "student_logp_correct" in r]
    summary["logp_correct_student"] = _mean_se([r["student_logp_correct"] for r in lp])
    summary["logp_correct_teacher"] = _mean_se([r["teacher_logp_correct"] for r in lp])
    summary["logp_correct_teacher_minus_student"] = _mean_se(
        [r["teacher_logp_correct"] - r["student_logp_correct"] for r in lp])
    by_kind = {}
    for kind in sorted({r["error_kind"] for r in per_site}):
        rs = [r for r in per_site if r["error_kind"] == kind]
        by_kind[kind] = dict(sites=len(rs), **{f"{w}_{key}": _mean_se([r[f"{w}_{key}"] for r in rs])[0]
                                               for w in ("student", "teacher") for key in ("accepted", "correct")})
    summary["by_error_kind"] = by_kind
    if peer_demo_reward is not None:  # the sites whose teacher saw a successful peer attempt, and the others
        for label, rs in (("with_peer_demo", [r for r in per_site if r["with_demo"]]),
                          ("without_peer_demo", [r for r in per_site if not r["with_demo"]])):
            summary[label] = dict(sites=len(rs), **{
                f"{w}_{key}": _mean_se([r[f"{w}_{key}"] for r in rs]) for w in ("student", "teacher")
                for key in ("accepted", "correct")},
                teacher_minus_student_correct=_mean_se([r["teacher_correct"] - r["student_correct"] for r in rs]))
    summary["examples"] = [{k: r[k] for k in ("error_kind", "error", "hint", "recorded", "samples")}
                           for r in per_site[:6]]
    return summary


def _dpo(model, tok, episodes, session, hints, teachers, script, config: RunConfig, progress=None) -> dict[str, Any]:
    """The DPO half of `diagnose` (see the module docstring)."""
    by_id = {ep.episode_id: ep for ep in episodes}
    p = config.preference
    pairs, stats = collect_pairs(model, tok, episodes, session, hints=hints, teachers=teachers, mode=p.mode,
                                 min_score_diff=p.min_score_diff, max_pairs_per_turn=p.max_pairs_per_turn,
                                 max_sites=10**9, max_turn_tokens=config.env.max_turn_tokens,
                                 temperature=config.grpo.temperature, progress=progress)
    rows = []
    for pair in pairs:
        lc = _logp(model, pair.prompt_ids, pair.chosen_ids)
        lr = _logp(model, pair.prompt_ids, pair.rejected_ids)
        call = parse_tool_call(tok.decode(pair.chosen_ids, skip_special_tokens=False))
        useful = _remaining(script, by_id[pair.episode_id], pair.turn)
        rows.append(dict(chosen_len=len(pair.chosen_ids), rejected_len=len(pair.rejected_ids), logp_chosen=lc,
                         logp_rejected=lr, sources=f"{pair.chosen_source}>{pair.rejected_source}",
                         chosen_useful=float(call.ok and json.dumps([call.name, call.arguments], sort_keys=True)
                                             in useful)))
    out: dict[str, Any] = dict(pairs=len(pairs), pair_stats={k: int(v) for k, v in stats.as_dict().items()},
                               sources=dict(Counter(r["sources"] for r in rows)))
    out["chosen_useful_by_source"] = {src: _mean_se([r["chosen_useful"] for r in rows if r["sources"] == src])[0]
                                      for src in out["sources"]}
    for key in ("chosen_useful", "chosen_len", "rejected_len", "logp_chosen", "logp_rejected"):
        out[key] = _mean_se([r[key] for r in rows])
    out["len_diff"] = _mean_se([r["chosen_len"] - r["rejected_len"] for r in rows])
    out["abs_len_diff_over_mean_len"] = (sum(abs(r["chosen_len"] - r["rejected_len"]) for r in rows)
                                         / max(sum((r["chosen_len"] + r["rejected_len"]) / 2 for r in rows), 1))
    out["logp_per_token_chosen"] = _mean_se([r["logp_chosen"] / r["chosen_len"] for r in rows])
    out["logp_per_token_rejected"] = _mean_se([r["logp_rejected"] / r["rejected_len"] for r in rows])
    return out


def diagnose(config: RunConfig, *, episodes: int, samples: int, seed: int) -> dict[str, Any]:
    """Play ``episodes`` warm-start episodes and measure both channels at their sites (see the module docstring).

    Args:
        config: the run config (its env, warm start, ``[loss]``, ``[preference]``, ``[hints]``).
        episodes: episodes to play (ids ``diag-i``, seed ``config.seed``), >= 1.
        samples: continuations sampled per site and context (student, teacher), >= 1.
        seed: torch seed of the episodes' and the samples' sampling.
    Returns:
        ``{"episodes", "episode_reward", "sdpo_sites_per_node_round", "dpo_pairs_per_node_round", "sdpo", "dpo",
        "dpo_script_progress", "seconds"}`` (JSON-serialisable).
    """
    t0 = time.monotonic()
    model, tok = load_run_policy(config)
    env = load_env_package(config.env.server_module)
    sessions = [env.local_session(max_tool_calls=config.env.max_tool_calls, reset_kwargs=config.env.reset_kwargs)
                for _ in range(config.batch_size)]
    with tempfile.TemporaryDirectory() as scratch:
        trainer = ComposerGRPOTrainer(model=model, tokenizer=tok, config=config, sessions=sessions, peer_name="diag",
                                      args=grpo_args(config, output_dir=Path(scratch), max_steps=1, use_cpu=True,
                                                     bf16=False), env=env)
        torch.manual_seed(seed)
        played = []
        # tasks in GRPO groups (each played num_generations times, as a node's step plays them) when the teacher
        # sees a successful peer attempt of the group; else one episode per task
        peer_demo_reward = SdpoSettings.of(config.loss).sdpo_peer_demo_reward
        group = config.grpo.num_generations if peer_demo_reward is not None else 1
        all_keys = [(config.seed, f"diag-{i // group}") for i in range(episodes)]
        for first in range(0, episodes, config.batch_size):
            played += play_rollout(trainer, sessions, config, all_keys[first:first + config.batch_size])[0]
        model.eval()
        scripted = make_teachers(["scripted"], env)["scripted"]
        sdpo = _sdpo(model, tok, played, sessions[0], trainer.hints, scripted, env.script, samples,
                     config.env.max_turn_tokens, config.grpo.temperature, config.max_seq_len,
                     peer_demo_reward)
        rng = torch.get_rng_state()  # the DPO candidates' draws, the same for both scores
        dpo = _dpo(model, tok, played, sessions[0], trainer.hints, make_teachers(config.preference.teachers, env),
                   env.script, config)
        torch.set_rng_state(rng)
        dpo_progress = _dpo(model, tok, played, sessions[0], trainer.hints,
                            make_teachers(config.preference.teachers, env), env.script, config,
                            progress=script_progress(env))
    per_round = config.inner_steps * config.batch_size  # episodes one node plays in a round
    return dict(episodes=len(played), episode_reward=_mean_se([e.reward for e in played]),
                sdpo_sites_per_node_round=sdpo["sites"] / len(played) * per_round,
                dpo_pairs_per_node_round=dpo["pairs"] / len(played) * per_round,
                sdpo=sdpo, dpo=dpo, dpo_script_progress=dpo_progress, seconds=round(time.monotonic() - t0, 1))


def main(argv: list[str] | None = None) -> int:
    """``python bench/channel_diagnosis.py [--config run.toml] [--episodes N] [--samples K] [--out file.json]``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="run config TOML (default: the embedded default run)")
    ap.add_argument("--episodes", type=int, default=256)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hint-rate", type=float, default=None,
                    help="[warmstart] hint_rate of the warm start to diagnose (default: the config's)")
    ap.add_argument("--peer-demo-reward", type=float, default=None,
                    help="[loss] sdpo_peer_demo_reward: the teacher also sees a successful attempt of the task's GRPO "
                         "group (episodes are then played in groups of num_generations)")
    ap.add_argument("--out", default=None, help="also write the result as JSON here")
    a = ap.parse_args(argv)
    if a.episodes < 1 or a.samples < 1:
        ap.error(f"--episodes and --samples must be >= 1, got {a.episodes} and {a.samples}")
    config = load_config(a.config) if a.config else RunConfig()
    if a.hint_rate is not None:
        config = config.model_copy(update={"warmstart": config.warmstart.model_copy(update={"hint_rate": a.hint_rate})})
    if a.hint_rate is not None or a.peer_demo_reward is not None:
        data = config.model_dump()
        if a.peer_demo_reward is not None:
            data["loss"]["sdpo_peer_demo_reward"] = a.peer_demo_reward
        config = RunConfig.model_validate(data)  # a bad value: the config's one-line error
    result = diagnose(config, episodes=a.episodes, samples=a.samples, seed=a.seed)
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

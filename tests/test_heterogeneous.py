"""Heterogeneous nodes: each node picks its micro-batch, gradient accumulation and precision.

- One optimizer step with K=2 micro-batches of 4 episodes has the gradients of K=1 with one batch of 8, composite
  loss on (GRPO + SDPO + DPO), through the trainer's real `train()` (TRL's loop, our rollout, collator, pairs).
- Bad ``--batch-size`` / ``--grad-accum`` / ``--dtype`` values: one line naming the value, exit 1.
- Two real nodes with different batches in one run, the coordinator weighting their pseudo-gradients by samples:
  `tests/test_faults.py::test_slow_node_stops_at_the_round_budget_and_is_weighted_for_what_it_did` (one run with
  the slow node's: the suite's time).
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import prefork
import pytest
from tests_support import error_line, imported_modules
import torch
from transformers import TrainerCallback

from composer_diloco.channels import dpo as dpo_channel
from composer_diloco.channels import dpo_pairs as preference
from composer_diloco.channels import sdpo as sdpo_channel
from composer_diloco.rollout import episodes as rollout
from composer_diloco.config import LossConfig, RunConfig
from composer_diloco.policy import build_tiny_model, load_default_tokenizer
from composer_diloco.rollout.episodes import EnvSession
from composer_diloco.inner.trainer import ComposerGRPOTrainer, episode_dataset, grpo_args
from envs.tool_env.models import ToolAction
from envs.tool_env.server.tool_environment import ToolEnvironment
from envs.tool_env.tasks import ITEM_VOCAB, make_task, solve
from nodes.device import BatchError, DeviceError, NodeBatch, Placement
from episode_support import tool_call_ids

ROOT = Path(__file__).resolve().parents[1]
PEER = "hetero"


# ------------------------------------------------------------------------------- K micro-batches == one batch


class LocalSession(EnvSession):
    """`envs.tool_env`'s environment in this process: the episodes its server plays, without a socket."""

    def __init__(self, max_tool_calls: int):
        self.env, self.max_tool_calls = ToolEnvironment(), max_tool_calls

    def reset(self, seed: int, episode_id: str) -> tuple[str, list[dict]]:
        obs = self.env.reset(seed=seed, episode_id=episode_id, max_tool_calls=self.max_tool_calls)
        return obs.question, list(obs.tools)

    def call(self, tool: str, arguments: dict) -> tuple[str, str | None, dict, float, bool]:
        obs = self.env.step(ToolAction(tool=tool, arguments=arguments))
        return obs.content, obs.error_kind, dict(obs.error_meta), float(obs.reward or 0.0), bool(obs.done)


def group_scripts(seed: int, episode_id: str) -> list[list[tuple[str, dict]]]:
    """The G=4 episodes of one task: solved; an unknown item looked up first; an unknown tool and a wrong answer;
    a wrong answer. Rewards 1, 1, 0, 0 (GRPO advantages are non-zero); two error sites (SDPO sites, DPO sites)."""
    task = make_task(seed, episode_id)
    good = solve(task, random.Random(0), 0.0)  # lookup x, lookup y, op, submit
    outside = next(item for item in ITEM_VOCAB if item not in task.catalogue)
    wrong = [("submit", {"answer": task.answer + 1})]
    return [
        good,
        [("lookup", {"item": outside})] + good,
        good[:2] + [("sum", dict(good[2][1]))] + good[2:3] + wrong,
        good[:3] + wrong,
    ]


def scripted_sampler(tok, scripts):
    """Stands in for `rollout.generate_turns`: at lock-step turn j, every episode still playing emits its scripted call."""
    turn = itertools.count()

    def generate(model, tokenizer, contexts, max_new_tokens, temperature, cache=None):
        j = next(turn)
        active = [s for s in scripts if len(s) > j]  # every script ends with a submit, which ends the episode
        assert len(contexts) == len(active)
        ids = [tool_call_ids(tok, *s[j]) for s in active]
        return ids, [[-0.5] * len(x) for x in ids]

    return generate


def fixed_candidate(tok):
    """Stands in for the DPO candidates' sampler (`preference.generate_turns`): a lookup of an unknown item, always."""

    def generate(model, tokenizer, contexts, max_new_tokens, temperature, cache=None):
        ids = tool_call_ids(tok, "lookup", {"item": "zzz"})
        return [list(ids) for _ in contexts], [[-0.5] * len(ids) for _ in contexts]

    return generate


class GradCapture(TrainerCallback):
    """Keeps a copy of every parameter's gradient right before the optimizer step."""

    def __init__(self):
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def one_step(tmp_path: Path, monkeypatch, *, loss_type: str, micro_batch: int, grad_accum: int):
    """One optimizer step of `ComposerGRPOTrainer.train()` on the same 8 scripted episodes; returns the gradients,
    the step's `StepLosses` and how many SDPO/DPO loss calls there were.

    Gradients, not updated weights, are compared: AdamW's first step is ``lr * g / (|g| + eps)``, so a gradient
    entry near 0 turns float rounding into a visible weight difference."""
    tok = load_default_tokenizer()
    model = build_tiny_model(tok, seed=0)
    config = RunConfig(loss=LossConfig(alpha_sdpo=0.5, beta_dpo=0.5), grpo={"loss_type": loss_type},
                       inner={"max_grad_norm": 1e6})  # no clipping: a wrong overall scale must show
    args = grpo_args(config, output_dir=tmp_path / f"k{grad_accum}", max_steps=1, use_cpu=True, bf16=False,
                     micro_batch=micro_batch, grad_accum=grad_accum)
    rows = episode_dataset(config, PEER, 2)  # the two tasks of the first generation batch, G episodes each
    scripts = [s for row in rows for s in group_scripts(config.seed, row["episode_id"])]
    capture = GradCapture()
    calls = {"sdpo": 0, "dpo": 0}

    def counting(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    trainer = ComposerGRPOTrainer(model=model, tokenizer=tok, config=config, peer_name=PEER, args=args,
                                  sessions=[LocalSession(config.env.max_tool_calls) for _ in range(8)],
                                  callbacks=[capture])
    with monkeypatch.context() as m:
        m.setattr(rollout, "generate_turns", scripted_sampler(tok, scripts))
        m.setattr(preference, "generate_turns", fixed_candidate(tok))
        m.setattr(sdpo_channel, "sdpo_loss", counting("sdpo", sdpo_channel.sdpo_loss))
        m.setattr(dpo_channel, "dpo_loss", counting("dpo", dpo_channel.dpo_loss))
        trainer.train()
    stats = trainer.take_round_stats()
    episodes, losses = stats.episodes, stats.steps
    assert [e.reward for e in episodes] == [1.0, 1.0, 0.0, 0.0] * 2
    assert len(losses) == 1  # one record per optimizer step, whatever K
    return capture.grads, losses[0], calls


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_micro_batches_give_the_gradients_of_one_batch(tmp_path, monkeypatch, loss_type):
    g1, rec1, calls1 = one_step(tmp_path, monkeypatch, loss_type=loss_type, micro_batch=8, grad_accum=1)
    g2, rec2, calls2 = one_step(tmp_path, monkeypatch, loss_type=loss_type, micro_batch=4, grad_accum=2)
    # the composite loss had all three channels, and K=2 cut the SDPO sites and DPO pairs across both micro-batches
    assert rec1.sdpo_sites == rec2.sdpo_sites == 4 and rec1.dpo_pairs == rec2.dpo_pairs > 0
    assert calls1 == {"sdpo": 1, "dpo": 1} and calls2 == {"sdpo": 2, "dpo": 2}
    for key in ("loss_grpo", "loss_sdpo", "loss_dpo"):
        assert getattr(rec2, key) == pytest.approx(getattr(rec1, key), rel=1e-5, abs=1e-7), key
    assert rec1.loss_sdpo > 0 and rec1.loss_dpo > 0
    assert g1.keys() == g2.keys() and len(g1) > 0
    flat1 = torch.cat([g.flatten() for g in g1.values()])
    flat2 = torch.cat([g2[n].flatten() for n in g1])
    assert flat1.norm() > 0
    assert torch.allclose(flat2, flat1, rtol=1e-4, atol=1e-6 * float(flat1.abs().max())), \
        float((flat2 - flat1).abs().max())


def test_channel_split_weights_add_up_to_the_whole_batch():
    """The chunks' weights are the shares of SDPO tokens and DPO pairs; padding beyond a chunk's rows is cut."""
    valid = torch.zeros(3, 5, dtype=torch.bool)
    valid[0, :5], valid[1, :1], valid[2, :2] = True, True, True
    att = torch.tensor([[1] * 9, [1] * 4 + [0] * 5, [1] * 6 + [0] * 3])
    t = {"sdpo_student_ids": att.clone(), "sdpo_student_attention_mask": att, "sdpo_student_mask": att.bool(),
         "sdpo_teacher_ids": att.clone(), "sdpo_teacher_attention_mask": att, "sdpo_teacher_mask": att.bool(),
         "student_response_idx": valid.long(), "teacher_response_idx": valid.long(),
         "student_response_valid": valid, "teacher_response_valid": valid.clone()}
    parts = sdpo_channel.split_sdpo(t, 2)
    assert [p.count for p in parts] == [2, 1]
    assert [p.weight for p in parts] == pytest.approx([6 / 8, 2 / 8])
    assert parts[1].rows["sdpo_student_ids"].shape == (1, 6)  # padding beyond the chunk's longest row is cut
    assert parts[1].rows["student_response_idx"].shape == (1, 2)
    assert sdpo_channel.split_sdpo(t, 1)[0].weight == 1.0
    assert [p.count for p in sdpo_channel.split_sdpo(t, 5)] == [1, 1, 1, 0, 0]
    assert sdpo_channel.split_sdpo(t, 5)[4].rows is None
    with pytest.raises(ValueError, match="parts 0"):
        sdpo_channel.split_sdpo(t, 0)
    # DPO: weights are the shares of pairs
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    d = {f"dpo_{n}_{k}": mask.clone() for n in ("chosen", "rejected") for k in ("ids", "attention_mask", "response_mask")}
    d.update(dpo_ref_chosen_logps=torch.zeros(3), dpo_ref_rejected_logps=torch.zeros(3))
    dparts = dpo_channel.split_dpo(d, 2)
    assert [p.count for p in dparts] == [2, 1] and [p.weight for p in dparts] == pytest.approx([2 / 3, 1 / 3])
    assert dparts[1].rows["dpo_chosen_ids"].shape == (1, 1)


# ------------------------------------------------------------------------------------------- resolution rules


def test_node_batch_resolution():
    config = RunConfig()  # G = 4, tasks_per_step = 2
    default = NodeBatch.resolve(config)
    assert (default.micro_batch, default.grad_accum, default.episodes_per_step) == (8, 1, 8)
    small = NodeBatch.resolve(config, 2, 6)
    assert (small.episodes_per_step, small.tasks_per_step) == (12, 3)  # a micro-batch need not hold a whole group
    with pytest.raises(BatchError, match=r"--batch-size 3 x --grad-accum 1 = 3 .* num_generations 4"):
        NodeBatch.resolve(config, 3, 1)
    with pytest.raises(BatchError, match="--grad-accum 0"):
        NodeBatch.resolve(config, 4, 0)
    with pytest.raises(ValueError, match="micro_batch 3 x grad_accum 1"):
        grpo_args(config, output_dir=Path("unused"), max_steps=1, use_cpu=True, bf16=False, micro_batch=3)


def test_placement_precision_on_this_machine():
    cpu = Placement.resolve("cpu", "auto")
    assert (cpu.use_cpu, cpu.bf16, cpu.describe()) == (True, False, "cpu, fp32")
    assert Placement.resolve("cpu", "fp32") == cpu
    rehearsal = Placement.resolve("cpu", "bf16")  # CPU autocast, only when asked for
    assert (rehearsal.use_cpu, rehearsal.bf16, rehearsal.describe()) == (True, True, "cpu, bf16")
    with pytest.raises(DeviceError, match="--dtype 'fp16' is not one of auto, fp32, bf16"):
        Placement.resolve("cpu", "fp16")
    if torch.cuda.is_available():
        gpu = Placement.resolve("cuda:0", "auto")
        assert gpu.bf16 == torch.cuda.is_bf16_supported(including_emulation=False)
        assert not Placement.resolve("cuda:0", "fp32").bf16


def test_cpu_nodes_sharing_cores_are_warned_unless_threads_are_set():
    """`cpu_oversubscription`: N CPU nodes at torch's default (a thread per core) on C cores, no OMP_NUM_THREADS."""
    from nodes.device import cpu_oversubscription

    line = cpu_oversubscription(cores=2, threads=2, other_nodes=1, omp_env=None)
    assert line and "2 CPU nodes share this machine's 2 cores" in line and "OMP_NUM_THREADS=1" in line
    assert "OMP_NUM_THREADS=4" in cpu_oversubscription(cores=16, threads=16, other_nodes=3, omp_env=None)
    assert cpu_oversubscription(cores=2, threads=2, other_nodes=1, omp_env="2") is None  # the user chose
    assert cpu_oversubscription(cores=2, threads=2, other_nodes=0, omp_env=None) is None  # alone
    assert cpu_oversubscription(cores=2, threads=1, other_nodes=1, omp_env=None) is None  # they fit


def test_other_local_nodes_counts_node_processes_by_command_line():
    from nodes.device import other_local_nodes

    before = other_local_nodes()
    # a stand-in node that forks a child, as hivemind's DHT and averager processes are: one node, not two
    forking = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nelse:\n    time.sleep(60)\n"
    sleeper = subprocess.Popen([sys.executable, "-c", forking, "nodes join"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(psutil.Process(sleeper.pid).children()) < 1:
            assert time.monotonic() < deadline, "the stand-in did not fork"
            time.sleep(0.05)
        assert other_local_nodes() == before + 1
    finally:
        os.killpg(sleeper.pid, signal.SIGKILL)
        sleeper.wait()
    assert other_local_nodes() == before


# ------------------------------------------------------------------------------------- bad input, one line, exit 1


DEAD_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def join(tmp_path: Path, *args: str, timeout_s: float = 120, python: tuple[str, ...] = ()
         ) -> subprocess.CompletedProcess:
    return prefork.run([sys.executable, *python, "-m", "nodes", "join", "--peer", DEAD_PEER, "--run-dir",
                        str(tmp_path), *args], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("args", "expected"), [
    (("--batch-size", "0"), "--batch-size 0: expected a number of episodes >= 1"),
    (("--grad-accum", "-1"), "--grad-accum -1: expected a number of micro-batches >= 1"),
    (("--dtype", "fp16"), "--dtype 'fp16' is not one of auto, fp32, bf16"),
    (("--device", "cuda:0x"), "--device 'cuda:0x': expected cuda:N with N a GPU index"),
    (("--device", "cudax"), "--device 'cudax': expected cuda:N with N a GPU index"),
    (("--env-sessions", "0"), "--env-sessions 0: expected at least 1 session per env URL"),
    (("--task-shard", "2/2"), "--task-shard '2/2': expected K/N with 0 <= K < N"),
    (("--env-url", "localhost:8000"), "--env-url 'localhost:8000' is not a URL: expected http://HOST:PORT"),
    (("--rollout", "vllm"), "--rollout 'vllm': expected one of auto, batched, continuous"),
    (("--rollout", "continuous", "--dtype", "bf16"), "--rollout continuous on a bf16 node: "),
])
def test_bad_node_options_fail_before_the_heavy_imports(tmp_path, args, expected):
    """Checked by `NodeOptions.check` before torch, TRL and hivemind are imported (``-X importtime`` lists every
    module a process imports), so before the DHT too: the dead peer is never reached."""
    r = join(tmp_path, *args, python=("-X", "importtime"))
    assert r.returncode == 1 and expected in error_line(r)
    imported = imported_modules(r)
    assert "typer" in imported and not {"torch", "hivemind", "transformers"} & imported, sorted(imported)[:20]
    assert not list(tmp_path.rglob("metrics.jsonl"))


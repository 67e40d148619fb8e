"""The memory plan (`composer_diloco.policy.memory_plan`): its figures against what one inner step allocates on CPU, the
one-line refusal of a plan that does not fit, the rows it plans, the micro-batch a node picks from it (and a real run
with it), the measured peak next to the plan in every round's line, and a ``--model`` folder without a chat
template."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import prefork
from tests_support import error_line

from composer_diloco.config import LoraSection, LossConfig, load_config
from composer_diloco.policy.memory_plan import (
    DEVICE_MEMORY_ENV,
    REPLY_SLACK,
    RUNTIME_HOST_BYTES,
    DeviceMemoryError,
    PeakMemory,
    PlanInputs,
    check_plan,
    choose_batch,
    device_free_bytes,
    model_shape,
    plan_for_run,
    plan_inputs,
    plan_memory,
    round_memory,
    row_bound,
)

ROOT = Path(__file__).resolve().parents[1]
DEAD_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"

MEASURE = """
import json, sys, torch
from transformers import Qwen3Config
from composer_diloco.config import LoraSection
from composer_diloco.policy import build_tiny_model, load_default_tokenizer, tiny_model_config
from composer_diloco.policy.memory_measure import measure_training_bytes
from composer_diloco.policy.memory_plan import model_shape, plan_memory
kind, lora, bf16 = sys.argv[1], sys.argv[2] == "lora", sys.argv[3] == "bf16"
tok = load_default_tokenizer()
small = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             head_dim=32, vocab_size=8192)
overrides = {} if kind == "default" else small
cfg = tiny_model_config(tok, 0, **overrides)
model = build_tiny_model(tok, 0, **overrides)
section = LoraSection(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]) if lora else None
if section is not None:
    from composer_diloco.policy.lora import apply_lora
    model = apply_lora(model, section)
torch.set_num_threads(1)
measured = measure_training_bytes(model, rows=4, seq_len=512, reference=True, lora=lora, bf16=bf16)
shape = model_shape(cfg, section)
from dataclasses import replace
from composer_diloco.channels.dpo import DpoChannel, DpoSettings
from composer_diloco.config import RunConfig
from composer_diloco.policy.memory_plan import StepShape
dpo = DpoChannel.memory(DpoSettings(), RunConfig(), StepShape(shape, 4, 1, 512, 512, bf16))
reference_only = replace(dpo, rows=0, backward_rows=0, peak=0, kept=0, phase=0)  # as measured: the copy, no pair
plan = plan_memory(shape, micro_batch=4, seq_len=512, bf16=bf16, channels=[reference_only])
print(json.dumps({"measured": measured, "state": plan.optimizer + plan.reference, "gradients": plan.gradients,
                  "activations": plan.activations, "peak": plan.optimizer + plan.reference + plan.training_peak}))
"""


# the default run measures two cases (each in its own process, ~7 s of CPU, mostly imports); the other three ask the
# same code other questions (LoRA in fp32, the full model and its reference copy in bf16) and run with `-m bench`
CASES = [("default", "full", "fp32"), ("small", "lora", "bf16")]
BENCH_CASES = [("small", "full", "fp32"), ("small", "lora", "fp32"), ("small", "full", "bf16")]


@pytest.fixture(scope="module")
def measurements(request):
    """Every case of `test_plan_matches_measured_allocations` this session runs, measured at once, each in its own
    fresh process (the resident set is per process; torch runs one thread in each)."""
    selected = {tuple(item.callspec.params[k] for k in ("kind", "mode", "dtype")) for item in request.session.items
                if item.originalname == "test_plan_matches_measured_allocations"}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = {case: subprocess.Popen([sys.executable, "-c", MEASURE, *case], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=ROOT) for case in CASES + BENCH_CASES
             if case in selected}
    try:
        yield {case: (proc, *proc.communicate(timeout=200)) for case, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind,mode,dtype",
                         CASES + [pytest.param(*case, marks=pytest.mark.bench) for case in BENCH_CASES])
def test_plan_matches_measured_allocations(measurements, kind, mode, dtype):
    """AdamW + the reference (measured once allocated), and the peak of one inner step over a micro-batch of 4 rows x
    512 tokens (state + the gradients backward creates + activations + the step's temporaries), as planned against the
    resident-set growth in a fresh process (glibc maps every tensor >= 64 KiB on its own, so the resident set follows
    the allocations): the state within 10 %, the activations (peak - state - gradients) within 15 %, the whole peak
    within 10 %. The embedded default is
    0.9 M parameters (vocab 878), the small random model 5.2 M (hidden 256, 4 layers, vocab 8192). bf16 is a
    ``--dtype bf16`` node rehearsed on CPU autocast: the reference copy's linear weights in bf16 (full fine-tuning), the
    LoRA base's likewise."""
    proc, stdout, stderr = measurements[(kind, mode, dtype)]
    assert proc.returncode == 0, stderr[-2000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    m = out["measured"]
    # a LoRA state is < 1 MB: the resident set moves in pages and small allocations, so 256 KiB of slack
    assert m["state"] == pytest.approx(out["state"], rel=0.10, abs=256 * 1024), out
    assert m["gradients"] == out["gradients"], out
    assert m["activations"] == pytest.approx(out["activations"], rel=0.15), out
    assert m["peak"] == pytest.approx(out["peak"], rel=0.10), out


def test_bytes_per_parameter_follow_the_code():
    """Full fine-tuning: 4 (weights) + 4 (gradients) + 8 (AdamW) + 4 (the DPO reference copy, 2 for its linear weights
    under bf16) bytes per parameter on the device, and theta + pseudo-gradient + the outer state (Delayed Nesterov's
    momentum and running sum) + a resync's download buffers (theta and the outer state again) in host RAM; LoRA: the
    base's 4 bytes per parameter (2 for its linear weights under bf16) and 16 per adapter parameter, no reference
    copy."""
    # a model run's default outer optimizer, Delayed Nesterov (two state tensors); DPO on (it defaults off): a reference
    config = load_config(None, model="some/model", loss=LossConfig(beta_dpo=0.2))
    from composer_diloco.policy import load_default_tokenizer, tiny_model_config

    cfg = tiny_model_config(load_default_tokenizer(), 0)
    full = check_plan(config, cfg, micro_batch=8, grad_accum=1, device="cuda:0", bf16=True,
                      gradient_checkpointing=False, free=None)
    p, lin = full.shape.params_total, full.shape.linear
    assert 0 < lin < p and full.shape.frozen_linear == 0  # full fine-tuning: every weight trains, kept fp32
    # bf16: the DPO reference copy keeps its linear weights in bf16 (2 bytes), its embedding and norms in fp32
    assert (full.weights, full.gradients, full.optimizer, full.reference) == (4 * p, 4 * p, 8 * p, 4 * p - 2 * lin)
    assert full.host == 4 * p * (1 + 1 + 2 + 3) + RUNTIME_HOST_BYTES  # + the process's own allocations
    assert full.host_bytes == full.host + 4 * p  # + the model as loaded on the CPU
    lora_config = load_config(None, model="some/model", lora=LoraSection(r=16, lora_alpha=32))
    lora = check_plan(lora_config, cfg, micro_batch=8, grad_accum=1, device="cuda:0", bf16=True,
                      gradient_checkpointing=False, free=None)
    t = lora.shape.params_trainable
    assert 0 < t < p // 10 and lora.shape.params_total == p + t
    frozen = lora.shape.frozen_linear  # the base's linear weights, stored in bf16 under bf16
    assert frozen == lin  # every linear weight of the base is frozen; the adapters train in fp32
    assert (lora.weights, lora.gradients, lora.optimizer, lora.reference) == (4 * (p + t) - 2 * frozen, 4 * t, 8 * t, 0)
    fp32 = check_plan(lora_config, cfg, micro_batch=8, grad_accum=1, device="cuda:0", bf16=False,
                      gradient_checkpointing=False, free=None)
    assert fp32.weights == 4 * (p + t) and fp32.reference == 0
    assert lora.activations < full.activations
    checkpointed = plan_memory(full.shape, micro_batch=8, seq_len=1024, gradient_checkpointing=True)
    assert checkpointed.activations < plan_memory(full.shape, micro_batch=8, seq_len=1024).activations


def test_refusal_names_need_free_and_what_fits():
    config = load_config(None, loss=LossConfig(beta_dpo=0.2))  # with the DPO reference copy (DPO defaults off)
    from composer_diloco.policy import load_default_tokenizer, tiny_model_config

    cfg = tiny_model_config(load_default_tokenizer(), 0)
    plan = check_plan(config, cfg, micro_batch=8, grad_accum=1, device="cpu", bf16=False,
                      gradient_checkpointing=False, free=None)
    with pytest.raises(DeviceMemoryError) as e:
        check_plan(config, cfg, micro_batch=8, grad_accum=1, device="cpu", bf16=False,
                   gradient_checkpointing=False, free=plan.need // 3, free_source="test")
    text = str(e.value)
    assert "\n" not in text and "not enough host RAM on cpu" in text and f"{plan.need / 1e9:.2f} GB" in text
    assert "free (test)" in text and "would fit: --batch-size 2 --grad-accum 4" in text


def test_gpu_node_refuses_when_host_ram_cannot_hold_the_outer_loop():
    """A GPU node's device may fit while the host cannot hold the fp32 theta, pseudo-gradient and momentum."""
    config = load_config(None, model="some/model")
    from composer_diloco.policy import load_default_tokenizer, tiny_model_config

    cfg = tiny_model_config(load_default_tokenizer(), 0)
    kw = dict(micro_batch=1, grad_accum=8, device="cuda:0 (test)", bf16=True, gradient_checkpointing=False,
              free=10**12)
    plan = check_plan(config, cfg, host_free=10**12, **kw)
    with pytest.raises(DeviceMemoryError, match=r"not enough host RAM beside cuda:0 \(test\): the memory plan needs"):
        check_plan(config, cfg, host_free=plan.host_bytes - 1, **kw)


@pytest.mark.parametrize("outer, tensors", [
    ("[outer]\nmomentum = 0.0\n", 0),                     # parameter averaging
    ("[outer]\nmomentum = 0.9\n", 1),                     # DiLoCo's Nesterov SGD
    ('[outer]\noptimizer = "adamw"\nlr = 0.001\n', 2),     # exp_avg, exp_avg_sq (the step count is a scalar)
    ('[outer]\noptimizer = "composer_diloco.outer.delayed_nesterov.DelayedNesterov"\nlr = 0.7\n'
     "kwargs = {momentum = 0.9, delay = 4}\n", 2),          # momentum and the pseudo-gradients' running sum
])
def test_host_plan_counts_the_outer_optimizers_own_state(tmp_path, outer, tensors):
    """The host part of the plan holds theta, the pseudo-gradient, the outer state, and a resync's download buffers
    (theta and the outer state again), 4 bytes each per trainable parameter: the outer state is counted on the
    optimizer itself, a dotted-path class included."""
    from composer_diloco.policy import load_default_tokenizer, tiny_model_config

    path = tmp_path / "c.toml"
    path.write_text(outer)
    cfg = tiny_model_config(load_default_tokenizer(), 0)
    plan = check_plan(load_config(path, model="some/model"), cfg, micro_batch=1, grad_accum=8, device="cpu",
                      bf16=False, gradient_checkpointing=False, free=10**12)
    assert plan.host == 4 * model_shape(cfg).params_trainable * (2 + tensors + 1 + tensors) + RUNTIME_HOST_BYTES


def test_device_memory_env_caps_and_rejects(monkeypatch):
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "1000000")
    assert device_free_bytes("cpu") == (1_000_000, f"capped by ${DEVICE_MEMORY_ENV}")
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match="'lots': expected a positive number of bytes"):
        device_free_bytes("cpu")


def test_model_shape_counts_real_qwen3_sizes():
    """Built on the meta device from the config alone: Qwen3-0.6B's 596,049,920 parameters (tied embeddings)."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True)
    shape = model_shape(cfg)
    assert shape.params_total == 596_049_920 and shape.params_trainable == shape.params_total
    lora = model_shape(cfg, LoraSection(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    # per layer: r * (in + out) for q (1024 -> 2048), k and v (1024 -> 1024 each), o (2048 -> 1024)
    assert lora.params_trainable == 28 * 16 * ((1024 + 2048) + 2 * (1024 + 1024) + (2048 + 1024))


def _smoke_plans(**kw) -> dict[tuple[int, bool], int]:
    """smoke.toml's plan need on this CPU by (micro-batch, gradient checkpointing), as a node without --config
    plans it."""
    from nodes.node import _model_config

    config = load_config(ROOT / "configs" / "smoke.toml", **kw)
    cfg, inputs = _model_config(config), plan_inputs(config)
    return {(b, gc): plan_for_run(config, cfg, micro_batch=b, grad_accum=8 // b, device="cpu", bf16=False,
                                  gradient_checkpointing=gc, free=None, inputs=inputs).need
            for b in (8, 4, 2, 1) for gc in (False, True)}


@pytest.mark.timeout(120)
def test_node_refuses_before_joining_when_the_device_is_too_small(tmp_path):
    """A node with ``--config`` plans before it starts the DHT, without dialling the (dead) peer. Its own
    ``--batch-size 8`` at a budget only micro-batch 2 fits: exit 1 with the one-line refusal naming what would fit.
    Without ``--batch-size`` at a budget below micro-batch 1 with gradient checkpointing: the one line naming that
    plan."""
    plans = _smoke_plans()
    assert plans[(2, False)] < plans[(4, False)]
    between, tiny = (plans[(2, False)] + plans[(4, False)]) // 2, plans[(1, True)] // 2
    join = [sys.executable, "-m", "nodes", "join", "--peer", DEAD_PEER, "--config", "configs/smoke.toml", "--device",
            "cpu", "--join-timeout", "5"]
    runs = [prefork.popen(join + ["--run-dir", str(tmp_path / name), *args], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, DEVICE_MEMORY_ENV: str(cap)})
            for name, cap, args in (("own", between, ["--batch-size", "8"]), ("auto", tiny, []))]
    results = []
    for p in runs:
        err = p.communicate(timeout=110)[1]
        results.append(subprocess.CompletedProcess(p.args, p.returncode, "", err))
    for r in results:
        assert r.returncode == 1, r.stderr[-2000:]
        assert "not enough host RAM on cpu: the memory plan needs" in error_line(r)
        assert "no peer answered" not in r.stderr
    own, auto = (error_line(r) for r in results)
    assert f"{between / 1e9:.2f} GB free" in own or f"{between / 1e6:.1f} MB free" in own, own
    assert "at --batch-size 8 x 1024 tokens" in own and "would fit: --batch-size 2 --grad-accum 4" in own, own
    assert "at --batch-size 1 x 1024 tokens with gradient checkpointing" in auto, auto


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_node_picks_the_micro_batch_that_fits_and_keeps_the_episodes_per_step(run_dir, tmp_path):
    """Two nodes without ``--batch-size`` in one run of smoke.toml (one round of H = 2 steps, 8 episodes a step): one
    with ``$COMPOSER_DILOCO_DEVICE_MEMORY_BYTES`` between the plans of micro-batch 4 and 8 (the run's micro-batch of 8,
    which a node refused before it chose its own), one with the machine's memory. The capped node logs its choice,
    micro-batch 4 x 2, and trains the same samples each round as the other at 8 x 1; each round's line holds the
    measured peak next to the planned figure, the capped node's plan under its budget."""
    from composer_diloco.metrics import read_metrics
    from local_run import assert_peer_line, coordinator_line, free_listen_address
    from tests_support import stop_processes

    config = tmp_path / "one_round.toml"
    config.write_text((ROOT / "configs" / "smoke.toml").read_text().replace("rounds = 2", "rounds = 1"))
    plans = _smoke_plans()
    cap = (plans[(4, False)] + plans[(8, False)]) // 2
    env = {**os.environ, "COLUMNS": "400"}  # rich would wrap the log lines at 80 columns
    procs = []
    try:
        listen = free_listen_address()  # its line is known (its key is in the run dir): the nodes start beside it
        peer = coordinator_line(run_dir, listen)
        coordinator = prefork.popen(
            [sys.executable, "-m", "coordinator", "start", "--config", str(config), "--run-dir", str(run_dir),
             "--listen", listen], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
            start_new_session=True)
        procs.append(coordinator)
        node = [sys.executable, "-m", "nodes", "join", "--peer", peer, "--run-dir", str(run_dir), "--device", "cpu"]
        logs = {name: tmp_path / f"{name}.log" for name in ("capped", "roomy")}
        for name, extra in (("capped", {DEVICE_MEMORY_ENV: str(cap)}), ("roomy", {})):
            with open(logs[name], "w") as err:  # a file, not a pipe: neither node can block on a full pipe
                procs.append(prefork.popen(node + ["--name", name], stdout=subprocess.DEVNULL, stderr=err, text=True,
                                           cwd=ROOT, start_new_session=True, env={**env, **extra}))
        assert_peer_line(coordinator, peer)
        for p, path in zip(procs[1:], logs.values()):
            assert p.wait(timeout=380) == 0, path.read_text()[-3000:]
        assert coordinator.wait(timeout=60) == 0
    finally:
        stop_processes(procs)
    capped_log, roomy_log = (path.read_text() for path in logs.values())
    assert "micro-batch 4 x --grad-accum 2 = 8 episodes per step, chosen: --batch-size 8 needs" in capped_log, \
        capped_log[-3000:]
    assert "micro-batch 8 x --grad-accum 1 = 8 episodes per step: the run's micro-batch fits" in roomy_log
    metrics = read_metrics(run_dir)
    capped, roomy = ({r["round"]: r for r in metrics[name]} for name in ("capped", "roomy"))
    assert sorted(capped) == sorted(roomy) == [0]
    for r in capped:
        assert capped[r]["samples"] == roomy[r]["samples"] == 2 * 8  # H = 2 steps of the run's 8 episodes
        assert capped[r]["global_sha256"] == roomy[r]["global_sha256"]
        for line in (capped[r], roomy[r]):
            assert line["memory_peak_bytes"] > 0 and line["memory_planned_bytes"] > 0
        assert capped[r]["memory_planned_bytes"] <= cap < roomy[r]["memory_planned_bytes"]


@pytest.mark.timeout(120)
def test_model_folder_without_chat_template(tmp_path):
    """A ``--model`` folder whose tokenizer has no chat template: one line saying so, exit 1, no checkpoint."""
    from composer_diloco.policy import build_tiny_model, load_default_tokenizer

    tokenizer = load_default_tokenizer()
    build_tiny_model(tokenizer, 0).save_pretrained(tmp_path / "model")
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "model")
    assert not (tmp_path / "model" / "chat_template.jinja").exists()
    r = prefork.run([sys.executable, "-m", "coordinator", "start", "--model", str(tmp_path / "model"),
                     "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "its tokenizer has no chat template" in error_line(r) and str(tmp_path / "model") in error_line(r)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.timeout(120)
def test_real_arch_plan_table(tmp_path):
    """``bench/real_arch.py plan`` (BENCHMARKS.md section 7): Qwen3-0.6B's parameter count, LoRA smaller than full
    fine-tuning everywhere, and 8B full fine-tuning fitting no single 80 GB GPU."""
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "real_arch.py"), "plan", "--json", str(out)],
                       capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {(row["arch"], row["mode"]): row for row in json.loads(out.read_text())}
    assert rows[("0.6b", "full")]["params"] == 596_049_920
    for arch in ("0.6b", "1.7b", "4b", "8b"):
        assert rows[(arch, "lora")]["device_gb_b1"] < rows[(arch, "full")]["device_gb_b1"]
    assert rows[("8b", "full")]["fits_80"] == "no" and rows[("0.6b", "lora")]["fits_24"] != "no"
    assert "| Qwen3-0.6B | full |" in r.stdout


# ------------------------------------------------------------------------------ rows, the micro-batch choice, the peak


def _config(text: str = ""):
    """A run config from TOML text (defaults elsewhere)."""
    import tomllib

    from composer_diloco.config import RunConfig

    return RunConfig.model_validate(tomllib.loads(text))


def test_rows_are_the_longest_episode_the_config_allows():
    """prompt + T turns + (T - 1) capped tool replies with their template tokens, under max_seq_len; max_seq_len when
    a reply is not capped (a reply is bounded by max_seq_len alone) or the prompt is unknown; a prompt whose first
    turn passes max_seq_len is its own bound."""
    capped = _config("max_seq_len = 1024\n[env]\nmax_tool_calls = 6\nmax_turn_tokens = 40\n"
                     "max_tool_reply_tokens = 32\n")
    row = row_bound(capped, prompt_tokens=56, reply_scaffold_tokens=10)
    assert row.tokens == 56 + 6 * 40 + 5 * (32 + 10 + REPLY_SLACK) and row.completion == row.tokens - 56
    assert "prompt 56 + 6 x 40 turn + 5 x (32 + 18) reply" in row.source
    assert row_bound(capped, prompt_tokens=None, reply_scaffold_tokens=10).tokens == 1024
    assert row_bound(capped, prompt_tokens=800, reply_scaffold_tokens=10).tokens == 1024  # capped by max_seq_len
    assert row_bound(capped, prompt_tokens=1000, reply_scaffold_tokens=10).tokens == 1040  # prompt + its first turn
    uncapped = _config("max_seq_len = 1024\n")
    assert row_bound(uncapped, prompt_tokens=56, reply_scaffold_tokens=10).tokens == 1024
    one_turn = _config("max_seq_len = 1024\n[env]\nmax_tool_calls = 1\n")
    assert row_bound(one_turn, prompt_tokens=56, reply_scaffold_tokens=None).tokens == 56 + 40


def test_plan_inputs_bound_the_embedded_default_s_prompts_and_replies():
    """The prompt bound covers every rendered demonstration prompt of the run's env; a cut reply renders within the
    scaffold plus the cap plus `REPLY_SLACK` tokens."""
    from composer_diloco.policy import load_embedded_tokenizer
    from composer_diloco.rollout.env_package import load_env_package
    from composer_diloco.rollout.episode_tokens import tool_suffix_ids
    from composer_diloco.rollout.episodes import CUT_MARK, cut_reply

    config = _config("[env]\nmax_tool_reply_tokens = 8\n")
    tok = load_embedded_tokenizer(config.env.server_module)
    inputs = plan_inputs(config, tok)
    package = load_env_package(config.env.server_module)
    for i in range(200):
        demo = package.demonstration(1, i, 0.3)
        prompt = tok.apply_chat_template([{"role": "user", "content": demo.question}], tools=demo.tools,
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
        assert len(prompt) <= inputs.prompt_tokens, (i, len(prompt), inputs)
    assert inputs.reply_scaffold_tokens == len(tool_suffix_ids(tok, [{"role": "tool", "name": "x", "content": ""}]))
    long = "error: unknown tool 'frobnicate'; available tools: lookup, add, subtract, multiply, submit " * 3
    cut = cut_reply(tok, long, 8)
    assert cut.endswith(CUT_MARK) and cut_reply(tok, "7", 8) == "7"
    rendered = tool_suffix_ids(tok, [{"role": "tool", "name": "add", "content": cut}])
    assert len(rendered) <= inputs.reply_scaffold_tokens + 8 + REPLY_SLACK
    # unknown where the plan cannot render prompts before the first reset: rows of max_seq_len
    assert plan_inputs(_config('[tasks]\npath = "configs/mcp_prices_tasks.jsonl"\n'), tok).prompt_tokens is None


def test_the_node_picks_the_largest_micro_batch_that_fits():
    """The run's episodes per step stay 8; the micro-batch is the largest divisor of 8 whose plan fits, without
    gradient checkpointing first, then with it (turned on); below micro-batch 1 with gradient checkpointing the one
    line refusal names that plan; with --gradient-checkpointing only checkpointed plans are tried; free unknown: 8."""
    from composer_diloco.policy import load_default_tokenizer, tiny_model_config

    config = load_config(ROOT / "configs" / "smoke.toml")
    cfg = tiny_model_config(load_default_tokenizer(), 0)
    inputs = PlanInputs(prompt_tokens=56, reply_scaffold_tokens=10)
    need = {(b, gc): plan_for_run(config, cfg, micro_batch=b, grad_accum=8 // b, device="cpu", bf16=False,
                                  gradient_checkpointing=gc, free=None, inputs=inputs).need
            for b in (8, 4, 2, 1) for gc in (False, True)}

    def choose(free, gc=False):
        choice = choose_batch(config, cfg, device="cpu", bf16=False, gradient_checkpointing=gc, free=free,
                              free_source="test", inputs=inputs)
        assert choice.micro_batch * choice.grad_accum == 8 and choice.plan.need <= (free or choice.plan.need)
        return choice.micro_batch, choice.gradient_checkpointing, choice.reason

    assert choose(None)[:2] == choose(need[(8, False)])[:2] == (8, False)
    b, gc, reason = choose(need[(4, False)] + 1)
    assert (b, gc) == (4, False) and "--batch-size 8 needs" in reason and "short" in reason, reason
    assert choose(need[(1, False)] - 1)[:2] == (max(b for b in (8, 4, 2, 1) if need[(b, True)] < need[(1, False)]),
                                                 True)
    assert "gradient checkpointing turned on" in choose(need[(1, False)] - 1)[2]
    assert choose(need[(8, True)], gc=True)[:2] == (8, True)
    with pytest.raises(DeviceMemoryError, match=r"at --batch-size 1 x 1024 tokens with gradient checkpointing.*free "
                                                r"\(test\)") as e:
        choose(need[(1, True)] - 1)
    assert "\n" not in str(e.value)


def test_a_round_line_holds_the_peak_next_to_the_plan_and_warns_past_it():
    from types import SimpleNamespace

    from composer_diloco.metrics import format_table, round_table
    from composer_diloco.policy import load_default_tokenizer, tiny_model_config

    cfg = tiny_model_config(load_default_tokenizer(), 0)
    plan = plan_for_run(load_config(None), cfg, micro_batch=8, grad_accum=1, device="cpu", bf16=False,
                        gradient_checkpointing=False, free=None)
    stats = SimpleNamespace(longest_episode_tokens=140, samples=16, channel_stats={})
    fields, warnings = round_memory(plan, plan.planned_peak // 2, stats)
    assert fields == {"memory_peak_bytes": plan.planned_peak // 2, "memory_planned_bytes": plan.need,
                      "episode_tokens_max": 140} and warnings == []
    long = SimpleNamespace(longest_episode_tokens=plan.seq_len + 1, samples=16, channel_stats={})
    _, warnings = round_memory(plan, plan.planned_peak + 1, long)
    assert len(warnings) == 2 and "passed the memory plan" in warnings[0] and "longer than" in warnings[1]
    assert round_memory(None, None, stats)[0]["memory_planned_bytes"] is None
    line = {"round": 0, "role": "node", "peers": 2, "samples": 16, "global_sha256": "a", **fields}
    table = format_table(round_table({"node-0": [line]}))
    assert "peak/plan GB" in table.splitlines()[0]
    assert f"{plan.planned_peak / 2e9:.2f}/{plan.planned_peak / 1e9:.2f}" in table.splitlines()[1]
    assert "-" in format_table(round_table({"node-0": [{"round": 0, "role": "node"}]})).splitlines()[1]


def test_the_cpu_peak_is_the_resident_set_growth_since_the_last_take():
    """`PeakMemory` on CPU: the resident set's peak over its baseline since the last take (which starts at the resident
    set of that moment). 200 MB touched after a take count in the next one; freed before a take, not in the one
    after it."""
    peak = PeakMemory("cpu")
    peak.take()
    block = bytearray(200 * 10**6)  # zero-filled: every page touched (its own mapping: freed back at del)
    first = peak.take()
    del block
    peak.take()
    second = peak.take()
    assert first is not None and second is not None
    assert first >= 200 * 10**6 and second <= first - 150 * 10**6, (first, second)


QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True)


def test_torch_foreach_adamw_takes_one_copy_of_every_trainable_tensor():
    """The plan's GPU optimizer step (`plan_memory`'s ``step_transient``) as torch computes it: the multi-tensor AdamW
    (the default on a GPU) allocates sqrt(exp_avg_sq) for every parameter at once, 4 bytes a trainable parameter
    (run here with ``foreach=True`` on CPU tensors, under torch's memory profiler)."""
    import torch

    params = [torch.nn.Parameter(torch.randn(n)) for n in (1000, 3000, 500)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, foreach=True)
    opt.step()  # the state exists before the profiled step
    with torch.profiler.profile(profile_memory=True) as prof:
        opt.step()
    allocated = {e.key: e.cpu_memory_usage for e in prof.key_averages() if e.cpu_memory_usage > 0}
    assert allocated.pop("aten::_foreach_sqrt") == 4 * 4500 and allocated.pop("aten::sqrt") == 4 * 4500
    assert sum(allocated.values()) < 1000, allocated  # the rest: step counters and scalars


def test_a_gpu_plan_covers_the_h200_full_fine_tuning_peak():
    """bench/gpu.py's 0.6b-full-2nodes on an H200 (2026-11-27, BENCHMARKS.md section 7): full fine-tuning of Qwen3-0.6B
    peaked at 13.49 GB (``torch.cuda.max_memory_allocated``) against a plan of 12.28 GB that counted a CPU's
    single-tensor AdamW step. A GPU plan counts the foreach step's copy of every trainable tensor and cuBLAS's
    workspaces; a CPU plan is unchanged."""
    from transformers import Qwen3Config

    config = load_config(ROOT / "configs" / "qwen3_0.6b_full.toml")
    plan = {device: plan_for_run(config, Qwen3Config(**QWEN3_06B), micro_batch=2, grad_accum=1, device=device,
                                 bf16=device != "cpu", gradient_checkpointing=False, free=None)
            for device in ("cpu", "cuda:0 (NVIDIA H200)")}
    gpu, cpu = plan["cuda:0 (NVIDIA H200)"], plan["cpu"]
    assert gpu.step_transient == 4 * gpu.shape.params_trainable
    assert cpu.step_transient == 8 * cpu.shape.largest_trainable and cpu.workspace == 0
    single_tensor = max(gpu.activations + gpu.gradients // 4, gpu.gradients + 8 * gpu.shape.largest_trainable)
    phases = [c.phase for c in gpu.channels]  # DPO's reference pass
    logged = gpu.weights + gpu.optimizer + gpu.reference + max(single_tensor, gpu.rollout, *phases)
    assert round(logged / 1e9, 2) == 12.28  # the plan that run logged, reproduced
    assert 13.49e9 <= gpu.device_bytes < 1.05 * 13.49e9  # now it covers the peak, and not by much
    assert "cuBLAS workspaces" in gpu.describe() and "cuBLAS" not in cpu.describe()

"""The memory plan (`composer_diloco.policy.memory_plan`): its figures against what one inner step allocates on CPU, the
one-line refusal of a plan that does not fit, and a ``--model`` folder without a chat template."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests_support import error_line

from composer_diloco.config import LoraSection, LossConfig, load_config
from composer_diloco.policy.memory_plan import (
    DEVICE_MEMORY_ENV,
    DeviceMemoryError,
    check_plan,
    device_free_bytes,
    model_shape,
    plan_memory,
)

ROOT = Path(__file__).resolve().parents[1]
DEAD_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"

MEASURE = """
import json, sys, torch
from transformers import Qwen3Config
from composer_diloco.config import LoraSection
from composer_diloco.policy import build_tiny_model, load_default_tokenizer, tiny_model_config
from composer_diloco.policy.memory_plan import measure_training_bytes, model_shape, plan_memory
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
plan = plan_memory(model_shape(cfg, section), micro_batch=4, seq_len=512, sdpo=False, bf16=bf16)
print(json.dumps({"measured": measured, "state": plan.optimizer + plan.reference, "gradients": plan.gradients,
                  "activations": plan.activations, "peak": plan.optimizer + plan.reference + plan.training_peak}))
"""


CASES = [("default", "full", "fp32"), ("small", "full", "fp32"), ("small", "lora", "fp32"), ("small", "full", "bf16"),
         ("small", "lora", "bf16")]


@pytest.fixture(scope="module")
def measurements():
    """Every case of `test_plan_matches_measured_allocations` measured at once, each in its own fresh process (the
    resident set is per process; torch runs one thread in each): ~7 s of CPU each, mostly imports."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = {case: subprocess.Popen([sys.executable, "-c", MEASURE, *case], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=ROOT) for case in CASES}
    try:
        yield {case: (proc, *proc.communicate(timeout=200)) for case, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind,mode,dtype", CASES)
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
    momentum and running sum) + the outer step's two transients in host RAM; LoRA: the base's 4 bytes per parameter (2 for its linear weights under bf16) and 16 per
    adapter parameter, no reference copy."""
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
    assert full.host == 4 * p * 6 and full.host_bytes == full.host + 4 * p  # + the model as loaded on the CPU
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
    """The host part of the plan holds theta, the pseudo-gradient, the outer state and two transients, 4 bytes each
    per trainable parameter: the outer state is counted on the optimizer itself, a dotted-path class included."""
    from composer_diloco.policy import load_default_tokenizer, tiny_model_config

    path = tmp_path / "c.toml"
    path.write_text(outer)
    cfg = tiny_model_config(load_default_tokenizer(), 0)
    plan = check_plan(load_config(path, model="some/model"), cfg, micro_batch=1, grad_accum=8, device="cpu",
                      bf16=False, gradient_checkpointing=False, free=10**12)
    assert plan.host == 4 * model_shape(cfg).params_trainable * (2 + tensors + 2)


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


@pytest.mark.timeout(90)
def test_node_refuses_before_joining_when_the_device_is_too_small(tmp_path):
    """A node with ``--config`` plans before it starts the DHT: with the device capped at 1 GB it exits 1 with the
    one-line refusal (the default micro-batch of 8 at 1024 tokens needs about 2.2 GB), without dialling the (dead)
    peer."""
    env = {**os.environ, DEVICE_MEMORY_ENV: "1000000000"}
    r = subprocess.run([sys.executable, "-m", "nodes", "join", "--peer", DEAD_PEER, "--config", "configs/smoke.toml",
                        "--run-dir", str(tmp_path), "--device", "cpu", "--join-timeout", "5"],
                       capture_output=True, text=True, timeout=80, cwd=ROOT, env=env)
    assert r.returncode == 1, r.stderr[-2000:]
    line = error_line(r)
    assert "not enough host RAM on cpu: the memory plan needs" in line and "1.00 GB free" in line, line
    assert "would fit: --batch-size 2 --grad-accum 4" in line and "no peer answered" not in r.stderr


@pytest.mark.timeout(120)
def test_model_folder_without_chat_template(tmp_path):
    """A ``--model`` folder whose tokenizer has no chat template: one line saying so, exit 1, no checkpoint."""
    from composer_diloco.policy import build_tiny_model, load_default_tokenizer

    tokenizer = load_default_tokenizer()
    build_tiny_model(tokenizer, 0).save_pretrained(tmp_path / "model")
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "model")
    assert not (tmp_path / "model" / "chat_template.jinja").exists()
    r = subprocess.run([sys.executable, "-m", "coordinator", "start", "--model", str(tmp_path / "model"),
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

"""LoRA DiLoCo (`composer_diloco.policy.lora`): the ``[lora]`` section, theta = the adapters only, the base kept
bit-identical, the DPO reference without a copy, PEFT adapter checkpoints (load, merge, resume)."""

from pathlib import Path

import pytest
import torch

from composer_diloco.checkpoint import CheckpointError, read_outer_state, restore_outer_state, save_checkpoint
from composer_diloco.config import ConfigError, RunConfig, load_config
from composer_diloco.outer.global_model import GlobalModel
from composer_diloco.policy import build_tiny_model, load_default_tokenizer
from composer_diloco.policy.lora import (
    AdaptersDisabled,
    LoraError,
    apply_lora,
    base_sha256,
    load_adapters,
    merge_adapters,
)
import prefork

ROOT = Path(__file__).resolve().parents[1]
LORA = ROOT / "configs" / "lora.toml"


@pytest.fixture(scope="module")
def tokenizer():
    return load_default_tokenizer()


def _base(tokenizer, seed: int = 0):
    torch.manual_seed(seed)
    return build_tiny_model(tokenizer, seed)


def _base_tensors(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def _train_adapters(model, steps: int = 3) -> None:
    """A few AdamW steps on a next-token loss: moves lora_B off zero (and lora_A)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    ids = torch.randint(0, 800, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()


# -- config ----------------------------------------------------------------------------------------------------
def test_lora_section_on_off_and_json_of_a_full_run_unchanged():
    cfg = load_config(LORA)
    assert cfg.lora is not None and cfg.lora.r == 8 and cfg.lora.lora_alpha == 16
    assert cfg.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert RunConfig.from_json(cfg.to_json()) == cfg
    full = load_config(None)
    assert full.lora is None and '"lora"' not in full.to_json()  # no key: a full run's JSON and digest as before
    assert RunConfig.from_json(full.to_json()).lora is None


def test_lora_section_bad_key_is_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[lora]\nrank = 8\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert "lora.rank" in str(e.value) and "\n" not in str(e.value)


def test_target_modules_that_match_nothing_is_one_line(tokenizer):
    from composer_diloco.config import LoraSection

    with pytest.raises(LoraError) as e:
        apply_lora(_base(tokenizer), LoraSection(target_modules=["qproj"]))
    msg = str(e.value)
    assert "qproj" in msg and "q_proj" in msg and "\n" not in msg


# -- theta = the adapters ----------------------------------------------------------------------------------------
def test_theta_is_the_adapters_and_the_outer_step_leaves_the_base_bit_identical(tokenizer):
    base = _base(tokenizer)
    full_numel = sum(p.numel() for p in base.parameters())
    before_hash = base_sha256(base)
    model = apply_lora(base, load_config(LORA).lora)
    assert base_sha256(model) == before_hash  # the wrapped model hashes to its base
    frozen = _base_tensors(model)
    g = GlobalModel(model, lr=1.0, momentum=0.0)
    assert g.names and all(".lora_A." in n or ".lora_B." in n for n in g.names)
    assert g.numel() < full_numel / 20
    adapters_before = [p.clone() for p in g.params]

    _train_adapters(model)
    delta = [torch.zeros_like(p) for p in g.params]
    g.pseudo_gradient(model, delta)
    assert any(d.abs().sum() > 0 for d in delta)  # the adapters moved
    g.outer_step(delta)  # lr 1, no momentum: theta <- theta_i
    g.load_into(model)

    assert any(not torch.equal(a, b) for a, b in zip(adapters_before, g.params))
    for n, p in model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, frozen[n]), n  # bit-identical base
    assert base_sha256(model) == before_hash


def test_dpo_reference_is_the_base_without_a_copy(tokenizer):
    base = _base(tokenizer)
    ids = torch.randint(0, 800, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = base(input_ids=ids).logits.clone()
    model = apply_lora(base, load_config(LORA).lora)
    _train_adapters(model)
    reference = AdaptersDisabled(model)
    assert next(reference.parameters()) is next(model.parameters())  # the policy's own tensors
    got = reference(input_ids=ids).logits
    assert not got.requires_grad
    assert torch.allclose(got, want, atol=1e-6)
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits, want, atol=1e-4)  # adapters on: another policy


# -- checkpoints --------------------------------------------------------------------------------------------------
def test_checkpoint_is_a_peft_adapter_folder_that_loads_merges_and_resumes(tokenizer, tmp_path):
    from peft import PeftModel

    cfg = load_config(LORA)
    model = apply_lora(_base(tokenizer), cfg.lora)
    g = GlobalModel(model, lr=1.0, momentum=0.0)
    _train_adapters(model)
    delta = [torch.zeros_like(p) for p in g.params]
    g.pseudo_gradient(model, delta)
    g.outer_step(delta)
    folder = save_checkpoint(tmp_path / "run", 1, model, tokenizer, g, cfg.to_json())
    assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
    assert not (folder / "model.safetensors").exists()  # the adapters only
    assert read_outer_state(folder)["base_sha256"] == base_sha256(model)

    ids = torch.randint(0, 800, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    loaded = PeftModel.from_pretrained(_base(tokenizer), str(folder)).eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, want, atol=1e-5)

    merged = merge_adapters(_base(tokenizer), folder, tmp_path / "merged")
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    from transformers import AutoModelForCausalLM

    reread = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert torch.allclose(reread(input_ids=ids).logits, want, atol=1e-4)

    # resume: the run's [lora] over the same base, adapters from the folder, theta's hash checked
    resumed = apply_lora(_base(tokenizer), cfg.lora)
    load_adapters(resumed, folder)
    assert restore_outer_state(folder, GlobalModel(resumed, lr=1.0, momentum=0.0), base_sha256(resumed)) == 1
    with pytest.raises(CheckpointError, match="base_sha256"):
        restore_outer_state(folder, GlobalModel(resumed, lr=1.0, momentum=0.0), "0" * 64)
    from composer_diloco.config import LoraSection

    with pytest.raises(LoraError):  # another rank than the checkpoint's
        load_adapters(apply_lora(_base(tokenizer), LoraSection(r=4, target_modules=cfg.lora.target_modules)), folder)


# -- a run: real processes ------------------------------------------------------------------------------------------
def _perturbed_base(warm_cache: Path, out_cache: Path) -> None:
    """``out_cache/warmstart`` = a copy of the warm cache with one base weight changed: another machine's base, the
    same layout (a node started with ``COMPOSER_DILOCO_CACHE=out_cache`` loads it)."""
    import shutil

    from safetensors.torch import load_file, save_file

    for entry in warm_cache.iterdir():
        if (entry / "model.safetensors").is_file():
            dst = out_cache / "warmstart" / entry.name
            shutil.copytree(entry, dst)
            tensors = load_file(str(dst / "model.safetensors"))
            name = sorted(n for n in tensors if n.endswith("down_proj.weight"))[0]
            tensors[name] = tensors[name] + 1e-3
            save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_lora_run_two_nodes_adapters_only_and_a_node_with_another_base_refused(run_dir, warm_cache, tmp_path):
    """Coordinator + 2 nodes on configs/lora.toml: every peer agrees each round, the all-reduce carries the adapters
    only, the base is untouched, the adapters learn; a node whose base differs is refused at join with one line
    naming both hashes; the coordinator resumes from the LoRA checkpoint for one more round with a new node; the
    checkpoint is a PEFT adapter folder that loads with PeftModel.from_pretrained and merges (merge-lora).

    node-b runs ``--dtype bf16`` (CPU autocast) beside node-a's fp32 (one run for both: the suite's time): it keeps its
    base's linear weights in bf16 (the base hash, taken before the cast, matches the run's) and agrees every round."""
    import sys

    from peft import PeftModel
    from safetensors.torch import load_file

    from composer_diloco.checkpoint import latest_checkpoint
    from composer_diloco.policy import load_policy
    from local_run import LocalRun, assert_agree

    cfg = load_config(LORA)
    base, _ = load_policy(None, seed=cfg.warmstart.seed, warmstart_steps=cfg.warmstart.steps)
    run_base = base_sha256(base)
    full_bytes = 4 * sum(p.numel() for p in base.parameters())  # the full model's fp32 theta
    bad_dir, bad_cache = tmp_path / "bad", tmp_path / "bad-cache"
    _perturbed_base(warm_cache, bad_cache)

    run = LocalRun(run_dir, LORA)
    try:
        run.start_coordinator(wait=False)  # the nodes start beside it (the suite's time)
        bad = run.start_node("node-bad", "--run-dir", str(bad_dir),  # the later --run-dir wins
                             env={"COMPOSER_DILOCO_CACHE": str(bad_cache)})
        run.start_node("node-a", "--dtype", "fp32")  # beside the refused one: its refusal must not disturb the run
        run.start_node("node-b", "--dtype", "bf16")
        run.wait_peer_line()
        assert run.wait_exit("node-bad", timeout_s=180) == 1
        last = run.log_tail("node-bad", 1)
        assert f"base_sha256 {run_base} in the run" in last, last
        assert bad.returncode == 1
        for name in ("node-a", "node-b", "coordinator"):
            assert run.wait_exit(name, timeout_s=400) == 0, run.all_tails()
    finally:
        run.stop()

    records = run.records()
    assert "node-bad" not in records
    shas = assert_agree(records, range(cfg.rounds))
    assert "training on cpu, fp32" in run.log("node-a") and "training on cpu, bf16" in run.log("node-b")
    assert "frozen linear weights stored in bf16" in run.log("node-b"), run.log_tail("node-b")
    for name in ("node-a", "node-b"):
        sent = [r["bytes_sent"] for r in records[name]]
        assert len(sent) == cfg.rounds and all(0 < b < full_bytes / 10 for b in sent), (sent, full_bytes)

    first = run_dir / "checkpoints" / "round-000000"
    final = latest_checkpoint(run_dir)
    state = read_outer_state(final)
    assert state["round"] == cfg.rounds and state["global_sha256"] == shas[cfg.rounds - 1]
    assert state["base_sha256"] == run_base  # the coordinator's base never moved
    for name in ("node-a", "node-b"):  # a joiner received the run's adapters (theta of round 0)
        assert f"global model of round 0 loaded (sha256 {read_outer_state(first)['global_sha256'][:12]})" in run.log(name)
    start, end = load_file(str(first / "adapter_model.safetensors")), load_file(str(final / "adapter_model.safetensors"))
    assert start.keys() == end.keys() and all("lora_" in k for k in end)
    assert any(not torch.equal(start[k], end[k]) for k in end)  # the adapters learned

    # resume from the LoRA checkpoint: one more round with a new node, from the adapters of the last checkpoint
    resumed = LocalRun(run_dir, LORA)
    try:
        resumed.start_coordinator("--resume", "--rounds", str(cfg.rounds + 1), wait=False)
        resumed.start_node("node-c")
        resumed.wait_peer_line()
        for name in ("node-c", "coordinator"):
            assert resumed.wait_exit(name, timeout_s=300) == 0, resumed.all_tails()
    finally:
        resumed.stop()
    records = resumed.records()
    assert [r["round"] for r in records["node-c"]] == [cfg.rounds]
    assert f"global model of round {cfg.rounds} loaded (sha256 {state['global_sha256'][:12]})" in resumed.log("node-c")
    assert_agree(records, [cfg.rounds])
    final = latest_checkpoint(run_dir)
    state = read_outer_state(final)
    assert state["round"] == cfg.rounds + 1 and state["base_sha256"] == run_base
    assert state["global_sha256"] == records["node-c"][0]["global_sha256"]

    fresh, _ = load_policy(None, seed=cfg.warmstart.seed, warmstart_steps=cfg.warmstart.steps)
    loaded = PeftModel.from_pretrained(fresh, str(final))
    assert base_sha256(loaded) == run_base
    merged = prefork.run([sys.executable, "-m", "composer_diloco.policy", "merge-lora", str(final), "--out",
                          str(tmp_path / "merged")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert merged.returncode == 0, merged.stderr[-2000:]
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert (tmp_path / "merged" / "config.json").is_file()


@pytest.mark.timeout(180)
def test_coordinator_refuses_target_modules_that_match_nothing_before_the_network(run_dir):
    import sys

    from tests_support import error_line

    bad = run_dir / "bad.toml"
    bad.write_text(LORA.read_text().replace('"o_proj"]', '"out_proj"]'))
    r = prefork.run([sys.executable, "-m", "coordinator", "start", "--config", str(bad), "--run-dir", str(run_dir)],
                    capture_output=True, text=True, timeout=170, cwd=ROOT)
    line = error_line(r)
    assert r.returncode == 1 and "target_modules" in line and "out_proj" in line, r.stderr[-2000:]
    assert "peer:" not in r.stdout  # no DHT was started

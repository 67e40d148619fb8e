"""A node whose config, model architecture, batch or env server does not fit the run is refused at join, naming it."""

import re
import subprocess
import sys

import pytest

import prefork
from local_run import ROOT, LocalRun, write_config


def build_model(path, hidden_size: int, seed: int = 0) -> str:
    """Save a 1-layer tiny Qwen3 to ``path``; returns its `base_sha256` (what a full-fine-tuning run publishes)."""
    from composer_diloco.policy import build_tiny_model, load_default_tokenizer
    from composer_diloco.policy.lora import base_sha256

    tokenizer = load_default_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed, hidden_size=hidden_size, num_hidden_layers=1, intermediate_size=64)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return base_sha256(model)


def join(run: LocalRun, *extra: str) -> subprocess.Popen:
    """Start a node that is expected to be refused; `refusal` waits for it."""
    return prefork.popen([sys.executable, "-m", "nodes", "join", "--peer", run.peer, "--device", "cpu",
                          "--run-dir", str(run.run_dir), "--join-timeout", "20", *extra],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def refusal(proc: subprocess.Popen) -> str:
    """Wait for a refused node: exit code 1 and its one-line error (the last line of stderr)."""
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 1, stderr[-2000:]
    return stderr.strip().splitlines()[-1]


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_node_with_another_config_architecture_or_base_is_refused_and_a_round_0_join_moves_nothing(tmp_path):
    """A full-fine-tuning ``--model`` run: nodes whose config, env, batch, architecture or weights (same architecture,
    other bytes) do not fit are refused, each in one line; a node that loaded the run's own ``--model`` holds round
    0's theta already, and its join moves no byte of state."""
    model_dir = tmp_path / "model"
    run_base = build_model(model_dir, hidden_size=32)
    env = "[env]\nconnect_timeout_s = 10.0\n"  # a node gives up on its own env server's start after 10 s
    config = write_config(tmp_path / "run.toml", f'rounds = 1\ninner_steps = 2\nmodel = "{model_dir}"\n{env}')
    run = LocalRun(tmp_path / "run", config)
    try:
        run.start_coordinator(wait=False)  # the first nodes start beside it (the suite's time)

        other = write_config(tmp_path / "other.toml", f'rounds = 1\ninner_steps = 3\nmodel = "{model_dir}"\n{env}')
        # three independent refusals at once (each node is its own process and DHT peer)
        nodes = [join(run, "--config", str(other)),
                 # nothing listens there: its --join-timeout (the last one given wins) bounds the wait
                 join(run, "--env-url", "http://127.0.0.1:9", "--join-timeout", "5"),
                 join(run, "--batch-size", "3")]  # G = 4: 3 episodes per step cannot hold whole GRPO groups
        run.wait_peer_line()
        other_config, unreachable, split = (refusal(p) for p in nodes)
        assert other_config.startswith("composer-node: error: run 'composer' has another config")
        assert "inner_steps" in other_config
        assert "http://127.0.0.1:9" in unreachable and "not reachable" in unreachable, unreachable
        assert "--batch-size 3 x --grad-accum 1 = 3 episodes per step is not a multiple of the run's " \
               "num_generations 4" in split

        build_model(model_dir, hidden_size=48)  # this machine's copy of the model is not the run's
        error = refusal(join(run, "--config", str(config)))
        assert "model architecture differs from the run's" in error, error
        assert "32]" in error and "48]" in error, error

        other_base = build_model(model_dir, hidden_size=32, seed=1)  # the run's architecture, other weights
        error = refusal(join(run, "--config", str(config)))
        assert error == (f"composer-node: error: base model differs from the run's: base_sha256 {run_base} in the run, "
                         f"{other_base} here (every peer must load the run's --model, the same weights: theta started "
                         "from them)"), error

        build_model(model_dir, hidden_size=32)  # the run's own --model again: round 0's theta is all there
        # it is stopped once it holds theta (its training would prove nothing here: the suite's time)
        run.start_node("node-0", "--config", str(config))
        run.wait_until(lambda: "global model of round 0 loaded" in " ".join(run.log("node-0").split()), 240,
                       "the node to load round 0's theta")
        log = " ".join(run.log("node-0").split())  # the log's lines are wrapped
        moved = re.search(r"loaded round 0 state from a peer \(sha256 \w+\): state of round 0 \((.+?)\) "
                          r"from coordinator: 0 B moved .*?, (.+?) kept", log)
        assert moved and moved[1] == moved[2], log[-3000:]  # the whole state kept, nothing downloaded
    finally:
        run.stop()

"""A node whose config, model architecture, batch or env server does not fit the run is refused at join, naming it."""

import subprocess
import sys

import pytest

from local_run import ROOT, LocalRun, write_config


def build_model(path, hidden_size: int) -> None:
    from composer_diloco.policy import build_tiny_model, load_default_tokenizer

    tokenizer = load_default_tokenizer()
    model = build_tiny_model(tokenizer, seed=0, hidden_size=hidden_size, num_hidden_layers=1, intermediate_size=64)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def join(run: LocalRun, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nodes", "join", "--peer", run.peer, "--device", "cpu",
                           "--run-dir", str(run.run_dir), "--join-timeout", "20", *extra],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_node_with_another_config_or_architecture_is_refused(tmp_path):
    model_dir = tmp_path / "model"
    build_model(model_dir, hidden_size=32)
    env = "[env]\nconnect_timeout_s = 10.0\n"  # a node gives up on an unreachable env server after 10 s
    config = write_config(tmp_path / "run.toml", f'rounds = 1\ninner_steps = 2\nmodel = "{model_dir}"\n{env}')
    run = LocalRun(tmp_path / "run", config)
    try:
        run.start_coordinator()

        other = write_config(tmp_path / "other.toml", f'rounds = 1\ninner_steps = 3\nmodel = "{model_dir}"\n{env}')
        refused = join(run, "--config", str(other))
        assert refused.returncode == 1, refused.stderr[-2000:]
        error = refused.stderr.strip().splitlines()[-1]
        assert error.startswith("composer-node: error: run 'composer' has another config") and "inner_steps" in error

        unreachable = join(run, "--env-url", "http://127.0.0.1:9")  # nothing listens there
        assert unreachable.returncode == 1, unreachable.stderr[-2000:]
        error = unreachable.stderr.strip().splitlines()[-1]
        assert "http://127.0.0.1:9" in error and "not reachable" in error, error

        split = join(run, "--batch-size", "3")  # G = 4: 3 episodes per step cannot hold whole GRPO groups
        assert split.returncode == 1, split.stderr[-2000:]
        assert "--batch-size 3 x --grad-accum 1 = 3 episodes per step is not a multiple of the run's " \
               "num_generations 4" in split.stderr.strip().splitlines()[-1]

        build_model(model_dir, hidden_size=48)  # this machine's copy of the model is not the run's
        refused = join(run, "--config", str(config))
        assert refused.returncode == 1, refused.stderr[-2000:]
        error = refused.stderr.strip().splitlines()[-1]
        assert "model architecture differs from the run's" in error, refused.stderr[-2000:]
        assert "32]" in error and "48]" in error, error
    finally:
        run.stop()

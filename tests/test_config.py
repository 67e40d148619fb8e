"""The run config: defaults run the embedded default, TOML is validated field by field."""

import json
import subprocess
import sys

import pytest

from composer_diloco.config import ConfigError, NetworkConfig, RunConfig, load_config


def test_defaults_are_valid_and_embedded():
    cfg = load_config(None)
    assert cfg.model is None and cfg.outer.nesterov
    assert cfg.batch_size == cfg.grpo.tasks_per_step * cfg.grpo.num_generations


def test_toml_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('rounds = 7\ninner_steps = 3\n[outer]\nlr = 0.5\n[grpo]\nloss_type = "grpo"\n')
    cfg = load_config(path, rounds=9)
    assert (cfg.rounds, cfg.inner_steps, cfg.outer.lr, cfg.grpo.loss_type) == (9, 3, 0.5, "grpo")


def test_json_roundtrip_and_digest():
    cfg = RunConfig(rounds=5)
    again = RunConfig.from_json(cfg.to_json())
    assert again == cfg and again.digest() == cfg.digest() != RunConfig().digest()


@pytest.mark.parametrize(
    "text, needle",
    [
        ("rounds = 0\n", "field 'rounds'"),
        ("[outer]\nlrr = 1\n", "field 'outer.lrr'"),
        ('[grpo]\nloss_type = "ppo"\n', "field 'grpo.loss_type'"),
        ("[network]\nheartbeat_s = 5\nheartbeat_ttl_s = 6\n", "heartbeat_ttl_s"),
        ("rounds = [\n", "not valid TOML"),
    ],
)
def test_invalid_file_names_field(tmp_path, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_env_reset_kwargs(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[env]\nreset_kwargs = { source = "generated", level = 2 }\n')
    assert load_config(path).env.reset_kwargs == {"source": "generated", "level": 2}
    path.write_text('[env]\nreset_kwargs = { seed = 3 }\n')
    with pytest.raises(ConfigError, match="reset_kwargs must not set seed"):
        load_config(path)


def test_outer_defaults_follow_the_policy(tmp_path):
    """The embedded default averages (lr 1, momentum 0); a real model whose [outer] chooses nothing gets Delayed
    Nesterov with DiLoCo's 0.7 / 0.9 (BENCHMARKS.md 1d); a section that sets SGD values gets DiLoCo's SGD for the rest;
    explicit values win either way, and a published config keeps its values."""
    embedded = load_config(None)
    assert (embedded.outer.optimizer, embedded.outer.lr, embedded.outer.momentum) == ("sgd", 1.0, 0.0)
    real = load_config(None, model="Qwen/Qwen3-0.6B")
    assert real.outer.optimizer == "composer_diloco.outer.delayed_nesterov.DelayedNesterov"
    assert (real.outer.lr, real.outer.kwargs, real.outer.momentum) == (0.7, {"momentum": 0.9, "delay": 4}, None)
    from composer_diloco.outer.global_model import check_factory, optimizer_factory

    check_factory(optimizer_factory(real.outer))  # read without building it (config.check_delayed_nesterov): it builds
    path = tmp_path / "c.toml"
    path.write_text("[outer]\nmomentum = 0.9\n")
    assert (load_config(path).outer.lr, load_config(path).outer.momentum) == (1.0, 0.9)
    sgd = load_config(path, model="m").outer
    assert (sgd.optimizer, sgd.lr, sgd.momentum, sgd.nesterov) == ("sgd", 0.7, 0.9, True)
    path.write_text('[outer]\noptimizer = "sgd"\nmax_norm_ratio = 5.0\n')  # naming SGD alone: DiLoCo's SGD
    assert (load_config(path, model="m").outer.lr, load_config(path, model="m").outer.momentum) == (0.7, 0.9)
    path.write_text("[outer]\noverlap = true\n")  # fields that choose no optimizer keep the model's default
    chosen = load_config(path, model="m").outer
    assert chosen.overlap and chosen.optimizer.endswith("DelayedNesterov") and chosen.lr == 0.7
    assert RunConfig.from_json(real.to_json()) == real and RunConfig.from_json(embedded.to_json()) == embedded


def test_a_model_runs_config_is_read_without_importing_torch(tmp_path):
    """The command lines judge a config before their heavy imports: a --model run's default outer optimizer (Delayed
    Nesterov) and a bad argument of it are checked without torch (`config.check_delayed_nesterov`)."""
    path = tmp_path / "c.toml"
    path.write_text('[outer]\noptimizer = "composer_diloco.outer.delayed_nesterov.DelayedNesterov"\nlr = 0.5\n'
                    "kwargs = {momentum = 0.95, delay = 0}\n")
    code = ("import sys\nfrom composer_diloco.config import ConfigError, load_config\n"
            "assert load_config(None, model='Qwen/Qwen3-0.6B').outer.optimizer.endswith('DelayedNesterov')\n"
            f"try:\n    load_config({str(path)!r}, model='m')\nexcept ConfigError as e:\n    print(e)\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "delay=0" in r.stdout and r.stdout.strip().endswith("no torch"), r.stdout


def test_the_all_reduce_time_limit_grows_with_the_pseudo_gradient():
    net = RunConfig().network
    # Qwen3-0.6B's fp32 pseudo-gradient (full fine-tuning): its all-reduce took 44-45 s on an H200, the old fixed limit
    assert net.allreduce_timeout_s(2_400_000_000) == pytest.approx(net.averaging_timeout_s + 480.0)
    assert net.allreduce_timeout_s(3_600_000) == pytest.approx(net.averaging_timeout_s + 0.72)
    slow = NetworkConfig(state_min_rate_mb_s=1.0)
    assert slow.allreduce_timeout_s(10_000_000) == pytest.approx(slow.averaging_timeout_s + 20.0)


def test_loss_keys_are_checked_by_their_channels_and_published_as_before(tmp_path):
    """``[loss]`` keys are declared by the channel modules (`SdpoSettings`, `DpoSettings`), checked with the config's
    one-line error, and published with every channel key at its value: the JSON (and digest) of configs written when
    the keys were fields of config.py."""
    path = tmp_path / "c.toml"
    path.write_text("[loss]\nalpha_sdpo = 0.2\nsdpo_top_k = 0\n")
    with pytest.raises(ConfigError, match=r"field 'loss.sdpo_top_k': Input should be greater than or equal to 1 "
                                          r"\(got 0\)"):
        load_config(path)
    path.write_text("[loss]\nalpha_sdpo = 0.2\ndpo_scor = 'recovery'\n")
    with pytest.raises(ConfigError, match=r"field 'loss.dpo_scor': Extra inputs are not permitted"):
        load_config(path)
    published = json.loads(RunConfig().to_json())["loss"]
    assert published == {"alpha_sdpo": 0.0, "beta_dpo": 0.0, "dpo_beta": 0.1, "dpo_score": "accepted",
                         "sdpo_jsd_beta": 1.0, "sdpo_temperature": 1.0, "sdpo_token_clip": None, "sdpo_top_k": None,
                         "sdpo_verify_samples": 0}  # sdpo_peer_demo_reward: left out at its default (None)
    path.write_text("[loss]\nalpha_sdpo = 0.2\nbeta_dpo = 0.2\nsdpo_peer_demo_reward = 1\n")
    config = load_config(path)
    assert json.loads(config.to_json())["loss"]["sdpo_peer_demo_reward"] == 1.0
    assert RunConfig.from_json(config.to_json()) == config

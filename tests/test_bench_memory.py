"""bench/memory.py: the sampler sees a process tree's private bytes, and the slope reads copies of theta off two
summaries."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from memory import TreeMemory, slope  # noqa: E402

HOLD_300_MIB_IN_A_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "b = bytearray(b'x' * (300 << 20)); import time; time.sleep(3)"])
child.wait()
"""


def test_the_sampler_counts_a_grandchild_s_private_bytes():
    proc = subprocess.Popen([sys.executable, "-c", HOLD_300_MIB_IN_A_CHILD])
    memory = TreeMemory(period_s=0.2).start()
    memory.watch("tree", proc.pid)
    try:
        proc.wait(timeout=60)
    finally:
        peaks = memory.stop()
    assert peaks["tree"].uss_bytes > 300 << 20, peaks
    assert peaks["tree"].pss_bytes >= peaks["tree"].uss_bytes
    assert any(s["peer"] == "tree" for s in memory.series) and all(s["time"] <= time.time() for s in memory.series)


def _summary(parameters: int, coordinator_bytes: int) -> list[dict]:
    return [{"mode": "blocking", "parameters": parameters,
             "memory": {"coordinator": {"uss_bytes": coordinator_bytes, "pss_bytes": coordinator_bytes + 4_000_000}}}]


def test_the_slope_is_the_peak_difference_over_theta_s_bytes():
    # 1M more parameters (4 MB of fp32) and 40 MB more private bytes: 10 copies of theta, none of them shared
    rows = slope(_summary(1_000_000, 500_000_000), _summary(2_000_000, 540_000_000))
    assert rows == [{"mode": "blocking", "peer": "coordinator", "private": 10.0, "shared": 0.0, "total": 10.0}]
    with pytest.raises(ValueError, match="larger"):
        slope(_summary(2_000_000, 1), _summary(1_000_000, 1))
    with pytest.raises(ValueError, match="--memory"):
        slope([{"mode": "blocking", "parameters": 1}], _summary(2, 1))


def test_real_arch_writes_a_config_with_other_settings(tmp_path):
    """``bench/real_arch.py config``: dotted settings replace the base's, and a setting the config refuses fails there."""
    import tomllib

    from real_arch import ROOT, write_config

    from composer_diloco.config import ConfigError

    out = write_config(ROOT / "configs" / "qwen3_0.6b_lora.toml", tmp_path / "long.toml",
                       ["max_seq_len=1024", "env.max_tool_calls=6", "env.max_tool_reply_tokens=32"])
    data = tomllib.loads(out.read_text())
    assert data["max_seq_len"] == 1024 and data["env"] == {"max_tool_calls": 6, "max_turn_tokens": 16,
                                                            "max_tool_reply_tokens": 32}
    assert data["lora"]["r"] == 16  # the rest is the base's
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        write_config(ROOT / "configs" / "qwen3_0.6b_lora.toml", tmp_path / "bad.toml", ["max_seq_len"])
    with pytest.raises(ConfigError):
        write_config(ROOT / "configs" / "qwen3_0.6b_lora.toml", tmp_path / "bad.toml", ["env.max_tool_reply_tokens=0"])

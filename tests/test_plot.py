"""`composer-coordinator plot`: PNGs from hand-written metrics.jsonl files, and its bad-input errors."""

import json
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread
from typer.testing import CliRunner

from coordinator.cli import app
import prefork

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FIGURES = ("reward.png", "losses.png", "bytes.png", "sync.png")
runner = CliRunner()


def node_record(name: str, rnd: int, reward: float, samples: int = 8) -> dict:
    """The fields `composer_diloco.diloco.DiLoCoRounds.end_round` writes (values made up)."""
    return {
        "round": rnd, "peer": name, "role": "node", "peers": 3, "samples": samples, "mean_reward": reward,
        "success_rate": reward / 2, "tool_errors_per_episode": 0.25, "loss_grpo": -0.1 + 0.01 * rnd,
        "loss_sdpo": 0.2 - 0.01 * rnd, "loss_dpo": 0.69 - 0.02 * rnd, "inner_steps": 4, "sdpo_sites": 3,
        "dpo_pairs": 2, "sdpo_skipped": {"no_hint": 0}, "pair_stats": {"pairs": 2}, "inner_seconds": 4.5,
        "sync_seconds": 2.0 + rnd, "wait_seconds": 0.5, "bytes_sent": 4_784_218, "global_sha256": f"sha{rnd}",
        "status": "averaged", "rejected": [], "deadline_hit": False, "time": 1.0e9 + rnd,
    }


def coordinator_record(rnd: int) -> dict:
    """The fields `coordinator.coordinator.Coordinator.serve` writes (values made up)."""
    return {
        "round": rnd, "peer": "coordinator", "role": "coordinator", "peers": 3, "samples": 0, "weight_total": 16.0,
        "sync_seconds": 10.0, "wait_seconds": 8.0, "bytes_sent": 4_838_070, "global_sha256": f"sha{rnd}",
        "status": "averaged", "rejected": [], "time": 1.0e9 + rnd,
    }


def write_metrics(run_dir: Path, peer: str, records: list[dict]) -> None:
    path = run_dir / peer / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    write_metrics(run, "coordinator", [coordinator_record(r) for r in range(3)])
    write_metrics(run, "node-0", [node_record("node-0", r, 0.5 + 0.1 * r) for r in range(3)])
    # node-1 joined late and lost the loss of round 2 (a NaN, as JSON writes it): both must still draw
    late = [node_record("node-1", r, 0.25, samples=4) for r in (1, 2)]
    late[1]["loss_grpo"] = float("nan")
    write_metrics(run, "node-1", late)
    return run


def assert_pngs(folder: Path) -> None:
    for name in FIGURES:
        path = folder / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE, path
        pixels = imread(path)
        assert pixels.shape[0] > 200 and pixels.shape[1] > 400, (path, pixels.shape)
        assert pixels.std() > 0.01, f"{path} is blank"


def test_plot_writes_every_figure_into_run_dir_plots(run_dir: Path):
    result = runner.invoke(app, ["plot", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [str(run_dir / "plots" / name) for name in FIGURES]
    assert_pngs(run_dir / "plots")


def test_plot_out_option_and_a_single_node(tmp_path: Path):
    run = tmp_path / "run"
    write_metrics(run, "node-0", [node_record("node-0", 0, 1.0)])
    out = tmp_path / "figs" / "nested"
    result = runner.invoke(app, ["plot", str(run), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert_pngs(out)
    assert not (run / "plots").exists()


def test_resumed_peer_keeps_the_last_record_of_a_round(run_dir: Path):
    from coordinator.plot import load_run

    again = node_record("node-0", 1, 0.9)
    with open(run_dir / "node-0" / "metrics.jsonl", "a") as f:
        f.write(json.dumps(again) + "\n")
    records = load_run(run_dir)["node-0"]
    assert [r["round"] for r in records] == [0, 1, 2]
    assert records[1]["mean_reward"] == 0.9


def run_error(args: list[str]) -> tuple[int, str]:
    result = runner.invoke(app, args)
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("composer-coordinator: error: ")
    return result.exit_code, lines[0]


def test_run_dir_that_does_not_exist(tmp_path: Path):
    missing = tmp_path / "no-such-run"
    code, line = run_error(["plot", str(missing)])
    assert code == 1 and str(missing) in line and "does not exist" in line and "metrics.jsonl" in line
    assert not missing.exists()


def test_run_dir_without_metrics(tmp_path: Path):
    (tmp_path / "node-0").mkdir()
    (tmp_path / "node-0" / "node.log").write_text("no metrics here\n")
    code, line = run_error(["plot", str(tmp_path)])
    assert code == 1 and str(tmp_path) in line and "no metrics" in line and "metrics.jsonl" in line
    assert not (tmp_path / "plots").exists()


def test_run_dir_that_is_a_file(tmp_path: Path):
    file = tmp_path / "metrics.jsonl"
    file.write_text("{}\n")
    code, line = run_error(["plot", str(file)])
    assert code == 1 and "is not a directory" in line


def test_metrics_line_that_is_not_json(run_dir: Path):
    with open(run_dir / "node-0" / "metrics.jsonl", "a") as f:
        f.write('{"round": 3, "peer"\n')
    code, line = run_error(["plot", str(run_dir)])
    assert code == 1 and str(run_dir) in line and "not JSON" in line
    assert not (run_dir / "plots").exists()


def test_record_without_round(run_dir: Path):
    write_metrics(run_dir, "node-2", [{"peer": "node-2", "role": "node"}])
    code, line = run_error(["plot", str(run_dir)])
    assert code == 1 and "node-2" in line and "'round'" in line
    assert not (run_dir / "plots").exists()


def test_out_that_is_a_file(run_dir: Path, tmp_path: Path):
    out = tmp_path / "taken"
    out.write_text("")
    code, line = run_error(["plot", str(run_dir), "--out", str(out)])
    assert code == 1 and str(out) in line and "not a directory" in line


def test_console_entry_point_reports_one_error_line(tmp_path: Path):
    root = Path(__file__).resolve().parents[1]
    r = prefork.run([sys.executable, "-m", "coordinator", "plot", str(tmp_path / "gone")], capture_output=True,
                    text=True, timeout=120, cwd=root)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"composer-coordinator: error: run directory "
                                             f"{str(tmp_path / 'gone')!r} does not exist (expected a run's folder "
                                             "holding <peer>/metrics.jsonl files)"]

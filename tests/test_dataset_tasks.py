"""Tasks from a dataset (``[tasks]``, TRL's ``reset(**row)``): loading JSONL / Parquet / ``save_to_disk`` folders, the
one-line errors of a bad dataset, the deterministic split between nodes, and a two-node run against an OpenEnv MCP
server whose reset carries no task text (`tests/mcp_env_server.py` given a row), which trains."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from composer_diloco.config import ConfigError, TasksConfig, load_config
from composer_diloco.inner.trainer import episode_dataset
from composer_diloco.rollout.mcp import McpEnvSession, McpProtocolError
from composer_diloco.rollout.sessions import open_env_sessions
from composer_diloco.rollout.tasks import TaskEnvSession, TaskSet, TaskSetError, TaskShard, row_of, task_episode_id
import prefork
from local_run import LocalRun, assert_agree
from mcp_env_server import task_row
from test_mcp_env import start_mcp_server
from tests_support import stop_processes

ROOT = Path(__file__).resolve().parents[1]
TASK_FILE = ROOT / "configs" / "mcp_prices_tasks.jsonl"
TASK_CONFIG = ROOT / "configs" / "mcp_prices.toml"


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------ loading and errors


def test_the_shipped_task_file_loads_with_its_config():
    config = load_config(TASK_CONFIG)
    tasks = TaskSet.load(config.tasks)
    assert len(tasks) == 64 and all(p.startswith("What is the price of ") for p in tasks.prompts)
    prompt, kwargs = tasks.task(3)
    assert sorted(kwargs) == ["ask", "items", "prices"] and kwargs == {k: task_row(0, "task-3")[k] for k in kwargs}
    assert prompt == task_row(0, "task-3")["prompt"]
    assert TaskSet.load(TasksConfig()) is None  # no path: the env's reset gives the tasks


def test_jsonl_parquet_and_saved_datasets_give_the_same_tasks(tmp_path):
    import datasets

    rows = [task_row(1, f"t{i}") for i in range(5)]
    data = datasets.Dataset.from_list(rows)
    data.to_parquet(str(tmp_path / "tasks.parquet"))
    data.save_to_disk(str(tmp_path / "saved"))
    loaded = [TaskSet.load(TasksConfig(path=str(p))) for p in
              (_write_jsonl(tmp_path / "tasks.jsonl", rows), tmp_path / "tasks.parquet", tmp_path / "saved")]
    assert len({t.sha256 for t in loaded}) == 1 and len(loaded[0]) == 5
    # every column goes to reset(**row) by default (TRL's convention), the prompt included
    assert sorted(loaded[0].task(0)[1]) == ["ask", "items", "prices", "prompt"]
    # chat-message prompts: the user contents are the task text
    chat = TaskSet.from_rows([{"prompt": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "What is 2 + 3?"}]}], reset_columns=[])
    assert chat.prompts == ("What is 2 + 3?",) and chat.task(0)[1] == {}


@pytest.mark.parametrize("rows, settings, message", [
    ([], {}, r"has no rows"),
    ([{"question": "q"}], {}, r"has no prompt column 'prompt': its columns are \['question'\]"),
    ([{"prompt": "  "}], {}, r"row 0: the prompt column 'prompt' is empty"),
    ([{"prompt": "q", "seed": 3}], {}, r"column\(s\) \['seed'\] would be passed to reset"),
    ([{"prompt": "q"}], {"reset_columns": ["items"]}, r"reset_columns \['items'\] are not columns"),
])
def test_a_bad_dataset_is_refused_in_one_line(rows, settings, message):
    with pytest.raises(TaskSetError, match=message) as info:
        TaskSet.from_rows(rows, source="t.jsonl", **settings)
    assert "\n" not in str(info.value)


def test_a_missing_or_unknown_path_is_refused_in_one_line(tmp_path):
    for path, message in [(tmp_path / "nope.jsonl", r"cannot be loaded"),
                          (_write_jsonl(tmp_path / "t.txt", [{"prompt": "q"}]), r"unknown file type '.txt'")]:
        with pytest.raises(TaskSetError, match=message) as info:
            TaskSet.load(TasksConfig(path=str(path)))
        assert "\n" not in str(info.value) and str(path) in str(info.value)
    with pytest.raises(ConfigError, match=r"tasks.prompt_column"):
        load_config(None, tasks={"path": "x.jsonl", "prompt_column": ""})


# ------------------------------------------------------------------------------------------------- the split


def test_shards_partition_the_rows_deterministically_and_reshuffle_each_epoch():
    tasks = TaskSet.from_rows([{"prompt": f"task {i}"} for i in range(10)])
    shards = [tasks.order(5, seed=7, shard=TaskShard(k, 2)) for k in range(2)]
    assert sorted(shards[0] + shards[1]) == list(range(10))  # disjoint, and together every row once
    assert shards == [tasks.order(5, seed=7, shard=TaskShard(k, 2)) for k in range(2)]  # deterministic
    assert tasks.order(5, seed=8, shard=TaskShard(0, 2)) != shards[0]  # the run's seed picks the permutation
    two_epochs = tasks.order(10, seed=7, shard=TaskShard(0, 2))
    assert two_epochs[:5] == shards[0] and len(two_epochs) == 10  # the second pass: shard 0 of a new permutation
    # without a shard, each node walks its own permutation of all rows
    own = tasks.order(10, seed=7, peer_name="node-a")
    assert sorted(own) == list(range(10)) and own != tasks.order(10, seed=7, peer_name="node-b")
    with pytest.raises(ValueError, match=r"--task-shard '2/2': expected K/N with 0 <= K < N"):
        TaskShard.parse("2/2")
    with pytest.raises(ValueError, match=r"shard 3/4 holds no row: the dataset has 3 rows"):
        TaskSet.from_rows([{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}]).order(1, seed=0, shard=TaskShard(3, 4))


def test_episode_ids_name_their_row_so_any_peer_can_replay_them():
    config = load_config(TASK_CONFIG)
    tasks = TaskSet.load(config.tasks)
    rows = episode_dataset(config, "node-0", 6, tasks, TaskShard(0, 2))
    ids = [r["episode_id"] for r in rows]
    assert [row_of(e) for e in ids] == tasks.order(6, seed=config.seed, shard=TaskShard(0, 2))
    assert len(set(ids)) == 6 and row_of("abc-1") is None and row_of(task_episode_id("x-2", 17)) == 17


# ---------------------------------------------------------------------------- an env whose reset has no task


@pytest.mark.timeout(180)
def test_rows_drive_an_mcp_env_whose_reset_carries_no_task(tmp_path):
    """Without [tasks] the node refuses such an env at its check reset; with them every episode is its row's."""
    tasks = TaskSet.load(load_config(TASK_CONFIG).tasks)
    proc, url = start_mcp_server()
    try:
        raw = McpEnvSession(url, max_tool_calls=4)
        try:
            text, _ = raw.start(0, "r", tasks.task(2)[1])
            assert text == ""  # a row given: the server's reset carries no task text
        finally:
            raw.close()
        with pytest.raises(McpProtocolError, match=r"holds no task text"):  # such a reset, as a node without tasks
            s = McpEnvSession(url, max_tool_calls=4, reset_kwargs=tasks.task(2)[1])
            try:
                s.reset(0, "r")
            finally:
                s.close()
        (session,) = open_env_sessions([url], 1, max_tool_calls=4, tasks=tasks, check_row=5)
        try:
            assert isinstance(session, TaskEnvSession)
            question, tools = session.reset(0, task_episode_id("e", 9))
            assert question == tasks.prompts[9] and [t["function"]["name"] for t in tools][-1] == "submit"
            row = task_row(0, "task-9")
            answer = dict(zip(row["items"], row["prices"]))
            total = sum(answer[item] for item in row["ask"])
            assert session.call("submit", {"answer": total})[3:] == (1.0, True)  # scored on the row's catalogue
        finally:
            session.close()
    finally:
        stop_processes([proc])


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_two_nodes_train_on_their_shards_of_a_jsonl_task_file(run_dir):
    """Rounds complete, tool calls parse, reward is earned on the rows' catalogues, and theta agrees."""
    server, url = start_mcp_server(log_path=run_dir / "mcp-server.log")
    run = LocalRun(run_dir, TASK_CONFIG)
    try:
        run.start_coordinator("--rounds", "1", wait=False)  # the nodes start beside it (the suite's time)
        for k in range(2):
            run.start_node(f"node-{k}", "--env-url", url, "--task-shard", f"{k}/2")
        run.wait_peer_line()
        codes = {name: run.wait_exit(name, timeout_s=480) for name in ("node-0", "node-1", "coordinator")}
        assert codes == {"node-0": 0, "node-1": 0, "coordinator": 0}, run.all_tails()
        records = run.records()
        assert_agree(records, [0])
        for k in range(2):
            (record,) = records[f"node-{k}"]
            assert record["samples"] > 0 and record["episodes_without_tool_call"] < record["samples"]
            assert record["mean_reward"] > 0.0, record  # a prompt that did not match the catalogue earns nothing
            text = run.log(f"node-{k}")
            assert "tasks: 64 rows from configs/mcp_prices_tasks.jsonl" in text and f"shard {k}/2 of 64 rows" in text
        print(f"\ndataset tasks, round 0: rewards {[records[f'node-{k}'][0]['mean_reward'] for k in range(2)]}")
    finally:
        run.stop()
        stop_processes([server])


def test_a_node_refuses_a_task_shard_that_is_not_k_of_n(tmp_path):
    r = prefork.run([sys.executable, "-m", "nodes", "join", "--peer", "/ip4/127.0.0.1/tcp/9/p2p/"
                     "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN", "--task-shard", "3", "--run-dir",
                     str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == ("composer-node: error: --task-shard '3': expected K/N with "
                                                 "0 <= K < N, e.g. 0/2")

"""The dashboard of a run that reports to trackio (``[report]``), as a headless browser sees it.

``run`` plays a `simulate` run whose peers report to trackio (its store in ``OUT/trackio``); ``shoot`` serves that
store's dashboard (``trackio show``) on a free local port and has headless Chromium load its metrics page and its
tables page: each page's DOM after its scripts ran (``OUT/<page>.html``) and a screenshot (``OUT/<page>.png``).
Without a subcommand, both. tests/test_localhost_run.py shoots the main job's run and asserts on the pages.

    python bench/dashboard.py --out runs/dashboard --rounds 8 \
        --metric-filter '^(mean_reward|success_rate|loss_grpo|loss_sdpo|loss_dpo|inner_seconds|sync_seconds)$'
                                                                         # the README's screenshots
    python bench/dashboard.py shoot --trackio-dir DIR --project P --out DIR

Needs trackio (``pip install -e ".[trackio]"``) and Chromium (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"metrics": "/", "tables": "/media"}
"""The dashboard's pages shot, by name: trackio's metrics (one chart per metric, every run's curve in it) and its
media & tables page (the coordinator's ``peers_table`` of every round)."""


def find_chromium() -> str | None:
    """The path of a Chromium (or Chrome) binary, or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def run(out: Path, rounds: int, nodes: int, config: Path | None, project: str) -> None:
    """`simulate` with ``[report] to = ["trackio"]`` appended to ``config`` (smoke.toml's settings by default).

    Raises:
        SystemExit: simulate failed (its exit code; its output is in ``out/simulate.log``).
    """
    out.mkdir(parents=True, exist_ok=True)
    base = (config or ROOT / "configs" / "smoke.toml").read_text()
    (out / "report.toml").write_text(f'{base}\n[report]\nto = ["trackio"]\nproject = "{project}"\n')
    with open(out / "simulate.log", "w") as log:
        code = subprocess.call([sys.executable, "-m", "coordinator", "simulate", "--nodes", str(nodes), "--rounds",
                                str(rounds), "--config", str(out / "report.toml"), "--run-dir", str(out / "run")],
                               env={**os.environ, "TRACKIO_DIR": str(out / "trackio")}, stdout=log,
                               stderr=subprocess.STDOUT, cwd=ROOT)
    if code != 0:
        raise SystemExit(f"simulate exited with {code}: see {out / 'simulate.log'}")


def shoot(trackio_dir: Path, project: str, out: Path, metric_filter: str | None = None,
          timeout_s: float = 60.0) -> dict[str, str]:
    """Serve ``trackio_dir``'s dashboard of ``project`` and load each of `PAGES` in headless Chromium
    (``metric_filter``: a regex of the metrics page's charts to show, trackio's ``metric_filter``; no smoothing).

    Returns:
        page name -> its DOM after the page's scripts ran (also written to ``out/<page>.html``, with
        ``out/<page>.png``, 1600x1000).
    Raises:
        RuntimeError: no Chromium; the dashboard did not answer within ``timeout_s`` seconds (its output is in the
            message); a screenshot was not written.
    """
    chromium = find_chromium()
    if chromium is None:
        raise RuntimeError("no Chromium on this machine (Debian: apt-get install chromium)")
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "TRACKIO_DIR": str(trackio_dir), "GRADIO_SERVER_PORT": str(port),
           "BROWSER": "true"}  # `trackio show` opens a browser tab: here, the no-op `true`
    server = subprocess.Popen([sys.executable, "-m", "trackio.cli", "show", "--project", project], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    pages = {}
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{base}/?project={project}", timeout=2).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"trackio's dashboard did not answer at {base}") from None
                time.sleep(0.5)
        browser = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                   "--window-size=1600,1000", "--virtual-time-budget=15000", f"--user-data-dir={out / 'profile'}"]
        for page, path in PAGES.items():
            url = f"{base}{path}?project={project}&smoothing=0"
            if metric_filter and page == "metrics":
                url += "&metric_filter=" + urllib.parse.quote(metric_filter)
            pages[page] = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True,
                                         timeout=120).stdout
            (out / f"{page}.html").write_text(pages[page])
            subprocess.run([*browser, f"--screenshot={out / f'{page}.png'}", url], capture_output=True, timeout=120)
            if not (out / f"{page}.png").is_file():
                raise RuntimeError(f"Chromium wrote no screenshot of {url}")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        shutil.rmtree(out / "profile", ignore_errors=True)
    return pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=["run", "shoot"], help="one step (default: both)")
    parser.add_argument("--out", type=Path, required=True, help="folder of the run, the store and the pages")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--config", type=Path, default=None, help="run config (default configs/smoke.toml)")
    parser.add_argument("--project", default="dashboard", help="trackio project")
    parser.add_argument("--trackio-dir", type=Path, default=None, help="shoot: the store (default OUT/trackio)")
    parser.add_argument("--metric-filter", default=None, help="shoot: regex of the charts to show (default all)")
    args = parser.parse_args()
    if args.command in (None, "run"):
        run(args.out, args.rounds, args.nodes, args.config, args.project)
    if args.command in (None, "shoot"):
        pages = shoot(args.trackio_dir or args.out / "trackio", args.project, args.out, args.metric_filter)
        print(json.dumps({page: {"bytes": len(dom), "png": str(args.out / f"{page}.png")}
                          for page, dom in pages.items()}))


if __name__ == "__main__":
    main()

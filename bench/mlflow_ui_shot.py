"""A screenshot of a training run's page in the MLflow UI, in a real headless Chromium (not a test): what a user
sees first when they open a run (docs/tracking.md, docs/evaluation.md).

Starts ``mlflow ui`` on the given store on a free 127.0.0.1 port, opens ``#/experiments/<id>/runs/<run>`` and its
``model-metrics`` tab, and writes one PNG of each.

Usage:  .venv/bin/python bench/mlflow_ui_shot.py --store sqlite:///$PWD/mlflow.db --run RUN_ID --out /tmp/shots
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True, help="the backend store URI, e.g. sqlite:////abs/mlflow.db")
    ap.add_argument("--run", required=True, help="the run id")
    ap.add_argument("--out", default="/tmp/mlflow-shots")
    args = ap.parse_args()

    from mlflow.tracking import MlflowClient
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    run = MlflowClient(args.store).get_run(args.run)
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "ui", "--backend-store-uri", args.store,
                               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        opts = webdriver.ChromeOptions()
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1600,1200"):
            opts.add_argument(flag)
        opts.binary_location = "/usr/bin/chromium"
        browser = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        base = f"http://127.0.0.1:{port}/#/experiments/{run.info.experiment_id}/runs/{args.run}"
        for name, url in (("run", base), ("metrics", base + "/model-metrics")):
            browser.get(url)
            time.sleep(8)  # the single-page app renders its charts after its API calls return
            browser.save_screenshot(str(out / f"{name}.png"))
            print(f"{name}: {out / f'{name}.png'}  ({browser.title})")
        browser.quit()
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()

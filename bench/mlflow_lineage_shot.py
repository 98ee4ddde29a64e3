"""Screenshots of a pipeline's (or a sweep's) lineage in the MLflow UI, in a real headless Chromium (not a test):
the experiment's runs with the stages nested under the parent, the parent's page, and a stage's page with its
lineage tags (docs/pipeline.md, docs/sweeps.md).

Starts ``mlflow ui`` on the store on a free 127.0.0.1 port; writes runs.png, parent.png and <stage>.png.

Usage:  .venv/bin/python bench/mlflow_lineage_shot.py --store sqlite:///$PWD/mlflow.db --parent RUN_ID \
            [--child RUN_ID ...] --out /tmp/lineage
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
    ap.add_argument("--parent", required=True, help="the pipeline's or sweep's parent run id")
    ap.add_argument("--child", action="append", default=[], help="a stage's run id to photograph too (repeatable)")
    ap.add_argument("--out", default="/tmp/mlflow-lineage")
    args = ap.parse_args()

    from mlflow.tracking import MlflowClient
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    client = MlflowClient(args.store)
    parent = client.get_run(args.parent)
    exp = parent.info.experiment_id
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
                     "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1800,1300"):
            opts.add_argument(flag)
        opts.binary_location = "/usr/bin/chromium"
        browser = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        root = f"http://127.0.0.1:{port}/#/experiments/{exp}"
        pages = [("runs", f"{root}/runs"), ("parent", f"{root}/runs/{args.parent}")]
        pages += [(client.get_run(c).info.run_name, f"{root}/runs/{c}") for c in args.child]
        for name, url in pages:
            browser.get(url)
            time.sleep(8)  # the single-page app renders after its API calls return
            if name == "runs":  # open the parent's row so its children show nested under it
                for el in browser.find_elements("css selector", "[data-testid*='expand'], button[aria-label*='xpand']"):
                    try:
                        el.click()
                    except Exception:  # noqa: BLE001 - a row that is not clickable: the shot still shows the table
                        pass
                time.sleep(3)
            browser.save_screenshot(str(out / f"{name}.png"))
            print(f"{name}: {out / f'{name}.png'}  ({browser.title})")
        browser.quit()
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()

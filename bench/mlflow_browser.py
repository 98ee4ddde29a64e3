"""What the MLflow UI screenshot scripts share (not a test): ``mlflow ui`` on a store, on a free 127.0.0.1 port,
and a headless Debian Chromium driven by selenium (bench/mlflow_ui_shot.py, bench/mlflow_lineage_shot.py)."""
from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def mlflow_ui_browser(store: str, window: str = "1600,1200"):
    """Yields (the UI's base URL, a selenium Chrome) with the UI serving ``store``; both stopped after."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "ui", "--backend-store-uri", store,
                               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    browser = None
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        opts = webdriver.ChromeOptions()
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync", "--no-first-run", f"--window-size={window}"):
            opts.add_argument(flag)
        opts.binary_location = "/usr/bin/chromium"
        browser = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
        yield f"http://127.0.0.1:{port}", browser
    finally:
        if browser is not None:
            browser.quit()
        server.terminate()
        server.wait(timeout=30)

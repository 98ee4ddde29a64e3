"""A real headless browser for the tests that look at a page as a user does: Debian's chromium and its
chromedriver, driven by selenium (the chat page in test_serve.py, the MLflow run page in test_mlflow_ui.py)."""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from tests.skip_budget import missing


@contextlib.contextmanager
def chromium(profile_dir: Path, window: str = "1366,860"):
    """A headless Chromium with its own profile in ``profile_dir`` (no state shared between tests: MLflow's UI keeps
    its chart layouts in the browser's localStorage); quit on exit. Skipped (under CI=true: failed) without chromium
    and chromium-driver (.ci/run installs them)."""
    chromium_bin, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium_bin or not driver_bin:
        missing("Debian's chromium and chromium-driver are not installed (.ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium_bin
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--window-size={window}", f"--user-data-dir={profile_dir}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_bin), options=opts)
    try:
        yield driver
    finally:
        driver.quit()

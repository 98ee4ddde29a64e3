"""The MLflow UI of a real tracked run, in a real headless Chromium against a real `mlflow server` on 127.0.0.1.

The run is the suite's one tiny baseline run (conftest.py:tiny_baseline: 2 gloo workers, held-out eval, a benchmark
task on its checkpoints), trained once per test run; this file only serves its store and reads the pages:

- the run's charts (tracking/ui.py:run_charts_url): the loss first (the train section, then eval), the sections in
  the order of tracking/names.py, none empty;
- the run's page (tracking/runs.py:run_page_url, its Overview): "Datasets" lists the prepared data, "Logged models"
  the final model with its registered version, "Registered models" the version.

A screenshot of each page is left in the test's tmp_path (charts.png, run.png).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from .browser import chromium
from .conftest import MlflowServer

pytestmark = pytest.mark.integration

SECTION = re.compile(r"^\((\d+)\)$")  # a chart section's header is its name, then its chart count on the next line


def page_text(driver) -> list:
    return [line.strip() for line in driver.find_element("tag name", "body").text.splitlines() if line.strip()]


def chart_sections(lines: list) -> list:
    """(name, chart count, the first chart's title) of each section on a charts page, top to bottom."""
    out = []
    for i in range(1, len(lines)):
        m = SECTION.match(lines[i])
        if m:
            after = lines[i + 1:]
            titles = [t for t in after[:6] if "/" in t or t == "loss"]
            out.append((lines[i - 1], int(m.group(1)), titles[0] if titles else None))
    return out


@pytest.fixture(scope="module")
def served_baseline(tiny_baseline, tmp_path_factory):
    shared, res, _, _ = tiny_baseline
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-ui"), store=shared["mlflow"])
    server.start()
    try:
        yield server, res
    finally:
        server.stop()


def test_the_run_opens_on_its_loss_and_lists_its_data_and_model(served_baseline, tmp_path):
    from mlflow import MlflowClient
    from selenium.webdriver.support.ui import WebDriverWait

    from minimind_ray.tracking.runs import run_page_url
    from minimind_ray.tracking.ui import run_charts_url

    server, res = served_baseline
    client = MlflowClient(server.uri)
    run = client.get_run(res.mlflow_run_id)
    prepared = Path(run.data.tags["minimind.data.prepared_dir"]).name
    [version] = client.search_model_versions(f"run_id = '{res.mlflow_run_id}'")
    charts, page = run_charts_url(server.uri, res.mlflow_run_id), run_page_url(server.uri, res.mlflow_run_id)
    assert charts and page

    with chromium(tmp_path / "chromium", window="1600,1200") as driver:
        wait = WebDriverWait(driver, 120)  # the single-page app renders after its API calls return
        driver.get(charts)
        wait.until(lambda d: len(chart_sections(page_text(d))) >= 4 and "Step" in page_text(d))  # drawn
        driver.save_screenshot(str(tmp_path / "charts.png"))
        sections = chart_sections(page_text(driver))
        names = [name for name, _, _ in sections]
        # the loss first: the train section, its first chart the loss; then the evaluations (the benchmark's
        # eval/<task>: this run has no held-out split), then perf and sys; no empty section (MLflow's run page always
        # shows its catch-all "Model metrics", empty when every name has a prefix)
        assert sections[0][0] == "train" and sections[0][2] in ("loss", "train/loss"), sections
        assert [n for n in names if n.startswith("eval")] == ["eval/mc_eval"], names
        assert names.index("train") < names.index("eval/mc_eval") < names.index("perf") < names.index("sys"), names
        assert all(count > 0 for _, count, _ in sections) and "Model metrics" not in names, sections

        driver.get(page)
        wait.until(lambda d: "Logged models (1)" in page_text(d) and any(prepared in t for t in page_text(d)))
        driver.save_screenshot(str(tmp_path / "run.png"))
        lines = page_text(driver)
        # "Datasets": the prepared data, as the run's training input
        datasets = lines[lines.index("Datasets") + 1:lines.index("Datasets") + 4]
        assert any(t.startswith(prepared) for t in datasets) and "Train" in datasets, datasets
        # "Logged models": the final model, ready, with its registered version
        logged = lines[lines.index("Logged models (1)"):]
        assert "model" in logged and "Ready" in logged, logged[:30]
        assert version.name in logged and f"v{version.version}" in logged, logged[:30]
        # "Registered models": the same version
        box = len(lines) - 1 - lines[::-1].index("Registered models")  # the run's box (the table has a column so named)
        registered = lines[box:box + 4]
        assert version.name in registered and f"v{version.version}" in registered, registered

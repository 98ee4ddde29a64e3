"""A screenshot of a training run's page in the MLflow UI, in a real headless Chromium (not a test): what a user
sees first when they open a run (docs/tracking.md, docs/evaluation.md).

Starts ``mlflow ui`` on the given store on a free 127.0.0.1 port, opens ``#/experiments/<id>/runs/<run>`` and its
``model-metrics`` tab, and writes one PNG of each.

Usage:  .venv/bin/python bench/mlflow_ui_shot.py --store sqlite:///$PWD/mlflow.db --run RUN_ID --out /tmp/shots
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlflow_browser import mlflow_ui_browser  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True, help="the backend store URI, e.g. sqlite:////abs/mlflow.db")
    ap.add_argument("--run", required=True, help="the run id")
    ap.add_argument("--out", default="/tmp/mlflow-shots")
    args = ap.parse_args()

    from mlflow.tracking import MlflowClient

    run = MlflowClient(args.store).get_run(args.run)
    with mlflow_ui_browser(args.store, window="1600,1200") as (ui, browser):
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        base = f"{ui}/#/experiments/{run.info.experiment_id}/runs/{args.run}"
        for name, url in (("run", base), ("metrics", base + "/model-metrics")):
            browser.get(url)
            time.sleep(8)  # the single-page app renders its charts after its API calls return
            browser.save_screenshot(str(out / f"{name}.png"))
            print(f"{name}: {out / f'{name}.png'}  ({browser.title})")


if __name__ == "__main__":
    main()

"""Screenshots of a pipeline's (or a sweep's) lineage in the MLflow UI, in a real headless Chromium (not a test):
the experiment's runs with the stages nested under the parent, the parent's page, and a stage's page with its
lineage tags (docs/pipeline.md, docs/sweeps.md).

Starts ``mlflow ui`` on the store on a free 127.0.0.1 port; writes runs.png, parent.png and <stage>.png.

Usage:  .venv/bin/python bench/mlflow_lineage_shot.py --store sqlite:///$PWD/mlflow.db --parent RUN_ID \
            [--child RUN_ID ...] --out /tmp/lineage
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
    ap.add_argument("--parent", required=True, help="the pipeline's or sweep's parent run id")
    ap.add_argument("--child", action="append", default=[], help="a stage's run id to photograph too (repeatable)")
    ap.add_argument("--out", default="/tmp/mlflow-lineage")
    args = ap.parse_args()

    from mlflow.tracking import MlflowClient

    client = MlflowClient(args.store)
    parent = client.get_run(args.parent)
    exp = parent.info.experiment_id
    with mlflow_ui_browser(args.store, window="1800,1300") as (ui, browser):
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        root = f"{ui}/#/experiments/{exp}"
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


if __name__ == "__main__":
    main()

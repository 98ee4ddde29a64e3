"""Entry point for `ray job submit`: serve trained weights on Ray Serve.

    python -m pipelines.serve WEIGHTS [--host 127.0.0.1] [--port 8000] [--replicas N | --autoscale MIN..MAX] ...

WEIGHTS: a run dir, checkpoint, MiniMind .pth, HF export folder, storage URI, models:/NAME/VERSION or
runs:/RUN_ID/model. Works under `ray job submit`, with RAY_ADDRESS set, or with nothing set (a local Ray).
The job runs until it is stopped (`ray job stop` deletes the app), or pass --detach to leave the app running.
All logic lives in the library (minimind_ray.cli -> minimind_ray.serve.serve_verb).
"""
import sys

from minimind_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))

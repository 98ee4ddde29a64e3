"""Entry point for `ray job submit`: a Ray Tune sweep over a recipe (docs/sweeps.md).

    python -m pipelines.sweep --config pipelines/configs/sweep_tiny.yaml [sweep field=value ...]

Running the same command again resumes the sweep (finished trials are not run again).
"""
import sys

from minimind_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["sweep", *sys.argv[1:]]))

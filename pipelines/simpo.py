"""Entry point for `ray job submit`: the simpo stage.

    python -m pipelines.simpo --config pipelines/configs/<recipe>.yaml [key=value ...]

Works under `ray job submit`, with RAY_ADDRESS set, or with nothing set (a local Ray).
All logic lives in the library (minimind_ray.cli -> minimind_ray.raytrain.driver).
"""
import sys

from minimind_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["simpo", *sys.argv[1:]]))

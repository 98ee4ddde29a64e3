"""Entry point for `ray job submit`: the rloo stage (REINFORCE leave-one-out reinforcement learning).

    python -m pipelines.rloo --config pipelines/configs/<recipe>.yaml [key=value ...]

Works under `ray job submit`, with RAY_ADDRESS set, or with nothing set (a local Ray).
All logic lives in the library (minimind_ray.cli -> minimind_ray.raytrain.driver); the stage
itself is minimind_ray/stages/rloo.py, on the plan base minimind_ray/rl/plan.py (docs/rl.md).
"""
import sys

from minimind_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["rloo", *sys.argv[1:]]))

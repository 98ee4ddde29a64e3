"""Entry point for `ray job submit`: the ppo stage (PPO with an actor and a critic, MiniMind's train_ppo.py).

    python -m pipelines.ppo --config pipelines/configs/<recipe>.yaml [key=value ...]

Works under `ray job submit`, with RAY_ADDRESS set, or with nothing set (a local Ray).
All logic lives in the library (minimind_ray.cli -> minimind_ray.raytrain.driver); the stage
itself is minimind_ray/stages/ppo.py, with its plan, on rl/plan.py and rl/critic.py (docs/rl.md).
"""
import sys

from minimind_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["ppo", *sys.argv[1:]]))

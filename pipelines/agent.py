"""Entry point for `ray job submit`: the agent stage (agentic tool-use RL, MiniMind's train_agent.py).

    python -m pipelines.agent --config pipelines/configs/<recipe>.yaml [key=value ...]

Works under `ray job submit`, with RAY_ADDRESS set, or with nothing set (a local Ray).
All logic lives in the library (minimind_ray.cli -> minimind_ray.raytrain.driver); the stage
itself is minimind_ray/stages/agent.py, with its plan, on rl/turns.py, rl/trajectory_rewards.py and rl/tools.py
(docs/rl.md).
"""
import sys

from minimind_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["agent", *sys.argv[1:]]))

"""Reinforcement learning on the training engine: the pieces of the RL stages (grpo, ppo, agent and rloo, whose
algorithm is its stage module alone, stages/rloo.py; docs/rl.md).

``plan.py``     the plan base every algorithm's step runs on (what was sent ahead, the weight update, generation,
                scoring, the next submission, the reference and the rewards); ``GroupPlan``: a group per prompt
``grpo*.py``    GRPO/CISPO: its section, advantages and losses, its plan; ``ppo*.py``: PPO with a critic;
                ``agent*.py``, ``tools.py``: multi-turn tool-use RL
``rollout.py``  the rollout interface and the in-worker batched KV-cache sampler; ``actors.py``: a pool of Ray actors
``rewards.py``  reward plug-ins (MiniMind's rule rewards, exact answers, ``module:function``) and their sum
``reward_model.py``  model-based rewards: an HF sequence classifier, or a MiniMind-style ``get_score`` model

A stage's record (minimind_ray/stages/<name>.py) builds its objective, stages/rl_objective.py:RLObjective, with its
algorithm's plan. Ray only for the pool of rollout actors (actors.py) and a reward model on a shared actor.
"""

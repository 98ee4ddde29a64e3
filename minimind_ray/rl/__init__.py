"""Reinforcement learning on the training engine (stages ``grpo``, ``ppo`` and ``agent``).

``rollout.py``  the rollout interface and the in-worker batched KV-cache sampler
``rewards.py``  reward plug-ins (MiniMind's rule rewards, exact answers, ``module:function``) and their sum
``reward_model.py``  model-based rewards: an HF sequence classifier, or a MiniMind-style ``get_score`` model
``grpo.py``     group-normalised advantages, the EOS mask, the GRPO/CISPO loss and one micro-batch's rollout

The objective that ties them into the engine is ``minimind_ray.stages.grpo_objective.GRPOObjective``; PPO and the agent have theirs beside it.
Ray only for the pool of rollout actors (actors.py) and a reward model on a shared actor (docs/rl.md).
"""

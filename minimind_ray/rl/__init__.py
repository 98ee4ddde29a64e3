"""Reinforcement learning on the training engine: the neutral toolkit every RL algorithm stands on. Each algorithm
(GRPO, PPO, the agent, RLOO) is one module of stages/ (its section, its plan, which is its objective, and its
record); no file here bears an algorithm's name (docs/rl.md).

``plan.py``         the plan base every algorithm's step runs on (what was sent ahead, the weight update, generation,
                    scoring, the next submission, the reference and the rewards); ``GroupPlan``: a group per prompt
``rollout.py``      the rollout interface and the in-worker batched KV-cache sampler; ``rollout_config.py``: the
                    ``train.rollout`` section; ``actors.py``: a pool of Ray actors
``constraints.py``  constrained rollouts: an algorithm's ``json_schema`` (the agent's tool calls), one grammar matcher
                    per row in the batched decode step (llguidance, model/grammar.py)
``completions.py``  a micro-batch's completions sampled and scored (dynamic sampling, truncation, reference log-probs)
``logprobs.py``     which completion tokens count, and the policy's log-probs of them
``advantages.py``   group advantages, the leave-one-out baseline, GAE and whitening
``losses.py``       KL estimates, the clipped / clamped policy losses, PPO's value loss, how a loss aggregates
``critic.py``       a value head on a copy of the policy (PPO's critic)
``rewards.py``      reward plug-ins (MiniMind's rule rewards, exact answers, ``module:function``) and their sum;
                    ``reward_model.py``: model-based rewards (an HF sequence classifier, or a ``get_score`` model)
``turns.py``        multi-turn rollouts that call tools; ``tools.py`` + ``tool_worker.py``: the tools, run with a time
                    limit; ``trajectory_rewards.py``: the reward terms of whole trajectories

Ray only for the pool of rollout actors (actors.py) and a reward model on a shared actor.
"""

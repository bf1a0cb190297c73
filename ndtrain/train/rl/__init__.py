"""Reinforcement learning with verifiable rewards: the third task of the one trainer.

Reading order:
- `losses.py`: advantages, the policy-gradient objectives (reinforce, grpo, dr_grpo, dapo),
  dynamic sampling and overlong shaping;
- `rollout.py`: rows dealt to the generation ranks, sampled, scored, gathered;
- `task.py`: the RL task: the rollout phase before each update, the rows it serves, the
  log-probability check, the metrics, held-out evaluation;
- `job.py`: what each rank of `ndtrain rl` runs, and the default job's SFT warm-up;
- `asynchronous.py`, `generator.py`: asynchronous rollouts (rl.generate_ranks): generator
  processes beside the training ranks, their schedule, the weights and rollouts exchanged.

The generation layout lives in parallel/generation.py, the sampler in generate/sampler.py,
the tasks and their checks in data/verifiable.py.
"""

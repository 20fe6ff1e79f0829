"""Reward training's rewards (GRPO and its kin): the built-in reward functions, pure functions of the
completions and the data's columns (builtin), and the guarded call that scores a batch with several
of them at once, each bounded in time and its answer checked (guard). Imports torch and train/core's
errors only; loading a user's reward file is run-level work (train/run/plan/reward_funcs.py)."""

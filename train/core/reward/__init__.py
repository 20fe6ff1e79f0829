"""Reward training's core (GRPO and its kin): sampling G completions per prompt under the policy's
current weights (sampling), the KV cache that sampling holds, counted (kv_cache). Imports torch,
transformers and train/core's other modules only."""

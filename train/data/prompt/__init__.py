"""Reward training's data (GRPO and its kin): prompt records in the formats users have read into
Prompts with their extra columns (prompt_formats), the built-in arithmetic task (arithmetic), and the
front door that renders them with the chat template as SFT frames a prompt and hands each batch's
prompts and columns to the rewards (prompts). Imports train/core and train/data (SFT's readers and
templates), never the root config.py or a model."""

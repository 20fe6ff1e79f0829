"""Units and constants every layer shares. "MB" in summary.json and the log is MiB (2**20 bytes), as
nvidia-smi and torch.cuda's memory statistics count it."""

MIB = 2**20
IGNORE_INDEX = -100  # the label torch's cross_entropy (and transformers' causal-LM loss) skips

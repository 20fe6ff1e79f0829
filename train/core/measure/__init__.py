"""What a step costs, measured or predicted: device peaks, the FLOPs formula and MFU (mfu), the
step timer and data wait (timing), and the host-sync counter (syncs). The per-family parts (peak
memory, FLOPs per token of a model) are train/models/'s. Imports torch and train/core's other
modules only; nothing here changes a run."""

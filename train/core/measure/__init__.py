"""What a step costs, measured or predicted: the peak-memory estimate (estimate, and
estimate_seq2seq for encoder-decoders), FLOPs per token and MFU (mfu), the step timer and data
wait (timing), and the host-sync counter (syncs). Imports torch and train/core's other modules
only; nothing here changes a run."""

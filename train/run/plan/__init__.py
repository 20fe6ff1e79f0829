"""Planning a run before its folder exists: the one frozen Plan (plan), the batch size fitted to
the memory (adapt), pretraining's model and data (build), SFT's (sft, sft_model). May import
run/rundir/, run/checkpoint/ and run/compile/; nothing above it."""

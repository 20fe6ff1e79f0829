"""The run folder: claimed and locked (claim), written whole (rundir), its console and log
(runlog), the start and end report (report), and what a run leaves behind (outputs: final/,
summary.json). May import run/checkpoint/ (which checkpoints a folder holds) and run/compile/;
nothing above it."""

"""Checkpoints on disk: the files of one checkpoint written whole (or sharded, one part per rank),
checked before they are trusted, listed and pruned; the one manager that saves and restores the
objects owning their state (CheckpointManager) and the RNG states. Imports core, config, distributed
and, of run/, only run/compile/."""

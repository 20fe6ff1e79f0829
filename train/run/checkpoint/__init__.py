"""Checkpoints on disk: the files of one checkpoint written whole (or sharded, one part per rank),
checked before they are trusted, listed and pruned; what goes in them (Checkpointer) and the RNG
states. Imports core, config, distributed and, of run/, only run/compile/."""

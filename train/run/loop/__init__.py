"""The training loop: run_loop (loop), the pieces of one step (parts), its meter, the OOM
remedy (oom) and validation (evaluate). The highest room below run/pipeline.py: may import every
other room of run/."""

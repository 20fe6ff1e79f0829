"""torch.compile for the run: the model compiled with a fallback to eager, SFT's length buckets
(static shapes) and dynamo's counters for summary.json. The lowest room of run/: planning
(plan/sft), the report (rundir/report) and the step (loop/parts) all read it, so it imports
nothing of run/."""

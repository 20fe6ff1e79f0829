"""Never lose a run: the RunGuard (resume) that restores a checkpoint, saves every SAVE_EVERY
steps and stops on a signal or non-finite losses; where a run starts (resume_state), its counters
of skipped and non-finite steps (health), Ctrl+C / SIGTERM (signals). May import run/plan/,
run/rundir/, run/checkpoint/ and run/compile/; nothing above it."""

"""The thin Python core of the kit: `python -m train <mode> --flags`."""

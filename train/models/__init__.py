"""The model families, one registry entry each (family.py's Family; gpt2.py, t5.py, llama.py: llama, qwen3),
and
the two doors every model goes through: build.py makes every new model (pretraining, SFT from
scratch), load.py loads every saved one (SFT's MODEL_PATH, generate, import; state_dict.py reads a
bare checkpoint). Imports train/core only. The family is decided once (family_of / FAMILIES) and
carried by the plan; no other package asks what a model is."""

from train.models.family import CAUSAL, CAUSAL_LM, ENCODER_DECODER, KINDS, SEQ2SEQ, Family, Layout, family_of
from train.models.gpt2 import GPT2
from train.models.llama import LLAMA, QWEN3
from train.models.t5 import T5

FAMILIES = {f.name: f for f in (GPT2, T5, LLAMA, QWEN3)}
"""MODEL_FAMILY -> its entry. A new family: a module beside gpt2.py and its entry here."""
DEFAULT_FAMILY = GPT2.name
"""MODEL_FAMILY's default (config.py), and a checkpoint's from before MODEL_FAMILY existed."""
SIZES = ("nano", "tiny", "small", "medium")
"""MODEL_SIZE's names: every family has each."""

__all__ = [
    "CAUSAL",
    "CAUSAL_LM",
    "DEFAULT_FAMILY",
    "ENCODER_DECODER",
    "FAMILIES",
    "KINDS",
    "SEQ2SEQ",
    "SIZES",
    "Family",
    "Layout",
    "family_of",
]

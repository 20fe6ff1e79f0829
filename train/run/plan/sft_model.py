"""Which saved model SFT fine-tunes: MODEL_PATH, or the newest completed pretraining run's final/
(choose_pretrained), with a warning where it is barely trained; preference training's default is
the newest completed SFT run's final/ (STAGES). Loading it is train/models/load.py's.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from types import SimpleNamespace

from config import TrainConfig
from train.core import files
from train.core.errors import UsageError
from train.models.family import family_of_type
from train.run.rundir.folder import unfinished

MAKE_A_MODEL = "MODEL_SIZE=nano MAX_STEPS=200 ./run_single_gpu_optimized.sh"


# Who may have made SFT's default model: the pretraining launchers and `python -m train pretrain`.
# Never doctor-* (doctor.py), compare-* / gpu-report-* (KIT_MADE_BY in scripts/common.sh): their
# runs are a few steps long, measurements rather than models.
PRETRAIN_LAUNCHERS = ("run_single_gpu", "run_single_gpu_optimized", "train")
FEW_STEPS = 50  # fewer optimizer steps: the model still emits noise, and so will its SFT
SFT_LAUNCHERS = ("train_sft_custom", "quick_start_sft_fast", "train")
# A mode's default model: the mode of the run it continues, the launchers that make such runs, how to make
# one.
STAGES = {"sft": ("pretrain", PRETRAIN_LAUNCHERS, MAKE_A_MODEL),
          "dpo": ("sft", SFT_LAUNCHERS, f"MAX_STEPS={FEW_STEPS} ./train_sft_custom.sh")}


def _json_of(path: Path) -> dict | None:
    """A kit file read as JSON, never through a link; None when it is not a readable object."""
    try:
        data = json.loads(files.read_text(path))
    except (OSError, ValueError, files.LinkRefused):
        return None  # a half-written or foreign file: not a run to start from
    return data if isinstance(data, dict) else None


def pretrained_run(run: Path, mode: str = "pretrain", launchers=PRETRAIN_LAUNCHERS) -> SimpleNamespace | None:
    """run's final/ as SFT's default candidate, or None: a folder (not a link) whose summary.json
    says a pretraining run that completed its budget (MAX_STEPS counts; Ctrl-C, out of memory, a
    kill do not), whose final/ is whole and of that step, started by PRETRAIN_LAUNCHERS."""
    summary = _json_of(run / "summary.json") if run.is_dir() and not run.is_symlink() else None
    config = _json_of(run / "config.json") if summary else None
    if not summary or not config or summary.get("mode") != mode or summary.get("exit_reason") != "completed":
        return None
    steps = summary.get("steps")
    if not isinstance(steps, int) or unfinished(run, steps) is not None:
        return None
    run_cfg = config.get("config", {}).get("run") if isinstance(config.get("config"), dict) else None
    if not isinstance(run_cfg, dict) or run_cfg.get("launcher") not in launchers:
        return None
    family = (_json_of(run / "final" / "config.json") or {}).get("model_type")  # what was built, not asked
    return SimpleNamespace(
        final=run / "final",
        steps=steps,
        family=family if isinstance(family, str) else "?",
        time=(run / "summary.json").stat().st_mtime,
        config=config,
    )


def longer_sft(chosen: SimpleNamespace, output_dir: Path) -> str:
    """The command that makes a short SFT run again, FEW_STEPS long, as printed runnable: its launcher, its
    DATA_PATH, and its MODEL_PATH unless that is SFT's default anyway (the newest pretraining run); a
    MODEL_PATH through runs/latest (the first hour's) is taken as that run, since latest has moved on."""
    cfg = chosen.config.get("config", {})
    model_path = (cfg.get("model") or {}).get("model_path")
    data_path = (cfg.get("data") or {}).get("data_path")
    launcher = (cfg.get("run") or {}).get("launcher")
    default = choose_pretrained(output_dir)
    if isinstance(model_path, str) and ("latest" in Path(model_path).parts or not Path(model_path).is_dir()):
        model_path = None  # moved on, or gone: the newest pretraining run stands for it
    if (
        model_path is not None
        and default is not None
        and Path(model_path).resolve() == default.final.resolve()
    ):
        model_path = None
    if model_path is None and default is None:
        return MAKE_A_MODEL + " first, then " + STAGES["dpo"][2]
    settings = [f"MODEL_PATH={shlex.quote(str(model_path))}"] if model_path else []
    settings += [f"DATA_PATH={shlex.quote(str(data_path))}"] if isinstance(data_path, str) else []
    if launcher == "train":
        flags = [f"--{k.split('=')[0].lower()} {k.split('=', 1)[1]}" for k in settings]
        return " ".join([".venv/bin/python -m train sft", *flags, f"--max_steps {FEW_STEPS}"])
    script = launcher if launcher in SFT_LAUNCHERS else "train_sft_custom"
    return " ".join([*settings, f"MAX_STEPS={FEW_STEPS}", f"./{script}.sh"])


def _causal(model_type: str) -> bool:
    family = family_of_type(model_type)
    return family is not None and not family.layout.encoder_decoder


def choose_pretrained(
    output_dir: Path, mode: str = "pretrain", launchers=PRETRAIN_LAUNCHERS
) -> SimpleNamespace | None:
    """The newest completed launcher-made causal-LM pretraining run under output_dir (gpt2, llama;
    an encoder-decoder only where no causal run is there: a chat model is a causal LM). runs/latest
    is no help: it may be an SFT or compare run. mode: the run's mode (dpo asks for an SFT run)."""
    runs = output_dir.iterdir() if output_dir.is_dir() else ()
    found = [c for run in runs if (c := pretrained_run(run, mode, launchers))]
    same = [c for c in found if _causal(c.family)]
    return max(same or found, key=lambda c: c.time, default=None)


def newest_pretrained(output_dir: Path) -> Path | None:
    """final/ of choose_pretrained's run, or None."""
    chosen = choose_pretrained(output_dir)
    return chosen.final if chosen else None


def model_source(cfg: TrainConfig, decide, say=print) -> str:
    """MODEL_PATH, or choose_pretrained's final/ under OUTPUT_DIR (SFT: of a pretraining run; DPO:
    of an SFT run), with a warning where it is barely trained."""
    if cfg.model.model_path is not None:
        return cfg.model.model_path
    mode, launchers, make = STAGES.get(getattr(cfg.run, "mode", "sft"), STAGES["sft"])
    stage = "pretraining" if mode == "pretrain" else mode.upper()
    chosen = choose_pretrained(Path(cfg.run.output_dir), mode, launchers)
    if chosen is None:
        raise UsageError(
            f"MODEL_PATH is empty and {cfg.run.output_dir} holds no completed {stage} run of a launcher "
            f"(compare, doctor and unfinished runs do not count); make one with `{make}` or set MODEL_PATH "
            "to a local transformers model folder"
        )
    why = f"the newest completed {stage} run of a launcher (set MODEL_PATH to choose)"
    if not _causal(chosen.family):
        why += f"; note: a {chosen.family} model, as no completed causal-LM pretraining run is there"
    decide("model_path", str(chosen.final), why)
    if chosen.steps < FEW_STEPS:
        again = longer_sft(chosen, Path(cfg.run.output_dir)) if mode == "sft" else make
        say(f"warning: MODEL_PATH={chosen.final} trained only {chosen.steps} optimizer steps (under "
            f"{FEW_STEPS}): fine-tuning it teaches little; train it longer (`{again}`) or set MODEL_PATH")
    return str(chosen.final)


def model_label(path: Path, config) -> str:
    """summary.json's model_size: the source run's size where MODEL_PATH is a kit run's final/,
    else the model's type."""
    try:
        return str(json.loads((path.parent / "summary.json").read_text())["model_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return config.model_type

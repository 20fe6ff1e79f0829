"""`python -m train import SRC DEST [--tokenizer_path T]`: a bare checkpoint (a torch state_dict
`*.bin` / `*.safetensors` beside config.json or ChatLM-mini-Chinese's model_config.json,
train/models/state_dict.py), or a folder whose config.json names code of its own over a model_type
transformers has (ChatLM's hub folder: auto_map over T5), written as a transformers folder:
config.json naming the plain class of its model_type (no code), model.safetensors in the
weights' own dtype, and the tokenizer. DEST then
loads with AutoModelForSeq2SeqLM / AutoModelForCausalLM and AutoTokenizer offline, and serves
as MODEL_PATH (which also takes the bare folder itself, importing it in memory).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from train.config.flags import ArgParser
from train.core import files
from train.core import model as model_lib
from train.core.errors import UsageError
from train.core.model import quiet_saving
from train.core.remote_code import refuse_custom_code
from train.models.state_dict import NATIVE, bare_checkpoint, load_bare
from train.tools.generate import TOKENIZER_FILES  # what AutoTokenizer reads a tokenizer from


def parser() -> ArgParser:
    p = ArgParser(prog="python -m train import",
                  description="Write a bare state_dict checkpoint (ChatLM-mini-Chinese's) as a transformers "
                              "folder.")
    p.add_argument("src", metavar="SRC", help="a folder with a state_dict file and config.json / "
                                              "model_config.json, "
                   "or the state_dict file itself")  # fmt: skip
    p.add_argument("dest", metavar="DEST", help="the transformers folder to write (must not exist)")
    p.add_argument(
        "--tokenizer_path", help="the tokenizer folder (default: SRC's folder, where it holds one)"
    )
    return p


def has_tokenizer(folder: Path) -> bool:
    return folder.is_dir() and any((folder / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(src_folder: Path, tokenizer_path: str | None):
    """The tokenizer of --tokenizer_path or SRC's folder, loaded offline, no code run."""
    from transformers import AutoTokenizer

    folder = Path(tokenizer_path) if tokenizer_path else src_folder
    name = "--tokenizer_path" if tokenizer_path else "SRC"
    if not has_tokenizer(folder):
        hint = "" if tokenizer_path else "; give the tokenizer folder with --tokenizer_path"
        raise UsageError(f"{name}={folder}: no tokenizer there ({', '.join(TOKENIZER_FILES[:2])} ...){hint}")
    # Only the tokenizer's own file: SRC's config.json may name model code, which is never run
    # here anyway (the model is built as its plain model_type).
    refuse_custom_code(folder / "tokenizer_config.json", name)
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as err:  # OSError, ValueError ... of a bad folder
        raise UsageError(
            f"{name}={folder}: no tokenizer could be loaded: {str(err).strip().splitlines()[0]}"
        ) from None


def check_pair(model, tok, say) -> None:
    """A tokenizer with more ids than the embeddings has rows cannot drive this model; differing
    special ids are said (the weights were trained with the config's)."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tok) > rows:
        raise UsageError(f"the tokenizer has {len(tok)} tokens, more than the model's {rows} embedding rows: "
                         "not the tokenizer these weights were trained with")  # fmt: skip
    c = model.config
    for what in ("pad", "eos", "bos"):
        mine, theirs = getattr(c, f"{what}_token_id", None), getattr(tok, f"{what}_token_id", None)
        if not isinstance(mine, int) or theirs is None or mine == theirs:
            continue
        if mine < rows:
            say(f"note: the config's {what}_token_id is {mine}, the tokenizer's {theirs}; the config's is "
                f"kept")
            continue
        for holder in (c, model.generation_config):  # an id past the embeddings can only be wrong
            setattr(holder, f"{what}_token_id", theirs)
        say(f"note: the config's {what}_token_id {mine} is past the {rows} embedding rows: the tokenizer's "
            f"{theirs}")


def check_dest(dest: Path) -> None:
    """Before any loading: DEST new, under a folder (not a file) that can be written."""
    if dest.exists() or dest.is_symlink():
        raise UsageError(f"DEST={dest}: already exists; name a new folder")
    above = dest.absolute().parent
    while not above.exists() and not above.is_symlink() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise UsageError(f"DEST={dest}: {above} is a file, not a folder; name a folder to write")
    if not os.access(above, os.W_OK | os.X_OK):
        raise UsageError(f"DEST={dest}: {above} is not writable; name a folder you can write")


def write_folder(model, tok, dest: Path) -> None:
    """DEST whole or not at all: written in a fresh folder beside it, then renamed; never over
    something that appeared at DEST meanwhile, and a full disk is one line."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = files.fresh_folder(dest.parent, f".{dest.name}.import-")
    except OSError as err:  # /proc, a read-only disk, a path through a file
        raise UsageError(f"DEST={dest}: no folder can be made there ({err.strerror or err}); name a folder "
                         f"you can write") from None
    try:
        with quiet_saving():  # one file: no "Writing model shards" bar
            model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        files.sync_tree(tmp)
        if dest.exists() or dest.is_symlink():
            raise UsageError(f"DEST={dest}: appeared while importing; name a new folder")
        os.rename(tmp, dest)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if files.errno_of(err) in files.DISK_FULL:
            raise UsageError(f"DEST={dest}: the disk is full ({err}); nothing was written") from None
        raise


def import_main(argv: list[str], say=print) -> int:
    args = parser().parse_args(argv)
    src, dest = Path(args.src), Path(args.dest)
    if not src.exists():
        raise UsageError(f"SRC={src}: no such file or folder")
    check_dest(dest)
    found = bare_checkpoint(src, "SRC", plain=True)
    if found is None:
        raise UsageError(f"SRC={src}: already a transformers folder (model.safetensors / pytorch_model.bin) "
                         "naming no code of its own; use it as MODEL_PATH as it is")  # fmt: skip
    tok = load_tokenizer(found.weights.parent, args.tokenizer_path)
    model, dtype = load_bare(found, "SRC", say)
    check_pair(model, tok, say)
    if dtype not in NATIVE:  # float8: from_pretrained cannot load a float8 folder (no float8 default dtype)
        say(f"note: the {str(dtype).removeprefix('torch.')} weights are written as bfloat16, which holds "
            f"every one of their values exactly and which from_pretrained loads")
        dtype = torch.bfloat16
    model.to(dtype)  # the weights as they were saved: fp16 stays half the size
    model.config.use_cache = model.generation_config.use_cache = True  # plain generate() at full speed
    write_folder(model, tok, dest)
    n = model_lib.count_params(model)
    say(f"wrote {dest}: {type(model).__name__} ({n / 1e6:,.1f}M parameters, "
        f"{str(dtype).removeprefix('torch.')}) "
        f"and its tokenizer; fine-tune it with MODEL_PATH={dest}")  # fmt: skip
    return 0

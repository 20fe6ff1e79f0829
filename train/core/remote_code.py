"""No Python from a user's folder unless the user said so.

A transformers folder can name its own classes in an `auto_map` entry of config.json or
tokenizer_config.json; loading it with trust_remote_code=True imports that folder's .py files,
which then run with the user's permissions. Left unset, transformers asks "Do you wish to run the
custom code? [y/N]" on stdin, which `yes |` answers, and without a terminal it prints several
lines with a hub address. So every Auto* load in the kit passes trust_remote_code explicitly, and
a folder that ships code is refused here, in one line naming the variable, before transformers
reads it, unless the user allowed it (TRUST_REMOTE_CODE=1 for SFT, --trust_remote_code for
generate).
"""

from __future__ import annotations

import json
from pathlib import Path

from train.core.errors import UsageError

# The files from which transformers' Auto classes read an auto_map.
CODE_NAMING_FILES = (
    "config.json",
    "tokenizer_config.json",
    "processor_config.json",
    "preprocessor_config.json",
)


def names_code(path: str | Path) -> str | None:
    """The file (of a folder, or the file itself) whose auto_map names Python code, or None."""
    path = Path(path)
    files = [path] if path.is_file() else [path / name for name in CODE_NAMING_FILES]
    for file in files:
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):  # RecursionError: nested past the interpreter's limit
            continue  # absent or unreadable: the load itself names what is wrong with it
        if isinstance(raw, dict) and raw.get("auto_map"):
            return file.name
    return None


def refuse_custom_code(path: str | Path, variable: str, trust: bool = False, allow: str = "") -> None:
    """UsageError unless `path` ships no code of its own or `trust` is set. `allow` says how a
    user who trusts the folder turns it on, where the command has a way."""
    if trust:
        return
    file = names_code(path)
    if file is not None:
        how = f"; if you trust it, {allow}" if allow else ""
        raise UsageError(
            f"{variable}={path}: its {file} names Python code of its own (auto_map); "
            f"the kit does not run code from a folder{how}"
        )

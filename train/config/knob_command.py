"""`python -m train knobs` (make knobs): print, rewrite or check the generated knob blocks of
docs/knobs.md and every root launcher (train/config/knob_docs.py says them from config.py)."""

from __future__ import annotations

import os
from pathlib import Path

import config
from train.config.knob_docs import MD_BEGIN_PREFIX, launcher_block, launchers, markdown, rewritten
from train.core import files
from train.core.errors import UsageError

KNOBS_USAGE = """usage: python -m train knobs --markdown | --launcher NAME | --write | --check

  --markdown       print docs/knobs.md's generated part
  --launcher NAME  print the knob block of a root launcher (run_single_gpu.sh ...)
  --write          rewrite the generated blocks in place (docs/knobs.md and every launcher)
  --check          exit 1 naming every file whose generated block is out of date"""


def targets() -> dict[Path, list[str]]:
    """{file: its text with the generated blocks as config.py says them}."""
    out = {}
    doc = config.KIT_DIR / "docs" / "knobs.md"
    lines = doc.read_text().splitlines()
    begin = next((i for i, line in enumerate(lines) if line.startswith(MD_BEGIN_PREFIX)), None)
    end = next((i for i, line in enumerate(lines) if line.startswith("<!-- END knobs")), None)
    if begin is None or end is None or end < begin:
        raise UsageError(f"{doc}: no '<!-- BEGIN knobs' ... '<!-- END knobs' lines to write between")
    out[doc] = [*lines[:begin], *markdown(), *lines[end + 1 :]]
    for launcher in launchers():
        out[launcher.path] = rewritten(launcher.path.read_text().splitlines(), launcher_block(launcher))
    return out


def knobs_main(argv: list[str]) -> int:
    if len(argv) == 1 and argv[0] == "--markdown":
        print("\n".join(markdown()))
    elif len(argv) == 2 and argv[0] == "--launcher":
        found = {lw.path.name: lw for lw in launchers()}
        if argv[1] not in found:
            raise UsageError(f"--launcher: expected one of {' | '.join(found)}, got {argv[1]!r}")
        print("\n".join(launcher_block(found[argv[1]])))
    elif len(argv) == 1 and argv[0] in ("--write", "--check"):
        stale = []
        for path, lines in targets().items():
            text = "\n".join(lines) + "\n"
            if path.read_text() != text:
                stale.append(path.relative_to(config.KIT_DIR).as_posix())
                if argv[0] == "--write":
                    mode = path.stat().st_mode & 0o777  # a launcher stays executable
                    with files.writing(path) as out:
                        os.fchmod(out.fileno(), mode)
                        out.write(text.encode())
        verb = "rewritten" if argv[0] == "--write" else "out of date (make knobs)"
        print(f"{verb}: {', '.join(stale)}" if stale else "knob docs up to date")
        return 1 if stale and argv[0] == "--check" else 0
    elif argv in ([], ["-h"], ["--help"]):
        print(KNOBS_USAGE)
    else:
        raise UsageError(f"knobs: expected --markdown | --launcher NAME | --write | --check, got "
                         f"{' '.join(argv)!r}")
    return 0

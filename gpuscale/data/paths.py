"""A path the user typed, as the settings and the history keep it: absolute, because the supervisor and
the ranks start in the run folder, not where the user stood."""

from __future__ import annotations

from pathlib import Path


def absolute_path(path: str | Path) -> Path:
    """`path` absolute, its `~` expanded and no `.` or `..` left (`--model ../m` typed in /home/u/work is
    kept as /home/u/m, not /home/u/work/../m), the folders above it resolved as the system resolves them.
    Its own name is kept even where it is a symbolic link: a model folder or a data file linked from the
    Hugging Face cache keeps the name the user gave (a data file's name is its domain), not its target's."""
    path = Path(path).expanduser().absolute()
    if path.name in ("", ".."):  # the root, or a path ending in `..`: nothing of its own to keep
        return path.resolve()
    return path.parent.resolve() / path.name

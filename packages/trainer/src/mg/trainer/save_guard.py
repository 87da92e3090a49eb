"""Never destroy a checkpoint: what `--save` already holds is checked before training.

A run that finds nothing in `--load` (a typo, a missing folder) would start
from scratch, and its saves would overwrite the iterations already in `--save`
and move `latest_checkpointed_iteration.txt` backwards. So before the model is
even built:

- if `--save` holds checkpoints up to iteration N and this run would start
  below N (nothing found in `--load`, `--finetune`, a `release` checkpoint, an
  older `--load`), the run is refused with both folders and the flags to
  choose: `--load` the existing folder, a new `--save`, or
  `--overwrite-checkpoints` to overwrite on purpose;
- when `--load` and `--save` are the same folder, its tracker is what counts:
  an `iter_XXXXXXX` folder newer than the tracker is a save that was killed
  before the tracker moved (the resumed run saves that iteration again), and
  a tracker set back by hand is Megatron's way to roll back;
- `--save` must be a folder this process can create and write (checked with a
  probe file).

Reads only the tracker file and folder names (no torch), so it runs before
anything heavy.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's tracker file
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
OVERRIDE_FLAG = "--overwrite-checkpoints"


class SaveGuardError(ValueError):
    """The run would lose checkpoints or cannot save; the message says what to do."""


def latest_iteration(folder: str | Path) -> int | str | None:
    """The iteration the tracker names (an int or "release"), or None without a tracker."""
    tracker = Path(folder) / TRACKER
    try:
        text = tracker.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise SaveGuardError(f"{tracker}: cannot read it ({exc.strerror})") from None
    if text == "release":
        return text
    try:
        return int(text)
    except ValueError:
        raise SaveGuardError(
            f"{tracker}: expected an iteration number or 'release', found {text[:40]!r}; "
            "write the number of the last complete iter_XXXXXXX folder into it"
        ) from None


def saved_iterations(folder: str | Path) -> list[int]:
    """The iteration numbers of the complete `iter_XXXXXXX` folders in `folder`."""
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for n in names if (m := _ITER_DIR.match(n)))


def highest_saved(folder: str | Path) -> int | None:
    """The highest iteration `folder` holds: its tracker's or its newest iter folder's."""
    tracker = latest_iteration(folder)
    found = saved_iterations(folder)
    candidates = [i for i in [tracker, *found] if isinstance(i, int)]
    if tracker == "release" and not candidates:
        return 0  # converted weights only: nothing a new run's iter folders overwrite
    return max(candidates) if candidates else None


def start_iteration(load: str | None, finetune: bool) -> tuple[int, str | None]:
    """Where this run starts and, when `--load` holds no checkpoint, why (for the message)."""
    if not load:
        return 0, "no --load was given"
    latest = latest_iteration(load)
    if latest is None:
        if not Path(load).exists():
            return 0, f"--load {load} does not exist"
        return 0, f"--load {load} holds no checkpoint (no {TRACKER})"
    if finetune:
        return 0, f"--finetune restarts at iteration 0, from --load {load}"
    if latest == "release":
        return 0, f"--load {load} is a release checkpoint, which restarts at iteration 0"
    return int(latest), None


def check_save_target(
    save: str | None, load: str | None, *, finetune: bool = False, overwrite: bool = False
) -> None:
    """Refuse a run whose saves would overwrite newer checkpoints in `--save`."""
    if not save or overwrite:
        return
    same = load is not None and Path(load).resolve() == Path(save).resolve()
    saved = highest_saved(save)
    if same and isinstance(tracked := latest_iteration(save), int):
        saved = tracked  # newer folders: an interrupted save (see the module's docstring)
    if saved is None:
        return
    start, why = start_iteration(load, finetune)
    if start >= saved:
        return
    reason = why or f"--load {load} is at iteration {start}"
    choices = [] if same else [f"resume from it with --load {save}"]
    choices += [
        "save this run elsewhere with a new --save folder",
        f"or pass {OVERRIDE_FLAG} to overwrite its checkpoints on purpose",
    ]
    raise SaveGuardError(
        f"--save {save} already holds checkpoints up to iteration {saved}, but this run starts "
        f"at iteration {start} ({reason}): its saves would overwrite them and move "
        f"{TRACKER} backwards. Nothing was written. To go on, " + "; ".join(choices) + "."
    )


def check_writable(save: str | None) -> None:
    """Create `--save` if needed and write (then remove) a probe file in it."""
    if not save:
        return
    folder = Path(save)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise SaveGuardError(f"--save {save}: exists and is not a folder") from None
    except NotADirectoryError:
        raise SaveGuardError(
            f"--save {save}: a part of the path is a file, not a folder; choose another --save"
        ) from None
    except OSError as exc:
        raise SaveGuardError(
            f"--save {save}: cannot create the folder ({exc.strerror}); choose another --save"
        ) from None
    probe = folder / f".mg-write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as handle:
            handle.write(b"0")
    except OSError as exc:
        raise SaveGuardError(
            f"--save {save}: cannot write into it ({exc.strerror}); fix its permissions or "
            "choose another --save (checked before training, so no work is lost)"
        ) from None
    finally:
        probe.unlink(missing_ok=True)

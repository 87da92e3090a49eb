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
  probe file), on a disk with room for a checkpoint (refused) and for all the
  saves of the run (a warning); the size is estimated from the parameters.

The checks of the folder read only the tracker file and folder names (no
torch), so they run before anything heavy.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

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


def start_iteration(
    load: str | None, finetune: bool, ckpt_step: int | None = None
) -> tuple[int, str | None]:
    """Where this run starts and, when not at `--load`'s latest checkpoint, why."""
    if not load:
        return 0, "no --load was given"
    if ckpt_step is not None and not finetune:
        return ckpt_step, f"--ckpt-step {ckpt_step} loads iteration {ckpt_step} of --load {load}"
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
    save: str | None,
    load: str | None,
    *,
    finetune: bool = False,
    overwrite: bool = False,
    ckpt_step: int | None = None,
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
    start, why = start_iteration(load, finetune, ckpt_step)
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


# fp32 weights plus Adam's two fp32 moments: what one `torch` or `torch_dist` save holds
BYTES_PER_PARAMETER = {True: 12, False: 4}  # with / without the optimizer state


def checkpoint_bytes(num_parameters: int, save_optim: bool = True) -> int:
    """About one checkpoint's size (the RNG and scheduler states are negligible)."""
    return num_parameters * BYTES_PER_PARAMETER[save_optim]


def planned_saves(args: Any) -> tuple[int, int]:
    """(bytes of one checkpoint, how many saves) of a gpt run; (0, 0) when not estimated
    (other families, or a tokenizer that does not load: that error comes later, named)."""
    c, t = args.checkpoint, args.training
    if not c.save or args.family != "gpt":
        return 0, 0
    try:
        # lazy: the cli imports this module before --help is answered; these load torch
        from mg.core.models.flops import num_parameters
        from mg.trainer.families import get_family
        from mg.trainer.padded_vocab import padded_vocab_size

        config = get_family("gpt").build_config(args, padded_vocab_size(args))
        size = checkpoint_bytes(num_parameters(config), save_optim=not c.no_save_optim)
    except Exception:  # an estimate only
        return 0, 0
    iterations = t.train_iters or 0
    return size, 1 + (iterations // c.save_interval if c.save_interval else 0)


def check_free_space(save: str | None, needed: int, saves: int = 1) -> str | None:
    """Refuse a `--save` whose disk cannot take one checkpoint; warn (the returned line)
    when it cannot take all `saves` this run will write (Megatron keeps every one)."""
    if not save or needed <= 0:
        return None
    try:
        free = shutil.disk_usage(save).free
    except OSError:
        return None  # check_writable has already named what is wrong with the folder
    if free < needed:
        raise SaveGuardError(
            f"--save {save}: its disk has {_size(free)} free, one checkpoint needs about "
            f"{_size(needed)}; free some space or choose another --save (checked before "
            "training, so no work is lost)"
        )
    if free < needed * saves:
        return (
            f"WARNING: --save {save}: its disk has {_size(free)} free, room for "
            f"{free // needed} of the {saves} checkpoints of about {_size(needed)} this run "
            "writes; raise --save-interval or free some space"
        )
    return None


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")

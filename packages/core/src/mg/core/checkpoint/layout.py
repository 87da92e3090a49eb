"""Names and layout of Megatron-LM's `torch` checkpoint format on disk.

A save directory looks like this (Megatron's ``get_checkpoint_name``)::

    <save>/latest_checkpointed_iteration.txt    "200" or "release"
    <save>/iter_0000200/mp_rank_00/model_optim_rng.pt            PP = 1
    <save>/iter_0000200/mp_rank_00_001/model_optim_rng.pt        PP > 1: _{pp:03d}
    <save>/iter_0000200/mp_rank_00_001_002/model_optim_rng.pt    PP > 1 and EP > 1
    <save>/iter_0000200/mp_rank_00_002/model_optim_rng.pt        PP = 1 and EP > 1 (!)
    <save>/release/mp_rank_00/model_optim_rng.pt                 a "release" checkpoint

The last-but-one line is Megatron's quirk, kept on purpose: with PP = 1 and
EP > 1 the expert rank takes the place the pipeline rank has when PP > 1, so
``mp_rank_00_002`` alone cannot tell the two apart. :func:`detect_layout`
resolves it from the checkpoint's own metadata when it has any (mg's ``mg``
entry or Megatron's ``args``), and otherwise reads it as PP, as Megatron's
``find_checkpoint_rank_0`` does for the rank-0 file.

Our own saves stage into ``iter_XXXXXXX.tmp/`` and displace an older copy of
the same iteration to ``iter_XXXXXXX.old/`` for an instant; neither name is
ever read as a checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MODEL_FILENAME = "model_optim_rng.pt"
DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"  # the distributed optimizer's state, beside it
RELEASE = "release"
STAGING_SUFFIX = ".tmp"
DISPLACED_SUFFIX = ".old"

_ITER_DIR_RE = re.compile(r"^iter_(\d{7,})$")
_RANK_DIR_RE = re.compile(r"^mp_rank_(\d{2,})(?:_(\d{3,}))?(?:_(\d{3,}))?$")


class CheckpointError(Exception):
    """A checkpoint cannot be written or read; the message says where and what to do."""


Iteration = int | str  # an iteration number, or "release"


def _iteration_dirname(iteration: Iteration, release: bool = False) -> str:
    if release or iteration == RELEASE:
        return RELEASE
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be a non-negative int or 'release', got {iteration!r}")
    return f"iter_{iteration:07d}"


def checkpoint_dir(save: str | Path, iteration: Iteration, release: bool = False) -> Path:
    """``<save>/iter_{iteration:07d}`` (or ``<save>/release``)."""
    return Path(save) / _iteration_dirname(iteration, release)


def rank_dirname(
    tp_rank: int,
    pp_rank: int = 0,
    pp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> str:
    """The per-rank folder name, exactly as Megatron's ``get_checkpoint_name`` builds it."""
    name = f"mp_rank_{tp_rank:02d}"
    if pp_size > 1:
        name += f"_{pp_rank:03d}"
    if ep_size > 1:
        name += f"_{ep_rank:03d}"
    return name


def checkpoint_file(
    save: str | Path,
    iteration: Iteration,
    tp_rank: int = 0,
    pp_rank: int = 0,
    pp_size: int = 1,
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
    release: bool = False,
) -> Path:
    """Path of one rank's ``model_optim_rng.pt`` inside the checkpoint of ``iteration``."""
    return (
        checkpoint_dir(save, iteration, release)
        / rank_dirname(tp_rank, pp_rank, pp_size, ep_rank, ep_size)
        / MODEL_FILENAME
    )


def tracker_file(save: str | Path) -> Path:
    return Path(save) / TRACKER_FILENAME


def parse_tracker_text(text: str, path: Path | str) -> Iteration:
    """Megatron's ``read_metadata``: strip, then an int > 0 or the word ``release``."""
    content = text.strip()
    if content == RELEASE:
        return RELEASE
    try:
        iteration = int(content)
    except ValueError:
        iteration = None
    if iteration is None or iteration <= 0:
        raise CheckpointError(
            f"{path}: expected an iteration number > 0 or 'release', found {content[:80]!r}. "
            "The file is damaged; write the iteration of the checkpoint to resume from into it "
            f"(see the iter_XXXXXXX folders beside it), or pass an explicit iteration."
        )
    return iteration


def read_latest_iteration(load_dir: str | Path) -> Iteration | None:
    """The iteration named by ``latest_checkpointed_iteration.txt``; ``None`` if there is none.

    Raises :class:`CheckpointError` naming the file when its content is neither an
    integer > 0 nor ``release`` (Megatron stops there too).
    """
    path = tracker_file(load_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        raise CheckpointError(
            f"{path}: not a text file; expected an iteration number or 'release'"
        ) from None
    return parse_tracker_text(text, path)


def list_iterations(save: str | Path) -> list[int]:
    """Iterations with a complete-looking ``iter_XXXXXXX`` folder, ascending.

    Staging (``.tmp``) and displaced (``.old``) folders are not listed; ``release`` is
    not an iteration (see :func:`has_release`).
    """
    root = Path(save)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _ITER_DIR_RE.match(entry.name)
        if match and entry.is_dir():
            found.append(int(match.group(1)))
    return sorted(found)


def has_release(save: str | Path) -> bool:
    return (Path(save) / RELEASE).is_dir()


@dataclass(frozen=True)
class RankDir:
    """One ``mp_rank_*`` folder, its numbers as written (meaning depends on the layout)."""

    name: str
    numbers: tuple[int, ...]


def scan_rank_dirs(iteration_dir: Path) -> list[RankDir]:
    """The ``mp_rank_*`` folders holding a ``model_optim_rng.pt``, sorted by name."""
    found = []
    if not iteration_dir.is_dir():
        return found
    for entry in sorted(iteration_dir.iterdir()):
        match = _RANK_DIR_RE.match(entry.name)
        if match and (entry / MODEL_FILENAME).is_file():
            numbers = tuple(int(g) for g in match.groups() if g is not None)
            found.append(RankDir(entry.name, numbers))
    return found


@dataclass(frozen=True)
class Layout:
    """Parallel sizes of a saved checkpoint as found on disk."""

    tp: int
    pp: int
    ep: int = 1

    def rank_dirname(self, tp_rank: int, pp_rank: int = 0, ep_rank: int = 0) -> str:
        return rank_dirname(tp_rank, pp_rank, self.pp, ep_rank, self.ep)

    def __str__(self) -> str:
        text = f"TP={self.tp}, PP={self.pp}"
        return text + (f", EP={self.ep}" if self.ep > 1 else "")


def detect_layout(iteration_dir: Path, second_is_expert: bool | None = None) -> Layout | None:
    """The TP/PP/EP sizes of the checkpoint in ``iteration_dir`` from its folder names.

    ``second_is_expert`` settles Megatron's ambiguous ``mp_rank_TT_NNN`` name (PP > 1
    or EP > 1 with PP = 1); ``None`` reads it as PP. Returns ``None`` when the folder
    holds no rank file at all.
    """
    dirs = scan_rank_dirs(iteration_dir)
    if not dirs:
        return None
    width = max(len(d.numbers) for d in dirs)
    tp = 1 + max(d.numbers[0] for d in dirs)
    if width == 1:
        return Layout(tp=tp, pp=1)
    if width == 3:
        return Layout(
            tp=tp,
            pp=1 + max(d.numbers[1] for d in dirs if len(d.numbers) > 1),
            ep=1 + max(d.numbers[2] for d in dirs if len(d.numbers) > 2),
        )
    second = 1 + max(d.numbers[1] for d in dirs if len(d.numbers) > 1)
    if second_is_expert:
        return Layout(tp=tp, pp=1, ep=second)
    return Layout(tp=tp, pp=second)

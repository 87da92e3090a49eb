"""`--engine`, `--ray-address`, `--ray-connect-timeout`: the flags of every command that runs
on Ray too (`tokenize`, `clean`, `dedup`), and their checks. Light: no `ray` import."""

from __future__ import annotations

import argparse
import importlib.util

from mg.corpus_prep.commands import UserError

DEFAULT_CONNECT_TIMEOUT = 30.0  # ray_cluster's default, repeated here to keep --help light


def add_ray_arguments(group: argparse._ArgumentGroup, engine_help: str) -> None:
    group.add_argument("--engine", choices=("local", "ray"), default="local", help=engine_help)
    group.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="with --engine ray: the cluster to join (auto, HOST:PORT as `ray start --head` "
        "prints it, or ray://HOST:10001); default: a local Ray instance on this machine's CPUs",
    )
    group.add_argument(
        "--ray-connect-timeout",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT,
        metavar="SECONDS",
        help="with --ray-address: give up joining the cluster after this long "
        "(default: %(default)g)",
    )


def check_ray_arguments(args: argparse.Namespace) -> None:
    """The Ray flags make sense together, and ray is installed when --engine ray asks for it."""
    if args.ray_address is not None and args.engine != "ray":
        raise UserError(f"--ray-address {args.ray_address}: only with --engine ray")
    if args.ray_connect_timeout <= 0:
        raise UserError(f"--ray-connect-timeout {args.ray_connect_timeout:g}: must be above 0")
    if args.engine == "ray" and importlib.util.find_spec("ray") is None:
        raise UserError(
            "--engine ray: the ray package is not installed; install mg-corpus-prep[ray]"
        )

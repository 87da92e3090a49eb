"""`mg-prep refresh`: keep an output folder of shards in step with a growing input folder.

The run; the flags and the command's description are in `refresh_flags`, which
`mg-prep refresh --help` reads without importing this module's dependencies.
"""

from __future__ import annotations

import argparse

from mg.corpus_prep.commands import UserError, refuse_own_input
from mg.corpus_prep.refresh import RefreshConfig, RefreshError, refresh
from mg.corpus_prep.refresh_manifest import ManifestError
from mg.corpus_prep.refresh_tokenize import (
    dataset_names,
    fingerprint,
    output_options,
    tokenize_file,
)


def run(args: argparse.Namespace) -> int:
    refuse_own_input(
        [("--output-dir", args.output_dir)], [("--input-dir", args.input_dir)], files_into=True
    )
    options = output_options(args, args.tokenize_dests)
    config = RefreshConfig(
        input_dir=args.input_dir,
        output_dir=args.output_dir,
        datasets=dataset_names(args),
        fingerprint=fingerprint(options),
        options=options,
        patterns=tuple(args.pattern),
        lock_timeout=args.lock_timeout,
        dry_run=args.dry_run,
        prune=args.prune,
        rehash=args.rehash,
    )
    try:
        refresh(config, lambda path, prefix: tokenize_file(args, path, prefix))
    except (RefreshError, ManifestError) as err:
        raise UserError(f"{err}; the published blend and manifest are unchanged") from err
    except UserError as err:
        raise UserError(f"{err}; the published blend and manifest are unchanged") from err
    return 0

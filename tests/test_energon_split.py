"""An energon split's shards: brace ranges expanded in order, as energon's reader does,
for the trainer and the evaluator alike."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from mg.core.energon_split import expand_range, split_shards


def _split_yaml(folder: Path, train: list[str]) -> None:
    meta = folder / ".nv-meta"
    meta.mkdir()
    lines = "".join(f"  - {name}\n" for name in train)
    (meta / "split.yaml").write_text(f"split_parts:\n  train:\n{lines}  val: []\n")


def test_ranges_expand_zero_padded_and_in_order(tmp_path: Path) -> None:
    assert expand_range("data-{000008..000011}.tar") == [
        "data-000008.tar",
        "data-000009.tar",
        "data-000010.tar",
        "data-000011.tar",
    ]
    assert expand_range("plain-000001.tar") == ["plain-000001.tar"]
    _split_yaml(tmp_path, ["data-{000000..000001}.tar", "extra-000009.tar"])
    names = [p.name for p in split_shards(tmp_path, "train")]
    assert names == ["data-000000.tar", "data-000001.tar", "extra-000009.tar"]
    assert split_shards(tmp_path, "val") == [] and split_shards(tmp_path, "test") == []
    assert split_shards(tmp_path / "nowhere", "train") is None
    from mg.trainer.vlm_data import split_shards as trainer_shards

    assert trainer_shards(tmp_path, "train") == split_shards(tmp_path, "train")


def test_the_evaluator_reads_every_shard_of_a_range(tmp_path: Path) -> None:
    from mg.evaluate.vlm_samples import read_shard_records

    for i in range(2):
        with tarfile.open(tmp_path / f"data-00000{i}.tar", "w") as tar:
            sample = {"conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                        {"from": "gpt", "value": f"answer {i}"}]}  # fmt: skip
            for ext, data in (("png", b"\x89PNG fake"), ("json", json.dumps(sample).encode())):
                member = tarfile.TarInfo(f"s{i}.{ext}")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
    _split_yaml(tmp_path, ["data-{000000..000001}.tar"])
    records = read_shard_records(tmp_path, "train")
    assert [r.references for r in records] == [["answer 0"], ["answer 1"]]

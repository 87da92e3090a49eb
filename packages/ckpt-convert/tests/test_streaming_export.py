"""export-hf streams: safetensors files written tensor by tensor are byte for byte what
`safetensors.torch.save_file` writes, shards are cut as before, and a layer's tensors are
all that is read between two releases, from `torch` and `torch_dist` checkpoints alike."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save, save_file

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from reshard_helpers import CONFIGS, build, save_source  # noqa: E402

from mg.ckpt_convert.checkpoint_source import CheckpointSource  # noqa: E402
from mg.ckpt_convert.export_hf import export_hf  # noqa: E402
from mg.ckpt_convert.format_convert import convert_format  # noqa: E402
from mg.ckpt_convert.hf_shards import plan_shards  # noqa: E402
from mg.ckpt_convert.reshard import reshard  # noqa: E402
from mg.ckpt_convert.safetensors_stream import StreamingSafetensorsFile  # noqa: E402

QUIET = {"report": lambda _: None}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64, torch.int8]
DTYPES += [torch.bool, torch.uint8, torch.int32, torch.int16]
NAMES = ["a", "b.w", "model.layers.10.x", "model.layers.2.x", "lm_head.weight", "Ä", 'q"', "s\\"]


def _random_tensors(rng: random.Random) -> dict[str, torch.Tensor]:
    tensors = {}
    for _ in range(rng.randint(1, 8)):
        name = rng.choice(NAMES) + str(rng.randint(0, 30))
        shape = [rng.randint(0, 4) for _ in range(rng.randint(0, 3))]
        tensors[name] = (torch.randn(shape) * 10).to(rng.choice(DTYPES))
    return tensors


def test_streamed_file_is_save_files_bytes(tmp_path):
    """Mixed dtypes (safetensors sorts by alignment, then name), scalars, empty tensors,
    names needing JSON escapes, every metadata form; tensors written in random order."""
    rng = random.Random(0)
    for trial in range(300):
        tensors = _random_tensors(rng)
        metadata = rng.choice([{"format": "pt"}, None, {}, {"x": "ü"}])
        path = tmp_path / f"{trial}.safetensors"
        specs = {n: t.to("meta") for n, t in tensors.items()}
        out = StreamingSafetensorsFile(path, specs, metadata)
        for name in rng.sample(list(tensors), len(tensors)):
            out.write(name, tensors[name])
        out.close()
        assert path.read_bytes() == save(tensors, metadata=metadata), (trial, tensors)


def test_streamed_file_refuses_what_was_not_planned(tmp_path):
    planned = {"w": torch.empty(2, 3, device="meta")}
    out = StreamingSafetensorsFile(tmp_path / "x.safetensors", planned, None)
    with pytest.raises(ValueError, match="planned as torch.float32 \\(2, 3\\)"):
        out.write("w", torch.zeros(3, 2))
    with pytest.raises(ValueError, match="'v' is not planned"):
        out.write("v", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="never written: \\['w'\\]"):
        out.close()


def test_shard_plan_is_the_save_pretrained_rule():
    """A shard closes when the next tensor would pass the limit; a big one stands alone."""
    specs = [(f"t{i}", torch.empty(n, device="meta")) for i, n in enumerate([3, 3, 5, 20, 1, 4])]
    shards = plan_shards(specs, max_bytes=4 * 8)
    assert [list(s) for s in shards] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]


@pytest.mark.parametrize("shard_size", ["5GB", "20KB"])
def test_exported_files_are_what_save_file_writes(tmp_path, shard_size):
    save_source(tmp_path / "src", build(CONFIGS["llama"]))
    export_hf(tmp_path / "src", tmp_path / "hf", shard_size=shard_size, progress=False)
    files = sorted((tmp_path / "hf").glob("*.safetensors"))
    assert (len(files) > 1) == (shard_size == "20KB")
    for path in files:
        save_file(load_file(path), tmp_path / "again.safetensors", metadata={"format": "pt"})
        assert path.read_bytes() == (tmp_path / "again.safetensors").read_bytes(), path.name
    if len(files) > 1:
        index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
        total = sum(t.numel() * t.element_size() for f in files for t in load_file(f).values())
        assert index["metadata"]["total_size"] == total


@pytest.mark.parametrize("layout", ["torch", "torch-tp2pp2", "torch_dist"])
def test_export_reads_one_layer_between_releases(tmp_path, monkeypatch, layout):
    """What export reads between two `release()` calls is one layer group, never the model."""
    model = build(CONFIGS["llama"])
    save_source(tmp_path / "torch", model)
    reshard(tmp_path / "torch", tmp_path / "torch-tp2pp2", 2, 2, **QUIET)
    convert_format(tmp_path / "torch", tmp_path / "torch_dist", "torch_dist", **QUIET)
    held: list[int] = [0]
    peaks: list[int] = []
    tensors, release = CheckpointSource.tensors, CheckpointSource.release

    def counting_tensors(self, names):
        out = tensors(self, names)
        held[0] += sum(t.numel() * t.element_size() for t in out.values())
        peaks.append(held[0])
        return out

    def counting_release(self):
        held[0] = 0
        release(self)

    monkeypatch.setattr(CheckpointSource, "tensors", counting_tensors)
    monkeypatch.setattr(CheckpointSource, "release", counting_release)
    export_hf(tmp_path / layout, tmp_path / "hf", progress=False)

    sizes = {n: t.numel() * t.element_size() for n, t in model.state_dict().items()}
    layer = sum(v for n, v in sizes.items() if n.startswith("decoder.layers.0."))
    last = sizes["output_layer.weight"] + sizes["decoder.final_layernorm.weight"]
    largest_group = max(layer, last)
    assert len(peaks) == CONFIGS["llama"].num_layers + 2  # embedding, layers, final norm + output
    assert max(peaks) == largest_group < sum(sizes.values()) / 3

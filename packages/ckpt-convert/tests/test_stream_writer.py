"""StreamingTorchFile writes what torch.save writes, one tensor at a time."""

from __future__ import annotations

import torch

from mg.ckpt_convert.stream_writer import StreamingTorchFile


def test_loads_like_torch_save(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 4, generator=g)
    tensors = {
        "w": torch.randn(3, 5, generator=g),
        "b": torch.arange(7),
        "h": torch.randn(4, generator=g).half(),
        "bf": torch.randn(2, 3, generator=g).bfloat16(),
        "view": base[2:4],  # a view: only its own rows are written
        "t": base.t(),  # not contiguous
        "scalar": torch.tensor(3.5),
    }
    writer = StreamingTorchFile(tmp_path / "s.pt")
    model = {name: writer.add(t) for name, t in tensors.items()}
    state = {"model": model, "args": {"lr": 0.1}, "iteration": 0, "nested": [1, "x"]}
    writer.finish(state)
    torch.save({"model": tensors, "args": {"lr": 0.1}, "iteration": 0, "nested": [1, "x"]},
               tmp_path / "ref.pt")  # fmt: skip
    reference = torch.load(tmp_path / "ref.pt", weights_only=True)
    for mmap in (False, True):
        got = torch.load(tmp_path / "s.pt", weights_only=True, mmap=mmap)
        assert got.keys() == reference.keys() and got["args"] == {"lr": 0.1}
        assert got["nested"] == [1, "x"]
        for name, tensor in reference["model"].items():
            assert got["model"][name].dtype == tensor.dtype
            assert torch.equal(got["model"][name], tensor), name
    assert (tmp_path / "s.pt").stat().st_size < (tmp_path / "ref.pt").stat().st_size + 4096

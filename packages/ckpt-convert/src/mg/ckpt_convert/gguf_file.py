"""Reading a GGUF file (llama.cpp's format): its metadata, and its tensors as Hugging Face
tensors, one layer at a time.

A GGUF tensor is stored as rows of blocks of a GGML type; `gguf.quants.dequantize`
turns each type we accept into float32 exactly as ggml's own ``dequantize_row_*`` does
(same operations, same order: the tests check it against hand-computed blocks). The
names are llama.cpp's (``blk.N.attn_q.weight``); :data:`HF_NAMES` maps them to the
Hugging Face names import-hf's tables read, so the rest of the conversion is import-hf's.

llama.cpp's converter permutes the rows of a Llama's q_proj / k_proj (``permute`` in
convert_hf_to_gguf.py: each head's rotate-half pairs become adjacent rows, for GGML's
interleaved RoPE); :func:`unpermute` is its exact inverse. Qwen2 / Qwen3 are stored as
they are (llama.cpp runs them with NeoX RoPE).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mg.ckpt_convert.errors import ConvertError

# The GGML types whose dequantization is checked exactly (tests/test_import_gguf.py).
DEQUANTIZED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
ROPE_FREQS = "rope_freqs.weight"
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(name: str) -> str | None:
    """The Hugging Face name of GGUF tensor `name` (None if it has none)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def unpermute(rows: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's q/k permutation: ``w.reshape(heads, 2, r // heads // 2, ...)
    .swapaxes(1, 2)`` wrote row (h, i, j) of the interleaved layout from HF's (h, j, i)."""
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def open_reader(path: Path) -> Any:
    """`gguf.GGUFReader` on `path`, a one-line error for anything that is not GGUF."""
    try:
        # lazy: gguf (and its numpy memmap reader) only when a GGUF file is converted
        from gguf import GGUFReader
    except ImportError:
        raise ConvertError(
            "import-gguf needs the gguf package (llama.cpp's reader): pip install gguf"
        ) from None
    if not path.is_file():
        raise ConvertError(f"{path} does not exist or is not a file: give a .gguf file")
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise ConvertError(
            f"{path}: not a readable GGUF file ({exc}); give a file llama.cpp's convert tools wrote"
        ) from None


def metadata(reader: Any) -> dict[str, Any]:
    """Every key-value field of the file as a Python value (strings, numbers, lists)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def dequantized(tensor: Any, file: Path) -> Tensor:
    """One GGUF tensor as a float32 torch tensor in PyTorch's [out, in] order."""
    # lazy: gguf only when a GGUF file is converted
    from gguf.quants import dequantize

    kind = tensor.tensor_type.name
    if kind not in DEQUANTIZED_TYPES:
        raise ConvertError(
            f"{file}: tensor {tensor.name} is {kind}, a type import-gguf does not read; "
            f"supported: {', '.join(DEQUANTIZED_TYPES)} (requantize the file with llama.cpp's "
            "llama-quantize, or convert the original model with import-hf)"
        )
    values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGML lists dims inner first
    values = np.array(values, dtype=np.float32, copy=True).reshape(shape)  # off the memmap
    return torch.from_numpy(values)


class GGUFWeights:
    """A GGUF file's tensors under their Hugging Face names, read on demand (the same
    `names` / `open_group` contract as `hf_source.HFWeights`, so import-hf's
    `convert_weights` reads either).

    `permute_heads` gives (query heads, key-value heads) for a Llama file, whose q/k rows
    are un-permuted on reading; None leaves them as stored."""

    def __init__(
        self,
        path: Path,
        reader: Any,
        permute_heads: tuple[int, int] | None,
        tie_output: bool = False,
    ) -> None:
        self.folder = path  # what convert_weights names in its errors
        self._permute = permute_heads
        self._tensors: dict[str, Any] = {}
        unknown = []
        for tensor in reader.tensors:
            name = hf_name(tensor.name)
            if tensor.name == ROPE_FREQS:  # read into the config (gguf_rope), not a weight
                continue
            if name is None:
                unknown.append(tensor.name)
            elif not (tie_output and name == "lm_head.weight"):
                self._tensors[name] = tensor
        if unknown:
            raise ConvertError(
                f"{path}: tensors with no counterpart in a Llama / Mistral / Qwen2 / Qwen3 "
                f"model: {', '.join(unknown[:5])}; this file's architecture is not supported"
            )

    def names(self) -> list[str]:
        return list(self._tensors)

    @contextmanager
    def open_group(self, names: Iterable[str]) -> Iterator[dict[str, Tensor]]:
        yield {name: self.read(name) for name in names}

    def read(self, name: str) -> Tensor:
        tensor = dequantized(self._tensors[name], self.folder)
        if self._permute is not None:
            heads, kv_heads = self._permute
            if ".self_attn.q_proj." in name:
                tensor = unpermute(tensor, heads)
            elif ".self_attn.k_proj." in name:
                tensor = unpermute(tensor, kv_heads)
        return tensor

    def raw_bytes(self, name: str) -> bytes:
        """The stored bytes of a tensor (to see whether output.weight copies the embedding)."""
        tensor = self._tensors[name]
        return tensor.tensor_type.name.encode() + np.asarray(tensor.data).tobytes()

"""bf16 linear layers with their weights packed once, for serving on a CPU.

PyTorch's bf16 `F.linear` on a CPU hands the weight to oneDNN in its plain
[out, in] layout, and oneDNN reorders it into its blocked layout at every call:
at a decode step of a few rows, where the weights' bytes are the cost, each
weight is read, written and read again. Packed once (what torch.compile's
freezing does for its graphs), a step reads it once: a bf16 decode step of 8
sequences of a 135M model on two cores, 49 -> 44.5 ms. The packed weight replaces
the plain one, so memory stays the same; the layers' outputs are oneDNN's, the
same matmul as before. On CPUs with AMX the weights are packed for this package's
own kernel instead (`amx_matmul`: the weights streamed at the cores' memory speed,
~1.9x oneDNN for a decode step's linears); oneDNN keeps the weights it cannot take.

Each packed layer is swapped for a `PackedLinear` in its parent (its forward is the
packed matmul; it keeps the layer's `weight`, emptied, and `bias` under their names).
The output layer is packed too (the model's output head becomes a `PackedOutputHead`, as
tensor parallelism picks its vocab-parallel head): its [vocab, hidden] matrix is the
largest single weight, 5.3 -> ~1.8 ms of a step of 8 sequences of a 135M model with a
49k vocabulary. An own output layer's plain weight is freed. A tied one is freed too
where the AMX kernel took it (the word embedding becomes a `PackedEmbedding`, which
gathers its rows from the packed copy); oneDNN's layout cannot be read back, so there
the plain matrix stays beside the packed one (56 MB for that model).

The eager CPU server does this, and the compiled runner where AMX is there (its
graphs call the kernel; elsewhere inductor packs inside its graphs); a model under
tensor parallelism keeps its plain sharded layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from mg.core.models import GPTModel
from mg.core.models.gpt import MLP
from mg.core.models.output_head import OutputHead
from mg.generate_server.amx_matmul import AMXLinear, amx_matmul, fits


def packing_available() -> bool:
    """Whether this torch has oneDNN's packed linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def weight_packing(amx: bool | None = None) -> str | None:
    """What `pack_linears` packs for here: "AMX" (this package's kernel, on CPUs with AMX),
    "oneDNN", or None. `amx`: None where available, False never, True required."""
    if amx is not False and amx_matmul()[0] is not None:
        return "AMX"
    if amx:
        raise RuntimeError(f"AMX matmuls asked for: {amx_matmul()[1]}")
    return "oneDNN" if packing_available() else None


def pack_linears(model: nn.Module, amx: bool | None = None) -> int:
    """Pack the bf16 CPU linears of a GPT model's attention and dense MLPs (the layers
    that run through their own `forward`; MoE experts read their weights directly and
    keep them) and its output layer, for `weight_packing(amx)`; the number packed. A
    model with nothing to pack (another dtype or device) returns 0 before any kernel is
    built."""
    if not isinstance(model, GPTModel):
        return 0
    linears: list[tuple[nn.Module, str]] = []  # (parent, name) of each layer to pack
    for layer in model.decoder.layers:
        attention = getattr(layer, "self_attention", None)
        if attention is not None:
            linears += [(attention, "linear_qkv"), (attention, "linear_proj")]
        if type(getattr(layer, "mlp", None)) is MLP:
            linears += [(layer.mlp, "linear_fc1"), (layer.mlp, "linear_fc2")]
    linears = [
        (parent, name)
        for parent, name in linears
        if type(getattr(parent, name)) is nn.Linear and _packable(getattr(parent, name).weight)
    ]
    output = _packable(model.output_weight())
    packing = weight_packing(amx) if linears or output else None
    if packing is None:
        return 0
    packed = 0
    for parent, name in linears:
        linear = getattr(parent, name)
        matmul = _packed(linear.weight, linear.bias, packing)
        if matmul is None:
            continue
        setattr(parent, name, PackedLinear(linear, matmul))
        packed += 1
    return packed + (_pack_output_layer(model, packing) if output else 0)


def _packable(weight: Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu"


def _pack_output_layer(model: GPTModel, packing: str) -> int:
    weight = model.output_weight()
    matmul = _packed(weight, None, packing)
    if matmul is None:
        return 0
    if model.output_layer is not None:  # its own: the packed copy replaces it
        _free(weight)
    elif isinstance(matmul, AMXLinear):  # tied: the embedding looks its rows up in the copy
        embedding = model.embedding
        embedding.word_embeddings = PackedEmbedding(embedding.word_embeddings, matmul)

    model.output_head = PackedOutputHead(matmul)
    return 1


class PackedOutputHead(OutputHead):
    """The model's output head with its logits from the packed output matrix (the plain
    head's masking of the padding rows and its loss around them)."""

    def __init__(self, matmul: Callable[[Tensor], Tensor]) -> None:
        self.matmul = matmul

    def logits_from(self, model: nn.Module, hidden: Tensor) -> Tensor:
        return self.matmul(hidden)


def _packed(weight: Tensor, bias: Tensor | None, packing: str) -> Callable[[Tensor], Tensor] | None:
    """x -> x @ weight.T + bias over x's last dimension, the weight packed once: for the
    AMX kernel where it takes the shape, else for oneDNN (None: neither here)."""
    kernel = amx_matmul()[0] if packing == "AMX" else None
    if kernel is not None and fits(weight):
        return AMXLinear(kernel, weight, bias)
    return OneDNNLinear(weight, bias) if packing_available() else None


def _free(weight: Tensor) -> None:
    """Empty a weight whose packed copy replaces it (the Parameter stays, under its name)."""
    weight.data = torch.empty(0, dtype=weight.dtype)


class PackedLinear(nn.Module):
    """An `nn.Linear` whose weight was packed once: its forward is the packed matmul.

    Swapped in for the layer in its parent module. It keeps the layer's `weight`
    Parameter, emptied (the packed copy replaced it), and its `bias`, so the
    model's parameter names stay those of the plain layer."""

    def __init__(self, linear: nn.Linear, matmul: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.matmul = matmul
        """`AMXLinear` or `OneDNNLinear`: x -> x @ weight.T + bias."""
        _free(linear.weight)
        self.register_parameter("weight", linear.weight)
        self.register_parameter("bias", linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.matmul(x)

    def extra_repr(self) -> str:
        packing = type(self.matmul).__name__
        return f"in_features={self.in_features}, out_features={self.out_features}, {packing}"


class PackedEmbedding(nn.Module):
    """A tied word embedding whose matrix lives only in the output layer's AMX-packed
    copy: looks its tokens' rows up there (`AMXLinear.rows`).

    Swapped in for the `nn.Embedding`; it keeps its `weight` Parameter, emptied, under
    its name (the model's `output_weight()` still finds it)."""

    def __init__(self, embedding: nn.Embedding, matmul: AMXLinear) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.matmul = matmul
        _free(embedding.weight)
        self.register_parameter("weight", embedding.weight)

    def forward(self, ids: Tensor) -> Tensor:
        return self.matmul.rows(ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, AMX-packed"


class OneDNNLinear:
    """One bf16 weight packed into oneDNN's blocked layout, with its bias."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = bias

    def __call__(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])

"""A Llama-shaped bf16 model's serving step as one C++ call, on CPUs with AMX.

On a CPU a decode step of a few sequences costs a read of the weights (~12 ms
for a 135M model on two cores) plus everything around it: per layer, five
matmuls, the norms, RoPE, the SwiGLU product, residual adds and the paged
attention, each a torch op (or a compiled graph's kernel) with its dispatch,
its output allocation and an OpenMP team woken for a few microseconds of work.
For 30 layers that overhead was as large as the matmuls themselves (a
compiled step of 8 sequences: 26 ms, of which the linears' reads ~12).

This module builds one C++ library from the package's AMX matmul kernel
(`amx_matmul`), the paged decode-attention kernel
(`mg.core.models.paged_attention_cpu`) and the small ops between them, and
runs every layer of a step in a single call, with the GIL released: decode
rows, and prompt chunks whose context is short (each prompt row attends over
its own length, as a decode row does). The embedding lookup and the output
layer stay in PyTorch. Each row is computed alone, in the same order whatever
else the step holds, so a sequence's tokens do not depend on the schedule; each
op rounds to bf16 where the eager model does (a norm's product and its scale,
RoPE's two products and their sum, SiLU and its product, each residual add), so
it computes the eager model's numbers up to the order of the sums.

It serves models whose every layer is pre-norm RMSNorm, fused QKV without bias
(GQA allowed), RoPE over all or part of each head, and a SwiGLU MLP without
bias, with weights the AMX kernel took (`pack_linears`): Llama, Mistral,
SmolLM, Qwen-without-bias shapes. `fused_decode_unsupported` says why any
other model (or machine) keeps the per-op step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from mg.core.models import GPTModel
from mg.core.models.gpt import MLP, TransformerLayer
from mg.core.models.paged_attention_cpu import kernel_flags, kernel_source, quiet_cpp_extension
from mg.core.models.paged_kv_cache import PagedKVCache, PagedSegment
from mg.generate_server.amx_matmul import KERNEL_FLAGS, AMXLinear
from mg.generate_server.amx_matmul import kernel_source as amx_source
from mg.generate_server.packed_linears import PackedLinear

_STEP = r"""
static inline float from_bf16(uint16_t x) {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t to_bf16(float x) {  // round to nearest even
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return static_cast<uint16_t>(u >> 16);
}
static inline float rounded(float x) { return from_bf16(to_bf16(x)); }

// 16 floats rounded to bf16 (nearest even), kept as floats (`load16`, `store16`, `exp16`:
// the attention kernel's)
static inline __m512 rounded16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(0xFFFF0000)));
}

// y = x / rms(x) * w per row, rounded once as torch's rms_norm on bf16 rounds it (torch
// 2.15's fused kernel: x / rms * w in fp32, then to bf16). In place (y == x) is allowed.
static void rms_norm(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t n,
                     int64_t width, float eps) {
    #pragma omp parallel for
    for (int64_t i = 0; i < n; i++) {
        const uint16_t* row = x + i * width;
        float squares = 0.f;
        for (int64_t c = 0; c < width; c++) squares += from_bf16(row[c]) * from_bf16(row[c]);
        const float inverse = 1.f / std::sqrt(squares / width + eps);
        for (int64_t c = 0; c < width; c++)
            y[i * width + c] = to_bf16(from_bf16(row[c]) * inverse * from_bf16(w[c]));
    }
}

// RoPE ("rotate half") over the first `rot` channels of every query and key head, in place
// in the QKV rows ([n][groups][per_group queries, key, value][d]); cos, sin: [n, rot] bf16.
static void rope(uint16_t* qkv, const uint16_t* cos, const uint16_t* sin, int64_t n,
                 int64_t rot) {
    const int64_t row = G * (H + 2) * D, half = rot / 2;
    #pragma omp parallel for
    for (int64_t i = 0; i < n; i++)
        for (int64_t g = 0; g < G; g++)
            for (int64_t h = 0; h < H + 1; h++) {  // the group's queries, then its key
                uint16_t* head = qkv + i * row + (g * (H + 2) + h) * D;
                float x[D];
                for (int64_t j = 0; j < rot; j++) x[j] = from_bf16(head[j]);
                for (int64_t j = 0; j < rot; j++) {
                    const float other = j < half ? -x[j + half] : x[j - half];
                    head[j] = to_bf16(rounded(x[j] * from_bf16(cos[i * rot + j])) +
                                      rounded(other * from_bf16(sin[i * rot + j])));
                }
            }
}

// (width: a multiple of 16, as the AMX kernel's sides are of 32)
static void add_into(uint16_t* hidden, const uint16_t* x, int64_t n, int64_t width) {
    #pragma omp parallel for
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = i * width; c < (i + 1) * width; c += 16)
            store16(_mm512_add_ps(load16(hidden + c), load16(x + c)), hidden + c);
}

// act = silu(gate) * up over rows [gate | up] of 2 * ffn (a multiple of 16)
static void swiglu(const uint16_t* fc1, uint16_t* act, int64_t n, int64_t ffn) {
    #pragma omp parallel for
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = 0; c < ffn; c += 16) {
            const __m512 gate = load16(fc1 + i * 2 * ffn + c);
            const __m512 e = exp16(_mm512_sub_ps(splat(0.f), gate));
            const __m512 silu = rounded16(_mm512_div_ps(gate, _mm512_add_ps(splat(1.f), e)));
            store16(_mm512_mul_ps(silu, load16(fc1 + i * 2 * ffn + ffn + c)), act + i * ffn + c);
        }
}

// Every layer of a decode step: hidden [n, width] (the embeddings in; the final norm's
// output out). weights: per layer the addresses of the input norm, the packed QKV and
// output projections, the pre-MLP norm, the packed fc1 and fc2; then the final norm.
// keys, values: the pool [layers][blocks, block_size, G, D] (`layer_elements` apart);
// tables [n, blocks_width], lengths [n] (the new position included), slots [n].
extern "C" void kernel(uint16_t* hidden, const int64_t* weights, uint16_t* keys,
                       uint16_t* values, const uint16_t* cos, const uint16_t* sin,
                       const int64_t* tables, const int64_t* lengths, const int64_t* slots,
                       int64_t n, int64_t layers, int64_t width, int64_t ffn, int64_t rot,
                       int64_t blocks_width, int64_t window, int64_t layer_elements, float eps,
                       float scale) {
    PyThreadState* released = PyEval_SaveThread();  // the server's other threads run meanwhile
    const int64_t qkv_width = G * (H + 2) * D, context_width = G * H * D;
    std::vector<uint16_t> normed(n * width), qkv(n * qkv_width), context(n * context_width);
    std::vector<uint16_t> out(n * width), fc1(n * 2 * ffn), act(n * ffn);
    auto weight = [&](int64_t layer, int64_t k) {
        return reinterpret_cast<const uint16_t*>(weights[layer * 6 + k]);
    };
    for (int64_t l = 0; l < layers; l++) {
        rms_norm(hidden, weight(l, 0), normed.data(), n, width, eps);
        amx_linear(normed.data(), weight(l, 1), nullptr, qkv.data(), n, qkv_width, width, 0);
        rope(qkv.data(), cos, sin, n, rot);
        // every row's key and value first: a prompt's rows read each other's
        const int64_t group = (H + 2) * D;
        uint16_t* layer_keys = keys + l * layer_elements;
        uint16_t* layer_values = values + l * layer_elements;
        #pragma omp parallel for
        for (int64_t i = 0; i < n; i++)
            store_new(layer_keys, layer_values, qkv.data() + i * qkv_width + H * D,
                      qkv.data() + i * qkv_width + (H + 1) * D, group, group, slots[i]);
        paged_attention(qkv.data(), layer_keys, layer_values, tables, lengths, context.data(),
                        nullptr, nullptr, slots, n, blocks_width, window, 0, qkv_width, group, 0,
                        0, 0, 0, scale, nullptr, 0);
        amx_linear(context.data(), weight(l, 2), nullptr, out.data(), n, width, context_width, 0);
        add_into(hidden, out.data(), n, width);
        rms_norm(hidden, weight(l, 3), normed.data(), n, width, eps);
        amx_linear(normed.data(), weight(l, 4), nullptr, fc1.data(), n, 2 * ffn, width, 0);
        swiglu(fc1.data(), act.data(), n, ffn);
        amx_linear(act.data(), weight(l, 5), nullptr, out.data(), n, width, ffn, 0);
        add_into(hidden, out.data(), n, width);
    }
    rms_norm(hidden, reinterpret_cast<const uint16_t*>(weights[layers * 6]), hidden, n, width, eps);
    PyEval_RestoreThread(released);
}
"""

MAX_PROMPT_CONTEXT = 1024
"""The longest context a prompt chunk may attend over in a fused step."""

_ARGUMENTS = ["uint16_t*", "const int64_t*", "uint16_t*", "uint16_t*", "const uint16_t*"]
_ARGUMENTS += ["const uint16_t*", "const int64_t*", "const int64_t*", "const int64_t*"]
_ARGUMENTS += ["int64_t"] * 8 + ["float", "float"]


def llama_shape_unsupported(
    model: nn.Module, cache: PagedKVCache | None, cache_dtype: torch.dtype
) -> str | None:
    """Why a model and cache are not what the whole-step kernels compute (a dense pre-norm
    Llama shape: RoPE, RMSNorm, SwiGLU, a `cache_dtype` paged cache on the CPU), or None."""
    if not isinstance(model, GPTModel) or cache is None:
        return "not a GPT-family model with a paged KV cache"
    config = model.config
    if cache.fp8 or cache.keys.dtype != cache_dtype or cache.device.type != "cpu":
        return f"the KV cache is not {_DTYPE_NAMES[cache_dtype]} on the CPU"
    if model.rotary_pos_emb is None or model.embedding.position_embeddings is not None:
        return "positions are not RoPE"
    if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
        return "its norms are not RMSNorm"
    if config.activation != "swiglu" or not config.gated_linear_unit:
        return "its MLP is not SwiGLU"
    if config.qk_layernorm:
        return "it norms queries and keys (--qk-layernorm)"
    if config.softmax_type != "vanilla":
        return f"its attention has sinks (--softmax-type {config.softmax_type})"
    if config.glu_linear_offset or config.activation_func_clamp_value is not None:
        return "its SwiGLU is clamped or offset (gpt-oss's)"
    rot = config.rotary_dim
    if rot > config.kv_channels or rot % 2:
        return "its RoPE covers an unusual part of each head"
    for layer in model.decoder.layers:
        if type(layer) is not TransformerLayer or type(layer.mlp) is not MLP:
            return "a layer is not a dense pre-norm layer (MoE or another kind)"
        norms = (layer.input_layernorm, layer.pre_mlp_layernorm, model.decoder.final_layernorm)
        if any(type(norm) is not nn.RMSNorm for norm in norms):
            return "its norms are not RMSNorm modules"
    return None


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def layer_linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    """A dense layer's four linears, in the kernels' order."""
    attention, mlp = layer.self_attention, layer.mlp
    return attention.linear_qkv, attention.linear_proj, mlp.linear_fc1, mlp.linear_fc2


def fused_decode_unsupported(model: nn.Module, cache: PagedKVCache | None) -> str | None:
    """Why `FusedDecode` cannot run this model's decode steps here, or None."""
    if why := llama_shape_unsupported(model, cache, torch.bfloat16):
        return why
    for layer in model.decoder.layers:
        if any(not _amx_packed(m) or m.matmul.has_bias for m in layer_linears(layer)):
            return "its linears are not AMX-packed and bias-free"
    return None  # (AMX-packed linears: the kernel was built)


def _amx_packed(linear: nn.Module) -> bool:
    """Whether `pack_linears` swapped this layer for one with the AMX kernel's weights."""
    return isinstance(linear, PackedLinear) and isinstance(linear.matmul, AMXLinear)


class FusedDecode:
    """A model's serving steps over its paged cache, each one C++ call (`_build`). For a
    model and cache `fused_decode_unsupported` accepts (`ModelRunner.use_fused_decode`)."""

    def __init__(self, model: GPTModel, cache: PagedKVCache) -> None:
        config = model.config
        self.model, self.cache = model, cache
        attention = model.decoder.layers[0].self_attention
        groups, heads, d = attention.num_groups, attention.num_heads, attention.head_dim
        self._step = _build(groups, heads // groups, d, cache.block_size)
        self.description = "amx bf16"
        """For the log ("decode steps fused: amx bf16")."""
        addresses: list[int] = []
        self._keep: list[Tensor] = []  # what the addresses point into
        for layer in model.decoder.layers:
            attention, mlp = layer.self_attention, layer.mlp
            for tensor in (
                layer.input_layernorm.weight,
                attention.linear_qkv.matmul.packed,
                attention.linear_proj.matmul.packed,
                layer.pre_mlp_layernorm.weight,
                mlp.linear_fc1.matmul.packed,
                mlp.linear_fc2.matmul.packed,
            ):
                tensor = tensor.detach().contiguous()
                self._keep.append(tensor)
                addresses.append(tensor.data_ptr())
        final = model.decoder.final_layernorm.weight.detach().contiguous()
        self._keep.append(final)
        addresses.append(final.data_ptr())
        self._weights = torch.tensor(addresses, dtype=torch.int64)
        self._sizes = (
            len(model.decoder.layers),
            config.hidden_size,
            config.ffn_hidden_size,
            config.rotary_dim,
        )
        self._eps = float(config.layernorm_epsilon)
        self._scale = 1.0 / math.sqrt(d)
        self._window = config.window_size[0] if config.window_size is not None else -1
        self.steps = 0
        """Steps run so far."""

    def takes(self, segments: Sequence[PagedSegment]) -> bool:
        """Whether this step runs fused: decodes, and prompt chunks that attend over at
        most `MAX_PROMPT_CONTEXT` positions (each prompt row reads its context once; a
        longer prompt's chunks keep SDPA, which reads it once a chunk)."""
        return takes(segments)

    @torch.inference_mode()
    def logits(
        self, segments: Sequence[PagedSegment], ids: Tensor, pos: Tensor, logit_rows: Sequence[int]
    ) -> Tensor:
        """`ModelRunner.forward` for a step it `takes` (ids, positions: [1, n]): logits
        [len(logit_rows), vocab]."""
        model, cache = self.model, self.cache
        blocks, lengths, slots = step_tables(segments, cache.block_size)
        hidden = model.embedding(ids, pos)[0].contiguous()
        rope = model.rotary_pos_emb(pos)  # fp32 [1, n, 1, rot], cast as RoPE casts them
        cos, sin = (x[0, :, 0].to(torch.bfloat16).contiguous() for x in rope)
        layers, width, ffn, rot = self._sizes
        self._step(
            hidden, self._weights, cache.keys, cache.values, cos, sin, blocks, lengths, slots,
            hidden.shape[0], layers, width, ffn, rot,
            blocks.shape[1], self._window, cache.keys[0].numel(), self._eps, self._scale,
        )  # fmt: skip
        self.steps += 1
        if list(logit_rows) != list(range(hidden.shape[0])):
            hidden = hidden[torch.tensor(list(logit_rows), dtype=torch.long)]
        return model.output_and_loss(hidden[None], None)[0]


def takes(segments: Sequence[PagedSegment]) -> bool:
    """Whether a step runs fused: decodes, and prompt chunks that attend over at most
    `MAX_PROMPT_CONTEXT` positions."""
    return all(s.query_length == 1 or s.context_length <= MAX_PROMPT_CONTEXT for s in segments)


def step_tables(segments: Sequence[PagedSegment], bs: int) -> tuple[Tensor, Tensor, Tensor]:
    """A fused step's block tables [rows, width], lengths [rows] (the row's position + 1)
    and pool slots [rows], one row per query row of the segments."""
    table_width = max(-(-s.context_length // bs) for s in segments)
    tables, lengths, slots, owners = [], [], [], []
    for k, s in enumerate(segments):
        if s.context_length > len(s.blocks) * bs:
            end = s.context_length - 1
            raise ValueError(f"fused step: position {end} is past the sequence's blocks")
        table = list(s.blocks[:table_width])
        tables.append(table + [0] * (table_width - len(table)))
        for p in range(s.context_start, s.context_length):
            slots.append(s.blocks[p // bs] * bs + p % bs)
            lengths.append(p + 1)
            owners.append(k)
    blocks = torch.tensor(tables)
    if len(owners) != len(segments):  # a prompt's rows: its table for each
        blocks = blocks[torch.tensor(owners)]
    return blocks, torch.tensor(lengths), torch.tensor(slots)


@functools.cache
def _build(groups: int, per_group: int, head_dim: int, block_size: int):
    # lazy: torch._inductor takes seconds to import; only a CPU with AMX builds this step
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    source = "\n".join(
        [
            "#define PY_SSIZE_T_CLEAN\n#include <Python.h>\n#include <cmath>\n#include <vector>",
            "#define kernel paged_attention",
            kernel_source("uint16_t", groups, per_group, head_dim, block_size),
            "#undef kernel\n#define kernel amx_linear",
            amx_source(),
            "#undef kernel",
            _STEP,
        ]
    )
    with quiet_cpp_extension():
        return CppPythonBindingsCodeCache.load_pybinding(
            _ARGUMENTS,
            source,
            needs_vec_isa=True,
            extra_flags=(*kernel_flags(), *KERNEL_FLAGS),
        )

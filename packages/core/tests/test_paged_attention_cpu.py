"""The CPU decode kernel that reads paged KV blocks in place equals attention over the
gathered positions: float32 and bfloat16, grouped queries, sliding windows, sequences
that end inside a block or hold a single position, blocks scattered in the pool, and
whatever lies in a block's positions past a sequence's end (NaN here) never read.
Shapes with head_dim and block_size multiples of 16 take the AVX-512 path where the
CPU has it, multiples of 8 the AVX2 one (also forced, with the compiler flags of a CPU
without AVX-512); the others the portable loops."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from mg.core.models.paged_attention_cpu import decode_kernel


def skip_unless_no_compiler(why: str) -> None:
    """Skip where no C++ toolchain can build the kernel; fail where one refused its source
    (a compile error is a bug here, not a missing compiler)."""
    assert "CppCompileError" not in why, why
    pytest.skip(why)


def reference(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    tables: Tensor,
    lengths: Tensor,
    window: int,
    scale: float | None = None,
) -> Tensor:
    """What the kernel computes, in PyTorch: each row's query heads over its
    first `lengths[i]` positions (the last `window` + 1 of them when window >= 0)."""
    n, heads, d = query.shape
    groups = keys.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(query)
    for i in range(n):
        length = int(lengths[i])
        k = keys[tables[i]].reshape(-1, groups, d)[:length].float()
        v = values[tables[i]].reshape(-1, groups, d)[:length].float()
        first = max(0, length - 1 - window) if window >= 0 else 0
        k, v = k[first:], v[first:]
        q = query[i].float().view(groups, heads // groups, d)
        scores = torch.einsum("ghd,lgd->ghl", q, k) * scale
        context = torch.einsum("ghl,lgd->ghd", scores.softmax(-1), v)
        out[i] = context.reshape(heads, d).to(query.dtype)
    return out


@pytest.mark.parametrize(
    ("dtype", "groups", "heads", "head_dim", "block_size", "window"),
    [
        (torch.float32, 3, 9, 64, 16, -1),
        (torch.bfloat16, 3, 9, 64, 16, -1),
        (torch.bfloat16, 2, 8, 128, 32, 37),
        (torch.bfloat16, 2, 2, 32, 8, 5),
        (torch.float32, 1, 4, 16, 4, -1),
    ],
    ids=["gqa-fp32", "gqa-bf16", "window-d128-bf16", "window-bf16", "mqa-fp32"],  # a build each
)
def test_kernel_equals_attention_over_gathered_blocks(
    dtype, groups, heads, head_dim, block_size, window
) -> None:
    assert_equals_attention_over_gathered_blocks(dtype, groups, heads, head_dim, block_size, window)


AVX2_ONLY = ("-mno-avx512f", "-mavx2", "-mfma", "-mf16c")
"""The flags that build the kernel as for a CPU with AVX2 and no AVX-512."""


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="no AVX2"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx2_path_equals_attention_over_gathered_blocks(dtype) -> None:
    """The 135M Llama shape (3 groups of 3 heads, head_dim 64, blocks of 16) and a sliding
    window, built without AVX-512: 8 positions scored at a time."""
    assert_equals_attention_over_gathered_blocks(dtype, 3, 9, 64, 16, 21, AVX2_ONLY)


def assert_equals_attention_over_gathered_blocks(
    dtype: torch.dtype,
    groups: int,
    heads: int,
    head_dim: int,
    block_size: int,
    window: int,
    isa_flags: tuple[str, ...] = (),
) -> None:
    kernel, why = decode_kernel(dtype, groups, heads, head_dim, block_size, isa_flags)
    if kernel is None:
        skip_unless_no_compiler(why)
    gen = torch.Generator().manual_seed(0)
    pool = (40, block_size, groups, head_dim)
    keys = torch.randn(pool, generator=gen).to(dtype)
    values = torch.randn(pool, generator=gen).to(dtype)
    tables = torch.randperm(40, generator=gen)[:40].view(5, 8)
    lengths = torch.tensor([1, 7, 8 * block_size, block_size + 1, 3 * block_size])
    for table, length in zip(tables, lengths.tolist(), strict=True):
        for position in range(length, -(-length // block_size) * block_size):
            block, offset = table[position // block_size], position % block_size
            keys[block, offset] = values[block, offset] = float("nan")
    query = torch.randn(5, heads, head_dim, generator=gen).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    got = kernel(query, keys, values, tables, lengths, window, scale)
    want = reference(query, keys, values, tables, lengths, window, scale)
    # fp32: summation order only; bf16: one rounding of nearly the same fp32 result (a
    # value that lies at a rounding boundary can land one bf16 step, 2^-8 to 2^-7, away)
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, atol=1e-5, rtol=rtol)
    # only the first ceil(length / block_size) blocks of a table are read
    tables[0, 1:] = 10**6
    assert torch.equal(kernel(query, keys, values, tables, lengths, window, scale)[0], got[0])


def test_unsupported_dtype_names_itself() -> None:
    kernel, why = decode_kernel(torch.float16, 1, 1, 8, 4)
    assert kernel is None and "float16" in why


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernel_stores_the_steps_keys_and_values_first(dtype) -> None:
    """A decode-only step hands the kernel its new keys/values (here strided views of a
    fused QKV row, as the model's split gives them): each is written to its slot before
    its row attends, as `index_copy_` into the pool and then the kernel would."""
    groups, heads, d, bs = 3, 9, 64, 16
    kernel, why = decode_kernel(dtype, groups, heads, d, bs)
    if kernel is None:
        skip_unless_no_compiler(why)
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(20, bs, groups, d, generator=gen).to(dtype)
    values = torch.randn(20, bs, groups, d, generator=gen).to(dtype)
    tables = torch.randperm(20, generator=gen)[:12].view(4, 3)
    lengths = torch.tensor([1, 17, 33, 48])
    slots = torch.stack(
        [tables[i, (n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lengths)]
    )
    qkv = torch.randn(4, groups, heads // groups + 2, d, generator=gen).to(dtype)
    query = qkv[:, :, :-2].reshape(4, heads, d)
    new_keys, new_values = qkv[:, :, -2], qkv[:, :, -1]  # [4, groups, d], not contiguous
    scale = 1 / math.sqrt(d)
    stored_keys, stored_values = keys.clone(), values.clone()
    stored_keys.view(-1, groups, d).index_copy_(0, slots, new_keys)
    stored_values.view(-1, groups, d).index_copy_(0, slots, new_values)
    want = kernel(query, stored_keys, stored_values, tables, lengths, -1, scale)
    got = kernel(query, keys, values, tables, lengths, -1, scale, (new_keys, new_values, slots))
    assert torch.equal(got, want)
    assert torch.equal(keys, stored_keys) and torch.equal(values, stored_values)

"""linear_logp's shape contract: the constants the build compiled in (kernel.toml), the workspace the CUDA ops
allocate, and ``unsupported_shape_reason``, the one place the kernel's limits live. Below both surfaces that need it
(``linear_ops`` and ``vocab_parallel``), and free of compiled code."""
from __future__ import annotations

import torch

from prime_kernels_core import manifest

from . import checks

CONSTANTS = manifest.constants("prime_kernels_fused_logp", "linear_logp")
BLOCK_N: int = CONSTANTS["BLOCK_N"]
BLOCK_V: int = CONSTANTS["BLOCK_V"]
BLOCK_K: int = CONSTANTS["BLOCK_K"]
STAGES: int = CONSTANTS["STAGES"]
MAX_SPLITS: int = CONSTANTS["MAX_SPLITS"]
DZ_CHUNK_ELEMS: int = CONSTANTS["DZ_CHUNK_ELEMS"]
INVARIANT_TILES_PER_SPLIT: int = CONSTANTS["INVARIANT_TILES_PER_SPLIT"]
INVARIANT_DZ_CHUNK_TILES: int = CONSTANTS["INVARIANT_DZ_CHUNK_TILES"]
INVARIANT_GEMM_ROWS: int = CONSTANTS["INVARIANT_GEMM_ROWS"]
HIDDEN_ALIGN: int = CONSTANTS["HIDDEN_ALIGN"]
PTR_ALIGN_BYTES: int = CONSTANTS["PTR_ALIGN_BYTES"]
MAX_VOCAB_SIZE: int = CONSTANTS["MAX_VOCAB_SIZE"]
MAX_NUM_TOKENS: int = CONSTANTS["MAX_NUM_TOKENS"]
CUDA_DTYPES = (torch.bfloat16, torch.float16)


def workspace_bytes(num_tokens: int, vocab_size: int, hidden_size: int, backward: bool = False,
                    batch_invariant: bool = False) -> int:
    """Device memory the CUDA ops allocate beyond their inputs and outputs (upper bound, excluding cuBLAS's own)."""
    if not backward:
        return (3 * MAX_SPLITS + 1) * 4 * num_tokens + 12 * num_tokens  # partials + label logit, stats
    if batch_invariant:  # vocab chunks of INVARIANT_DZ_CHUNK_TILES tiles, rows padded to whole GEMM blocks
        vc = INVARIANT_DZ_CHUNK_TILES * BLOCK_V
        block_rows = max(INVARIANT_GEMM_ROWS, DZ_CHUNK_ELEMS // vc // INVARIANT_GEMM_ROWS * INVARIANT_GEMM_ROWS)
        pad = -(-min(num_tokens, block_rows) // INVARIANT_GEMM_ROWS) * INVARIANT_GEMM_ROWS
        padded_tokens = -(-num_tokens // INVARIANT_GEMM_ROWS) * INVARIANT_GEMM_ROWS
        gw = 4 * vc * hidden_size if num_tokens > block_rows else 0  # fp32 grad_weight across token chunks
        return pad * vc * 2 + 4 * padded_tokens * hidden_size + 4 * vocab_size + gw
    rows = min(num_tokens, max(BLOCK_N, DZ_CHUNK_ELEMS // BLOCK_V // BLOCK_N * BLOCK_N))
    dz = min(DZ_CHUNK_ELEMS, rows * ((vocab_size + BLOCK_V - 1) // BLOCK_V) * BLOCK_V) * 2
    return dz + 4 * num_tokens * hidden_size + 4 * vocab_size  # + fp32 grad_hidden accumulator, fp32 grad_bias


def unsupported_shape_reason(hidden_size: int, vocab_size: int, num_tokens: int | None = None,
                             dtype: torch.dtype = torch.bfloat16, *, device: str | torch.device = "cuda",
                             hidden: torch.Tensor | None = None, weight: torch.Tensor | None = None) -> str | None:
    """None when the kernel on ``device`` handles these shapes, else one sentence saying what was found and what is needed.

    Pass the 2-D ``hidden`` [N, H] and ``weight`` [V, H] to also check their strides and data-pointer alignment.
    """
    checks.require_ints("unsupported_shape_reason", hidden_size=hidden_size, vocab_size=vocab_size)
    if num_tokens is not None:
        checks.require_ints("unsupported_shape_reason", num_tokens=num_tokens)
    if hidden_size < 1:
        return f"hidden_size must be >= 1, got {hidden_size}"
    if not 1 <= vocab_size <= MAX_VOCAB_SIZE:
        return f"vocab_size must be in [1, {MAX_VOCAB_SIZE}], got {vocab_size}"
    if num_tokens is not None and num_tokens > MAX_NUM_TOKENS:
        return f"num_tokens must be <= {MAX_NUM_TOKENS}, got {num_tokens}"
    if torch.device(device).type != "cuda":
        if dtype not in CUDA_DTYPES + (torch.float32,):
            return f"dtype must be bfloat16, float16 or float32 on CPU, got {dtype}"
        return None
    if dtype not in CUDA_DTYPES:
        return f"dtype must be bfloat16 or float16 on CUDA, got {dtype}"
    if hidden_size % HIDDEN_ALIGN:
        return (f"hidden_size must be a multiple of {HIDDEN_ALIGN} on CUDA (16-byte rows for TMA), "
                f"got {hidden_size}")
    for name, t in (("hidden", hidden), ("weight", weight)):
        if t is None:
            continue
        if t.stride(-1) != 1:
            return f"{name} last dim must have stride 1 on CUDA, got stride {t.stride(-1)}"
        if t.shape[0] > 1 and t.stride(0) % HIDDEN_ALIGN:
            return f"{name} row stride must be a multiple of {HIDDEN_ALIGN} elements on CUDA, got {t.stride(0)}"
        # Traced tensors have no address; the op's own check covers alignment when the compiled graph runs.
        if not torch.compiler.is_compiling() and t.data_ptr() % PTR_ALIGN_BYTES:
            return f"{name} data pointer must be {PTR_ALIGN_BYTES}-byte aligned on CUDA"
    return None

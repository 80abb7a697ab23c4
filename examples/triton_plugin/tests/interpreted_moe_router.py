"""The router's Triton functions on the CPU through Triton's interpreter: run with TRITON_INTERPRET=1 (set before
Python starts; test_moe_router.py does so in a child process). Checks numerics against float64 with the error-ratio
rule, and that the interpreter really ran the Triton functions (the conformance kit runs its own child with
TRITON_INTERPRET=1). Prints "interpreted_moe_router: ok" at the end."""
import sys
from pathlib import Path

import torch

import prime_kernels
from prime_kernels_core import jit_gating

sys.path.insert(0, str(Path(__file__).parent))
from test_moe_router import CONFIGS, INTERPRETER_SHAPES, KERNEL, check_route  # noqa: E402

assert jit_gating.interpreting(), "run with TRITON_INTERPRET=1"
# Triton's interpreter converts fp32 to bfloat16 by truncation (the GPU rounds to nearest even): a bfloat16 gradient
# computed here is judged on the GPU and on the PyTorch path, not here; its forward (fp32 weights) and every fp32 output
# are judged here.
ops = prime_kernels.load(KERNEL, "cpu")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pk_example_router import kernels  # noqa: E402

assert isinstance(kernels.route_forward, InterpretedFunction), "Triton did not make the functions interpreted"
for name, tokens in INTERPRETER_SHAPES.items():
    for dtype in (torch.float32, torch.bfloat16):
        check_route(ops, tokens, CONFIGS[name], dtype, "cpu", f"interpreter {name} {dtype}",
                    judge_grad=dtype == torch.float32)
assert prime_kernels.unavailable_reason(KERNEL, (9, 0)).startswith("TRITON_INTERPRET=1 is set")
print("interpreted_moe_router: ok")

"""The manifest's spelling of a CuTe DSL function's compile arguments: what ``cute.compile`` is given for each parameter
of a ``@cute.jit`` function, as strings the registry can check without importing the DSL.

Each runtime parameter of a specialization's ``signature`` is one of:

- a tensor, ``"BFloat16[tokens, N_EXPERTS]"``: its element type (a ``cutlass`` numeric type's name, or ``{dtype}`` for
  each entry of the specialization's ``dtypes``) and one entry per mode, outermost first (row-major and compact, as a
  contiguous torch tensor). A mode named by one of the specialization's constexprs is static, with that constexpr's
  value (the number is written once); an integer is static; any other name is dynamic, a ``cute.sym_int()`` shared by
  every mode spelled with the same name (the compiled code takes one extent for them). Every tensor's base pointer is
  assumed aligned to the specialization's ``align`` bytes (default: one element);
- a scalar, ``"Float32"``, ``"Int32"``, ``"Int64"``, ``"Boolean"``: a runtime value of that type;
- ``"stream"``: the CUDA stream the function launches on (the current torch stream at run time).

Constexpr parameters (``cutlass.Constexpr``) are the specialization's ``constexprs``, passed by name.
"""
from __future__ import annotations

import re

TENSOR = re.compile(r"\s*(\{dtype\}|[A-Z][A-Za-z0-9]*)\s*\[([^\]]*)\]\s*")
DIMENSION = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+")
# The element types a tensor may have: the cutlass numeric type of each torch dtype the runtime can pass (DLPack).
TORCH_TO_CUTE = {"float32": "Float32", "float16": "Float16", "bfloat16": "BFloat16", "float64": "Float64",
                 "int8": "Int8", "int16": "Int16", "int32": "Int32", "int64": "Int64", "uint8": "Uint8",
                 "bool": "Boolean", "float8_e4m3fn": "Float8E4M3FN", "float8_e5m2": "Float8E5M2"}
ELEMENT_BYTES = {"Float32": 4, "Float16": 2, "BFloat16": 2, "Float64": 8, "Int8": 1, "Int16": 2, "Int32": 4,
                 "Int64": 8, "Uint8": 1, "Boolean": 1, "Float8E4M3FN": 1, "Float8E5M2": 1}
SCALARS = ("Float32", "Float64", "Int32", "Int64", "Boolean")
STREAM = "stream"
DTYPE_SLOT = "{dtype}"


class CuteSignatureError(ValueError):
    """A signature entry that names no tensor, scalar or stream the build can make a compile argument of."""


def parse(kind: str, constexprs: dict) -> dict:
    """``"BFloat16[tokens, N]"`` -> ``{"tensor": "BFloat16", "modes": [["tokens", None], ["N", 256]]}`` (a static mode
    carries its extent, a dynamic one None); ``"Float32"`` -> ``{"scalar": "Float32"}``; ``"stream"`` ->
    ``{"stream": True}``. Raises CuteSignatureError with what was expected."""
    if kind == STREAM:
        return {"stream": True}
    if kind in SCALARS:
        return {"scalar": kind}
    found = TENSOR.fullmatch(kind) if isinstance(kind, str) else None
    if not found or (found[1] != DTYPE_SLOT and found[1] not in ELEMENT_BYTES):
        raise CuteSignatureError(f"expected a tensor such as \"BFloat16[tokens, N]\" (element type one of "
                                 f"{sorted(ELEMENT_BYTES)} or {DTYPE_SLOT}), a scalar among {list(SCALARS)}, or "
                                 f"\"{STREAM}\", found {kind!r}")
    modes = []
    for name in (m.strip() for m in found[2].split(",")):
        if not DIMENSION.fullmatch(name):
            raise CuteSignatureError(f"a tensor's modes are names or integers, found {name!r} in {kind!r}")
        static = int(name) if name.isdigit() else constexprs.get(name)
        if static is not None and (isinstance(static, bool) or not isinstance(static, int) or static < 1):
            raise CuteSignatureError(f"mode {name} of {kind!r} is the constexpr {name} = {static!r}, which is no "
                                     "extent")
        modes.append([name, static])
    return {"tensor": found[1], "modes": modes}


def check(signature: dict, constexprs: dict, dtypes: list) -> None:
    """Every entry of a specialization's signature parses (``{dtype}`` only where ``dtypes`` are listed)."""
    for name, kind in signature.items():
        try:
            parsed = parse(kind, constexprs)
        except CuteSignatureError as exc:
            raise CuteSignatureError(f"signature.{name}: {exc}") from None
        if parsed.get("tensor") == DTYPE_SLOT and not dtypes:
            raise CuteSignatureError(f"signature.{name} uses {DTYPE_SLOT}, and the specialization lists no dtypes")
    for dtype in dtypes:
        if dtype not in ELEMENT_BYTES:
            raise CuteSignatureError(f"dtypes lists the element types {DTYPE_SLOT} stands for, each one of "
                                     f"{sorted(ELEMENT_BYTES)}, found {dtype!r}")

"""The manifest keys of a JIT kernel: one whose device code is Triton (or CuTe DSL) source compiled by that library,
not C++/CUDA compiled into ``_C``.

A JIT kernel's table holds the keys every kernel has (description, namespace, ops, trainable, module, constants) and:

- ``language``: ``"triton"`` or ``"cute-dsl"``;
- ``requires``: the library and the versions the kernel supports, ``"triton >= 3.5, < 3.9"`` (comma-separated
  ``>=``, ``>``, ``<=``, ``<``, ``==``, ``!=`` clauses on numeric releases);
- ``capability``: the compute capabilities its code runs on, in the same clause form, ``">= 8.0"`` (Triton's own
  floor) or ``">= 9.0, < 10.0"`` (a kernel using Hopper-only features);
- ``cpu``: how its ops run on the CPU, in order of preference: ``"interpreter"`` (the library's interpreter, for
  Triton ``TRITON_INTERPRET=1`` set before Python starts) and/or ``"pytorch"`` (a PyTorch implementation in the
  kernel module);
- ``archs``: the targets ahead-of-time code is compiled for at wheel build time, spelled as for compiled kernels and
  as the library emits them (Triton compiles capability 9.0 and newer arch-specific: ``"9.0a"``, ``"10.0a"``);
- ``functions``: the module holding the kernel's ``@triton.jit`` functions (imported by the build, never by discovery);
- ``launch.<function>``: per function, the launch options both the build and a JIT fallback use (``num_warps``,
  ``num_stages``);
- ``specializations``: an array of tables, each one function compiled ahead of time: ``function``, ``signature``
  (every non-constexpr parameter's type: for Triton ``"*bf16"``, ``"i32"``, ``"fp32"``; for the CuTe DSL a tensor
  ``"BFloat16[tokens, N]"``, a scalar ``"Float32"`` or ``"stream"``, cute_signature; ``{dtype}`` stands for each entry
  of ``dtypes``), ``constexprs`` (every constexpr parameter's value; a list of values stands for one specialization per
  value) and, for the CuTe DSL, ``align`` (the byte alignment every tensor's base pointer is compiled for).

A CuTe DSL kernel has no ``launch`` table (its launch configuration is its code's, or a constexpr) and no
``"interpreter"`` CPU path; its archs are spelled as passed to ``--gpu-arch`` (``"8.0"`` is sm_80, ``"9.0a"`` sm_90a).

This module never imports the library: it reads strings.
"""
from __future__ import annotations

import itertools
import re

from . import cute_signature

LANGUAGES = ("triton", "cute-dsl")
# The distribution whose installed version each language's ``requires`` names.
LIBRARY_OF = {"triton": "triton", "cute-dsl": "nvidia-cutlass-dsl"}
CPU_PATHS = ("interpreter", "pytorch")
JIT_KEYS = {"language", "requires", "capability", "cpu", "functions", "launch", "specializations"}
LAUNCH_OPTIONS = {"num_warps", "num_stages"}
SPECIALIZATION_KEYS = {"function", "signature", "dtypes", "constexprs"}
CUTE_SPECIALIZATION_KEYS = SPECIALIZATION_KEYS | {"align"}
CLAUSE = re.compile(r"\s*(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)\s*")
REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)")
# A Triton parameter type: a pointer to an element type, or a scalar (what triton.compile's signature takes).
TRITON_TYPE = re.compile(r"\*?(i1|u1|i8|i16|i32|i64|u8|u16|u32|u64|fp8e4nv|fp8e5|fp16|bf16|fp32|fp64)")
DTYPE_SLOT = "{dtype}"
ARCH_SPELLING = re.compile(r"(\d+)\.(\d+)(a?)")
# Triton compiles capability 9.0 and newer for the arch-specific target (sm_90a, sm_100a): what archs must spell.
TRITON_FIRST_ARCH_SPECIFIC = 9


class JitManifestError(ValueError):
    """A JIT kernel table the build kit or the registry cannot use (manifest.ManifestError wraps its sentence)."""


def is_jit(table: dict) -> bool:
    """Whether a kernel table declares a JIT kernel (it names a ``language``)."""
    return "language" in table


def release(text: str) -> tuple[int, ...] | None:
    """``"3.8.0+git1a2b"`` -> ``(3, 8, 0)``: the numeric release a version begins with; None when there is none."""
    found = re.match(r"\d+(?:\.\d+)*", text or "")
    return tuple(int(p) for p in found[0].split(".")) if found else None


def parse_clauses(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """``">= 3.4, < 3.9"`` -> ``[(">=", (3, 4)), ("<", (3, 9))]``; raises JitManifestError for anything else."""
    clauses = []
    for part in text.split(","):
        found = CLAUSE.fullmatch(part)
        if not found:
            raise JitManifestError(f"{part.strip()!r} is no version clause: expected an operator (>=, >, <=, <, ==, "
                                   f"!=) and a release such as 3.4")
        clauses.append((found[1], tuple(int(p) for p in found[2].split("."))))
    return clauses


def _padded(version: tuple[int, ...], width: int) -> tuple[int, ...]:
    return version + (0,) * (width - len(version))


def satisfies(version: tuple[int, ...], clauses: list[tuple[str, tuple[int, ...]]]) -> bool:
    """Whether a release meets every clause; ``== 3.8`` matches every 3.8.x, as a bound names a release prefix."""
    for op, bound in clauses:
        head = version[:len(bound)] if op in ("==", "!=") else _padded(version, len(bound))
        bound = _padded(bound, len(head))
        ok = {">=": head >= bound, ">": head > bound, "<=": head <= bound, "<": head < bound,
              "==": head == bound, "!=": head != bound}[op]
        if not ok:
            return False
    return True


def requirement(table: dict) -> tuple[str, str]:
    """(distribution, clauses text) of a validated table's ``requires``."""
    found = REQUIREMENT.fullmatch(table["requires"])
    return found[1], found[2].strip()


def _check_requires(where: str, table: dict) -> None:
    text = table.get("requires")
    found = REQUIREMENT.fullmatch(text) if isinstance(text, str) else None
    library = LIBRARY_OF[table["language"]]
    if not found or found[1].lower() != library:
        raise JitManifestError(f"{where}: requires names the library and the versions the kernel supports, "
                               f"\"{library} >= X, < Y\", found {text!r}")
    if found[2].strip():
        try:
            parse_clauses(found[2])
        except JitManifestError as exc:
            raise JitManifestError(f"{where}: requires: {exc}") from None


def _check_capability(where: str, table: dict) -> None:
    text = table.get("capability")
    try:
        if not isinstance(text, str):
            raise JitManifestError(f"found {text!r}")
        parse_clauses(text)
    except JitManifestError as exc:
        raise JitManifestError(f"{where}: capability is the compute capabilities the kernel runs on, such as "
                               f"\">= 8.0\" or \">= 9.0, < 10.0\": {exc}") from None


def _check_cpu(where: str, table: dict) -> None:
    paths = table.get("cpu", [])
    allowed = CPU_PATHS if table["language"] == "triton" else ("pytorch",)  # the CuTe DSL has no interpreter
    if not isinstance(paths, list) or not all(p in allowed for p in paths) or len(set(paths)) != len(paths):
        raise JitManifestError(f"{where}: cpu lists how the ops run on the CPU, each once, from {list(allowed)}, "
                               f"found {paths!r}")


def _check_archs(where: str, table: dict) -> None:
    """Ahead-of-time targets, spelled as the library emits them and each inside the kernel's capability range."""
    clauses = parse_clauses(table["capability"])
    for arch in table.get("archs", []):
        found = ARCH_SPELLING.fullmatch(arch)
        if not found:
            raise JitManifestError(f"{where}: archs are spelled MAJOR.MINOR (\"8.0\") or MAJOR.MINORa (\"9.0a\"), "
                                   f"found {arch!r}")
        major = int(found[1])
        wants_a = major >= TRITON_FIRST_ARCH_SPECIFIC
        if table["language"] == "triton" and bool(found[3]) != wants_a:
            spelled = f"{found[1]}.{found[2]}{'a' if wants_a else ''}"
            raise JitManifestError(f"{where}: Triton compiles {found[1]}.{found[2]} for sm_{found[1]}{found[2]}"
                                   f"{'a' if wants_a else ''}, so archs spells it \"{spelled}\", found {arch!r}")
        if not satisfies((major, int(found[2])), clauses):
            raise JitManifestError(f"{where}: archs lists {arch}, outside the kernel's capability {table['capability']!r}")


def _check_launch(where: str, table: dict) -> None:
    launch = table.get("launch", {})
    if not isinstance(launch, dict):
        raise JitManifestError(f"{where}: launch maps a function name to its options, found {launch!r}")
    for function, options in launch.items():
        bad = (not isinstance(options, dict) or set(options) - LAUNCH_OPTIONS
               or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in options.values()))
        if bad:
            raise JitManifestError(f"{where}: launch.{function} holds positive ints among {sorted(LAUNCH_OPTIONS)}, "
                                   f"found {options!r}")


def _check_signature(where: str, language: str, entry: dict) -> None:
    signature = entry.get("signature")
    if not isinstance(signature, dict) or not signature:
        raise JitManifestError(f"{where}: signature maps each non-constexpr parameter to its type, found "
                               f"{signature!r}")
    if language == "cute-dsl":
        try:
            cute_signature.check(signature, _first_values(entry.get("constexprs", {})), entry.get("dtypes", []))
        except cute_signature.CuteSignatureError as exc:
            raise JitManifestError(f"{where}: {exc}") from None
        return
    for name, kind in signature.items():
        if not isinstance(kind, str) or not TRITON_TYPE.fullmatch(kind.replace(DTYPE_SLOT, "fp32")):
            raise JitManifestError(f"{where}: signature.{name} must be a Triton type such as \"*bf16\", \"i32\" or "
                                   f"\"*{DTYPE_SLOT}\", found {kind!r}")


def _is_constexpr_value(value) -> bool:
    return isinstance(value, (bool, int, float))


def _first_values(constexprs: dict) -> dict:
    """Each constexpr's value, the first of a list (what a signature's static modes are checked against)."""
    return {k: v[0] if isinstance(v, list) and v else v for k, v in constexprs.items()} \
        if isinstance(constexprs, dict) else {}


def _check_constexprs(where: str, constexprs) -> None:
    good = isinstance(constexprs, dict) and all(
        _is_constexpr_value(v) or (isinstance(v, list) and v and all(_is_constexpr_value(x) for x in v))
        for v in constexprs.values())
    if not good:
        raise JitManifestError(f"{where}: constexprs maps each constexpr parameter to a number or boolean, or to a "
                               f"list of them (one specialization per value), found {constexprs!r}")


def _check_dtypes(where: str, language: str, entry: dict) -> None:
    dtypes = entry.get("dtypes", [])
    if language == "cute-dsl":  # cute_signature checked the element types and where {dtype} may stand
        if dtypes and not any(DTYPE_SLOT in kind for kind in entry["signature"].values()):
            raise JitManifestError(f"{where}: dtypes lists the element types that {DTYPE_SLOT} in signature stands "
                                   f"for, and no signature entry uses {DTYPE_SLOT}")
        return
    slotted = any(DTYPE_SLOT in kind for kind in entry["signature"].values())
    if slotted != bool(dtypes) or not all(isinstance(d, str) and TRITON_TYPE.fullmatch(d) for d in dtypes):
        raise JitManifestError(f"{where}: dtypes lists the Triton types that {DTYPE_SLOT} in signature stands for "
                               f"(and only a signature using {DTYPE_SLOT} has them), found {dtypes!r}")


def _check_specializations(where: str, table: dict) -> None:
    specializations = table.get("specializations", [])
    language = table["language"]
    keys = CUTE_SPECIALIZATION_KEYS if language == "cute-dsl" else SPECIALIZATION_KEYS
    if not isinstance(specializations, list):
        raise JitManifestError(f"{where}: specializations is an array of tables ([[kernel.specializations]])")
    for i, entry in enumerate(specializations):
        here = f"{where}: specializations[{i}]"
        if not isinstance(entry, dict) or set(entry) - keys or not isinstance(entry.get("function"), str):
            raise JitManifestError(f"{here} needs a function name and only the keys {sorted(keys)}, found {entry!r}")
        if language == "triton" and entry["function"] not in table.get("launch", {}):
            raise JitManifestError(f"{here}: function {entry['function']!r} has no launch.{entry['function']} options")
        _check_constexprs(here, entry.get("constexprs", {}))
        _check_signature(here, language, entry)
        _check_dtypes(here, language, entry)
        align = entry.get("align")
        if align is not None and (isinstance(align, bool) or not isinstance(align, int) or align < 1
                                  or align & (align - 1)):
            raise JitManifestError(f"{here}: align is the byte alignment every tensor is compiled for, a power of "
                                   f"two, found {align!r}")


def check(where: str, table: dict) -> None:
    """The JIT keys of one kernel table, each with a sentence naming the key, what was expected and what was found."""
    if table.get("language") not in LANGUAGES:
        raise JitManifestError(f"{where}: language is one of {list(LANGUAGES)}, found {table.get('language')!r}")
    if table.get("sources"):
        raise JitManifestError(f"{where}: a {table['language']} kernel has no C++/CUDA sources (it needs no _C); "
                               "drop sources, or drop language for a compiled kernel")
    _check_requires(where, table)
    _check_capability(where, table)
    _check_cpu(where, table)
    _check_archs(where, table)
    if not isinstance(table.get("functions", ""), str):
        raise JitManifestError(f"{where}: functions names the module of the kernel's JIT functions, found "
                               f"{table['functions']!r}")
    if table.get("archs") and not table.get("functions"):
        raise JitManifestError(f"{where}: archs asks for ahead-of-time code, so functions must name the module of the "
                               "kernel's JIT functions")
    if table["language"] != "triton" and table.get("launch"):
        raise JitManifestError(f"{where}: launch holds Triton's launch options; a {table['language']} kernel's launch "
                               "configuration is in its code (or a constexpr)")
    _check_launch(where, table)
    _check_specializations(where, table)


def _constexpr_choices(constexprs: dict) -> list[dict]:
    """``{"A": 1, "B": [False, True]}`` -> ``[{"A": 1, "B": False}, {"A": 1, "B": True}]``."""
    names = list(constexprs)
    values = [v if isinstance(v, list) else [v] for v in constexprs.values()]
    return [dict(zip(names, chosen)) for chosen in itertools.product(*values)]


def expanded(specialization: dict) -> list[dict]:
    """One {"function", "signature", "constexprs"} (and "align" where given) per dtype and constexpr value of a
    specialization (itself when it has no dtypes and no constexpr lists)."""
    signature = specialization["signature"]
    dtypes = specialization.get("dtypes") or [None]
    align = {"align": specialization["align"]} if "align" in specialization else {}
    return [{
        "function": specialization["function"],
        "signature": {k: v.replace(DTYPE_SLOT, d) if d else v for k, v in signature.items()},
        "constexprs": constexprs,
        **align,
    } for d in dtypes for constexprs in _constexpr_choices(specialization.get("constexprs", {}))]


def declared(table: dict) -> dict:
    """What a KernelSpec keeps of a JIT table (the registry gates on it without reading the manifest again)."""
    return {key: table[key] for key in ("language", "requires", "capability", "cpu", "functions", "launch")
            if key in table}

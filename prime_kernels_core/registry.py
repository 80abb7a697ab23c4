"""Discovery of installed plugins and the gating rules that say whether a kernel can run here, and if not, why.

Every public function here returns a reason instead of raising: status and gating never raise.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.metadata
import os
import re
import sys
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

import pluggy

from . import ENTRY_POINT_GROUP, hookspecs, jit_gating, manifest
from .manifest import ARCH_PATTERN, TORCH_RELEASE, KernelSpec, arch_runs_on, capability_of, major_minor, release_tuple

DISABLE_ENV = "PRIME_KERNELS_DISABLE"
ALLOW_ENV = "PRIME_KERNELS_PLUGINS"
AVAILABLE = "available"
# status()'s one key when discovery itself failed: no kernel is named like this.
DISCOVERY_KEY = "<discovery>"
DECLARE_HINT = "return prime_kernels_core.manifest.declare(__file__)"
# The KernelSpec fields the gating rules and the CLI read as text, and as lists of text.
SPEC_STRING_FIELDS = ("name", "description", "namespace", "module")
SPEC_STRING_TUPLE_FIELDS = ("ops", "archs", "trainable")


class KernelUnavailableError(RuntimeError):
    """Raised by load() with the gating reason."""


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a kernel would run: the CPU, or CUDA device ``index`` of compute ``capability``; ``index`` None is a
    what-if (a device of that capability, whether or not one is present)."""

    kind: str
    index: int | None = None
    capability: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class Entry:
    """One row of discovery: a declared kernel, or a plugin that failed before declaring any."""

    name: str
    distribution: str
    version: str
    spec: KernelSpec | None = None
    error: str | None = None
    manager: pluggy.PluginManager | None = None


# ---------------------------------------------------------------- discovery

def normalized_name(name: str) -> str:
    """A distribution or plugin name as packaging compares them: case-folded, each run of "-", "_" and "." one "-"."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def _allowed(ep, dist_name: str) -> bool:
    """Whether the allow-list (ALLOW_ENV; unset or empty: every plugin) names this entry point or its distribution."""
    allowed = {normalized_name(n) for n in os.environ.get(ALLOW_ENV, "").split(",") if n.strip()}
    return not allowed or normalized_name(ep.name) in allowed or normalized_name(dist_name) in allowed


def _installed_as(dist) -> tuple[str, str]:
    """(name, version) from the folder a distribution is installed as (``name-version.dist-info``), for when its
    METADATA cannot be read."""
    # importlib.metadata keeps a distribution's folder only in the private _path; other finders may not have one.
    stem = Path(str(getattr(dist, "_path", "?-?"))).name.rsplit(".", 1)[0]
    name, _, version = stem.partition("-")
    return name, version or "?"


def _plugin_entry_points():
    """(distribution name, version, entry point, why its METADATA is unreadable or None) for each plugin, first copy of
    each distribution on sys.path only. Each distribution is read on its own: a broken unrelated one hides nothing."""
    seen = set()
    for dist in importlib.metadata.distributions():
        try:
            plugin_eps = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
        except Exception:  # an unparsable entry_points.txt names no plugin that could be loaded
            continue
        try:
            name, version, unreadable = dist.metadata["Name"], dist.version, None
        except Exception as exc:
            name, unreadable = None, f"its METADATA cannot be read: {type(exc).__name__}: {exc}"
        if name is None:  # importlib.metadata reads a missing METADATA as an empty one
            name, version = _installed_as(dist)
            unreadable = unreadable or (f"its dist-info folder {getattr(dist, '_path', '')} has no METADATA "
                                        "(reinstall the distribution)")
        key = normalized_name(name)
        if key in seen:
            continue
        seen.add(key)
        for ep in plugin_eps:
            if _allowed(ep, name):
                yield name, version, ep, unreadable


def _manifest_kernel_names(ep) -> list[str]:
    """The kernels in the kernel.toml of the entry point's package, found without importing it (the entry point names
    only one of them); the entry point's name when no manifest can be read."""
    try:
        return list(manifest.load(manifest.package_dir(ep.module.split(".")[0]))["kernels"])
    except Exception:
        return [ep.name]


def _failed(dist_name: str, version: str, ep, error: str) -> list[Entry]:
    return [Entry(name, dist_name, version, error=error) for name in _manifest_kernel_names(ep)]


class _HookManager(pluggy.PluginManager):
    """pluggy's manager, also taking a plugin's unmarked ``prime_kernels_*`` functions as hook implementations: an
    author who forgot ``@hookimpl`` gets the hook called, not a plugin that seems to declare nothing."""

    def parse_hookimpl_opts(self, plugin, name):
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith(ENTRY_POINT_GROUP + "_") and callable(getattr(plugin, name, None)):
            return {}
        return opts


def _plugin_failure(exc: BaseException, package: str) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if f"{package}.{manifest.EXTENSION_MODULE}" in sys.modules or (isinstance(exc, ImportError) and ".so" in str(exc)):
        text += (f" (its hooks' import loaded compiled code: discovery imports only the entry point's module, so "
                 f"import {package}.{manifest.EXTENSION_MODULE} in the kernel module, not in the package or plugin.py)")
    return text


def _entry_point_problem(ep) -> str | None:
    """Why an entry point's value names no importable object (importlib.metadata fails on it with an AttributeError)."""
    try:
        ep.module
    except Exception:
        return (f"its {ENTRY_POINT_GROUP} entry point {ep.name!r} has the value {ep.value!r}, which is no module path "
                "(package.module or package.module:object)")
    return None


def _spec_problem(spec) -> str | None:
    """Why a declared object is no well-formed KernelSpec (a hand-built one with a number for a name, say)."""
    if not isinstance(spec, KernelSpec):
        return f"{spec!r}, not a KernelSpec"
    for field in SPEC_STRING_FIELDS:
        if not isinstance(getattr(spec, field), str):
            return f"a KernelSpec whose {field} is {getattr(spec, field)!r}, not a string"
    for field in SPEC_STRING_TUPLE_FIELDS:
        value = getattr(spec, field)
        if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) for v in value):
            return f"a KernelSpec whose {field} is {value!r}, not a tuple of strings"
    return None


def _declared_specs(manager) -> list[KernelSpec]:
    """The KernelSpecs the plugin's prime_kernels_declare hooks return, each checked for form."""
    results = manager.hook.prime_kernels_declare()
    if not manager.hook.prime_kernels_declare.get_hookimpls():
        raise ValueError("it has no prime_kernels_declare hook")
    if not results:  # pluggy drops a hook's None
        raise TypeError(f"its prime_kernels_declare hook returned None, not a list of KernelSpecs ({DECLARE_HINT})")
    for result in results:
        if not isinstance(result, (list, tuple)):
            raise TypeError(f"its prime_kernels_declare hook returned {result!r}, not a list of KernelSpecs "
                            f"({DECLARE_HINT})")
    specs = [s for result in results for s in result]
    for spec in specs:
        problem = _spec_problem(spec)
        if problem:
            raise TypeError(f"its prime_kernels_declare hook returned {problem} ({DECLARE_HINT})")
    return specs


def _declare(dist_name: str, version: str, ep, unreadable: str | None) -> list[Entry]:
    """Import one plugin's hook module in its own PluginManager, so one plugin's failure touches no other."""
    problem = unreadable or _entry_point_problem(ep)
    if problem:
        return _failed(dist_name, version, ep, problem)
    package = ep.module.split(".")[0]
    try:
        manager = _HookManager(ENTRY_POINT_GROUP)
        manager.add_hookspecs(hookspecs)
        manager.register(ep.load(), name=f"{dist_name}:{ep.name}")
        manager.check_pending()
        specs = _declared_specs(manager)
        if not specs:
            raise ValueError("its prime_kernels_declare hook declared no kernel")
        return [
            Entry(s.name, dist_name, version, dataclasses.replace(s, distribution=dist_name, version=version), None, manager)
            for s in specs
        ]
    except BaseException as exc:  # a broken plugin is a row, never an abort (sys.exit(), odd BaseExceptions included)
        if isinstance(exc, (KeyboardInterrupt, GeneratorExit)):
            raise
        return _failed(dist_name, version, ep, _plugin_failure(exc, package))


def namespaces(spec: KernelSpec) -> set[str]:
    """The torch.ops namespaces ``spec``'s extension claims: declared, and registered as its build record says."""
    ops = spec.build.get("registered_ops") if isinstance(spec.build, dict) else None
    recorded = {op.split("::")[0] for op in ops if isinstance(op, str)} if isinstance(ops, list) else set()
    return {spec.namespace} | recorded


def _clashes(entries: list[Entry]) -> dict[int, str]:
    """For each entry index whose kernel name or namespace another distribution also claims, the sentence saying so."""
    claims = defaultdict(list)
    for i, entry in enumerate(entries):
        if entry.spec is not None:
            claims[("kernel name", entry.spec.name)].append(i)
            for namespace in namespaces(entry.spec):
                claims[("namespace", namespace)].append(i)
    reasons = {}
    for (what, value), indices in claims.items():
        dists = {(entries[i].distribution, entries[i].version) for i in indices}
        if len(dists) > 1:
            named = " and ".join(f"{d} {v}" for d, v in sorted(dists))
            for i in indices:
                reasons.setdefault(
                    i, f"{what} '{value}' is claimed by both {named}; uninstall one of them (neither was imported)"
                )
    return reasons


@lru_cache(maxsize=1)
def _discover() -> tuple[tuple[Entry, ...], dict]:
    entries = [e for found in _plugin_entry_points() for e in _declare(*found)]
    return tuple(entries), _clashes(entries)


def refresh() -> None:
    """Forget discovery, manifests and import results, e.g. after installing a plugin into a running process."""
    _discover.cache_clear()
    _import_module.cache_clear()
    manifest.load.cache_clear()
    importlib.invalidate_caches()  # the import system's directory listings predate the install


def entries() -> tuple[Entry, ...]:
    """Every discovered row, in discovery order."""
    return _discover()[0]


def _find(name: str) -> tuple[Entry | None, str | None]:
    found, clashes = _discover()
    for i, entry in enumerate(found):
        if entry.name == name:
            return entry, clashes.get(i)
    return None, None


# ---------------------------------------------------------------- targets

# "sm_120", "sm_90", "sm_90a": a capability as nvcc and nvidia-smi users spell it (the last digit is the minor).
SM_PATTERN = re.compile(r"sm_?([0-9]+)([0-9])[af]?")  # ASCII digits, as manifest.ARCH_PATTERN


def parse_capability(device) -> tuple[int, int] | None:
    """``"sm_120"``, ``"12.0"`` or ``(12, 0)`` as a capability; None for anything else (a device, an index)."""
    if isinstance(device, tuple):
        ok = len(device) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in device)
        return device if ok else None
    if isinstance(device, str):
        found = SM_PATTERN.fullmatch(device.strip().lower())
        return (int(found[1]), int(found[2])) if found else capability_of(device.strip())
    return None


def _checked_target(target: Target) -> Target | str:
    if target.kind == "cpu" or (target.kind == "cuda" and parse_capability(target.capability) is not None):
        return target
    return f"Target {target!r} is neither Target('cpu') nor a CUDA target with a (major, minor) capability"


def resolve_target(device=None) -> Target | str:
    """A Target for ``device`` (None, an index, "cuda:N", "cpu", a torch.device, a capability such as "sm_120" or
    (12, 0), or a Target), or why there is none. A capability asks about a device of that capability, present or not."""
    if isinstance(device, Target):
        return _checked_target(device)
    capability = parse_capability(device)
    if capability is not None:
        return Target("cuda", None, capability)
    if isinstance(device, tuple):
        return f"device {device!r} is no capability: expected (major, minor), two non-negative ints, e.g. (9, 0)"
    try:
        import torch

        if device is None:
            if not torch.cuda.is_available():
                return "no CUDA device is visible to this process (torch.cuda.is_available() is False)"
            device = torch.cuda.current_device()
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type == "cpu":
            return Target("cpu")
        if device.type != "cuda":
            return f"device type {device.type!r} is not supported; use a CUDA device or 'cpu'"
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index if device.index is not None else (torch.cuda.current_device() if count else 0)
        if index >= count:
            return f"no CUDA device cuda:{index} is visible to this process (it sees {count})"
        return Target("cuda", index, tuple(torch.cuda.get_device_capability(index)))
    except Exception as exc:
        return (
            f"could not resolve device {device!r}: {type(exc).__name__}: {exc}; expected None, an index, 'cuda:N', "
            "'cpu', a torch.device or a capability such as 'sm_90' or (9, 0)"
        )


# ---------------------------------------------------------------- gating

def _own_loaded_ops(spec: KernelSpec) -> set[str]:
    """The ``namespace::op`` names registered by compiled modules of ``spec``'s own distribution that are imported
    already (a plugin's _C and _C_stable may share one namespace through library fragments)."""
    return {
        f"{e.spec.namespace}::{op}" for e in entries()
        if e.spec is not None and e.distribution == spec.distribution and e.spec.extension in sys.modules
        for op in e.spec.ops
    }


def _foreign_namespace_reason(spec: KernelSpec) -> str | None:
    if spec.extension in sys.modules or spec.module in sys.modules:  # registered by the plugin itself
        return None
    import torch

    own = _own_loaded_ops(spec)
    registered = [op for op in torch._C._dispatch_get_all_op_names() if op.split(".")[0] not in own]
    for namespace in sorted(namespaces(spec)):
        taken = sorted(op for op in registered if op.startswith(namespace + "::"))
        if taken:
            return (
                f"torch.ops namespace '{namespace}' is already registered in this process by something other than "
                f"{spec.distribution} (found {', '.join(taken[:3])}); importing {spec.extension or spec.module} would abort the process"
            )
    return None


def _missing_ops_reason(spec: KernelSpec) -> str | None:
    """After the import: every op the kernel declares is in the dispatcher."""
    import torch

    registered = {op.split(".")[0] for op in torch._C._dispatch_get_all_op_names()}
    missing = [op for op in spec.ops if f"{spec.namespace}::{op}" not in registered]
    if missing:
        return (
            f"{spec.name} declares ops {', '.join(f'{spec.namespace}::{op}' for op in missing)} that importing "
            f"{spec.module} did not register; its kernel.toml and its C++ disagree (rebuild, or fix the manifest)"
        )
    return None


def _cuda_major(version: str | None) -> str | None:
    return version.split(".")[0] if version else None


def _stable_abi_reason(spec: KernelSpec, floor: str, running: str) -> str | None:
    """A stable-ABI build runs under any torch from its floor on."""
    running_release = release_tuple(running)
    if running_release is None:
        return (f"{spec.name} is built on the LibTorch stable ABI for torch >= {floor}, but the running torch's version "
                f"{running!r} names no release MAJOR.MINOR to compare with it")
    if running_release < release_tuple(floor):
        return (
            f"{spec.name} is built on the LibTorch stable ABI for torch >= {floor}, but this process runs torch "
            f"{major_minor(running)}; upgrade torch to {floor} or newer, or install a build of {spec.distribution} "
            f"for torch {major_minor(running)}"
        )
    return None


def _torch_reason(spec: KernelSpec, floor: str | None) -> str | None:
    """An exact-ABI build runs under the torch major.minor it was built against; a stable-ABI one from its floor on."""
    import torch

    if floor:
        return _stable_abi_reason(spec, floor, str(torch.__version__))
    built_torch, running_torch = major_minor(spec.build.get("torch")), major_minor(torch.__version__)
    if built_torch != running_torch:
        return (
            f"{spec.name} was built against torch {built_torch} but this process runs torch {running_torch}; "
            f"rebuild {spec.distribution} against the running torch"
        )
    return None


def _cuda_reason(spec: KernelSpec, floor: str | None, target: Target | str) -> str | None:
    """CUDA code runs under the CUDA it was built against: the same version for an exact-ABI build, the same major
    for a stable-ABI one. The CPU code needs none, but a module with CUDA code in it links torch's CUDA libraries,
    which a CPU-only torch lacks: it does not even load there."""
    import torch

    built_cuda, running_cuda = spec.build.get("torch_cuda"), torch.version.cuda
    cuda_built = bool(spec.build.get("nvcc"))  # the build kit records nvcc only when it compiled CUDA code
    if not cuda_built:
        return None
    if running_cuda is None:
        cpu_label = f"cputorchabi{floor}" if floor else f"cputorch{major_minor(spec.build.get('torch'))}"
        return (
            f"{spec.name} was built with CUDA {built_cuda}, and its compiled module loads only under a torch built with "
            f"CUDA, but this process runs a CPU-only torch ({torch.__version__}); install a torch built with CUDA "
            f"{built_cuda if not floor else _cuda_major(built_cuda) + '.x'}, or the CPU-only build of "
            f"{spec.distribution} (+{cpu_label})"
        )
    if isinstance(target, Target) and target.kind == "cpu":
        return None
    if floor and _cuda_major(built_cuda) != _cuda_major(running_cuda):
        return (
            f"{spec.name} was built against CUDA {built_cuda} and runs under any torch >= {floor} built with CUDA "
            f"{_cuda_major(built_cuda)}.x, but this process runs torch with CUDA {running_cuda}; install a build of "
            f"{spec.distribution} for CUDA {_cuda_major(running_cuda)}"
        )
    if not floor and built_cuda != running_cuda:
        return (
            f"{spec.name} was built against CUDA {built_cuda} but this process runs torch with CUDA {running_cuda}; "
            f"rebuild {spec.distribution} against the running torch"
        )
    return None


def _abi_reason(spec: KernelSpec, kernel: dict, target: Target | str) -> str | None:
    """Whether the running torch is one the build runs under: exact-ABI builds (``_C``) the torch and CUDA they were
    built against, stable-ABI builds (the record's ``stable_abi`` floor) any torch from the floor on, same CUDA major."""
    floor = kernel.get("stable_abi")
    return _torch_reason(spec, floor) or _cuda_reason(spec, floor, target)


def torch_support(spec: KernelSpec | None) -> str | None:
    """The torch releases ``spec``'s build runs under, as the CLI shows them: ``torch >= 2.11`` for a stable-ABI build,
    ``torch 2.14`` for an exact one; None without a well-formed build record. Never raises."""
    try:
        if spec is not None and spec.jit is not None:
            return spec.jit["requires"]
        kernel = _kernel_build(spec) if spec is not None and spec.build is not None else None
        if not isinstance(kernel, dict):
            return None
        floor = kernel.get("stable_abi")
        return f"torch >= {floor}" if floor else f"torch {major_minor(spec.build.get('torch'))}"
    except Exception:
        return None


@lru_cache(maxsize=None)
def _import_module(module: str):
    """(module, None) or (None, reason), imported once per process."""
    try:
        return importlib.import_module(module), None
    except BaseException as exc:  # noqa: B036  (a plugin's odd BaseException is a reason, an interrupt is not)
        if isinstance(exc, (KeyboardInterrupt, GeneratorExit)):
            raise
        text = f"{type(exc).__name__}: {exc}"
        symbol = re.search(r"undefined symbol: (\S+)", text)
        if symbol:
            import torch

            return None, (
                f"importing {module} failed with an undefined symbol ({symbol[1]}): its compiled extension does not "
                f"match the running torch {torch.__version__}; rebuild it against this torch"
            )
        return None, f"importing {module} failed: {text}"


def _unbuilt_reason(spec: KernelSpec) -> str:
    text = f"{spec.name} is not compiled: {spec.distribution} has no build record (was it built with prime_kernels_core.build?)"
    try:
        folder = manifest.package_dir(spec.extension.rsplit(".", 1)[0])
    except Exception:
        return text
    if (folder.parent / "setup.py").exists() and not list(folder.glob(f"{manifest.EXTENSION_MODULE}*.so")):
        text += (f"; {folder} is a source tree with no build, found ahead of any installed copy on sys.path (pytest "
                 "run from the plugin's own folder puts it first): run from another folder, or pip install -e it")
    return text


def _kernel_build(spec: KernelSpec) -> dict | str:
    """This kernel's entry of its build record ({"archs": [...], "not_built": {arch: why}}), or why it is unusable."""
    record, where = spec.build, f"{spec.distribution}'s build record"
    if isinstance(record, str):
        return f"{where} cannot be read: {record}; rebuild {spec.distribution}"
    if not isinstance(record, dict):
        return f"{where} is not a JSON object (found {type(record).__name__}); rebuild {spec.distribution}"
    kernels = record.get("kernels")
    if not isinstance(kernels, dict):
        return f"{where} has no per-kernel 'kernels' table (a build by an older prime-kernels-core?); rebuild {spec.distribution}"
    kernel = kernels.get(spec.name)
    if not isinstance(kernel, dict):
        return f"{where} has no entry for {spec.name}; rebuild {spec.distribution}"
    ops = record.get("registered_ops")
    if not isinstance(ops, list) or not all(isinstance(op, str) and "::" in op for op in ops):
        return f"{where} does not list the ops its _C registers (a build by an older prime-kernels-core?); rebuild {spec.distribution}"
    archs, not_built = kernel.get("archs"), kernel.get("not_built", {})
    if not isinstance(archs, list) or not all(isinstance(a, str) and ARCH_PATTERN.fullmatch(a) for a in archs):
        return f"{where} lists archs {archs!r} for {spec.name}, not a list of arch strings such as \"9.0a\"; rebuild it"
    if not isinstance(not_built, dict):
        return f"{where} has a malformed not_built entry for {spec.name} ({not_built!r}); rebuild it"
    floor = kernel.get("stable_abi")  # absent in records older than the stable ABI: an exact-ABI build
    if floor is not None and not (isinstance(floor, str) and TORCH_RELEASE.fullmatch(floor)):
        return (f"{where} gives {spec.name} the stable ABI floor {floor!r}, not a torch release such as \"2.11\"; "
                f"rebuild {spec.distribution}")
    return kernel


def built_archs(spec: KernelSpec) -> list[str]:
    """The archs ``spec``'s CUDA code was compiled for (none when its build record is missing or malformed); for a JIT
    kernel, those its wheel ships ahead-of-time code for."""
    if spec.jit is not None:
        return jit_gating.shipped_archs(spec)
    kernel = _kernel_build(spec) if spec.build is not None else None
    return kernel["archs"] if isinstance(kernel, dict) else []


def _arch_reason(spec: KernelSpec, kernel: dict, capability: tuple[int, int]) -> str | None:
    """Why ``spec`` has no code for a device of ``capability``: its own manifest archs must serve the device and its
    own CUDA sources must have been compiled for one of those (each kernel of a plugin is compiled for its own archs)."""
    if any(arch_runs_on(a, capability) for a in kernel["archs"]):
        return None
    device = "sm_{}{}".format(*capability)
    built = f"this install has it for {', '.join(kernel['archs'])}" if kernel["archs"] else "this install has no CUDA code for it"
    serving = [a for a in spec.archs if arch_runs_on(a, capability)]
    if not serving:
        text = f"{spec.name} has no CUDA build for {device}: it supports {', '.join(spec.archs) or 'no CUDA arch'} only ({built})"
        siblings = [
            e.name for e in entries() if e.spec is not None and e.name != spec.name and e.distribution == spec.distribution
            and any(arch_runs_on(a, capability) for a in built_archs(e.spec))
        ]
        return text + "".join(f"; this install has {name}'s for {device}" for name in siblings)
    why = "; ".join(f"{a}: {kernel['not_built'].get(a, 'not compiled')}" for a in serving)
    return (
        f"{spec.name} supports {device} ({', '.join(serving)}) but this build of {spec.distribution} did not compile it "
        f"({why}; {built}); rebuild it without PRIME_KERNELS_ARCH (every arch) or with PRIME_KERNELS_ARCH={serving[-1]}"
    )


def _extra_check_reason(spec: KernelSpec, answer) -> str | None:
    """The extra check's answer as a reason: a non-blank string is one; any other truthy value refuses without saying
    why, which is a reason too; a blank string or a falsy value is none."""
    if isinstance(answer, str):
        return answer if answer.strip() else None
    if answer:
        return (
            f"{spec.distribution}'s extra check refused {spec.name} without saying why "
            f"(it returned {answer!r}, not a sentence)"
        )
    return None


def unknown_kernel_reason(name: str) -> str:
    """Why ``name`` names no kernel here, with the closest installed name when one is close ("fused-logp")."""
    names = list(dict.fromkeys(e.name for e in entries()))
    close = [n for n in names if normalized_name(n) == normalized_name(name)] or difflib.get_close_matches(name, names, 1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"no installed plugin declares a kernel named '{name}'{hint}"


def _load_refusal(name: str, device, reason: str) -> str:
    """load()'s error: the kernel, where it was asked to run, the reason, and device="cpu" when that would work."""
    target = resolve_target(device)
    on_cpu = isinstance(target, Target) and target.kind == "cpu"
    where = "the CPU" if on_cpu else ("the current CUDA device" if device is None else f"device {device!r}")
    fallback = "" if on_cpu or not is_available(name, "cpu") else (
        f'; its CPU implementation can run: prime_kernels.load("{name}", device="cpu")')
    return f"cannot load {name} on {where}: {reason}{fallback}"


def _reason(name: str, device) -> str | None:
    disabled = {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",")}
    if name in disabled:
        return f"disabled by {DISABLE_ENV}"
    entry, clash = _find(name)
    if entry is None:
        return unknown_kernel_reason(name)
    if entry.error:  # rule 1
        return f"plugin {entry.distribution} {entry.version} failed to load: {entry.error}"
    spec = entry.spec
    if clash:  # rule 2
        return clash
    foreign = _foreign_namespace_reason(spec)  # rule 3
    if foreign:
        return foreign
    target = resolve_target(device)
    if spec.jit is not None:  # rules 4-7 of a JIT kernel: its library and where it would run
        return jit_gating.reason(spec, target) or _loaded_reason(entry, spec, name, target)
    if spec.build is None:  # rule 4
        return _unbuilt_reason(spec)
    kernel = _kernel_build(spec)
    if isinstance(kernel, str):
        return kernel
    wants_cuda = not (isinstance(target, Target) and target.kind == "cpu")
    if wants_cuda and spec.build.get("cuda_skipped"):
        return f"{spec.name} was built without CUDA: {spec.build['cuda_skipped']}"
    abi = _abi_reason(spec, kernel, target)  # rule 5
    if abi:
        return abi
    if isinstance(target, str):  # rule 6
        return target
    if target.kind == "cuda":  # rule 7
        arch = _arch_reason(spec, kernel, target.capability)
        if arch:
            return arch
    return _loaded_reason(entry, spec, name, target)


def _loaded_reason(entry: Entry, spec: KernelSpec, name: str, target: Target) -> str | None:
    """Rules 8 and 9: importing the kernel module, the ops it registers, the plugin's extra check."""
    _, failure = _import_module(spec.module)  # rule 8
    if failure:
        return failure
    missing = _missing_ops_reason(spec)
    if missing:
        return missing
    try:  # rule 9
        answer = entry.manager.hook.prime_kernels_extra_check(kernel=name, device=target)
    except (Exception, SystemExit) as exc:
        return f"{spec.distribution}'s extra check raised {type(exc).__name__}: {exc}"
    return _extra_check_reason(spec, answer)


def unavailable_reason(name: str, device=None) -> str | None:
    """None when ``name`` can run on ``device``, else one sentence saying what was found and what is needed."""
    try:
        return _reason(name, device)
    except Exception as exc:  # gating never raises
        return f"checking {name} failed unexpectedly: {type(exc).__name__}: {exc}"


def note(name: str, device=None) -> str | None:
    """For a usable JIT kernel: a sentence when it will compile on its first call on ``device`` (no shipped code for
    the device, or a call here already fell back to the JIT compiler), else None; never raises."""
    try:
        entry, _ = _find(name)
        if entry is None or entry.spec is None or entry.spec.jit is None or unavailable_reason(name, device):
            return None
        return jit_gating.note(entry.spec, resolve_target(device))
    except Exception as exc:
        return f"checking {name}'s shipped code failed unexpectedly: {type(exc).__name__}: {exc}"


def is_available(name: str, device=None) -> bool:
    return unavailable_reason(name, device) is None


def discovery_failure() -> str | None:
    """Why discovery itself failed (then there are no rows), or None; never raises."""
    try:
        entries()
    except Exception as exc:
        return f"plugin discovery failed: {type(exc).__name__}: {exc}"
    return None


def status(device=None) -> dict[str, str]:
    """{kernel name: "available" or the reason}, or {DISCOVERY_KEY: the reason} when discovery failed; never raises."""
    failure = discovery_failure()
    if failure:
        return {DISCOVERY_KEY: failure}
    return {n: unavailable_reason(n, device) or AVAILABLE for n in dict.fromkeys(e.name for e in entries())}


def spec(name: str) -> KernelSpec:
    """The declared spec of ``name`` (names, namespace, ops, archs, build record, distribution)."""
    entry, _ = _find(name)
    if entry is None or entry.spec is None:
        raise KernelUnavailableError(unavailable_reason(name, "cpu"))
    return entry.spec


def load(name: str, device=None):
    """The kernel's Python module; raises KernelUnavailableError with the reason when it cannot run on ``device``."""
    reason = unavailable_reason(name, device)
    if reason:
        raise KernelUnavailableError(_load_refusal(name, device, reason))
    return _import_module(spec(name).module)[0]


def log_status(logger, device=None) -> None:
    """One line per kernel, for a trainer's start-up log."""
    for name, state in status(device).items():
        remark = note(name, device) if state == AVAILABLE else None
        logger.info("prime-kernels: %s: %s", name, f"{state} ({remark})" if remark else state)

"""``python -m prime_kernels`` / ``prime-kernels``: what this machine has (core, Python, torch, driver, nvcc, GPUs), then
whether each installed kernel can run on the CUDA device and on the CPU, and why not; as text that fits the terminal
or as JSON (schema SCHEMA_VERSION, docs/core.md); ``--require`` for launch scripts. Exit codes: 0, 1 when a required
kernel is unavailable, 2 for a usage error, 3 when the report could not be written (stdout on a full device)."""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from . import __version__, build, registry

# Bumped whenever a key of the JSON document is renamed, removed or changes meaning (adding a key does not).
SCHEMA_VERSION = 1
# ASCII digits only: "sm_٩٠" or "cuda:٩" would pass \d and reach torch as a device it cannot parse. An arch has a
# major and a minor digit at least (sm_9 is no capability).
DEVICE_SPELLING = re.compile(r"[0-9]+|cpu|cuda(:[0-9]+)?")
WHAT_IF_ARCH = re.compile(r"sm_[1-9][0-9]+")
PROBE_TIMEOUT_S = 300
# The child prints one marked JSON line per device it was asked about; anything a plugin prints is not one.
PROBE_MARK = "prime-kernels-probe: "
PROBE_SCRIPT = (
    "import json, sys\n"
    "from prime_kernels_core import registry\n"
    "for device in json.loads(sys.argv[2]):\n"
    f"    print({PROBE_MARK!r} + json.dumps(registry.unavailable_reason(sys.argv[1], device)), flush=True)\n"
)
NO_PLUGINS_HINT = (
    "No prime-kernels plugins are installed. Install one (e.g. pip install --no-build-isolation plugins/fused_logp) "
    "and run again."
)
GAP = "  "
UNWRITTEN_EXIT = 3


# ---------------------------------------------------------------- arguments

def device_arg(value: str):
    """--device: an index, "cuda", "cuda:N" or "cpu"; anything else is a usage error."""
    if not DEVICE_SPELLING.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device; use an index N, cuda, cuda:N or cpu")
    return int(value) if value.isdigit() else value


def arch_arg(value: str) -> str:
    """--arch: a compute capability spelled sm_<major><minor> (sm_90, sm_100, sm_120), checked as if such a GPU were
    here."""
    if not WHAT_IF_ARCH.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not an arch; use sm_ and the capability's major and minor "
                                         "digits (ASCII), e.g. sm_90 or sm_100")
    return value


class _Once(argparse.Action):
    """A single-valued flag given twice is a usage error: silently keeping the last one checks another target than
    the launch script's first flag asked for."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest) is not None:
            parser.error(f"{option_string} was given twice ({getattr(namespace, self.dest)} and {values}); give it once")
        setattr(namespace, self.dest, values)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="prime-kernels", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", default="status", choices=["status"])
    p.add_argument("--version", action="version", version=f"prime-kernels {__version__}")
    p.add_argument("--json", action="store_true", help=f"print the report as JSON (schema version {SCHEMA_VERSION})")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--device", type=device_arg, default=None, action=_Once,
                       help="the CUDA device to check (N, cuda or cuda:N; default: the current one), or cpu alone")
    where.add_argument("--arch", type=arch_arg, default=None, action=_Once,
                       help="check as if the GPU were of this capability (sm_90, sm_100, ...), not the one present")
    # "extend": a launch script that passes one --require per kernel requires them all, not the last one only.
    p.add_argument("--require", nargs="+", action="extend", metavar="NAME", default=[],
                   help="exit 1 unless each of these kernels is available on the CUDA device (the CPU with --device "
                        "cpu); repeatable, the lists add up")
    p.add_argument("--probe", action="store_true", help="check each kernel in a child process (a crash becomes a row)")
    return p


# ---------------------------------------------------------------- environment

def _driver() -> tuple[str | None, str | None]:
    """(NVIDIA driver version, None) or (None, why none was found)."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        text = ""
    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    if found:
        return found[1], None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "no NVIDIA driver found (no /proc/driver/nvidia/version, no nvidia-smi on PATH)"
    try:
        done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
        return done.stdout.split()[0], None
    except Exception as exc:
        return None, f"nvidia-smi did not report a driver version ({type(exc).__name__}: {exc})"


def _nvcc() -> tuple[str | None, str | None, str | None]:
    """(version, CUDA_HOME, None) of the toolkit a plugin build would compile with (the build kit's own check), or
    (None, CUDA_HOME or None, why a build would skip CUDA)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # it prints "No CUDA runtime is found" without a GPU
            toolchain = build.detect_toolchain()
    except Exception as exc:
        return None, None, f"torch.utils.cpp_extension failed to import: {type(exc).__name__}: {exc}"
    if toolchain.nvcc_version:
        return toolchain.nvcc_version, toolchain.cuda_home, None
    return None, toolchain.cuda_home, build.no_toolkit_reason(toolchain.cuda_home)


def _gpus(torch) -> tuple[list[dict], str | None]:
    """Each visible GPU, or ([], why there is none)."""
    current = registry.resolve_target(None)
    if isinstance(current, str):
        return [], current
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": props.name, "capability": f"{props.major}.{props.minor}",
                     "arch": f"sm_{props.major}{props.minor}", "memory_gib": round(props.total_memory / 2**30, 1)})
    return gpus, None


def environment() -> dict:
    """The facts a bug report needs first; never raises (a fact that cannot be read is null with its reason)."""
    import torch

    driver, driver_reason = _driver()
    nvcc, cuda_home, nvcc_reason = _nvcc()
    try:
        gpus, gpu_reason = _gpus(torch)
    except Exception as exc:
        gpus, gpu_reason = [], f"listing the GPUs failed: {type(exc).__name__}: {exc}"
    return {
        "core_version": __version__, "python_version": platform.python_version(), "python_executable": sys.executable,
        "torch_version": torch.__version__, "torch_cuda_version": torch.version.cuda,
        "driver_version": driver, "driver_reason": driver_reason,
        "nvcc_version": nvcc, "nvcc_path": cuda_home and str(Path(cuda_home, "bin", "nvcc")), "cuda_home": cuda_home,
        "nvcc_reason": nvcc_reason,
        "gpus": gpus, "gpu_reason": gpu_reason,
    }


# ---------------------------------------------------------------- the report

def _cuda_target(device, arch) -> dict:
    """The CUDA column: the device checked (None for a what-if arch) and its arch (None when none is visible)."""
    if arch:
        return {"device": None, "arch": arch, "what_if": True}
    target = registry.resolve_target(device)
    if isinstance(target, registry.Target):
        return {"device": f"cuda:{target.index}", "arch": "sm_{}{}".format(*target.capability), "what_if": False}
    return {"device": f"cuda:{device}" if isinstance(device, int) else device or "cuda", "arch": None, "what_if": False}


def _probe_reasons(name: str, devices: list) -> list[str | None]:
    """The reasons computed in a child process, so a crash while loading a shared library becomes a reason."""
    try:
        done = subprocess.run([sys.executable, "-c", PROBE_SCRIPT, name, json.dumps(devices)], capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S)
        stdout, stderr, failure = done.stdout, done.stderr, f"exit code {done.returncode}"
    except subprocess.TimeoutExpired as exc:
        stdout, stderr, failure = exc.stdout or "", exc.stderr or "", f"no answer within {PROBE_TIMEOUT_S} s"
        stdout, stderr = (s.decode(errors="replace") if isinstance(s, bytes) else s for s in (stdout, stderr))
    answers = [json.loads(line[len(PROBE_MARK):]) for line in stdout.splitlines() if line.startswith(PROBE_MARK)]
    if len(answers) < len(devices):
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        answers += [f"probing {name} crashed the child process ({failure}): {tail}"] * (len(devices) - len(answers))
    return answers


def _kernel_row(entry: registry.Entry, checks: dict, probe: bool) -> dict:
    spec = entry.spec
    build = spec.build if spec and isinstance(spec.build, dict) else None  # the gating rules report a bad record
    devices = list(checks.values())
    reasons = (_probe_reasons(entry.name, devices) if probe
               else [registry.unavailable_reason(entry.name, d) for d in devices])
    states = {key: {"available": reason is None, "reason": reason,
                    "note": registry.note(entry.name, device) if reason is None else None}
              for (key, device), reason in zip(checks.items(), reasons)}
    return {
        "kernel": entry.name, "distribution": entry.distribution, "distribution_version": entry.version,
        "namespace": spec.namespace if spec else None,
        "archs_listed": list(spec.archs) if spec else None,
        "archs_built": registry.built_archs(spec) if build else None,
        "built_torch_version": build.get("torch") if build else None,
        "built_torch_cuda_version": build.get("torch_cuda") if build else None,
        "torch_support": registry.torch_support(spec),
        "language": spec.jit["language"] if spec and spec.jit else None,
        "checked_in_child": probe,
        "cuda": states.get("cuda"), "cpu": states["cpu"],
    }


def report(device=None, arch=None, probe: bool = False) -> dict:
    """The JSON document (schema SCHEMA_VERSION); the text output is rendered from it. Never raises for a plugin."""
    cuda_target = None if device == "cpu" else _cuda_target(device, arch)
    checks = {"cpu": "cpu"} if cuda_target is None else {"cuda": arch or device, "cpu": "cpu"}
    failure = registry.discovery_failure()
    kernels = [] if failure else [_kernel_row(entry, checks, probe) for entry in registry.entries()]
    return {"schema_version": SCHEMA_VERSION, "environment": environment(), "cuda_target": cuda_target,
            "probed": probe, "discovery_failure": failure, "kernels": kernels}


# ---------------------------------------------------------------- text

def _wrap(text: str, width: int, indent: str = "", hanging: str = "    ") -> list[str]:
    return textwrap.wrap(text, max(width, 20), initial_indent=indent, subsequent_indent=indent + hanging,
                         break_on_hyphens=False) or [indent]


def _environment_lines(env: dict, width: int) -> list[str]:
    torch_cuda = f"CUDA {env['torch_cuda_version']}" if env["torch_cuda_version"] else "CPU-only"
    facts = [
        ("prime-kernels", f"{env['core_version']}; Python {env['python_version']}; "
                          f"torch {env['torch_version']} ({torch_cuda})"),
        ("driver", env["driver_version"] or env["driver_reason"]),
        ("nvcc", f"{env['nvcc_version']} (CUDA_HOME {env['cuda_home']}, as plugin builds use it)"
                 if env["nvcc_version"] else env["nvcc_reason"]),
    ]
    facts += [(f"GPU {g['index']}", f"{g['name']}, {g['arch']} (capability {g['capability']}), {g['memory_gib']} GiB")
              for g in env["gpus"]] or [("GPU", f"none: {env['gpu_reason']}")]
    label_width = max(len(label) for label, _ in facts) + 2
    return [line for label, text in facts
            for line in _wrap(label.ljust(label_width) + text, width, hanging=" " * label_width)]


def _cuda_label(target: dict) -> str:
    if target["what_if"]:
        return f"{target['arch']} what-if"
    return f"{target['device']} ({target['arch'] or 'none'})"


def _fit(natural: list[int], words: list[int], fixed: list[bool], width: int) -> list[int]:
    """Column widths: the natural ones, the widest column narrowed one character at a time (once a cell wraps, the
    narrower lines cost nothing more) until a row fits ``width``: down to each column's longest word, then, if that is
    still too wide, to 8 characters, breaking words. State columns never wrap."""
    widths = list(natural)
    for floors in (words, [8] * len(widths)):
        while sum(widths) + len(GAP) * (len(widths) - 1) > width:
            room = [(w, i) for i, (w, floor) in enumerate(zip(widths, floors)) if not fixed[i] and w > floor]
            if not room:
                break
            widths[max(room)[1]] -= 1
    return widths


def _table_row(cells: list[str], widths: list[int]) -> list[str]:
    wrapped = [textwrap.wrap(c, w, break_on_hyphens=True) or [""] for c, w in zip(cells, widths)]
    height = max(map(len, wrapped))
    return [GAP.join((col[i] if i < len(col) else "").ljust(w) for col, w in zip(wrapped, widths)).rstrip()
            for i in range(height)]


def _shared_reason(kernels: list[dict], key: str) -> str | None:
    """The reason every row gives for ``key``, when there are several rows and they all give the same one."""
    reasons = {(k[key] or {}).get("reason") for k in kernels}
    return next(iter(reasons)) if len(kernels) > 1 and len(reasons) == 1 else None


def _table_lines(doc: dict, width: int) -> list[str]:
    kernels = doc["kernels"]
    keys = ["cuda", "cpu"] if doc["cuda_target"] else ["cpu"]
    labels = {"cuda": _cuda_label(doc["cuda_target"]) if doc["cuda_target"] else None, "cpu": "cpu"}
    shared = {key: _shared_reason(kernels, key) for key in keys}
    header = ["kernel", "plugin", "archs built", *(labels[k] for k in keys)]
    body = []
    for k in kernels:
        archs = "-" if k["archs_built"] is None else ", ".join(k["archs_built"]) or "none"
        states = ["available" if k[key]["available"] else "unavailable" for key in keys]
        plugin = f"{k['distribution']} {k['distribution_version']}" + (f" ({k['torch_support']})" if k["torch_support"] else "")
        body.append(([k["kernel"], plugin, archs, *states], k))
    columns = list(zip(header, *(cells for cells, _ in body)))
    natural = [max(map(len, column)) for column in columns]
    words = [max(len(word) for cell in column for word in cell.split() or [""]) for column in columns]
    widths = _fit(natural, words, [False, False, False] + [True] * len(keys), width)
    lines = _table_row(header, widths)
    for cells, k in body:
        lines += _table_row(cells, widths)
        for key in keys:
            if k[key]["reason"] and not shared[key]:
                lines += _wrap(f"{labels[key]}: {k[key]['reason']}", width, indent="  ")
            if k[key]["note"]:
                lines += _wrap(f"{labels[key]}: {k[key]['note']}", width, indent="  ")
    for key in keys:
        if shared[key]:
            lines += _wrap(f"every kernel is unavailable on {labels[key]}: {shared[key]}", width)
    if doc["probed"]:
        crashed = [k["kernel"] for k in kernels
                   if any("crashed the child process" in (k[key]["reason"] or "") for key in keys)]
        lines += _wrap(f"Each row was checked in a child process of its own (--probe): "
                       f"{', '.join(k['kernel'] for k in kernels)}; the child crashed for "
                       f"{', '.join(crashed) or 'none'}.", width)
    return lines


def format_report(doc: dict, width: int) -> str:
    lines = _environment_lines(doc["environment"], width) + [""]
    if doc["discovery_failure"]:
        lines += _wrap(doc["discovery_failure"], width)
    elif not doc["kernels"]:
        lines += _wrap(NO_PLUGINS_HINT, width)
    else:
        lines += _table_lines(doc, width)
    return "\n".join(lines)


# ---------------------------------------------------------------- main

@contextlib.contextmanager
def _stdout_to_stderr():
    """What plugins print while they are imported and checked (from Python or from C) goes to stderr, so stdout holds
    the report alone and ``--json`` stays one JSON document."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        ctypes.CDLL(None).fflush(None)  # C stdio's buffer, written while fd 1 was stderr, goes there too
        os.dup2(saved, 1)
        os.close(saved)


def _missing(doc: dict, names: list[str]) -> dict[str, str]:
    """{required name: why it cannot run on the first column's target} for each required kernel that cannot."""
    key = "cuda" if doc["cuda_target"] else "cpu"
    missing = {}
    for name in names:
        row = next((k for k in doc["kernels"] if k["kernel"] == name), None)
        if row is None:
            missing[name] = doc["discovery_failure"] or registry.unknown_kernel_reason(name)
        elif not row[key]["available"]:
            missing[name] = row[key]["reason"]
    return missing


def _write_report(text: str) -> str | None:
    """Print the report; None, or why stdout took it not (a full device, a closed pipe). A character the output's
    encoding lacks (PYTHONIOENCODING=ascii, a reason naming a non-ASCII path) is escaped, not a traceback."""
    try:
        sys.stdout.reconfigure(errors="backslashreplace")
    except (AttributeError, ValueError):  # a replaced stdout without reconfigure: write as it can
        pass
    try:
        print(text)
        sys.stdout.flush()
        return None
    except OSError as exc:
        # What stays buffered would fail again at exit ("Exception ignored ..."): send it to the null device.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return f"prime-kernels: error: the report could not be written to stdout: {exc.strerror or exc}"


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    with _stdout_to_stderr():
        doc = report(args.device, args.arch, args.probe)
    width = shutil.get_terminal_size((80, 24)).columns
    unwritten = _write_report(json.dumps(doc, indent=2) if args.json else format_report(doc, width))
    if unwritten:
        print(unwritten, file=sys.stderr)
        return UNWRITTEN_EXIT
    target = doc["cuda_target"]
    where = "cpu" if target is None else _cuda_label(target)
    missing = _missing(doc, args.require)
    for name, reason in missing.items():
        print(f"prime-kernels: required kernel {name} is unavailable on {where}: {reason}", file=sys.stderr)
    return 1 if missing else 0

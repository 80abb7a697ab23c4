"""``python -m prime_kernels`` / ``prime-kernels``: the status table, as text or JSON, and launch-time requirements."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from . import registry

COLUMNS = ("kernel", "distribution", "namespace", "archs built", "torch built/running", "state", "reason")
UNAVAILABLE = "unavailable"
# The child gets the device as --device spelled it (none: the current device) and parses it the same way.
PROBE_SCRIPT = (
    "import json, sys; from prime_kernels_core import cli, registry; "
    "device = cli._device_arg(sys.argv[2]) if sys.argv[2:] else None; "
    "print(json.dumps(registry.unavailable_reason(sys.argv[1], device)))"
)


def _device_arg(value: str):
    return int(value) if value.isdigit() else value


def _probe_reason(name: str, device) -> str | None:
    """The reason computed in a child process, so a crash while loading a shared library becomes a row."""
    device_args = [] if device is None else [str(device)]
    done = subprocess.run([sys.executable, "-c", PROBE_SCRIPT, name, *device_args], capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"probing {name} crashed the child process (exit code {done.returncode}): {tail}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def rows(device=None, probe: bool = False) -> list[dict]:
    import torch

    failure = registry.discovery_failure()
    if failure:
        return [dict(dict.fromkeys(COLUMNS, ""), kernel=registry.DISCOVERY_KEY, state=UNAVAILABLE, reason=failure)]
    out = []
    for entry in registry.entries():
        reason = _probe_reason(entry.name, device) if probe else registry.unavailable_reason(entry.name, device)
        spec = entry.spec
        build = spec.build if spec is not None and isinstance(spec.build, dict) else {}
        out.append({
            "kernel": entry.name,
            "distribution": f"{entry.distribution} {entry.version}",
            "namespace": spec.namespace if spec else "",
            "archs built": (",".join(registry.built_archs(spec)) or "none") if spec and build else "",
            "torch built/running": f"{build.get('torch', '?')} / {torch.__version__}",
            "state": registry.AVAILABLE if reason is None else UNAVAILABLE,
            "reason": reason or "",
        })
    return out


def format_table(table: list[dict]) -> str:
    if not table:
        return (
            "No prime-kernels plugins are installed. Install one (e.g. pip install --no-build-isolation "
            "plugins/fused_logp) and run again."
        )
    widths = {c: max(len(c), *(len(r[c]) for r in table)) for c in COLUMNS[:-1]}
    line = lambda r: "  ".join(r[c].ljust(widths[c]) for c in COLUMNS[:-1]) + "  " + r["reason"]
    return "\n".join([line(dict(zip(COLUMNS, COLUMNS))), *map(line, table)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="prime-kernels", description=__doc__)
    parser.add_argument("command", nargs="?", default="status", choices=["status"])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--device", type=_device_arg, default=None, help="CUDA index, cuda:N or cpu (default: current)")
    parser.add_argument("--require", nargs="+", metavar="NAME", default=[], help="exit 1 unless these are available")
    parser.add_argument("--probe", action="store_true", help="check each kernel in a child process")
    args = parser.parse_args(argv)

    table = rows(args.device, args.probe)
    print(json.dumps(table, indent=2) if args.json else format_table(table))
    reasons = {r["kernel"]: r["reason"] for r in table}  # "" when available
    missing = {n: reasons.get(n, "not installed") for n in args.require if reasons.get(n) != ""}
    for name, reason in missing.items():
        print(f"prime-kernels: required kernel {name} is unavailable: {reason}", file=sys.stderr)
    return 1 if missing else 0

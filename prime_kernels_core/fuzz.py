"""Fuzz sweeps for plugin tests (the conformance kit's bad-input half): every public function and raw op of a plugin,
each argument in turn replaced by a bad or edge value (non-tensors, other dtypes, shapes one off, empty,
non-contiguous, meta, NaN; numbers of other kinds and out of range). Each case must give a clean result or a
TypeError / ValueError / RuntimeError whose message names the argument that was replaced (for a changed shape, an
argument of the call will do: SHAPE_MUTATIONS); a crash, any other exception, or a result for a tensor on another
device than the others' fails. A clean result of a target that has a
reference must also be right: the same outputs (shape, dtype, NaN and infinity where the reference has them), each
floating one within the ratio rule (prime_kernels_core.testing.assert_error_ratio) of the reference run on the same
inputs in float64, against the reference run on the inputs as given as the PyTorch path; integer outputs equal. The
cases run in child processes (``python -m prime_kernels_core.fuzz TEST_FILE``), many per process; a process that dies
is restarted after the case that killed it, which is reported.

A plugin's test file defines ``cpu_targets() -> {name: (callable, valid keyword arguments)}`` (small CPU problems, the
same in every process), optionally ``references() -> {name: (reference callable taking the same keyword arguments,
max_ratio)}``, and asserts ``not sweep(__file__, device)``.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

FUZZ_DEVICE = "PRIME_KERNELS_FUZZ_DEVICE"  # the child's device, set by run_in_children
ACCEPTED = ("TypeError", "ValueError", "RuntimeError", "UnsupportedShapeError")
# What torch's dispatcher says when a raw op's only tensor argument is None: no kernel of ours runs, none can name it.
NO_TENSOR_ARGUMENTS = "There were no tensor arguments to this function"
ABORT = "abort"  # a case the child answers by aborting, as a crashing kernel would
# Mutations that change a tensor's shape: the shapes of a call are checked against each other, and the message may
# rightly name the argument on the other side ("topk_weights must have shape (M, top_k) = (0, 2)" for an empty x).
# Any other mutation (a type, a dtype, a value) is the replaced argument's own mistake, which its message must name.
SHAPE_MUTATIONS = {"empty", "extra dim", "one dim fewer", "last dim short", "first dim short", "transposed", "0-d"}


@functools.cache
def _test_module(target_file: str):
    spec = importlib.util.spec_from_file_location("_fuzz_targets", target_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def references(target_file: str) -> dict:
    """The test file's references() (name -> (reference, max_ratio)), or none."""
    module = _test_module(target_file)
    return module.references() if hasattr(module, "references") else {}


@functools.cache
def targets(target_file: str, device: str) -> dict:
    """The test file's cpu_targets() with every tensor (and every tensor a function makes) on ``device``."""
    import torch

    module = _test_module(target_file)

    def moved(v):
        if isinstance(v, torch.Tensor):
            return v.to(device)
        return (lambda: v().to(device)) if callable(v) else v

    return {name: (fn, {k: moved(v) for k, v in kwargs.items()}) for name, (fn, kwargs) in module.cpu_targets().items()}


def mutations(value) -> list:
    """(label, replacement) for one valid argument value; a replacement may be a function of nothing (made fresh)."""
    import numpy as np
    import torch

    if callable(value) and not isinstance(value, torch.Tensor):
        value = value()
    if isinstance(value, torch.Tensor):
        t = value
        found = [("None", None), ("list", t.reshape(-1)[:4].float().tolist()), ("numpy", np.zeros(tuple(t.shape))),
                 ("str", "tensor"), ("int", 3), ("0-d", torch.tensor(1.0)), ("meta", t.to("meta")),
                 *([("cpu", t.cpu())] if t.is_cuda else []),
                 ("empty", t[:0]), ("extra dim", t[None]), ("noncontiguous", t.repeat_interleave(2, -1)[..., ::2])]
        if t.dim() >= 1:
            found += [("one dim fewer", t.select(-1, 0)), ("last dim short", t[..., : max(t.shape[-1] - 1, 0)]),
                      ("first dim short", t[: max(t.shape[0] - 1, 0)])]
        if t.dim() >= 2:
            found.append(("transposed", t.transpose(0, 1)))
        for dtype in (torch.float64, torch.float32, torch.int64, torch.bool, torch.uint8):
            if dtype != t.dtype:
                found.append((f"as {dtype}", t.to(dtype)))
        if t.is_floating_point() and t.element_size() > 1:
            found.append(("nan", torch.full_like(t, math.nan)))
        if not t.is_floating_point() and t.dtype != torch.bool:
            found += [("int max", torch.full_like(t, torch.iinfo(t.dtype).max)), ("-2", torch.full_like(t, -2))]
        return found
    if isinstance(value, bool):
        return [("None", None), ("str", "yes"), ("int 2", 2)]
    if isinstance(value, int) or value is None:
        return [("-1", -1), ("0", 0), ("2**31", 2**31), ("2**63", 2**63), ("2**64", 2**64), ("1.5", 1.5),
                ("str", "1"), ("None", None), ("True", True)]
    if isinstance(value, float):
        return [("nan", math.nan), ("inf", math.inf), ("-1", -1.0), ("0", 0.0), ("str", "1"), ("None", None)]
    if isinstance(value, torch.dtype):
        return [("int64", torch.int64), ("str", "float32"), ("None", None)]
    return [("None", None), ("str", "x")]


def all_cases(target_file: str, device: str = "cpu") -> list[str]:
    """"name|argument|mutation index" for every argument of every target and each of its mutations."""
    return [f"{name}|{param}|{i}" for name, (_, kwargs) in targets(target_file, device).items()
            for param, value in kwargs.items() for i in range(len(mutations(value)))]


def _outputs(result) -> list:
    """A result's outputs in order, nested tuples and lists flattened."""
    if isinstance(result, (tuple, list)):
        return [item for part in result for item in _outputs(part)]
    return [result]


def _in_float64(value):
    import torch

    return value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def _wrong_output(label: str, actual, baseline, truth, max_ratio: float) -> str | None:
    """Why ``actual`` is not the reference's output (None when it is)."""
    import contextlib
    import io

    import torch

    from .testing import assert_error_ratio

    if not isinstance(truth, torch.Tensor):
        return None if actual == truth else f"{label} is {actual!r}, the reference's {truth!r}"
    if not isinstance(actual, torch.Tensor):
        return f"{label} is {type(actual).__name__}, the reference's a tensor"
    if actual.shape != truth.shape or actual.dtype != baseline.dtype:
        return (f"{label} is {actual.dtype} of shape {tuple(actual.shape)}, the reference's {baseline.dtype} of shape "
                f"{tuple(truth.shape)}")
    actual, baseline, truth = (t.detach().cpu() for t in (actual, baseline, truth))
    if not truth.is_floating_point():
        return None if torch.equal(actual, truth.to(actual.dtype)) else f"{label} differs from the reference's"
    for special in ("isnan", "isposinf", "isneginf"):
        if not torch.equal(getattr(actual, special)(), getattr(truth, special)()):
            return f"{label}'s {special}() differs from the reference's (NaN and infinities belong where it has them)"
    finite = truth.isfinite()
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            assert_error_ratio(label, actual[finite], baseline[finite], truth[finite], max_ratio)
        except AssertionError as exc:
            return str(exc)
    return None


def _wrong_result(result, reference, kwargs: dict, max_ratio: float) -> str | None:
    """Why a clean result differs from what ``reference`` returns on the same inputs (None: the same, or the
    reference itself refuses them, so only the error rules judge the case)."""
    try:
        baseline = _outputs(reference(**kwargs))
        truth = _outputs(reference(**{k: _in_float64(v) for k, v in kwargs.items()}))
    except Exception:  # noqa: BLE001  (inputs the reference cannot take: nothing to compare with)
        return None
    actual = _outputs(result)
    if len(actual) != len(truth):
        return f"returned {len(actual)} outputs, the reference {len(truth)}"
    for i, (a, b, t) in enumerate(zip(actual, baseline, truth)):
        why = _wrong_output(f"output {i}", a, b, t, max_ratio)
        if why:
            return f"returned a wrong value: {why}"
    return None


def run_case(target_file: str, case: str, device: str) -> dict:
    import torch

    name, param, index = case.split("|")
    fn, kwargs = targets(target_file, device)[name]
    label, bad = mutations(kwargs[param])[int(index)]
    kwargs = {k: (v() if callable(v) and not isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    kwargs[param] = bad
    record = {"case": case, "label": label, "names": list(kwargs), "replaced": param}
    try:
        result = fn(**kwargs)
    except Exception as e:  # noqa: BLE001  (every exception is judged by the parent)
        record.update(outcome="raise", type=type(e).__name__, message=str(e).split("\n")[0][:400])
        return record
    moved_away = isinstance(bad, torch.Tensor) and label in ("meta", "cpu") and any(
        isinstance(v, torch.Tensor) and v.device != bad.device for k, v in kwargs.items() if k != param)
    reference, max_ratio = references(target_file).get(name, (None, None))
    wrong = None if reference is None or moved_away or label == "meta" else _wrong_result(
        result, reference, kwargs, max_ratio)
    record.update(outcome="ok", mixed_devices=moved_away, wrong=wrong)
    return record


def run_in_children(target_file: str, cases: list[str], workers: int = 2, device: str = "cpu") -> list[dict]:
    """Runs ``cases`` on ``device`` in fresh processes, split among ``workers`` at once (CI has two cores); a case
    whose process died is recorded as a crash and the rest of its share goes to a new process."""
    records, shares = [], [cases[i::workers] for i in range(workers)]
    env = {**os.environ, FUZZ_DEVICE: device}
    while shares:
        procs = [(share, subprocess.Popen([sys.executable, "-m", __name__, target_file], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env)) for share in shares]
        shares = []
        for share, proc in procs:
            out, err = proc.communicate("\n".join(share), timeout=600)
            done = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            records += done
            if len(done) < len(share):
                records.append({"case": share[len(done)], "outcome": "crash", "returncode": proc.returncode,
                                "stderr": err[-400:]})
                if share[len(done) + 1:]:
                    shares.append(share[len(done) + 1:])
    return records


def verdict(record: dict) -> str | None:
    """None when the case behaved; else why not."""
    if record["outcome"] == "crash":
        return f"the process died (exit {record['returncode']}): {record['stderr']}"
    if record["outcome"] == "ok":
        if record["mixed_devices"]:
            return ("returned without error for a tensor on another device than the others (meta: the fake's "
                    "uninitialised memory)")
        return record["wrong"]
    if record["type"] == "NotImplementedError" and record["message"].startswith(NO_TENSOR_ARGUMENTS):
        return None  # torch's dispatcher, before any kernel: a raw op's only tensor given as None
    if record["type"] not in ACCEPTED:
        return f"{record['type']}: {record['message']}"
    names = lambda name: re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", record["message"])
    replaced = record["replaced"]
    if names(replaced) or (record["label"] in SHAPE_MUTATIONS and any(map(names, record["names"]))):
        return None
    if record["label"] in SHAPE_MUTATIONS:
        return f"the message names no argument: {record['type']}: {record['message']}"
    return f"the message does not name {replaced}, the argument replaced: {record['type']}: {record['message']}"


def sweep(target_file: str, device: str = "cpu", workers: int = 2) -> list[str]:
    """Every case of ``target_file``'s targets on ``device``, in child processes: the failures, one sentence each."""
    cases = all_cases(target_file, device)
    records = run_in_children(target_file, cases, workers=workers, device=device)
    failures = [f"{r['case']} ({r.get('label', '?')}): {why}" for r in records if (why := verdict(r)) is not None]
    if len(records) != len(cases):
        failures.append(f"{len(cases)} cases ran but {len(records)} records came back")
    print(f"{len(cases)} cases, {sum(r['outcome'] == 'ok' for r in records)} clean results, {len(failures)} failures")
    return failures


if __name__ == "__main__":  # the child: one JSON line per case of stdin, flushed before the next case starts
    import warnings

    warnings.filterwarnings("ignore")
    for line in sys.stdin.read().split("\n"):
        if line == ABORT:
            os.abort()
        if line:
            print(json.dumps(run_case(sys.argv[1], line, os.environ.get(FUZZ_DEVICE, "cpu"))), flush=True)

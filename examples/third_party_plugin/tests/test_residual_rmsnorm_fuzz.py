"""Fuzz-style sweep (issue 22): residual_rmsnorm's public functions and raw op, each argument in turn replaced by a
bad or edge value (non-tensors, other dtypes, shapes one off, empty, non-contiguous, meta, NaN; numbers of other kinds
and out of range). Each case must give a clean result or a TypeError / ValueError / RuntimeError whose message names
an argument of the call; a crash, any other exception, or a result computed from a meta tensor mixed with CPU ones
fails. The cases run in child processes (this file is the child's script), many per process; a process that dies is
restarted after the case that killed it, which is reported."""
from __future__ import annotations

import functools
import json
import math
import re
import subprocess
import sys

import pytest

KERNEL = "residual_rmsnorm"
ACCEPTED = ("TypeError", "ValueError", "RuntimeError", "UnsupportedShapeError")
# What torch's dispatcher says when a raw op's only tensor argument is None: no kernel of ours runs, none can name it.
NO_TENSOR_ARGUMENTS = "There were no tensor arguments to this function"


@functools.cache
def targets() -> dict:
    """name -> (callable, valid keyword arguments): small CPU problems, the same in every process."""
    import torch

    from pk_example_rmsnorm import ops

    g = torch.Generator().manual_seed(0)
    x, residual, weight = (torch.randn(*shape, generator=g) for shape in ((3, 8), (3, 8), (8,)))
    return {
        "residual_rmsnorm": (ops.residual_rmsnorm, dict(x=x, residual=residual, weight=weight, eps=1e-6)),
        "pk_example::residual_rmsnorm": (torch.ops.pk_example.residual_rmsnorm,
                                         dict(x=x, residual=residual, weight=weight, eps=1e-6)),
        "unsupported_shape_reason": (ops.unsupported_shape_reason, dict(hidden_size=8)),
    }


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


def all_cases() -> list[str]:
    return [f"{name}|{param}|{i}" for name, (_, kwargs) in targets().items() for param, value in kwargs.items()
            for i in range(len(mutations(value)))]


def run_case(case: str) -> dict:
    import torch

    name, param, index = case.split("|")
    fn, kwargs = targets()[name]
    label, bad = mutations(kwargs[param])[int(index)]
    kwargs = {k: (v() if callable(v) and not isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    kwargs[param] = bad
    record = {"case": case, "label": label, "names": list(kwargs)}
    try:
        result = fn(**kwargs)
    except Exception as e:  # noqa: BLE001  (every exception is judged by the parent)
        record.update(outcome="raise", type=type(e).__name__, message=str(e).split("\n")[0][:400])
        return record
    outputs = result if isinstance(result, (tuple, list)) else [result]
    others_real = any(isinstance(v, torch.Tensor) and v.device.type != "meta" for k, v in kwargs.items() if k != param)
    record.update(outcome="ok", meta_result=label == "meta" and others_real and any(
        isinstance(o, torch.Tensor) and o.device.type == "meta" for o in outputs))
    return record


def run_in_children(cases: list[str], workers: int = 2) -> list[dict]:
    """Runs ``cases`` in fresh processes, split among ``workers`` at once (CI has two cores); a case whose process
    died is recorded as a crash and the rest of its share goes to a new process."""
    records, shares = [], [cases[i::workers] for i in range(workers)]
    while shares:
        procs = [(share, subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True)) for share in shares]
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
        return "returned a result computed from a meta tensor mixed with CPU tensors" if record["meta_result"] else None
    if record["type"] == "NotImplementedError" and record["message"].startswith(NO_TENSOR_ARGUMENTS):
        return None  # torch's dispatcher, before any kernel: a raw op's only tensor given as None
    if record["type"] not in ACCEPTED:
        return f"{record['type']}: {record['message']}"
    named = [n for n in record["names"] if re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])",
                                                    record["message"])]
    return None if named else f"the message names no argument: {record['type']}: {record['message']}"


@pytest.mark.kernel(KERNEL, device="cpu")
def test_every_bad_input_gets_a_clean_result_or_an_error_naming_the_argument():
    cases = all_cases()
    records = run_in_children(cases)
    assert len(records) == len(cases)
    failures = [f"{r['case']} ({r.get('label', '?')}): {why}" for r in records if (why := verdict(r)) is not None]
    print(f"{len(cases)} cases, {sum(r['outcome'] == 'ok' for r in records)} clean results, "
          f"{len(failures)} failures")
    assert not failures, "\n".join(failures)


if __name__ == "__main__":  # the child: one JSON line per case of stdin, flushed before the next case starts
    import warnings

    warnings.filterwarnings("ignore")
    for line in sys.stdin.read().split("\n"):
        if line:
            print(json.dumps(run_case(line)), flush=True)

"""Fuzz-style sweep (issue 22): every public function and raw op of flash_moe, each argument in turn replaced by a bad
or edge value (non-tensors, other dtypes, shapes one off, empty, non-contiguous, meta, NaN; ints at and past int32
and int64, negative, of other types). Each case must give a clean result or a TypeError / ValueError / RuntimeError
whose message names an argument of the call; a crash, any other exception, or a result for a tensor on another device
than the others' (meta, or CPU among CUDA tensors) fails. The cases run in child processes (this file is the child's script), many per process; a
process that dies is restarted after the case that killed it, which is reported."""
from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys

import pytest

KERNEL = "flash_moe"
FUZZ_DEVICE = "PRIME_KERNELS_FUZZ_DEVICE"  # the child's device, set by run_in_children
ACCEPTED = ("TypeError", "ValueError", "RuntimeError", "UnsupportedShapeError")
# What torch's dispatcher says when a raw op's only tensor argument is None: no kernel of ours runs, none can name it.
NO_TENSOR_ARGUMENTS = "There were no tensor arguments to this function"
M, DIM, HIDDEN, E, TOP_K = 8, 128, 128, 4, 2


def cpu_targets() -> dict:
    """name -> (callable, valid keyword arguments): small CPU problems, the same in every process."""
    import torch

    from prime_kernels_flash_moe import ops

    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, DIM, generator=g).to(torch.bfloat16)
    w1, w3 = ((torch.randn(E, HIDDEN, DIM, generator=g) / DIM**0.5).to(torch.bfloat16) for _ in range(2))
    w2 = (torch.randn(E, DIM, HIDDEN, generator=g) / HIDDEN**0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(M)]).to(torch.int32)
    tw = torch.rand(M, TOP_K, generator=g)
    s, e, n = ops.moe_align(ids, E)
    w = torch.cat([w1, w3], 1)
    xq, xs = ops.quantize_mxfp8(x, exponent_block=ops.MXFP8_ALIGN)
    wq, ws = ops.quantize_mxfp8(w, exponent_block=ops.MXFP8_ALIGN)
    w2q, w2s = ops.quantize_mxfp8(w2, exponent_block=ops.MXFP8_ALIGN)
    wsp, w2sp = ops.pack_scales_blocked(ws), ops.pack_scales_blocked(w2s)
    align = dict(sorted_token_ids=s, expert_ids=e, num_tokens_post_padded=n)
    gate_up = torch.ops.flash_moe.moe_gate_up(x, w1, w3, s, e, n, TOP_K, ops.BLOCK_M)
    f = torch.ops.flash_moe
    mx = dict(x=xq, x_scales=xs, w=wq, w_scales=wsp, w2=w2q, w2_scales=w2sp)
    out = lambda: torch.empty(M, DIM, dtype=torch.bfloat16)  # noqa: E731  (fresh per call: the ops write it)
    swiglu = dict(gate_up=gate_up, grad_h=torch.randn(M * TOP_K, HIDDEN).to(torch.bfloat16),
                  row_weights=tw.reshape(-1), valid=torch.ones(M * TOP_K, dtype=torch.bool))
    return {
        "moe": (ops.moe, dict(x=x, w1=w1, w2=w2, w3=w3, topk_ids=ids, topk_weights=tw, expert_start=0,
                              deterministic=False, num_experts=None, mxfp8=False, recompute_gate_up=True)),
        "moe(mxfp8)": (ops.moe, dict(x=x, w1=w1, w2=w2, w3=w3, topk_ids=ids, topk_weights=tw, mxfp8=True)),
        "moe_align": (ops.moe_align, dict(topk_ids=ids, num_experts=E, block_m=ops.BLOCK_M, bpc=1, expert_start=0,
                                          num_local_experts=None, block_align=1)),
        "fused_moe_bf16": (ops.fused_moe_bf16, dict(x=x, w=w, w2=w2, **align, topk_weights=tw, out=out, top_k=TOP_K,
                                                    block_m=ops.BLOCK_M)),
        "fused_moe_mxfp8": (ops.fused_moe_mxfp8, dict(**mx, **align, topk_weights=tw, out=out, top_k=TOP_K,
                                                      block_m=ops.BLOCK_M)),
        "quantize_mxfp8": (ops.quantize_mxfp8, dict(t=x, block=ops.MXFP8_SCALE_BLOCK, exponent_block=None)),
        "dequantize_mxfp8": (ops.dequantize_mxfp8, dict(data=xq, scales=xs, block=ops.MXFP8_SCALE_BLOCK,
                                                        dtype=torch.float32)),
        "share_exponents_mxfp8": (ops.share_exponents_mxfp8, dict(data=xq, scales=xs)),
        "pack_scales_blocked": (ops.pack_scales_blocked, dict(scales=ws)),
        "unpack_scales_blocked": (ops.unpack_scales_blocked, dict(packed=wsp)),
        "unsupported_shape_reason": (ops.unsupported_shape_reason, dict(dim=DIM, hidden_dim=HIDDEN, mxfp8=False)),
        "flash_moe::moe_align": (f.moe_align, dict(topk_ids=ids, num_experts=E, block_m=ops.BLOCK_M, bpc=1,
                                                   expert_start=0, num_local_experts=-1, block_align=1)),
        "flash_moe::fused_moe_bf16": (f.fused_moe_bf16, dict(x=x, w=w, w2=w2, **align, topk_weights=tw, out=out,
                                                             top_k=TOP_K, block_m=ops.BLOCK_M, block_n=64, warp_n=64,
                                                             stages=3, bpc=1, cpc=1, split=True)),
        "flash_moe::moe_forward": (f.moe_forward, dict(x=x, w1=w1, w3=w3, w2=w2, **align, topk_weights=tw,
                                                       top_k=TOP_K, block_m=ops.BLOCK_M, deterministic=False,
                                                       save_gate_up=True)),
        "flash_moe::moe_gate_up": (f.moe_gate_up, dict(x=x, w1=w1, w3=w3, **align, top_k=TOP_K, block_m=ops.BLOCK_M)),
        "flash_moe::swiglu_backward": (f.swiglu_backward, swiglu),
        "flash_moe::quantize_mxfp8": (f.quantize_mxfp8, dict(t=x, block=ops.MXFP8_SCALE_BLOCK)),
        "flash_moe::share_exponents_mxfp8": (f.share_exponents_mxfp8, dict(data=xq, scales=xs)),
        "flash_moe::fused_moe_mxfp8": (f.fused_moe_mxfp8, dict(**mx, **align, topk_weights=tw, out=out, top_k=TOP_K,
                                                               block_m=ops.BLOCK_M, block_n=64, warp_n=4, stages=4,
                                                               bpc=1, split=True)),
        "flash_moe::moe_forward_mxfp8": (f.moe_forward_mxfp8, dict(**mx, **align, topk_weights=tw, top_k=TOP_K,
                                                                   block_m=ops.BLOCK_M, deterministic=False)),
    }


@functools.cache
def targets(device: str) -> dict:
    """cpu_targets() with every tensor (and every tensor a function makes) on ``device``."""
    import torch

    def moved(v):
        if isinstance(v, torch.Tensor):
            return v.to(device)
        return (lambda: v().to(device)) if callable(v) else v

    return {name: (fn, {k: moved(v) for k, v in kwargs.items()}) for name, (fn, kwargs) in cpu_targets().items()}


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


def all_cases(device: str = "cpu") -> list[str]:
    return [f"{name}|{param}|{i}" for name, (_, kwargs) in targets(device).items() for param, value in kwargs.items()
            for i in range(len(mutations(value)))]


def run_case(case: str, device: str) -> dict:
    import torch

    name, param, index = case.split("|")
    fn, kwargs = targets(device)[name]
    label, bad = mutations(kwargs[param])[int(index)]
    kwargs = {k: (v() if callable(v) and not isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    kwargs[param] = bad
    record = {"case": case, "label": label, "names": list(kwargs)}
    try:
        result = fn(**kwargs)
    except Exception as e:  # noqa: BLE001  (every exception is judged by the parent)
        record.update(outcome="raise", type=type(e).__name__, message=str(e).split("\n")[0][:400])
        return record
    del result  # its values are the other tests' business; here only that it came back
    moved_away = isinstance(bad, torch.Tensor) and label in ("meta", "cpu") and any(
        isinstance(v, torch.Tensor) and v.device != bad.device for k, v in kwargs.items() if k != param)
    record.update(outcome="ok", mixed_devices=moved_away)
    return record


def run_in_children(cases: list[str], workers: int = 2, device: str = "cpu") -> list[dict]:
    """Runs ``cases`` on ``device`` in fresh processes, split among ``workers`` at once (CI has two cores); a case
    whose process died is recorded as a crash and the rest of its share goes to a new process."""
    records, shares = [], [cases[i::workers] for i in range(workers)]
    env = {**os.environ, FUZZ_DEVICE: device}
    while shares:
        procs = [(share, subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
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
        return ("returned without error for a tensor on another device than the others (meta: the fake's "
                "uninitialised memory)" if record["mixed_devices"] else None)
    if record["type"] == "NotImplementedError" and record["message"].startswith(NO_TENSOR_ARGUMENTS):
        return None  # torch's dispatcher, before any kernel: a raw op's only tensor given as None
    if record["type"] not in ACCEPTED:
        return f"{record['type']}: {record['message']}"
    named = [n for n in record["names"] if re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])",
                                                    record["message"])]
    return None if named else f"the message names no argument: {record['type']}: {record['message']}"


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.kernel(KERNEL, device="cpu")),
                                    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.kernel(KERNEL)])])
def test_every_bad_input_gets_a_clean_result_or_an_error_naming_the_argument(device):
    cases = all_cases(device)
    records = run_in_children(cases, device=device)
    assert len(records) == len(cases)
    failures = [f"{r['case']} ({r.get('label', '?')}): {why}" for r in records if (why := verdict(r)) is not None]
    print(f"{len(cases)} cases, {sum(r['outcome'] == 'ok' for r in records)} clean results, "
          f"{len(failures)} failures")
    assert not failures, "\n".join(failures)


@pytest.mark.kernel(KERNEL, device="cpu")
def test_a_case_that_kills_its_process_is_reported_and_the_rest_still_run():
    first, second = all_cases()[:2]
    records = run_in_children([first, ABORT, second], workers=1)
    assert [r["case"] for r in records] == [first, ABORT, second]
    assert records[1]["outcome"] == "crash" and verdict(records[1]).startswith("the process died")
    assert verdict(records[0]) is None and verdict(records[2]) is None


ABORT = "abort"  # a case the child answers by aborting, as a crashing kernel would

if __name__ == "__main__":  # the child: one JSON line per case of stdin, flushed before the next case starts
    import warnings

    warnings.filterwarnings("ignore")
    for line in sys.stdin.read().split("\n"):
        if line == ABORT:
            os.abort()
        if line:
            print(json.dumps(run_case(line, os.environ.get(FUZZ_DEVICE, "cpu"))), flush=True)

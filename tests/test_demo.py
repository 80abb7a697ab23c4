"""scripts/demo.py: its verdict is the conformance kit's ratio rule, and on the CPU it prints what a newcomer needs."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import prime_kernels

DEMO = Path(__file__).resolve().parents[1] / "scripts" / "demo.py"


def _demo_module():
    spec = importlib.util.spec_from_file_location("demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_verdict_is_the_ratio_rule(capsys):
    demo = _demo_module()
    g = torch.Generator().manual_seed(0)
    reference = torch.randn(4096, generator=g, dtype=torch.float64)
    noise = torch.randn(4096, generator=g, dtype=torch.float64) * 1e-2
    baseline = (reference + noise).float()
    assert demo.verdict("same error", (reference + noise).float(), baseline, reference)
    assert demo.verdict("within the limit", (reference + noise * (demo.MAX_RATIO - 0.1)).float(), baseline, reference)
    assert not demo.verdict("over the limit", (reference + noise * (demo.MAX_RATIO + 0.2)).float(), baseline,
                            reference)
    lines = capsys.readouterr().out.splitlines()
    assert [line.rsplit(": ", 1)[-1] for line in lines] == ["pass", "pass", "FAIL"]
    assert all(f"(limit {demo.MAX_RATIO})" in line for line in lines)


def _small_demo(monkeypatch, wrong_logp: bool):
    """The demo at a small shape, its "kernel" paths the PyTorch ones, with logp off by 1% when ``wrong_logp``."""
    demo = _demo_module()
    for device in ("cpu", "cuda"):
        monkeypatch.setitem(demo.SHAPES, device, (64, 32, 16, 4, 128))
        monkeypatch.setitem(demo.WARMUP_STEPS, device, 1)
        monkeypatch.setitem(demo.TIMED_STEPS, device, 1)

    def off_by_one_percent(hidden, lm_head, labels):
        logp, entropy = demo.logp_entropy_pytorch(hidden, lm_head, labels)
        return logp * 1.01, entropy

    def paths(device, use_kernels):
        if not use_kernels:
            return demo.moe_pytorch, demo.logp_entropy_pytorch, "PyTorch per-expert loop", "PyTorch log_softmax"
        logp = off_by_one_percent if wrong_logp else demo.logp_entropy_pytorch
        return demo.moe_pytorch, logp, "a stand-in MoE", "a stand-in logp"

    monkeypatch.setattr(demo, "paths", paths)
    return demo


def test_a_failing_output_fails_the_demo(monkeypatch, capsys):
    """A launch script running the demo sees a non-zero exit when an output fails its accuracy check (issue 61,
    item 3); the same run with correct outputs exits 0."""
    assert _small_demo(monkeypatch, wrong_logp=False).main() == 0
    assert ": FAIL" not in capsys.readouterr().out
    assert _small_demo(monkeypatch, wrong_logp=True).main() == 1
    captured = capsys.readouterr()
    judged = {line.split(":")[0].strip(): line.rsplit(": ", 1)[-1] for line in captured.out.splitlines()
              if line.endswith((": pass", ": FAIL"))}
    assert judged["logp"] == "FAIL" and judged["entropy"] == "pass", judged
    assert captured.err.startswith("demo: logp") and "failed the accuracy check" in captured.err, captured.err


@pytest.mark.skipif(not (prime_kernels.is_available("flash_moe", "cpu")
                         and prime_kernels.is_available("linear_logp", "cpu")),
                    reason="the demo's CPU run needs the flash_moe and fused_logp plugins installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU run (the GPU run is the H200's)")
def test_cpu_run_says_what_it_timed_and_judges_every_output():
    done = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "MoE via flash_moe; logp/entropy via linear_logp" in out
    assert out.count(": median ") == 2 and "5 steps after 1 warm-up" in out
    assert "reference C++" in out and "BENCHMARKS.md" in out
    judged = [line for line in out.splitlines() if line.endswith((": pass", ": FAIL"))]
    assert [line.split(":")[0].strip() for line in judged] == [
        "logp", "entropy", "grad router", "grad w1", "grad w3", "grad w2", "grad lm_head"]
    assert all(line.endswith(": pass") for line in judged), judged  # and the exit code above says the same
    assert "largest |delta logp| against float64" in out and "nats" in out

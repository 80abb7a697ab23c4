"""Demo: RL steps of a small, randomly initialised MoE block with an lm_head (forward, per-token logp and entropy, a
clipped policy-gradient loss, backward), with the prime-kernels kernels where they can run and the PyTorch paths
otherwise. Prints which path ran for each part, the step time of both (median and spread of several steps after
warm-up) and, for both, the error of every output against a float64 reference on the same inputs, judged by the
project's ratio rule (prime_kernels_core.testing.assert_error_ratio). Exits 1 when any output fails that rule."""
import contextlib
import io
import statistics
import sys
import time

import torch

import prime_kernels
from prime_kernels_core.testing import assert_error_ratio

TEMPERATURE, CLIP, ENTROPY_BONUS, TOP_K = 0.7, 0.2, 0.01, 2
# The ratio limit flash_moe's and linear_logp's own tests hold their outputs and gradients to (MAX_RATIO in
# plugins/flash_moe/tests/test_flash_moe.py and plugins/fused_logp/tests/test_linear_logp.py); every output of the
# step passes through flash_moe.
MAX_RATIO = 1.5
WARMUP_STEPS = {"cuda": 2, "cpu": 1}
TIMED_STEPS = {"cuda": 10, "cpu": 5}
# tokens, dim, hidden, experts, vocab: a Qwen3-like lm_head on the GPU; on the CPU small enough for 2 shared cores
# (the kernels' reference C++ took ~1 s a step at 256 tokens and vocab 4096).
SHAPES = {"cuda": (8192, 2048, 768, 16, 151936), "cpu": (128, 256, 128, 8, 2048)}


def make_model(device, dim, hidden, experts, vocab):
    g = torch.Generator(device="cpu").manual_seed(0)
    param = lambda *shape, scale: (torch.randn(*shape, generator=g) * scale).to(device, torch.bfloat16).requires_grad_()
    return {
        "router": param(dim, experts, scale=dim**-0.5),
        "w1": param(experts, hidden, dim, scale=dim**-0.5),
        "w3": param(experts, hidden, dim, scale=dim**-0.5),
        "w2": param(experts, dim, hidden, scale=hidden**-0.5),
        "lm_head": param(vocab, dim, scale=dim**-0.5),
    }


def accumulation_dtype(t):
    """float32 for 16-bit tensors (what the PyTorch paths accumulate in), float64 for the reference."""
    return torch.promote_types(t.dtype, torch.float32)


def moe_pytorch(x, w1, w2, w3, topk_ids, topk_weights):
    out = torch.zeros_like(x, dtype=accumulation_dtype(x))
    for e in range(w1.shape[0]):
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        if token.numel():
            h = torch.nn.functional.silu(x[token] @ w1[e].T) * (x[token] @ w3[e].T)
            out.index_add_(0, token, (h @ w2[e].T).to(out.dtype) * topk_weights[token, slot, None])
    return out.to(x.dtype)


def logp_entropy_pytorch(hidden, lm_head, labels):
    logprobs = torch.log_softmax((hidden @ lm_head.T).to(accumulation_dtype(hidden)) / TEMPERATURE, dim=-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, labels[:, None]).squeeze(-1), entropy


def paths(device, use_kernels):
    """(moe function, logp/entropy function, their names) for this device."""
    moe, moe_name = moe_pytorch, "PyTorch per-expert loop"
    logp, logp_name = logp_entropy_pytorch, "PyTorch log_softmax"
    if use_kernels and prime_kernels.is_available("flash_moe", device):
        moe, moe_name = prime_kernels.load("flash_moe", device).moe, "flash_moe"
    if use_kernels and prime_kernels.is_available("linear_logp", device):
        linear = prime_kernels.load("linear_logp", device).linear_logp_entropy
        logp, logp_name = (lambda h, w, y: linear(h, w, y, TEMPERATURE)), "linear_logp (fused lm_head)"
    elif use_kernels and prime_kernels.is_available("fused_logp", device):
        fused = prime_kernels.load("fused_logp", device).logp_entropy
        logp, logp_name = (lambda h, w, y: fused(h @ w.T, y, TEMPERATURE)), "fused_logp (on materialised logits)"
    return moe, logp, moe_name, logp_name


def rl_step(model, x, labels, old_logp, advantages, moe, logp_entropy, topk_ids=None):
    """One step; the routing is chosen here unless ``topk_ids`` is given (the reference takes the 16-bit paths'
    choice, so a near-tie picked differently in float64 cannot look like an error)."""
    router_probs = torch.softmax((x @ model["router"]).to(accumulation_dtype(x)), dim=-1)
    if topk_ids is None:
        topk_weights, topk_ids = router_probs.topk(TOP_K, dim=-1)
    else:
        topk_weights = router_probs.gather(1, topk_ids.long())
    hidden = x + moe(x, model["w1"], model["w2"], model["w3"], topk_ids.int(), topk_weights)
    logp, entropy = logp_entropy(hidden, model["lm_head"], labels)
    ratio = torch.exp(logp - old_logp)
    clipped = torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)
    loss = -clipped.mean() - ENTROPY_BONUS * entropy.mean()
    loss.backward()
    return {"loss": loss.detach(), "logp": logp.detach(), "entropy": entropy.detach(), "topk_ids": topk_ids}


def timed_steps(device, model, step, count):
    """Milliseconds of each of ``count`` steps (gradients cleared before each) and the last step's outputs."""
    times = []
    for _ in range(count):
        for p in model.values():
            p.grad = None
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times, out


def run(device, use_kernels, inputs, shape):
    model = make_model(device, *shape)
    moe, logp_entropy, moe_name, logp_name = paths(device, use_kernels)
    step = lambda: rl_step(model, *inputs, moe, logp_entropy)
    timed_steps(device, model, step, WARMUP_STEPS[device])
    times, out = timed_steps(device, model, step, TIMED_STEPS[device])
    return {"moe_path": moe_name, "logp_path": logp_name, "times": times, **out,
            "grads": {k: p.grad for k, p in model.items()}}


def reference(device, inputs, shape, topk_ids):
    """The PyTorch paths in float64 from the same bf16 parameters and inputs, with the same routing."""
    model = {k: p.detach().double().requires_grad_() for k, p in make_model(device, *shape).items()}
    x, labels, old_logp, advantages = inputs
    out = rl_step(model, x.double(), labels, old_logp.double(), advantages.double(), moe_pytorch,
                  logp_entropy_pytorch, topk_ids=topk_ids)
    return {**out, "grads": {k: p.grad for k, p in model.items()}}


def timing_line(name, times, warmup):
    return (f"  {name}: median {statistics.median(times):.1f} ms (min {min(times):.1f}, max {max(times):.1f}; "
            f"{len(times)} steps after {warmup} warm-up)")


def verdict(label, actual, baseline, ref) -> bool:
    """assert_error_ratio's own line for this output, with pass or FAIL after it."""
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        try:
            assert_error_ratio(label, actual, baseline, ref, MAX_RATIO)
            passed = True
        except AssertionError:
            passed = False
    print(f"  {printed.getvalue().strip()}: {'pass' if passed else 'FAIL'}")
    return passed


def main() -> int:
    """0 when every output passes (or no kernel can run here and only the PyTorch paths ran), 1 when one fails."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens, dim, hidden, experts, vocab = SHAPES[device]
    g = torch.Generator(device="cpu").manual_seed(1)
    x = (torch.randn(tokens, dim, generator=g)).to(device, torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    old_logp = (-torch.rand(tokens, generator=g) * 10).to(device)
    advantages = torch.randn(tokens, generator=g).to(device)
    print(f"\nDemo: RL steps, MoE block ({experts} experts, top-{TOP_K}, dim {dim}, hidden {hidden}) + lm_head "
          f"(vocab {vocab}), {tokens} tokens on {device}, T={TEMPERATURE}")

    inputs, shape = (x, labels, old_logp, advantages), (dim, hidden, experts, vocab)
    fast = run(device, True, inputs, shape)
    print(f"ran: MoE via {fast['moe_path']}; logp/entropy via {fast['logp_path']}")
    pytorch_names = paths(device, False)[2:]
    if (fast["moe_path"], fast["logp_path"]) == pytorch_names:
        print(timing_line("PyTorch paths", fast["times"], WARMUP_STEPS[device]))
        print("no prime-kernels kernel can run here; the PyTorch paths ran (see the status table for why)")
        return 0
    slow = run(device, False, inputs, shape)
    print("step time:")
    print(timing_line("prime-kernels paths", fast["times"], WARMUP_STEPS[device]))
    print(timing_line("PyTorch paths      ", slow["times"], WARMUP_STEPS[device]))
    if any(max(t) > 1.5 * min(t) for t in (fast["times"], slow["times"])):
        print("  (the slowest step took over 1.5x the fastest: other work shares this machine; compare the medians)")
    if device == "cpu":
        print("  On a CPU the kernels run their reference C++ implementations (written for testing, not speed): this\n"
              "  compares that C++ with PyTorch's CPU paths and says nothing about GPU speed. The kernels' measured\n"
              "  GPU figures are in BENCHMARKS.md (summary table at the top).")

    ref = reference(device, inputs, shape, fast["topk_ids"])
    print(f"accuracy against a float64 reference on the same inputs (pass: error at most {MAX_RATIO}x the PyTorch\n"
          "path's, as the kernels' own tests, or at the rounding floor of the output's dtype;\n"
          "prime_kernels_core.testing.assert_error_ratio):")
    results = {key: verdict(key, fast[key], slow[key], ref[key]) for key in ("logp", "entropy")}
    results |= {f"grad {k}": verdict(f"grad {k}", fast["grads"][k], slow["grads"][k], ref["grads"][k])
                for k in ref["grads"]}
    nats = lambda out: float((out["logp"].double() - ref["logp"]).abs().max())
    print(f"largest |delta logp| against float64: prime-kernels {nats(fast):.2e} nats, PyTorch {nats(slow):.2e} nats")
    print(f"{sum(results.values())} of {len(results)} outputs pass. The loss, one number whose per-token errors "
          f"partly cancel (not judged):\n  prime-kernels {float(fast['loss']):.6f}, PyTorch {float(slow['loss']):.6f}, "
          f"float64 {float(ref['loss']):.6f}")
    failed = [label for label, passed in results.items() if not passed]
    if failed:
        print(f"demo: {', '.join(failed)} failed the accuracy check (error over {MAX_RATIO}x the PyTorch path's); "
              f"MoE via {fast['moe_path']}, logp/entropy via {fast['logp_path']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""What every benchmark here needs: median timing, the two ceilings measured in the same run, peak extra memory."""
import gc

import torch


def do_bench(fn, grad_to_none=None, warmup=25, rep=100) -> float:
    """Median milliseconds by CUDA events (triton.testing.do_bench; warmup and rep are milliseconds)."""
    from triton.testing import do_bench as triton_do_bench

    return triton_do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def peak_extra(fn) -> int:
    """Bytes allocated at the peak of ``fn`` above what was allocated before it."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 2 GiB device-to-device copy."""
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a))
    del a, b
    return 2 * n / (ms * 1e-3)


CEILING_WARMUP_MS = 500


def matmul_ceiling() -> float:
    """bf16 FLOP/s of an 8192³ product on random data, after half a second of the same products (CEILING_WARMUP_MS):
    with 10 ms of warm-up, the first benchmark of a device call read 743 TFLOP/s and the next ones in that call 808-812."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=CEILING_WARMUP_MS, rep=200)
    return 2 * 8192**3 / (ms * 1e-3)

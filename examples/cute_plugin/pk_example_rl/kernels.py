"""The CuTe DSL code of ppo_loss: one thread per token, the loss and its slope (d loss / d logp) in one pass.

    ratio     = exp(logp - old_logp)                          (fp32)
    objective = min(ratio * A, clamp(ratio, low, high) * A)   (PPO's clipped surrogate)
    dual-clip: objective = dual_clip * A where A < 0 and that is larger (Ye et al. 2020: bounds the loss of a
               negative advantage at a large ratio)
    loss      = -objective
    slope     = -ratio * A where the unclipped term is the one taken, else 0

Imported by the build (which compiles ppo_loss_forward for each shipped specialization and arch) and by ops.py's CUDA
path; never by discovery.
"""
import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute


@cute.kernel
def ppo_loss_kernel(logp: cute.Tensor, old_logp: cute.Tensor, advantages: cute.Tensor, loss: cute.Tensor,
                    slope: cute.Tensor, low: cutlass.Float32, high: cutlass.Float32, dual_clip: cutlass.Float32,
                    THREADS: cutlass.Constexpr[int], DUAL_CLIP: cutlass.Constexpr[bool]):
    thread, _, _ = cute.arch.thread_idx()
    block, _, _ = cute.arch.block_idx()
    i = block * THREADS + thread
    if i < logp.shape[0]:
        advantage = advantages[i]
        ratio = cute.math.exp(logp[i].to(cutlass.Float32) - old_logp[i].to(cutlass.Float32))
        surrogate = ratio * advantage
        clipped = cutlass.min(cutlass.max(ratio, low), high) * advantage
        objective = cutlass.min(surrogate, clipped)
        gradient = cutlass.select_(surrogate <= clipped, surrogate, cutlass.Float32(0.0))
        if cutlass.const_expr(DUAL_CLIP):
            floor = dual_clip * advantage
            bounded = (advantage < cutlass.Float32(0.0)) & (floor > objective)
            objective = cutlass.select_(bounded, floor, objective)
            gradient = cutlass.select_(bounded, cutlass.Float32(0.0), gradient)
        loss[i] = -objective
        slope[i] = -gradient


@cute.jit
def ppo_loss_forward(logp: cute.Tensor, old_logp: cute.Tensor, advantages: cute.Tensor, loss: cute.Tensor,
                     slope: cute.Tensor, low: cutlass.Float32, high: cutlass.Float32, dual_clip: cutlass.Float32,
                     stream: cuda.CUstream, THREADS: cutlass.Constexpr[int], DUAL_CLIP: cutlass.Constexpr[bool]):
    """Launch ppo_loss_kernel over logp's tokens on ``stream``."""
    blocks = (logp.shape[0] + THREADS - 1) // THREADS
    ppo_loss_kernel(logp, old_logp, advantages, loss, slope, low, high, dual_clip, THREADS, DUAL_CLIP).launch(
        grid=(blocks, 1, 1), block=(THREADS, 1, 1), stream=stream)

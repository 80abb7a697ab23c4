"""fused_logp batch invariance (issue 25): with ``batch_invariant=True`` a token's logp, entropy and own-row gradient
are bitwise identical whether it is computed alone or at a random position in a batch of 1, 7, 64, 1500 (CUDA also
16384 and 65536) tokens with random neighbours (other logits, labels, ignored tokens, per-token temperatures, leading
shapes); grad_weight and grad_bias are bitwise equal across two runs of the same batch. The vocabulary-parallel forms
(gloo here, CPU; ``@pytest.mark.gpu``: NCCL on 1 or 2 GPUs) the same, for a given world size and shard layout.

Every probe is compared with ``torch.equal`` (bits, not a tolerance) against the same probe run alone. Seed printed;
replay with BATCH_INVARIANCE_TEST_SEED=<seed>. Run as a script, this file is the vocabulary-parallel worker.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SEED = int(os.environ.get("BATCH_INVARIANCE_TEST_SEED", time.time_ns() % 2**31))
CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device; none is visible")]
# linear_logp's tests skip, with the registry's sentence, where it cannot run (the logits kernel's run on).
linear_cpu = pytest.mark.kernel("linear_logp", device="cpu")
linear_gpu = pytest.mark.kernel("linear_logp")
CPU_BATCHES = (1, 7, 64, 1500)
GPU_BATCHES = (1, 7, 64, 1500, 16384, 65536)
PROBES = 3  # tokens followed through every batch (batch 1 holds the first only)
IGNORE = -100


def _gen(device, salt):
    return torch.Generator(device=device).manual_seed((SEED * 7919 + salt) % 2**62)


def _neighbours(n, device, gen):
    """Labels' ignore mask, per-token temperatures, grad_logp and grad_entropy of a batch of n."""
    ignored = torch.rand(n, device=device, generator=gen) < 0.25
    temps = torch.rand(n, device=device, generator=gen) * 1.5 + 0.3
    return ignored, temps, torch.randn(n, device=device, generator=gen), torch.randn(n, device=device, generator=gen)


def _positions(n, k, device, gen):
    return torch.randperm(n, device=device, generator=gen)[:k]


def _lead_shape(n):
    """A leading shape for n tokens: 2-D where n allows it, so the flattening path is covered too."""
    return (n // 4, 4) if n % 4 == 0 and n >= 8 else (n,)


# ---- logits op -------------------------------------------------------------------------------------------------------
class _LogitsProbes:
    def __init__(self, v, dtype, device, row_pad=0, tf=None):
        g = _gen(device, v + 17 * row_pad)
        self.v, self.dtype, self.device, self.row_pad = v, dtype, device, row_pad
        self.tf = tf or {}  # the logit transforms (softcap, logit_scale)
        x = torch.randn(PROBES, v, device=device, generator=g) * 3
        x[1, int(torch.randint(0, v, (1,), generator=g, device=device))] += 25.0  # a peaked row
        self.x = x.to(dtype)
        self.y = torch.randint(0, v, (PROBES,), device=device, generator=g)
        self.t = torch.rand(PROBES, device=device, generator=g) + 0.4
        self.gl = torch.randn(PROBES, device=device, generator=g)
        self.ge = torch.randn(PROBES, device=device, generator=g)

    def run(self, n, salt):
        """(positions, logp, entropy, grad rows) of the probes in a batch of n with random neighbours."""
        from prime_kernels_fused_logp.ops import logp_entropy

        g = _gen(self.device, salt)
        k = min(PROBES, n)
        pos = _positions(n, k, self.device, g)
        # rows of a wider buffer when row_pad: a row stride that is no multiple of 16 bytes (rows not aligned)
        # drawn in place: at 65536 x 151936 a float32 temporary would not fit beside the gradient
        buf = torch.empty(n, self.v + self.row_pad, device=self.device, dtype=self.dtype).normal_(0, 4, generator=g)
        x = buf[:, self.row_pad:]
        ignored, temps, gl, ge = _neighbours(n, self.device, g)
        y = torch.randint(0, self.v, (n,), device=self.device, generator=g)
        y[ignored] = IGNORE
        x[pos], y[pos], temps[pos], gl[pos], ge[pos] = self.x[:k], self.y[:k], self.t[:k], self.gl[:k], self.ge[:k]
        buf.requires_grad_()
        x = buf[:, self.row_pad:]
        lead = _lead_shape(n)
        lp, ent = logp_entropy(x.reshape(*lead, self.v), y.reshape(lead), temps.reshape(lead), batch_invariant=True,
                               **self.tf)
        (lp.reshape(-1) * gl + ent.reshape(-1) * ge).sum().backward()
        grad = buf.grad[:, self.row_pad:]
        return lp.reshape(-1)[pos].detach(), ent.reshape(-1)[pos].detach(), grad[pos].detach()


def check_logits_invariance(v, dtype, device, batches, row_pad=0, tf=None):
    probes = _LogitsProbes(v, dtype, device, row_pad, tf)
    alone = [_alone_logits(probes, i) for i in range(PROBES)]
    for n in batches:
        lp, ent, grad = probes.run(n, salt=n)
        for i in range(min(PROBES, n)):
            what = f"V={v} {dtype} pad={row_pad} probe {i} in a batch of {n}"
            assert torch.equal(lp[i], alone[i][0]), f"{what}: logp {lp[i].item()!r} vs alone {alone[i][0].item()!r}"
            assert torch.equal(ent[i], alone[i][1]), f"{what}: entropy {ent[i].item()!r} vs {alone[i][1].item()!r}"
            diff = (grad[i] != alone[i][2]).sum().item()
            assert diff == 0, f"{what}: {diff} gradient elements differ from the token alone"


def _alone_logits(probes, i):
    """Probe i alone (a batch of one, no neighbours)."""
    from prime_kernels_fused_logp.ops import logp_entropy

    x = probes.x[i:i + 1].clone().requires_grad_()
    lp, ent = logp_entropy(x, probes.y[i:i + 1], probes.t[i:i + 1], batch_invariant=True, **probes.tf)
    (lp * probes.gl[i] + ent * probes.ge[i]).sum().backward()
    return lp[0].detach(), ent[0].detach(), x.grad[0]


# V = 151936 at 1500 rows only in bf16 on CPU (memory and time); every size in every dtype at V = 32000.
CPU_LOGITS_CASES = [(32000, d, CPU_BATCHES) for d in (torch.bfloat16, torch.float16, torch.float32)] + [
    (151936, torch.bfloat16, CPU_BATCHES), (151936, torch.float16, CPU_BATCHES[:3]),
    (151936, torch.float32, CPU_BATCHES[:3])]


@pytest.mark.parametrize("v, dtype, batches", CPU_LOGITS_CASES, ids=lambda c: str(c))
def test_cpu_logits(v, dtype, batches):
    check_logits_invariance(v, dtype, "cpu", batches)


def test_cpu_logits_unaligned_rows():
    check_logits_invariance(32001, torch.bfloat16, "cpu", (1, 7, 64), row_pad=3)


TRANSFORMS = [dict(softcap=30.0), dict(softcap=30.0, logit_scale=0.5), dict(logit_scale=0.0625)]
SOFTCAPS = TRANSFORMS[:2]  # on the GPU: a logit_scale alone only changes the temperature the kernels see


@pytest.mark.parametrize("tf", TRANSFORMS, ids=str)
def test_cpu_logits_transforms(tf):
    check_logits_invariance(32000, torch.bfloat16, "cpu", CPU_BATCHES[:3], tf=tf)


@pytest.mark.parametrize("v", [32000, 151936])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; none is visible")
def test_gpu_logits(v, dtype):
    check_logits_invariance(v, dtype, "cuda", GPU_BATCHES)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; none is visible")
@pytest.mark.parametrize("v, pad", [(32001, 0), (32000, 3), (151937, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_logits_unaligned_rows(v, pad, dtype):
    """Rows not 16-byte aligned (odd V, or rows of a wider buffer): the invariant forward gathers their vectors."""
    check_logits_invariance(v, dtype, "cuda", (1, 7, 64, 1500, 16384), row_pad=pad)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; none is visible")
@pytest.mark.parametrize("tf", SOFTCAPS, ids=str)
@pytest.mark.parametrize("v, pad", [(151936, 0), (32001, 3)])
def test_gpu_logits_transforms(tf, v, pad):
    """The transform is elementwise: with it on, the invariant forward and backward stay bitwise invariant."""
    check_logits_invariance(v, torch.bfloat16, "cuda", (1, 7, 64, 1500, 16384), row_pad=pad, tf=tf)


# ---- linear op -------------------------------------------------------------------------------------------------------
class _LinearProbes:
    def __init__(self, v, h, dtype, device, bias=True, tf=None):
        g = _gen(device, 3 * v + h)
        self.v, self.h, self.dtype, self.device = v, h, dtype, device
        self.tf = tf or {}
        self.w = (torch.randn(v, h, device=device, generator=g) / h**0.25).to(dtype)
        self.b = torch.randn(v, device=device, generator=g) if bias else None
        self.x = (torch.randn(PROBES, h, device=device, generator=g) * 2 / h**0.25).to(dtype)
        self.y = torch.randint(0, v, (PROBES,), device=device, generator=g)
        self.t = torch.rand(PROBES, device=device, generator=g) + 0.4
        self.gl = torch.randn(PROBES, device=device, generator=g)
        self.ge = torch.randn(PROBES, device=device, generator=g)

    def batch(self, n, salt):
        g = _gen(self.device, salt)
        k = min(PROBES, n)
        pos = _positions(n, k, self.device, g)
        hid = (torch.randn(n, self.h, device=self.device, generator=g) * 2 / self.h**0.25).to(self.dtype)
        ignored, temps, gl, ge = _neighbours(n, self.device, g)
        y = torch.randint(0, self.v, (n,), device=self.device, generator=g)
        y[ignored] = IGNORE
        hid[pos], y[pos], temps[pos], gl[pos], ge[pos] = self.x[:k], self.y[:k], self.t[:k], self.gl[:k], self.ge[:k]
        return pos, hid, y, temps, gl, ge

    def run(self, hid, y, temps, gl, ge):
        """(logp, entropy, grad_hidden, grad_weight, grad_bias) of one batch."""
        from prime_kernels_fused_logp.linear_ops import linear_logp_entropy

        n = hid.shape[0]
        lead = _lead_shape(n)
        h = hid.clone().requires_grad_()
        w = self.w.clone().requires_grad_()
        b = None if self.b is None else self.b.clone().requires_grad_()
        lp, ent = linear_logp_entropy(h.reshape(*lead, self.h), w, y.reshape(lead), temps.reshape(lead), bias=b,
                                      batch_invariant=True, **self.tf)
        (lp.reshape(-1) * gl + ent.reshape(-1) * ge).sum().backward()
        return lp.reshape(-1).detach(), ent.reshape(-1).detach(), h.grad, w.grad, None if b is None else b.grad


def check_linear_invariance(v, h, dtype, device, batches, tf=None):
    probes = _LinearProbes(v, h, dtype, device, tf=tf)
    alone = []
    for i in range(PROBES):
        s = slice(i, i + 1)
        lp, ent, gh, _, _ = probes.run(probes.x[s], probes.y[s], probes.t[s], probes.gl[s], probes.ge[s])
        alone.append((lp[0], ent[0], gh[0]))
    for n in batches:
        pos, *batch = probes.batch(n, salt=n)
        lp, ent, gh, gw, gb = probes.run(*batch)
        for j, i in enumerate(range(min(PROBES, n))):
            what = f"V={v} H={h} {dtype} probe {i} in a batch of {n} at {pos[j].item()}"
            p = pos[j]
            assert torch.equal(lp[p], alone[i][0]), f"{what}: logp {lp[p].item()!r} vs alone {alone[i][0].item()!r}"
            assert torch.equal(ent[p], alone[i][1]), f"{what}: entropy {ent[p].item()!r} vs {alone[i][1].item()!r}"
            diff = (gh[p] != alone[i][2]).sum().item()
            assert diff == 0, f"{what}: {diff} grad_hidden elements differ from the token alone"
        if n == batches[-1]:  # grad_weight / grad_bias: the same bits in a second run of the same batch
            _, _, _, gw2, gb2 = probes.run(*batch)
            assert torch.equal(gw, gw2), f"V={v} {dtype} batch {n}: grad_weight differs between two runs"
            assert torch.equal(gb, gb2), f"V={v} {dtype} batch {n}: grad_bias differs between two runs"


CPU_LINEAR_CASES = [(32000, 16, torch.bfloat16, CPU_BATCHES), (32000, 16, torch.float16, CPU_BATCHES[:3]),
                    (32000, 16, torch.float32, CPU_BATCHES[:3]), (151936, 16, torch.bfloat16, CPU_BATCHES[:3])]


@pytest.mark.parametrize("v, h, dtype, batches", CPU_LINEAR_CASES, ids=lambda c: str(c))
@linear_cpu
def test_cpu_linear(v, h, dtype, batches):
    check_linear_invariance(v, h, dtype, "cpu", batches)


@pytest.mark.parametrize("tf", TRANSFORMS, ids=str)
@linear_cpu
def test_cpu_linear_transforms(tf):
    check_linear_invariance(32000, 16, torch.bfloat16, "cpu", CPU_BATCHES[:3], tf=tf)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; none is visible")
@pytest.mark.parametrize("tf", SOFTCAPS, ids=str)
@linear_gpu
def test_gpu_linear_transforms(tf):
    check_linear_invariance(151936, 4096, torch.bfloat16, "cuda", GPU_BATCHES[:5], tf=tf)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; none is visible")
@pytest.mark.parametrize("v, h", [(32000, 4096), (151936, 4096), (32001, 200)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@linear_gpu
def test_gpu_linear(v, h, dtype):
    """Batches up to 65536 tokens: token chunks of the backward, several grad_hidden GEMM blocks, a padded last one."""
    check_linear_invariance(v, h, dtype, "cuda", GPU_BATCHES)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; none is visible")
@linear_gpu
def test_gpu_cublas_row_blocks_are_row_invariant():
    """The premise of the invariant backward: one cuBLAS GEMM shape gives a row the same bits wherever it sits in the
    block and whatever the other rows hold (rows permuted and refilled, the accumulator too)."""
    from prime_kernels_fused_logp.linear_ops import INVARIANT_GEMM_ROWS

    g = _gen("cuda", 5)
    m, k, h = INVARIANT_GEMM_ROWS, 8192, 4096
    w = torch.randn(k, h, device="cuda", generator=g).bfloat16()
    a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    acc = torch.randn(m, h, device="cuda", generator=g)
    def gemm(acc_in, a_in):  # the shape and dtypes of linear_logp_bwd.cu's at::addmm_out(acc, acc, dz, w, kFloat)
        return torch.addmm(acc_in, a_in, w, out_dtype=torch.float32)

    ref = gemm(acc, a)
    # a third of the rows kept, each moved to another row of the block; the others (and their accumulators) new
    src = torch.randperm(m, device="cuda", generator=g)[: m // 3]
    dst = torch.randperm(m, device="cuda", generator=g)[: m // 3]
    other_a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    other_acc = torch.randn(m, h, device="cuda", generator=g)
    other_a[dst], other_acc[dst] = a[src], acc[src]
    mixed = gemm(other_acc, other_a)
    assert torch.equal(mixed[dst], ref[src]), "cuBLAS: a row's GEMM result depends on its position or the other rows"


# ---- vocabulary-parallel (gloo: spawned CPU processes; NCCL: @gpu) ---------------------------------------------------
VP_LAYOUTS = {1: [32000], 2: [15000, 17000], 3: [10000, 12003, 9997]}
VP_BATCHES = (1, 7, 64, 300)


def _vp_worker_runs(rank, world, group, device):
    """For each batch size: this rank's probe outputs (global logp, entropy) and own-row gradients."""
    from prime_kernels_fused_logp.linear_ops import linear_logp_entropy
    from prime_kernels_fused_logp.ops import logp_entropy

    sizes = VP_LAYOUTS[world]
    v, start, size = sum(sizes), sum(sizes[:rank]), sizes[rank]
    out = {}
    probes = _LogitsProbes(v, torch.bfloat16, device)
    lin = _LinearProbes(v, 16 if device.type == "cpu" else 256, torch.bfloat16, device)
    for n in VP_BATCHES:
        g = _gen(device, n)
        k = min(PROBES, n)
        pos = _positions(n, k, device, g)
        x = torch.empty(n, v, device=device, dtype=torch.bfloat16).normal_(0, 4, generator=g)
        ignored, temps, gl, ge = _neighbours(n, device, g)
        y = torch.randint(0, v, (n,), device=device, generator=g)
        y[ignored] = IGNORE
        x[pos], y[pos], temps[pos], gl[pos], ge[pos] = probes.x[:k], probes.y[:k], probes.t[:k], probes.gl[:k], \
            probes.ge[:k]
        xs = x[:, start:start + size].clone().requires_grad_()
        lp, ent = logp_entropy(xs, y, temps, process_group=group, batch_invariant=True)
        (lp * gl + ent * ge).sum().backward()
        out[("logits", n)] = (lp[pos].cpu(), ent[pos].cpu(), xs.grad[pos].cpu())

        pos, hid, y, temps, gl, ge = lin.batch(n, salt=1000 + n)
        h = hid.clone().requires_grad_()
        w = lin.w[start:start + size].clone().requires_grad_()
        b = lin.b[start:start + size].clone().requires_grad_()
        lp, ent = linear_logp_entropy(h, w, y, temps, bias=b, process_group=group, batch_invariant=True)
        (lp * gl + ent * ge).sum().backward()
        out[("linear", n)] = (lp[pos].cpu(), ent[pos].cpu(), h.grad[pos].cpu())
        if n == VP_BATCHES[-1]:
            w2 = lin.w[start:start + size].clone().requires_grad_()
            lp, ent = linear_logp_entropy(h.detach(), w2, y, temps, bias=b.detach(), process_group=group,
                                          batch_invariant=True)
            (lp * gl + ent * ge).sum().backward()
            out["grad_weight twice"] = torch.equal(w.grad, w2.grad)
    if world > 1:  # ranks that disagree on the mode (all_gather vs all_reduce) raise instead of hanging
        try:
            logp_entropy(x[:, start:start + size], y, process_group=group, batch_invariant=rank == 0)
            out["mode mismatch"] = None
        except ValueError as e:
            out["mode mismatch"] = str(e)
    return out


def vp_worker_main(rank, world, tmp, backend):
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    torch.save(_vp_worker_runs(rank, world, dist.group.WORLD, device), f"{tmp}/out{rank}.pt")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # as test_vocab_parallel.py: gloo's teardown can abort when a peer has already exited


def _vp_spawn(world, tmp: Path, backend, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0", BATCH_INVARIANCE_TEST_SEED=str(SEED))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(world), str(tmp), backend], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    deadline, logs, hung = time.monotonic() + timeout, [], []
    for r, p in enumerate(procs):
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            hung.append(r)
            p.kill()
            logs.append(p.communicate()[0])
    report = "\n".join(f"--- rank {r} (rc {p.returncode}) ---\n{log[-3000:]}"
                       for r, (p, log) in enumerate(zip(procs, logs)))
    assert not hung and all(p.returncode == 0 for p in procs), f"a worker failed or hung:\n{report}"
    return [torch.load(tmp / f"out{r}.pt", weights_only=False) for r in range(world)]


def check_vp(outs, world):
    for rank, out in enumerate(outs):
        assert out.pop("grad_weight twice"), f"rank {rank}: grad_weight differs between two runs"
        if world > 1:
            msg = out.pop("mode mismatch")
            assert msg and "ranks disagree on batch_invariant" in msg, msg
        for kind in ("logits", "linear"):
            ref = out[(kind, 1)]
            for n in VP_BATCHES[1:]:
                lp, ent, grad = out[(kind, n)]
                what = f"{kind}, world {world}, rank {rank}: probe 0 in a batch of {n}"
                assert torch.equal(lp[0], ref[0][0]) and torch.equal(ent[0], ref[1][0]), f"{what}: logp/entropy"
                assert torch.equal(grad[0], ref[2][0]), f"{what}: own-row gradient"
                # probes 1, 2 against the batch of 7
                for i in range(1, min(PROBES, n)):
                    r7 = out[(kind, 7)]
                    assert torch.equal(lp[i], r7[0][i]) and torch.equal(ent[i], r7[1][i]), f"{what} (probe {i})"
                    assert torch.equal(grad[i], r7[2][i]), f"{what} (probe {i}): own-row gradient"
        if rank:
            for key in outs[0]:  # the global outputs agree on every rank
                assert torch.equal(out[key][0], outs[0][key][0]) and torch.equal(out[key][1], outs[0][key][1])


@pytest.mark.parametrize("world", [1, 2, 3])
@linear_cpu
def test_gloo_vocab_parallel(tmp_path, world):
    check_vp(_vp_spawn(world, tmp_path, "gloo", 300), world)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
@linear_gpu
def test_nccl_vocab_parallel(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices for NCCL")
    check_vp(_vp_spawn(world, tmp_path, "nccl", 300), world)


if __name__ == "__main__":
    vp_worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])

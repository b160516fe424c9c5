"""CPU benchmark driver: train a small Llama decoder on 8 gloo processes.

What it runs
------------
One command starts WORLD_SIZE (default 8) worker processes with
torch.multiprocessing (spawn start method).  Each worker joins a gloo process
group on 127.0.0.1 and trains the same small Llama decoder (defined below) on
a synthetic, fixed batch of random tokens.

Parallelism, chosen by --mesh:
  fsdp=F,tensor=T  2-D DeviceMesh ("fsdp", "tp") of shape (F, T), F*T = 8.
                   Tensor parallelism (parallelize_module): ColwiseParallel for
                   wq/wk/wv and w_gate/w_up, RowwiseParallel for wo and w_down
                   (heads divided by T).  Then FSDP2 fully_shard per block and
                   on the root over the "fsdp" sub-mesh.  Embedding, norms and
                   lm_head are not tensor-parallel (replicated over "tp",
                   sharded over "fsdp").
  fsdp=8           1-D DeviceMesh ("fsdp",) of size 8: FSDP2 only, no TP.
  data=8           Plain DDP (torch.nn.parallel.DistributedDataParallel),
                   every rank keeps a full replica.

The global batch (--batch-size sequences) is split evenly over the data/fsdp
ranks; ranks of the same tensor-parallel group see the same micro-batch.

Model: token embedding, N x [RMSNorm -> causal self-attention with RoPE
(F.scaled_dot_product_attention, is_causal=True) -> residual, RMSNorm ->
SwiGLU MLP (gate, up, down) -> residual], final RMSNorm, untied lm_head.
float32, no dropout, no biases.

Training: cross-entropy next-token loss, AdamW(lr 3e-3, wd 0.1,
betas (0.9, 0.95)), gradient clipping to global norm 1.0 with
torch.nn.utils.clip_grad_norm_; for FSDP2+TP, where that call fails in torch
2.13 because the gradients sit on two different meshes, the same clipping is
done with get_total_norm per mesh + clip_grads_with_norm_ (see
clip_grad_norm below).
Data: one fixed global batch of random tokens (seed 1234), reused at every
step, so the loss must fall (the model memorises it) - a sanity check.

Output (stdout, rank 0 only, one JSON object per line):
  {"step": i, "step_time_s": t, "loss": l}   for i = 1..steps
      t: wall time on rank 0 from a barrier at the start of the step until the
         optimizer step has finished and loss.item() has returned.
      l: loss of the step, averaged over all ranks.
  {"summary": true, "torch_version": ..., "peak_rss_bytes_per_process": ...,
   ...}
      peak_rss_bytes_per_process: max over ranks of getrusage ru_maxrss.
Everything else goes to stderr.

Threads: --threads (default 1) sets torch.set_num_threads in every worker.
On a 2-core machine with 8 workers, 1 was fastest (2 was 1.2x slower for
FSDP2 / FSDP2+TP and about 10x slower for DDP).

Example:
  python torch_driver.py --mesh fsdp=4,tensor=2 --steps 30 --batch-size 8 \
      --seq-len 128 --layers 4 --d-model 256 --heads 4 --mlp 1024 --vocab 256
"""

import argparse
import json
import math
import os
import resource
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x * rms * self.weight


def rope_tables(seq_len, head_dim, base=10000.0):
    """cos/sin tables of shape (seq_len, head_dim) for rotate-half RoPE."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    positions = torch.arange(seq_len, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)          # (T, head_dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)           # (T, head_dim)
    return emb.cos(), emb.sin()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x, cos, sin):
    # x: (B, H, T, D); cos/sin: (T, D)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        # With tensor parallelism wq/wk/wv return only the local heads, so the
        # number of heads is inferred (-1) instead of taken from the config.
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(B, T, -1)
        return self.wo(out)


class SwiGLU(nn.Module):
    def __init__(self, d_model, d_mlp):
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_mlp, bias=False)
        self.w_up = nn.Linear(d_model, d_mlp, bias=False)
        self.w_down = nn.Linear(d_mlp, d_model, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, d_model, n_heads, d_mlp):
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, d_mlp)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        x = x + self.mlp(self.mlp_norm(x))
        return x


class Llama(nn.Module):
    def __init__(self, vocab, d_model, n_layers, n_heads, d_mlp, max_seq_len):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(
            [Block(d_model, n_heads, d_mlp) for _ in range(n_layers)])
        self.norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        cos, sin = rope_tables(max_seq_len, d_model // n_heads)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens):
        T = tokens.shape[1]
        cos = self.rope_cos[:T]
        sin = self.rope_sin[:T]
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


# --------------------------------------------------------------------------
# Parallelism
# --------------------------------------------------------------------------

def parse_mesh(text):
    """'fsdp=4,tensor=2' -> {'fsdp': 4, 'tensor': 2} (known keys only)."""
    sizes = {}
    for part in text.split(","):
        key, value = part.split("=")
        key = key.strip()
        if key not in ("data", "fsdp", "tensor"):
            raise ValueError(f"unknown mesh axis {key!r} (use data, fsdp, tensor)")
        sizes[key] = int(value)
    if "data" in sizes and len(sizes) > 1:
        raise ValueError("data=N (DDP) cannot be combined with other axes here")
    return sizes


def apply_tensor_parallel(model, tp_mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module)
    plan = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(),
        "mlp.w_gate": ColwiseParallel(),
        "mlp.w_up": ColwiseParallel(),
        "mlp.w_down": RowwiseParallel(),
    }
    for block in model.layers:
        parallelize_module(block, tp_mesh, plan)


def apply_fsdp(model, fsdp_mesh):
    from torch.distributed.fsdp import fully_shard
    for block in model.layers:
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)


def build_parallel_model(args, mesh_sizes, rank, world_size):
    """Returns (model, data_parallel_rank, data_parallel_size)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)  # identical initial weights on every rank
    model = Llama(args.vocab, args.d_model, args.layers, args.heads,
                  args.mlp, args.seq_len)

    if "data" in mesh_sizes:
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model), rank, world_size

    fsdp = mesh_sizes.get("fsdp", 1)
    tp = mesh_sizes.get("tensor", 1)
    if tp > 1:
        if args.heads % tp:
            raise ValueError(f"heads={args.heads} not divisible by tensor={tp}")
        mesh = init_device_mesh("cpu", (fsdp, tp), mesh_dim_names=("fsdp", "tp"))
        apply_tensor_parallel(model, mesh["tp"])
        fsdp_mesh = mesh["fsdp"]
    else:
        fsdp_mesh = init_device_mesh("cpu", (fsdp,), mesh_dim_names=("fsdp",))
    apply_fsdp(model, fsdp_mesh)
    return model, fsdp_mesh.get_local_rank(), fsdp


def clip_grad_norm(parameters, max_norm):
    """Clip gradients to a global L2 norm of max_norm; returns the norm.

    torch.nn.utils.clip_grad_norm_ is used when all gradients live on one
    DeviceMesh (DDP, FSDP2 alone).  With FSDP2 + TP the TP weights are DTensors
    on the 2-D ("fsdp", "tp") mesh while the norms, embedding and lm_head are
    DTensors on the 1-D "fsdp" sub-mesh, and clip_grad_norm_ in torch 2.13
    fails with "All operands in aten.stack.default must have the same mesh".
    In that case the norm is computed per mesh with
    torch.nn.utils.get_total_norm, turned into a plain tensor with
    .full_tensor(), combined, and applied with
    torch.nn.utils.clip_grads_with_norm_ per mesh (same maths as
    clip_grad_norm_).
    """
    from torch.distributed.tensor import DTensor
    parameters = [p for p in parameters if p.grad is not None]
    params_by_mesh = {}
    for p in parameters:
        mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        params_by_mesh.setdefault(mesh, []).append(p)
    if len(params_by_mesh) == 1:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm=max_norm)

    norms = []
    for params in params_by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm)
    total_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    # Scaling is also done per mesh: one foreach op cannot mix meshes either.
    for params in params_by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm


# --------------------------------------------------------------------------
# Worker
# --------------------------------------------------------------------------

def log(rank, msg):
    print(f"[rank {rank}] {msg}", file=sys.stderr, flush=True)


def worker(rank, args, world_size, port):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size)
    mesh_sizes = parse_mesh(args.mesh)
    product = 1
    for size in mesh_sizes.values():
        product *= size
    if product != world_size:
        raise ValueError(f"mesh {args.mesh} has {product} ranks, world size is {world_size}")

    model, dp_rank, dp_size = build_parallel_model(args, mesh_sizes, rank, world_size)
    if args.batch_size % dp_size:
        raise ValueError(f"batch size {args.batch_size} not divisible by {dp_size} data ranks")
    local_batch = args.batch_size // dp_size

    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        log(rank, f"mesh={mesh_sizes} data-parallel size={dp_size} "
                  f"local batch={local_batch} local param elements={n_params} "
                  f"threads={torch.get_num_threads()}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3,
                                  weight_decay=0.1, betas=(0.9, 0.95))

    # One fixed global batch of random tokens, identical on every rank.
    gen = torch.Generator().manual_seed(1234)
    data = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=gen)
    local = data[dp_rank * local_batch:(dp_rank + 1) * local_batch]
    inputs = local[:, :-1].contiguous()
    targets = local[:, 1:].contiguous()

    step_times = []
    losses = []
    for step in range(1, args.steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip_grad_norm(model.parameters(), max_norm=1.0)
        optimizer.step()
        loss_value = loss.item()
        step_time = time.perf_counter() - t0

        # Average the loss over all ranks for logging (outside the timed region).
        loss_sum = torch.tensor([loss_value], dtype=torch.float64)
        dist.all_reduce(loss_sum)
        mean_loss = loss_sum.item() / world_size
        step_times.append(step_time)
        losses.append(mean_loss)
        if rank == 0:
            print(json.dumps({"step": step, "step_time_s": step_time, "loss": mean_loss}),
                  flush=True)

    # ru_maxrss is in KiB on Linux.
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    all_rss = [None] * world_size
    dist.all_gather_object(all_rss, peak_rss)

    if rank == 0:
        tail = step_times[9:] if len(step_times) >= 10 else step_times
        summary = {
            "summary": True,
            "torch_version": torch.__version__,
            "peak_rss_bytes_per_process": max(all_rss),
            "peak_rss_bytes_all_ranks": all_rss,
            "mesh": args.mesh,
            "world_size": world_size,
            "threads_per_process": torch.get_num_threads(),
            "parallelism": ("DDP" if "data" in mesh_sizes else
                            "FSDP2+TP" if mesh_sizes.get("tensor", 1) > 1 else "FSDP2"),
            "median_step_time_s_steps_10_to_end": statistics.median(tail),
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "loss_decreased": losses[-1] < losses[0],
        }
        print(json.dumps(summary), flush=True)
        if not losses[-1] < losses[0]:
            log(rank, "WARNING: loss did not decrease")

    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------

def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mesh", default="fsdp=4,tensor=2",
                        help="fsdp=F,tensor=T | fsdp=N | data=N")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--mlp", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads per process")
    parser.add_argument("--world-size", type=int, default=8)
    args = parser.parse_args()

    # gloo picks a network interface from the hostname; force loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = free_port()
    mp.start_processes(worker, args=(args, args.world_size, port),
                       nprocs=args.world_size, join=True, start_method="spawn")


if __name__ == "__main__":
    main()

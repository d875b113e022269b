"""How much does making TMA descriptors on the device cost per program? Three ways to read two (64, 64) bf16 tiles per
program of one (b, h) slice of a (B, H, N, D) tensor: device-side descriptors (what our kernels do), a host-side 4-D
descriptor passed as a kernel argument, and pointer loads. Grid = the forward's at 1K/4K tokens."""
import torch, triton, triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor


def alloc(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


triton.set_allocator(alloc)


@triton.jit
def k_device(K, V, OUT, stride_b, stride_h, stride_n, H, N, TILES: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr):
    pid = tl.program_id(0); bh = tl.program_id(1)
    b = bh // H; h = bh % H
    kd = tl.make_tensor_descriptor(K + b * stride_b + h * stride_h, shape=[N, D], strides=[stride_n, 1], block_shape=[BLOCK, D])
    vd = tl.make_tensor_descriptor(V + b * stride_b + h * stride_h, shape=[N, D], strides=[stride_n, 1], block_shape=[BLOCK, D])
    acc = tl.zeros([BLOCK, D], tl.float32)
    for j in range(TILES):
        acc += kd.load([j * BLOCK, 0]).to(tl.float32) + vd.load([j * BLOCK, 0]).to(tl.float32)
    tl.store(OUT + bh * tl.num_programs(0) + pid, tl.sum(acc))


@triton.jit
def k_host(kd, vd, OUT, H, TILES: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr):
    pid = tl.program_id(0); bh = tl.program_id(1)
    b = bh // H; h = bh % H
    acc = tl.zeros([BLOCK, D], tl.float32)
    for j in range(TILES):
        acc += kd.load([b, j * BLOCK, h, 0]).reshape(BLOCK, D).to(tl.float32) + \
            vd.load([b, j * BLOCK, h, 0]).reshape(BLOCK, D).to(tl.float32)
    tl.store(OUT + bh * tl.num_programs(0) + pid, tl.sum(acc))


@triton.jit
def k_ptr(K, V, OUT, stride_b, stride_h, stride_n, H, N, TILES: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr):
    pid = tl.program_id(0); bh = tl.program_id(1)
    b = bh // H; h = bh % H
    r = tl.arange(0, BLOCK); c = tl.arange(0, D)
    acc = tl.zeros([BLOCK, D], tl.float32)
    for j in range(TILES):
        off = b * stride_b + h * stride_h + (j * BLOCK + r)[:, None] * stride_n + c[None, :]
        acc += tl.load(K + off).to(tl.float32) + tl.load(V + off).to(tl.float32)
    tl.store(OUT + bh * tl.num_programs(0) + pid, tl.sum(acc))


print("B H N tiles/program: device-desc / host-desc / pointers (us)")
for B, H, N in [(16, 32, 1024), (4, 32, 4096)]:
    D, BLOCK = 64, 64
    kv = torch.randn(B, N, 2, H, D, device="cuda", dtype=torch.bfloat16)  # the model's layout: (B, N, H, D) rows
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # (B, H, N, D) views
    grid = (N // 64, B * H)
    out = torch.empty(grid[0] * grid[1], device="cuda")
    kd = TensorDescriptor(kv[:, :, 0], shape=[B, N, H, D], strides=list(kv[:, :, 0].stride()), block_shape=[1, BLOCK, 1, D])
    vd = TensorDescriptor(kv[:, :, 1], shape=[B, N, H, D], strides=list(kv[:, :, 1].stride()), block_shape=[1, BLOCK, 1, D])
    for tiles in (1, 4):
        r = []
        for f in (lambda: k_device[grid](k, v, out, k.stride(0), k.stride(1), k.stride(2), H, N, tiles, BLOCK, D),
                  lambda: k_host[grid](kd, vd, out, H, tiles, BLOCK, D),
                  lambda: k_ptr[grid](k, v, out, k.stride(0), k.stride(1), k.stride(2), H, N, tiles, BLOCK, D)):
            r.append(do_bench(f, warmup=10, rep=100, return_mode="median") * 1e3)
        print(B, H, N, tiles, " / ".join(f"{x:.1f}" for x in r), f" programs={grid[0] * grid[1]}", flush=True)

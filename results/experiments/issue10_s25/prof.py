"""cProfile of eager flash fwd+bwd (direct launches), GPU busy; D=128 and D=64 at 1K."""
import cProfile, io, os, pstats
import torch
from minigpt_kernels.flash_attention import flash_attention
out = os.environ.get("OUT", ".")
for D, H in ((128, 16), (64, 32)):
    N, B = 1024, 16
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for _ in range(3))
    do = torch.randn_like(q)
    def step():
        flash_attention(q, k, v).backward(do)
    for _ in range(3): step()
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(50): step()
    pr.disable(); torch.cuda.synchronize()
    for key, name in (("tottime", "tot"), ("cumulative", "cum")):
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(key).print_stats(45)
        open(f"{out}/prof_{name}_D{D}.txt", "w").write(s.getvalue())
print("done")

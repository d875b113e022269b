"""minigpt's attention kernels (Triton; warp-specialized Gluon kernels on Hopper, from 1K or 4K tokens), installed as
`minigpt_kernels` (the folder is kernels/ in the source tree). rotary.py: the model's qkv split + RoPE in one pass;
flash_attention_qkv.py: attention from the qkv projection with RoPE's backward folded into flash's; sm90_build.py: the
Gluon kernels compiled for sm_90 without a GPU, to check they build and to count their instructions."""
from minigpt_kernels.flash_attention import flash_attention, flash_attention_with_lse

__all__ = ["flash_attention", "flash_attention_with_lse"]

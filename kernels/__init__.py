"""minigpt's Triton kernels."""
from kernels.flash_attention import flash_attention

__all__ = ["flash_attention"]

"""The Hopper (sm_90) kernels, in Gluon (Triton's explicit-layout dialect): forward.py (the warp-specialized ping-pong
forward, plain and persistent), backward.py (the five-matmul dK/dV/dQ kernel, plain and persistent, and the dQ kernel),
common.py (what they share: TMA copy, wgmma layout, head rows, register split), schedule.py (the persistent kernels'
work lists, made on the host). Importing this needs triton's Gluon API for Hopper; launch.py runs the Triton kernels
alone where it is missing."""

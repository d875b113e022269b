"""kernels/dispatch.py: which kernel and tiles run each call, pinned.

The expected plans below were produced by the four choosers that dispatch.plan replaced (tile_config,
fused_backward_config, via_ds_chosen, specialized_ready in kernels/flash_attention.py at e668b53), run over the grid
GRID walks on a CPU with the device facts (capability, TMA alignment) given as arguments. Any change of choice fails
here; a deliberate one regenerates the table and says why in the commit. Since: the non-causal forward on sm_90 with
inputs that fit takes the Gluon forward from 1K query rows (W, X; ring attention's blocks of other ranks).
"""
import itertools

import pytest
import torch

from minigpt_kernels import dispatch
from minigpt_kernels.dispatch import TileConfig, plan

SEQS = (1, 2, 17, 63, 64, 65, 255, 256, 511, 512, 513, 1000, 1023, 1024, 1025, 2047, 2048, 2049, 4095, 4096, 4097,
        8191, 8192, 8193, 16383, 16384, 16385, 32767, 32768, 65535, 65536, 131071, 131072, 131073, 262144)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CAPABILITIES = {"sm80": (8, 0), "sm90": (9, 0)}


def grid():
    """(interpret, capability, aligned, batch·heads, dtype, head_dim, causal, deterministic, direction), in the
    order of EXPECTED; the interpreter only once (it ignores the device)."""
    for interpret in (False, True):
        for cap in (("sm80",) if interpret else ("sm80", "sm90")):
            yield from itertools.product([interpret], [cap], (True, False), (1, 2048), DTYPES, (16, 32, 64, 128, 256),
                                         (True, False), (False, True), ("fwd", "bwd"))


def short(c: TileConfig) -> str:
    """64x128w4s3T: block_m x block_n, warps, stages; T TMA, r<maxnreg>, G Gluon (warp-specialized), P persistent."""
    return (f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}" + ("T" if c.tma else "")
            + (f"r{c.maxnreg}" if c.maxnreg else "") + ("G" if c.specialized else "") + ("P" if c.persistent else ""))


def described(direction, p) -> str:
    """A plan as the old choosers' answer was written down: path, tiles (+ the dQ kernel's where it has its own)."""
    return f"{p.path}:{short(p.tiles)}" + (f"+{short(p.dq_tiles)}" if p.dq_tiles is not None else "")


PLANS = {
    'A': [(1, 'triton:64x64w4s3T'), (8192, 'triton:64x128w4s2T')],
    'B': [(1, 'triton:64x64w4s3Tr168+128x64w8s3T')],
    'C': [(1, 'triton:128x64w8s3T')],
    'D': [(1, 'triton:64x64w4s3T'), (8193, 'triton:128x64w8s3T')],
    'E': [(1, 'triton:64x64w4s2T+128x64w8s4T')],
    'F': [(1, 'triton:64x32w4s2')],
    'G': [(1, 'triton:16x64w4s2+64x16w4s2')],
    'H': [(1, 'triton:64x32w4s2T')],
    'I': [(1, 'triton:32x64w4s2T+64x32w4s2T')],
    'J': [(1, 'triton:32x16w4s1')],
    'K': [(1, 'triton:16x32w4s1+32x16w4s1')],
    'L': [(1, 'triton:64x64w4s3T'), (1024, 'gluon:128x128w4s3TGP'), (2048, 'gluon:192x128w4s3TGP'), (131072, 'gluon:192x128w4s3TG')],
    'M': [(1, 'triton:64x64w4s3Tr168+128x64w8s3T'), (2048, 'gluon:64x128w4s3TGP'), (16384, 'gluon:64x128w4s3TG')],
    'N': [(1, 'triton:64x64w4s3T'), (1024, 'gluon:128x128w4s3TGP')],
    'O': [(1, 'via_ds:64x64w4s2T+64x64w4s3'), (1025, 'triton:64x64w4s2T+128x64w8s4T'), (2048, 'gluon:64x128w4s3TGP'), (8192, 'gluon:64x128w4s2TG')],
    'P': [(1, 'via_ds:64x64w4s2T+64x64w4s3'), (1025, 'triton:64x64w4s2T+128x64w8s4T'), (4096, 'triton:64x64w4s2T+128x64w4s3TG')],
    'Q': [(1, 'via_ds:64x64w4s2T+64x64w4s3'), (1000, 'triton:64x64w4s2T+128x64w8s4T'), (2048, 'gluon:64x128w4s3TGP'), (8192, 'gluon:64x128w4s2TG')],
    'R': [(1, 'via_ds:64x64w4s2T+64x64w4s3'), (1000, 'triton:64x64w4s2T+128x64w8s4T'), (4096, 'triton:64x64w4s2T+128x64w4s3TG')],
    'S': [(1, 'via_ds:64x64w4s2T+64x64w4s3'), (1025, 'triton:64x64w4s2T+128x64w8s4T')],
    'T': [(1, 'via_ds:64x64w4s2T+64x64w4s3'), (1000, 'triton:64x64w4s2T+128x64w8s4T')],
    'U': [(1, 'triton:32x16w4s1T')],
    'V': [(1, 'triton:16x32w4s1T+32x16w4s1T')],
    # non-causal forward on sm_90 with inputs that fit: the Gluon forward (rows sm90-non-causal, ring attention)
    'W': [(1, 'triton:128x64w8s3T'), (1024, 'gluon:128x128w4s3TGP'), (2048, 'gluon:192x128w4s3TGP'),
          (131072, 'gluon:192x128w4s3TG')],
    'X': [(1, 'triton:128x64w8s3T'), (1024, 'gluon:128x128w4s3TGP')],
}
EXPECTED = (
    'ABABCBCBABABCBCBABABCBCBDEDECECEFGFGFGFGABABCBCBABABCBCBABABCBCBDEDECECEFGFGFGFGHIHIHIHIHIHIHIHI'
    'HIHIHIHIHIHIHIHIJKJKJKJKABABCBCBABABCBCBABABCBCBDEDECECEFGFGFGFGABABCBCBABABCBCBABABCBCBDEDECECE'
    'FGFGFGFGHIHIHIHIHIHIHIHIHIHIHIHIHIHIHIHIJKJKJKJKABABCBCBABABCBCBABABCBCBDEDECECEFGFGFGFGABABCBCB'
    'ABABCBCBABABCBCBDEDECECEFGFGFGFGHIHIHIHIHIHIHIHIHIHIHIHIHIHIHIHIJKJKJKJKABABCBCBABABCBCBABABCBCB'
    'DEDECECEFGFGFGFGABABCBCBABABCBCBABABCBCBDEDECECEFGFGFGFGHIHIHIHIHIHIHIHIHIHIHIHIHIHIHIHIJKJKJKJK'
    'ABABCBCBABABCBCBLMLBWBWBNONPXEXEFGFGFGFGABABCBCBABABCBCBLMLBWBWBNONPXEXEFGFGFGFGHIHIHIHIHIHIHIHI'
    'HIHIHIHIHIHIHIHIJKJKJKJKABABCBCBABABCBCBLMLBWBWBNQNRXEXEFGFGFGFGABABCBCBABABCBCBLMLBWBWBNQNRXEXE'
    'FGFGFGFGHIHIHIHIHIHIHIHIHIHIHIHIHIHIHIHIJKJKJKJKABABCBCBABABCBCBABABCBCBDSDSCECEFGFGFGFGABABCBCB'
    'ABABCBCBABABCBCBDSDSCECEFGFGFGFGHIHIHIHIHIHIHIHIHIHIHIHIHIHIHIHIJKJKJKJKABABCBCBABABCBCBABABCBCB'
    'DTDTCECEFGFGFGFGABABCBCBABABCBCBABABCBCBDTDTCECEFGFGFGFGHIHIHIHIHIHIHIHIHIHIHIHIHIHIHIHIJKJKJKJK'
    'UVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUV'
    'UVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUV'
    'UVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUV'
    'UVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUV'
    'UVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUVUV'
)


@pytest.fixture(autouse=True)
def no_forced_path(monkeypatch):
    monkeypatch.delenv(dispatch.PATH_ENV, raising=False)


def test_every_plan_is_the_old_choosers_choice():
    """Over head_dim × length (odd ones and every table boundary ± 1) × dtype × causality × deterministic ×
    capability × aligned inputs × B·H (the dS buffer's cap) × direction, and under the interpreter: the same path and
    tiles as before the split."""
    code = "".join(EXPECTED)
    keys = list(grid())
    assert len(keys) == len(code)
    wrong = []
    for (interpret, cap, aligned, bh, dtype, d, causal, det, direction), letter in zip(keys, code):
        segments = PLANS[letter]
        for n in SEQS:
            want = [v for start, v in segments if start <= n][-1]
            got = described(direction, plan(direction, d, n, DTYPES[dtype], causal, deterministic=det,
                                             capability=CAPABILITIES[cap], gluon_inputs=aligned, batch_heads=bh,
                                             interpret=interpret))
            if got != want:
                wrong.append((interpret, cap, aligned, bh, dtype, d, causal, det, direction, n, got, want))
    assert not wrong, f"{len(wrong)} plans changed, e.g. {wrong[:5]}"


def test_single_kernel_plans_match_the_backward_plan():
    """Ring attention launches the dQ and dK/dV kernels one at a time; their plans are the backward's pieces."""
    for d, n, causal in itertools.product((16, 64, 128, 256), (100, 1024, 4096, 65536), (True, False)):
        options = dict(deterministic=True, capability=(9, 0), gluon_inputs=True, interpret=False)
        whole = plan("bwd", d, n, torch.bfloat16, causal, **options)
        if whole.path == "triton":
            assert plan("dq", d, n, torch.bfloat16, causal, **options).tiles == whole.dq_tiles
            assert plan("dkdv", d, n, torch.bfloat16, causal, **options).tiles == whole.tiles


def test_every_row_says_why_and_keeps_the_kernels_tiling():
    """Each row of the one table names its reason (a NOTES.md section, or the tests for the interpreter's), and keeps
    the tiling the kernels assume: the dQ query tile a whole number of key tiles, the dK/dV key tile a whole number
    of query tiles (Triton), the forward's tiles powers of two (either may be the larger), a register cap ptxas accepts, and
    Gluon rows only where a Gluon kernel exists."""
    for e in dispatch.TABLE:
        assert "NOTES.md" in e.why or e.when == "interpreter", e
        c = e.tiles
        outer, inner = (c.block_n, c.block_m) if e.kernel == "dkdv" else (c.block_m, c.block_n)
        if e.kernel == "fwd":
            outer, inner = max(outer, inner), min(outer, inner)
        assert c.specialized or outer % inner == 0, e  # the Triton kernels' rule (Gluon's: 64-row consumers)
        assert not c.specialized or c.block_m % 64 == 0, e
        assert c.maxnreg is None or (24 <= c.maxnreg <= 255 and c.maxnreg % 8 == 0), e
        assert not c.specialized or (e.when in ("sm90", "sm90-masks", "sm90-non-causal")
                                     and set(e.head_dims) <= {64, 128}), e
        assert e.when in ("interpreter", "fp32", "sm90-non-causal", "non-causal", "sm90", "sm90-masks", "causal",
                          "any"), e
        assert e.when != "sm90-non-causal" or (e.kernel == "fwd" and not e.masks), e  # the Gluon forward alone
        # the masked Gluon kernels: the forward and the five-matmul backward
        assert (e.when == "sm90-masks") <= (e.masks and e.kernel in ("fwd", "dkdvdq")), e


@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
def test_every_call_finds_a_row(kernel):
    """No head_dim, dtype, causality or length falls through the table."""
    for d, dtype, causal, interpret in itertools.product(dispatch.ALL_HEAD_DIMS, DTYPES.values(), (True, False),
                                                         (True, False)):
        for n in (None, 1, 1 << 20):
            assert plan(kernel, d, n, dtype, causal, interpret=interpret).tiles is not None


BF16 = dict(dtype=torch.bfloat16, causal=True, capability=(9, 0), gluon_inputs=True, interpret=False)


def ask(kernel, head_dim, seq_len, path=None, **overrides):
    options = {**BF16, **overrides}
    dtype, causal = options.pop("dtype"), options.pop("causal")
    return plan(kernel, head_dim, seq_len, dtype, causal, path=path, **options)


def test_forced_triton_path_takes_the_triton_kernels_of_that_length():
    assert ask("fwd", 64, 8192).path == "gluon"
    forced = ask("fwd", 64, 8192, "triton")
    assert forced.path == "triton" and forced.tiles == TileConfig(64, 128, 4, 2, tma=True)  # the by-length row
    for det in (False, True):
        bwd = ask("bwd", 128, 16384, "triton", deterministic=det)
        assert bwd.path == "triton" and not bwd.dq_tiles.specialized and bwd.tiles == TileConfig(64, 64, 4, 2, tma=True)
    assert ask("bwd", 128, 512, "triton").path == "triton"  # not the dS path the table takes there


def test_forced_gluon_path_takes_the_first_gluon_row_below_the_tables_lengths():
    assert ask("fwd", 64, 512, "gluon").tiles == TileConfig(128, 128, 4, 3, tma=True, specialized=True, persistent=True)
    assert ask("bwd", 64, 512, "gluon").tiles == TileConfig(64, 128, 4, 3, tma=True, specialized=True, persistent=True)
    assert ask("bwd", 64, 65536, "gluon").tiles == ask("bwd", 64, 65536).tiles
    det = ask("bwd", 128, 8192, "gluon", deterministic=True)  # deterministic: the seven-matmul one with Gluon's dQ
    assert det.path == "triton" and det.dq_tiles.specialized
    # the non-causal forward: the first sm90-non-causal row below the table's lengths (the backward has none)
    assert ask("fwd", 128, 512, "gluon", causal=False).tiles == ask("fwd", 128, 4096, causal=False).tiles
    assert ask("fwd", 64, 512, "gluon", causal=False, masked=True).tiles.specialized  # GQA alone
    for why, call in (("interpreter", dict(interpret=True)), ("fp32", dict(dtype=torch.float32)),
                      ("non-causal", dict(causal=False)), ("sm_80", dict(capability=(8, 0))),
                      ("unaligned", dict(gluon_inputs=False)), ("head_dim 32", dict()),
                      ("deterministic at 64", dict(deterministic=True))):
        for direction in ("fwd", "bwd"):
            if why in ("deterministic at 64", "non-causal") and direction == "fwd":
                continue
            with pytest.raises(ValueError, match="allowed values are auto, triton, via_ds, gluon"):
                ask(direction, 32 if why == "head_dim 32" else 64, 4096, "gluon", **call)


def test_forced_via_ds_path_keeps_ds_where_its_tiles_are_square_and_its_buffer_fits():
    p = ask("bwd", 128, 4096, "via_ds")
    assert p.path == "via_ds" and p.tiles == TileConfig(64, 64, 4, 2, tma=True) and p.dq_tiles == TileConfig(64, 64, 4, 3)
    assert ask("fwd", 128, 4096, "via_ds").path == "triton"  # the dS path is a backward; the forward is Triton's
    for call in (dict(causal=False), dict(dtype=torch.float32), dict(interpret=True), dict(batch_heads=1 << 20)):
        with pytest.raises(ValueError, match="allowed values"):
            ask("bwd", 128, 4096, "via_ds", **call)
    with pytest.raises(ValueError, match="square"):
        ask("bwd", 256, 4096, "via_ds")


def test_the_environment_variable_forces_the_path(monkeypatch):
    monkeypatch.setenv(dispatch.PATH_ENV, "triton")
    assert ask("fwd", 64, 8192).path == "triton"
    monkeypatch.setenv(dispatch.PATH_ENV, "auto")
    assert ask("fwd", 64, 8192).path == "gluon"
    monkeypatch.setenv(dispatch.PATH_ENV, "cudnn")
    with pytest.raises(ValueError, match="MINIGPT_FLASH_PATH='cudnn': allowed values are auto, triton, via_ds, gluon"):
        ask("fwd", 64, 8192)


def test_the_ds_buffer_cap_is_read_at_each_call(monkeypatch):
    """VIA_DS_MAX_BYTES bounds the dS buffer (B·H·ds_head_elements(N, 64)·2 bytes); a buffer of exactly the cap
    takes the path, one byte more does not."""
    need = 16 * dispatch.ds_head_elements(1024, 64) * 2
    monkeypatch.setattr(dispatch, "VIA_DS_MAX_BYTES", need)
    assert ask("bwd", 128, 1024, batch_heads=16).path == "via_ds"
    monkeypatch.setattr(dispatch, "VIA_DS_MAX_BYTES", need - 1)
    assert ask("bwd", 128, 1024, batch_heads=16).path == "triton"


def test_the_non_causal_forward_takes_the_causal_rows_gluon_tiles_on_sm90():
    """Rows sm90-non-causal: a non-causal forward that fits the Gluon forward (launch.gluon_forward_ready: ring
    attention's blocks of other ranks, continued, GQA included) runs it with the causal rows' tiles for its query
    length, from 1K rows; unfit inputs, other devices, fp32, the interpreter and the backward keep their plans."""
    for d, n in itertools.product((64, 128), (1024, 1152, 2048, 4096, 65536, 131072)):
        causal, dense = ask("fwd", d, n), ask("fwd", d, n, causal=False)
        assert dense.path == "gluon" and dense.tiles == causal.tiles, (d, n)
        assert ask("fwd", d, n, causal=False, masked=True).tiles == causal.tiles  # GQA alone (the predicate's say)
        for call in (dict(gluon_inputs=False), dict(capability=(8, 0)), dict(dtype=torch.float32),
                     dict(interpret=True), dict(path="triton")):
            assert ask("fwd", d, n, causal=False, **call).path == "triton", (d, n, call)
        assert ask("fwd", d, n, causal=False, masked=True, gluon_inputs=False).path == "triton"  # masks: Triton's
        for kernel in ("bwd", "dq", "dkdv"):
            p = ask(kernel, d, n, causal=False)
            assert not p.tiles.specialized and (p.dq_tiles is None or not p.dq_tiles.specialized), (kernel, d, n)
    assert ask("fwd", 64, 1023, causal=False).path == "triton"  # below the Gluon rows' lengths


def test_forwards_fold_their_accumulator_from_long_rows_on():
    """Chains of FOLD_KEYS keys from FOLD_FROM_KEYS keys on, one chain below (kernels/NOTES.md, the truncation bias);
    under a window, from the keys a row sees (at most 2·window − 1). Holds for the MINIGPT_FOLD_* overrides too."""
    from minigpt_kernels.dispatch import FOLD_FROM_KEYS, FOLD_KEYS, fold_tiles

    assert fold_tiles(FOLD_FROM_KEYS - 1, 128) == 0
    assert fold_tiles(FOLD_FROM_KEYS, 128) == max(1, FOLD_KEYS // 128)
    assert fold_tiles(1 << 22, 64) == max(1, FOLD_KEYS // 64) and fold_tiles(FOLD_FROM_KEYS, 4 * FOLD_KEYS) == 1
    assert fold_tiles(1 << 22, 128, window=FOLD_FROM_KEYS // 2) == 0  # 2·window − 1 keys a row: under the threshold
    assert fold_tiles(1 << 22, 128, window=FOLD_FROM_KEYS // 2 + 1) == max(1, FOLD_KEYS // 128)

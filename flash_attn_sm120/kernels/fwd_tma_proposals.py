"""TMA forward configs proposed for measurement, per head dim, with the masks each compiles for.

Each entry is ((num_threads, tile_m, tile_n, num_stages, q_in_regs), masks): the mask kinds the
config compiles for without spills on sm_120a in bf16 and fp16 (tests/test_fwd_tma_codegen.py
checks them; scripts/smoke_tma.py and the GPU tests run them). R = rows per warp / 16. R=1 tiles
(8 warps x 16 rows) run the intra-warp overlap; R=2 tiles halve the ldmatrix traffic per mma.sync
(shared memory bandwidth bounds R=1 on an H200 in emulation) at the price of registers, so they
run the plain FA2 order (fwd_tma_rules.use_intra_warp_overlap). Search data, not kernel code: the
upstream patch leaves it out.
"""

ALL_MASKS = ("none", "causal", "local")
PROPOSED_CONFIGS: dict[int, tuple] = {
    128: (
        ((256, 128, 64, 2, False), ALL_MASKS),
        ((256, 128, 64, 2, True), ("none", "causal")),  # bf16 local spills with Q in registers
        ((256, 256, 32, 2, False), ("none",)),  # R=2
        ((256, 256, 48, 1, False), ("none", "causal")),  # R=2, one K and one V slot: 48 keys fit 99 KB
        # R=2, one slot each, 96 KB: causal only (non-causal bf16 spills 16 B); bf16 only (fp16_register_error)
        ((256, 256, 64, 1, False), ("causal",)),
        ((128, 128, 32, 2, False), ALL_MASKS),  # R=2, 4 warps
    ),
    96: (
        ((256, 128, 64, 3, True), ALL_MASKS),
        ((256, 128, 64, 2, True), ALL_MASKS),
        ((256, 256, 32, 2, False), ALL_MASKS),  # R=2
        # 4 warps R=2, 2 CTAs/SM (38 / 44 KB): the TMA twins of the cp.async 2-CTA non-causal entries
        ((128, 128, 32, 1, False), ALL_MASKS),
        ((128, 128, 48, 1, False), ("none",)),  # local spills 8 B
    ),
    64: (
        ((256, 128, 128, 2, True), ALL_MASKS),
        ((256, 128, 64, 3, True), ALL_MASKS),
        ((256, 256, 64, 2, False), ALL_MASKS),  # R=2
        ((128, 64, 64, 2, True), ALL_MASKS),  # 2 CTAs/SM (41 KB each): two tiles interleave per SM
        # 4 warps R=2, 2 CTAs/SM (35 / 43 / 35 KB): the TMA twins of the cp.async 2-CTA entry (4w 128x80 s1)
        ((128, 128, 64, 1, False), ALL_MASKS),
        ((128, 128, 48, 2, False), ALL_MASKS),
        ((128, 128, 32, 2, False), ALL_MASKS),
    ),
}


# The persistent tile order (FwdConfig.persistent, persistent_scheduler.py) on the configs that stay
# spill-free with it on sm_120a (tests/test_fwd_tma_persistent.py compiles each): the tile loop
# keeps more values live, and the 32-row-warp d128 tiles, the 16-row d96 q-in-registers tiles and
# most block-sparse walks spill with it (8 to 256 B). Entries: (head_dim, (num_threads, tile_m,
# tile_n, num_stages, q_in_regs), masks, block_sparse_ok).
PERSISTENT_CONFIGS: tuple = (
    (64, (256, 256, 64, 3, True), ("none", "causal"), False),  # the d64 causal table entry
    (64, (256, 256, 64, 2, False), ("none", "causal"), False),
    (64, (256, 128, 128, 2, True), ("none", "causal"), False),
    (64, (256, 128, 64, 3, True), ("none", "causal"), False),
    # 4 warps R=2, two CTAs per SM (35 KB): the d64 short-causal and block-sparse entries' tile
    (64, (128, 128, 64, 1, False), ("none", "causal"), True),
    (96, (256, 256, 64, 2, False), ("none", "causal"), False),  # the d96 causal table entry
    (96, (256, 256, 32, 2, False), ("none", "causal"), False),
    (96, (128, 64, 64, 2, False), (), True),
    (128, (256, 256, 32, 2, False), ("none",), False),
    (128, (128, 128, 32, 2, False), ("none", "causal"), False),
    (128, (128, 64, 64, 2, False), (), True),
    (128, (128, 64, 128, 1, False), (), True),
)


# Persistent with two Q slots (FwdConfig.q_stages=2): the producer loads the next tile's Q under the current
# tile's main loop, and the epilogue's sO takes the slot being retired, so a tile no longer starts by waiting
# for its Q. Same entry format as PERSISTENT_CONFIGS; the extra Q tile must fit 99 KB with the rings, and each
# entry compiles spill-free on sm_120a in the masks it lists (tests/test_fwd_tma_persistent.py).
Q_RING_CONFIGS: tuple = (
    (64, (256, 256, 64, 2, False), ("none", "causal"), False),  # 256 rows: no 128-row sparse block
    (64, (256, 128, 64, 3, False), ("none", "causal"), True),
    (64, (128, 128, 48, 1, False), ("none", "causal"), False),  # 45 KB: still two CTAs per SM; 48 keys
    (96, (256, 128, 64, 2, False), ("none", "causal"), False),  # its block-sparse walk spills 64 B
    (96, (128, 64, 64, 2, False), (), True),
    (128, (256, 128, 64, 1, False), ("none", "causal"), False),  # its block-sparse walk spills 64 B
    (128, (128, 64, 64, 2, False), (), True),
    (128, (128, 64, 128, 1, False), (), True),
)


# The dynamic tile order (FwdConfig.dynamic: persistent CTAs take tiles from a global counter) on tiles that
# stay spill-free with it on sm_120a (the d96 causal table entry's tile, 8w 256x64 s2, spills 8-64 B with it):
# (head_dim, (num_threads, tile_m, tile_n, num_stages, q_in_regs), masks, block_sparse_ok, q_stages).
DYNAMIC_CONFIGS: tuple = (
    (64, (256, 256, 64, 3, True), ("none", "causal"), False, 1),  # the d64 causal table entry's tile
    (64, (256, 256, 64, 2, False), ("none", "causal"), False, 2),
    (64, (128, 128, 64, 1, False), ("none", "causal"), False, 1),  # two CTAs per SM; its sparse walk spills 88 B
    (64, (256, 128, 64, 3, False), ("causal",), True, 2),
    (96, (256, 128, 64, 2, False), ("causal",), False, 2),
    (96, (128, 64, 64, 2, False), (), True, 2),
    (128, (256, 128, 64, 1, False), ("none", "causal"), True, 2),  # the block-sparse d128 tile, 8 warps
    (128, (128, 128, 32, 2, False), ("causal",), False, 1),
    (128, (128, 64, 64, 2, False), (), True, 2),
)

"""GPU correctness of the TMA family's ping-pong schedule (FwdConfig.pingpong, two MMA warpgroups).

Each 8-warp proposed config runs with the two warpgroups taking turns at the tensor pipe, in both
block orders (16-row warps overlap QK^T and PV; 32-row warps run the plain order), against an fp32
reference with NaN-poisoned outputs (test_fwd_tma_gpu's check and rule). The turns must balance for
every block count, so the shapes include one key block, zero visible blocks for some rows (causal with
seqlen_q > seqlen_k), local windows and packed GQA; one block-sparse case covers the walk over listed
tiles (a Q tile with no listed blocks takes no turn).
"""

import pytest

from test_fwd_tma_gpu import MASKS, _check
from flash_attn_sm120 import bench, testing_sparse
from flash_attn_sm120.config import FwdConfig
from flash_attn_sm120.kernels.fwd_tma import PROPOSED_CONFIGS

pytestmark = pytest.mark.gpu

PINGPONG = [
    (d, FwdConfig(*c, family="tma", pingpong=True), masks)
    for d, entries in PROPOSED_CONFIGS.items() for c, masks in entries if c[0] == 256
]
SHAPES = [(1, 1), (17, 17), (257, 257), (333, 1000), (1000, 333), (64, 2000)]


@pytest.mark.parametrize("d,cfg,masks", PINGPONG, ids=[f"d{d}-{c.name}" for d, c, _ in PINGPONG])
def test_pingpong_matches_reference(d, cfg, masks):
    for mask in masks:
        causal, window = MASKS[mask]
        for sq, sk in SHAPES:
            _check(cfg, bench.Problem(2, sq, sk, 4, 2, d), causal, window, seed=sq + sk + d)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_pingpong_packed_gqa_both_dtypes(dtype):
    cfg = FwdConfig(256, 128, 64, 2, False, "tma", pingpong=True)
    for sq, sk in [(1, 1), (333, 1000), (257, 257)]:
        _check(cfg, bench.Problem(2, sq, sk, 8, 2, 128, dtype=dtype), True, (None, None), seed=sq, pack_gqa=True)


@pytest.mark.parametrize("tile_m", [128, 256])
def test_pingpong_block_sparse(tile_m):
    import flash_attn_sm120
    from test_block_sparse_gpu import _inputs, _map_case, check

    b, h, sq, sk, d = 2, 3, 517, 700, 64
    q, k, v, _ = _inputs(b, sq, sk, h, h, d, seed=tile_m)
    block = (256, 128)
    kinds = _map_case(b, h, sq, sk, block, seed=3, density=0.4)
    kinds[0, 0, 0] = testing_sparse.SKIP  # a Q tile with nothing listed
    keep = testing_sparse.keep_from_map(kinds, block, sq, sk)
    cfg = FwdConfig(256, tile_m, 64, 2, False, "tma", pingpong=True)
    with flash_attn_sm120.driver.force_config(cfg):
        check(q, k, v, keep, dict(block_sparse_tensors=testing_sparse.lists_from_map(kinds, block)))


def test_pingpong_needs_two_warpgroups():
    cfg = FwdConfig(128, 64, 64, 2, False, "tma", pingpong=True)
    assert "two MMA warpgroups" in cfg.error(128, 128)
    with pytest.raises(ValueError, match="two MMA warpgroups"):
        _check(cfg, bench.Problem(1, 128, 128, 2, 2, 128), False, (None, None))

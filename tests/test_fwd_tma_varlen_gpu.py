"""GPU correctness of varlen in the TMA forward family (real SM120, or SM120 emulation).

Every TMA table entry that takes varlen calls, and the family's 128x64 path, run packed q and K/V
(cu_seqlens) and padded q (seqused_q) over packed K/V, through the driver with the config forced (an
explicit config that the family refused would raise, so a pass means the TMA kernel ran).
flash_attn_sm120.testing fills every byte a correct kernel must not read with NaN and poisons
out/LSE, then checks each sequence against fp32 with upstream's rule. Lengths include 0, 1 and
non-multiples of the tiles, seqlen_q != seqlen_k both ways, GQA unpacked, every mask kind.
`test_seqused_k_within_packed_kv` puts NaN in the packed K/V rows past seqused_k: the ragged
descriptors must keep them out of P V (0 * NaN would poison the row).
"""

import pytest
import torch

from flash_attn_sm120 import bench, driver, testing
from flash_attn_sm120.device import device_info
from flash_attn_sm120.config import FwdConfig, family_entries
from flash_attn_sm120.paths import KernelPath, Supports

# a hung kernel (mbarrier/TMA) ends the process through conftest.hang_watchdog
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hang_watchdog")]


def _configs():
    out = {(e.head_dim, e.config) for e in family_entries("tma") if e.config.varlen_error(e.head_dim) is None}
    out |= {(d, FwdConfig(256, 128, 64, 2, family="tma")) for d in (64, 96, 128)}
    return [pytest.param(d, cfg, id=f"d{d}-{cfg.name}") for d, cfg in sorted(out, key=lambda x: (x[0], x[1].name))]


PROBLEMS = {
    # (seqlens_q, seqlens_k): empty sequences, a single row, tile non-multiples, q longer and shorter than k
    "mixed": ((0, 1, 333, 77, 1000), (50, 0, 260, 1000, 999)),
    "long": ((1500, 700), (1500, 2100)),
}


@pytest.mark.parametrize("mask", ["none", "causal", "local_lr", "causal_l", "local_r"])
@pytest.mark.parametrize("layouts", [("packed", "packed"), ("padded", "packed")], ids=["packed", "seqused_q"])
@pytest.mark.parametrize("d,cfg", _configs())
def test_varlen_matches_reference(d, cfg, layouts, mask):
    path = KernelPath(f"tma-varlen-{cfg.name}", "tma", cfg, Supports(head_dims=(d,), mixed_head_dims=False))
    case = testing.AttnCase(dtype="bfloat16", head_dim=d, head_dim_v=d, qhead_per_kvhead=2, pack_gqa=None, mask=mask,
                            return_lse=True, q_layout=layouts[0], k_layout=layouts[1])
    for name, (sq, sk) in PROBLEMS.items():
        problem = testing.AttnProblem(sq, sk, nheads_kv=2, window_left=100, window_right=37, pad_q=17, seed=len(name))
        testing.run_case(path, "driver", case, problem)


@pytest.mark.parametrize("d", [64, 128])
def test_varlen_float16_softcap_and_mqa(d):
    cfg = FwdConfig(256, 128, 64, 2, family="tma")
    path = KernelPath("tma-varlen-fp16", "tma", cfg, Supports(head_dims=(d,), mixed_head_dims=False))
    case = testing.AttnCase(dtype="float16", head_dim=d, head_dim_v=d, qhead_per_kvhead=4, pack_gqa=None,
                            mask="causal", softcap=15.0, return_lse=True, q_layout="packed", k_layout="packed")
    testing.run_case(path, "driver", case, testing.AttnProblem((129, 1000, 5), (700, 1000, 64), nheads_kv=1, seed=3))


def test_public_varlen_call_takes_the_tma_entry():
    """flash_attn_varlen_func with the dispatcher's choice (nothing forced) on a GQA causal d128 batch."""
    path = KernelPath("table", "dispatch", None, Supports())
    case = testing.AttnCase(dtype="bfloat16", head_dim=128, head_dim_v=128, qhead_per_kvhead=4, pack_gqa=None,
                            mask="causal", return_lse=True, q_layout="packed", k_layout="packed")
    testing.run_case(path, "public", case, testing.AttnProblem((312, 1024, 77, 2048), (312, 1024, 77, 2048),
                                                               nheads_kv=2, seed=4))


@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k_within_packed_kv(causal):
    cfg = FwdConfig(256, 128, 64, 2, family="tma")
    lens_q, lens_k, used_k = (200, 1, 513), (300, 64, 700), (170, 0, 650)
    h, hk, d = 4, 2, 128
    g = torch.Generator(device="cuda").manual_seed(7)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), h, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(sum(lens_k), hk, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(sum(lens_k), hk, d, device="cuda", generator=g).bfloat16()
    for i, u in enumerate(used_k):  # the rows past seqused_k: never read
        k[cu_k[i] + u : cu_k[i + 1]] = float("nan")
        v[cu_k[i] + u : cu_k[i + 1]] = float("nan")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((h, q.shape[0]), float("nan"), device="cuda")
    seqused_k = torch.tensor(used_k, dtype=torch.int32, device="cuda")
    driver.forward(q, k, v, softmax_scale=None, causal=causal, window_size_left=None, window_size_right=None,
                   softcap=None, pack_gqa=None, need_lse=True, emulate_host_smem=device_info().emulate_host_smem,
                   cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused_k, out=out, lse=lse, config=cfg)
    torch.cuda.synchronize()
    for i, (nq, u) in enumerate(zip(lens_q, used_k)):
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i] + u)
        o, l = out[sq], lse[:, sq]
        assert not torch.isnan(o).any() and not torch.isnan(l).any(), i
        if u == 0:  # no key: zero output, LSE -inf (upstream's empty row)
            assert (o == 0).all() and torch.isneginf(l).all(), i
            continue
        ref, ref_lse = bench.reference_attention(q[None, sq], k[None, sk], v[None, sk], causal=causal)
        low, _ = bench.reference_attention(q[None, sq], k[None, sk], v[None, sk], causal=causal, upcast=False)
        err = bench.error_vs_reference(o[None], ref)
        assert err <= 2 * bench.error_vs_reference(low, ref) + 1e-3, (i, err)
        finite = torch.isfinite(ref_lse[0])
        assert torch.equal(torch.isfinite(l), finite), i
        assert torch.allclose(l[finite], ref_lse[0][finite], atol=1e-3, rtol=1e-3), i


@pytest.mark.parametrize("pack_gqa", [False, True])
@pytest.mark.parametrize("layouts", [("packed", "packed"), ("padded", "packed")], ids=["packed", "seqused_q"])
def test_varlen_gqa_packed_and_not(layouts, pack_gqa):
    """GQA 4:1 with the heads packed into the M tile (the ragged O descriptor packed as a dense one) and not."""
    cfg = FwdConfig(256, 128, 64, 2, True, family="tma")
    path = KernelPath("tma-varlen-gqa", "tma", cfg, Supports(head_dims=(128,), mixed_head_dims=False))
    case = testing.AttnCase(dtype="bfloat16", head_dim=128, head_dim_v=128, qhead_per_kvhead=4, pack_gqa=pack_gqa,
                            mask="causal", return_lse=True, q_layout=layouts[0], k_layout=layouts[1])
    testing.run_case(path, "driver", case, testing.AttnProblem((0, 33, 700, 129), (10, 64, 700, 1000), nheads_kv=2,
                                                               pad_q=5, seed=8))

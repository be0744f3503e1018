"""The fixed-point dQ's two helper kernels on the GPU, bit for bit against the torch path they replace.

* kernels/bwd_fixed_point_scales.py: the per-head scales in one launch must equal
  bwd_fixed_point.dq_scales (torch reductions + scales_from_patterns) bit for bit, NaN included, on
  bf16 and fp16, GQA, packed varlen tensors, a strided qkv-packed view, and inputs with zero,
  subnormal, huge, inf and NaN heads; layouts it cannot read give None (the driver then takes torch).
* kernels/bwd_fixed_point_post.py: dQ from the int64 accumulator must equal torch's dequantize followed
  by upstream's postprocess, bit for bit, dense and varlen, with dQ poisoned before the call.
"""

import pytest

torch = pytest.importorskip("torch")

from flash_attn_sm120.kernels import bwd_fixed_point as fp  # noqa: E402

pytestmark = pytest.mark.gpu


def _bits(t):
    return t.contiguous().view(torch.int32)


def _scales_both(k, v, do):
    from flash_attn_sm120.kernels import bwd_fixed_point_scales as fps

    got = fps.fixed_point_scales(k, v, do)
    assert got is not None
    want = fp.dq_scales(k, v, do)
    for g, w in zip(got, want):
        assert torch.equal(_bits(g), _bits(w)), (g, w)
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 1000, 8, 2, 128, 128), (1, 333, 6, 3, 96, 96), (3, 257, 4, 4, 64, 64),
                                   (1, 129, 4, 1, 192, 128), (1, 70, 2, 2, 256, 256)])
def test_scales_kernel_equals_torch_bit_for_bit(dtype, shape):
    b, s, h, hk, d, dv = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    rnd = lambda *sh: torch.randn(*sh, generator=gen, device="cuda").to(dtype)  # noqa: E731
    k, v, do = rnd(b, s, hk, d), rnd(b, s, hk, dv), rnd(b, s, h, dv)
    scale, inverse = _scales_both(k, v, do)
    assert torch.equal(scale * inverse, torch.ones_like(scale))
    # heads of every kind: zero, subnormal, huge, inf, NaN (each in one head; the others stay finite)
    tiny = torch.finfo(dtype).tiny / 4
    k[..., 0, :] = 0
    v[..., -1, :] = tiny
    do[:, 3 % s, 0, 5] = float(torch.finfo(dtype).max)
    _scales_both(k, v, do)
    do[:, 1, -1, 0] = float("inf")
    k[0, s // 2, hk - 1, d - 1] = float("nan")
    scale, _ = _scales_both(k, v, do)
    assert scale.isnan().any()
    if hk > 1:  # the NaN stays in the heads that read the bad values
        assert not scale.isnan().all()


def test_scales_kernel_reads_only_up_to_the_last_packed_sequence():
    """Rows past cu_seqlens[-1] (NaN here) do not count, as in the torch path; seqused: the kernel declines."""
    from flash_attn_sm120.kernels import bwd_fixed_point_scales as fps

    gen = torch.Generator(device="cuda").manual_seed(9)
    k, v, do = (torch.randn(3000, n, 128, generator=gen, device="cuda").to(torch.bfloat16) for n in (2, 2, 8))
    cu_q = torch.tensor([0, 1000, 2500], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 900, 2999], dtype=torch.int32, device="cuda")
    do[2500:] = float("nan")
    k[2999:] = float("nan")
    got = fps.fixed_point_scales(k, v, do, cu_q, cu_k)
    want = fp.dq_scales(k, v, do, cu_q, cu_k)
    assert not got[0].isnan().any()
    for g, w in zip(got, want):
        assert torch.equal(_bits(g), _bits(w))
    assert fps.fixed_point_scales(k, v, do, cu_q, cu_k, seqused_k=torch.tensor([5, 6], device="cuda")) is None


def test_scales_kernel_on_packed_varlen_and_strided_views():
    gen = torch.Generator(device="cuda").manual_seed(7)
    total, h, hk, d = 5003, 8, 2, 128
    k, v, do = (torch.randn(total, n, d, generator=gen, device="cuda").to(torch.bfloat16) for n in (hk, hk, h))
    _scales_both(k, v, do)
    qkv = torch.randn(2, 600, 3, 4, 64, generator=gen, device="cuda").to(torch.bfloat16)  # rows 3x a head block
    _scales_both(qkv[:, :, 1], qkv[:, :, 2], qkv[:, :, 0])


def test_scales_kernel_declines_layouts_it_cannot_read():
    from flash_attn_sm120.kernels import bwd_fixed_point_scales as fps

    x = torch.randn(2, 64, 4, 64, device="cuda").to(torch.bfloat16)
    transposed = x.transpose(0, 1).contiguous().transpose(0, 1)  # batches not s-major
    assert fps.rows_heads_words(transposed) is None
    assert fps.rows_heads_words(x[..., 4:]) is None  # rows of 60 elements, 8-byte offsets
    assert fps.fixed_point_scales(transposed, x, x) is None


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("d,tile_m,threads,atom,swap", [(128, 64, 256, 4, False), (96, 64, 128, 4, False),
                                                        (64, 128, 256, 4, True)])
def test_fixed_point_postprocess_equals_dequantize_then_upstream(varlen, d, tile_m, threads, atom, swap):
    import cutlass
    from flash_attn.cute.interface import _bwd_postprocess_convert
    from flash_attn_sm120.kernels.bwd_fixed_point_post import postprocess_dq_fixed

    gen = torch.Generator(device="cuda").manual_seed(d + tile_m)
    h, hdim_pad = 4, -(-d // 32) * 32
    if varlen:
        lens = [300, 1, 129, 64]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
        padded = sum(-(-n // tile_m) * tile_m + tile_m for n in lens)  # upstream's padded offsets, generously
        accum = torch.randint(-2**50, 2**50, (h, padded * hdim_pad), generator=gen, device="cuda")
        dq_shape = (sum(lens), h, d)
    else:
        cu, b, s = None, 2, 333
        accum = torch.randint(-2**50, 2**50, (b, h, -(-s // tile_m) * tile_m * hdim_pad), generator=gen, device="cuda")
        dq_shape = (b, s, h, d)
    inverse = torch.tensor([2.0 ** -40, 2.0 ** -52, 2.0 ** -45, float("nan")], device="cuda")
    want = torch.full(dq_shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    got = torch.full_like(want, float("nan"))
    _bwd_postprocess_convert(fp.dequantize(accum, inverse), want, 0.125, cu, None, 120, cutlass.BFloat16, d, tile_m,
                             threads, atom, swap, fake_mode=False, hdim_multiple_of=32)
    postprocess_dq_fixed(accum, inverse, got, 0.125, cu, None, cutlass.BFloat16, d, tile_m, threads, atom, swap)
    head = -2
    assert got.select(head, 3).isnan().all()  # the NaN head
    assert not got.narrow(head, 0, 3).isnan().any()  # every other element written
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("case_kw,seqlens", [
    (dict(head_dim=128, head_dim_v=128, qhead_per_kvhead=2, mask="none", mods="document"), ((300,), (300,))),
    (dict(head_dim=96, head_dim_v=96, qhead_per_kvhead=1, mask="none", dtype="float16"), ((333,), (260,))),
    (dict(head_dim=64, head_dim_v=64, qhead_per_kvhead=4, mask="causal", q_layout="padded", k_layout="padded"),
     ((200, 90), (260, 150))),
    # the loss uses the LSE too: dLSE enters D, the scales come from dq_scales' wider bound
    (dict(head_dim=128, head_dim_v=128, qhead_per_kvhead=2, mask="none", return_lse=True), ((300,), (280,))),
    (dict(head_dim=96, head_dim_v=96, qhead_per_kvhead=1, mask="causal", q_layout="packed", k_layout="packed",
          return_lse=True), ((200, 130), (260, 90))),
])
def test_the_plans_own_fixed_point_calls_run_twice_bitwise_and_correct(case_kw, seqlens):
    """Calls the plan now serves in fixed point without forcing (no mask, a mask_mod that replaces the mask,
    seqused, packed, an LSE gradient): the harness runs the public backward twice, bit for bit, and against
    fp32 autograd."""
    from flash_attn_sm120 import driver_bwd, testing

    case = testing.AttnCase(backward=True, deterministic=True, **case_kw)
    pad = dict(pad_q=5, pad_k=9) if case.q_layout == "padded" else {}
    problem = testing.AttnProblem(*seqlens, nheads_kv=2, seed=41, **pad)
    assert testing.deterministic_order(case, problem) == "fixed"
    testing.run_case("cpasync-table", "public", case, problem)
    assert any(s.dq_fixed_point and s.head_dim == case.head_dim and s.deterministic for s in driver_bwd._verified_keys)

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


def _scales_both(k, v, do, q=None, o=None, **index):
    """The kernel's scales against the torch path's, bit for bit (q, o: random where not given)."""
    from flash_attn_sm120.kernels import bwd_fixed_point_scales as fps

    q = torch.randn(*do.shape[:-1], k.shape[-1], device="cuda").to(do.dtype) if q is None else q
    o = (torch.rand_like(do, dtype=torch.float32) - 0.5).to(do.dtype) if o is None else o
    got = fps.fixed_point_scales(q, k, v, o, do, **index)
    assert got is not None
    want = fp.dq_scales(k, v, do, **index, q=q, out=o)
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
    q = torch.randn(3000, 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
    q[2500:] = float("nan")
    got = _scales_both(k, v, do, q=q, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert not got[0].isnan().any()
    cu_late = torch.tensor([100, 1000, 2500], dtype=torch.int32, device="cuda")  # rows before cu[0] do not count
    do[:100] = float("nan")
    assert not _scales_both(k, v, do, q=q, cu_seqlens_q=cu_late, cu_seqlens_k=cu_k)[0].isnan().any()
    assert fps.fixed_point_scales(q, k, v, do, do, cu_q, cu_k, seqused_k=torch.tensor([5, 6], device="cuda")) is None


def test_scales_kernel_on_packed_varlen_and_strided_views():
    gen = torch.Generator(device="cuda").manual_seed(7)
    total, h, hk, d = 5003, 8, 2, 128
    k, v, do = (torch.randn(total, n, d, generator=gen, device="cuda").to(torch.bfloat16) for n in (hk, hk, h))
    _scales_both(k, v, do)
    qkv = torch.randn(2, 600, 3, 4, 64, generator=gen, device="cuda").to(torch.bfloat16)  # rows 3x a head block
    _scales_both(qkv[:, :, 1], qkv[:, :, 2], qkv[:, :, 0])


def test_scales_take_the_callers_O_and_a_NaN_in_Q():
    """max(|V|, |O|) enters the bound (O is whatever the caller passes), and a NaN in Q makes its head's
    scales NaN (its dS would be NaN, which the int64 conversion turns into 0)."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    k, v, do = (torch.randn(1, 200, 2, 64, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
    base, _ = _scales_both(k, v, do)
    big_o = torch.full_like(do, 64.0)
    wide, _ = _scales_both(k, v, do, o=big_o)
    assert (wide < base).all()
    q = torch.randn(1, 200, 2, 64, generator=gen, device="cuda").to(torch.bfloat16)
    q[0, 7, 1, 3] = float("nan")
    scale, _ = _scales_both(k, v, do, q=q)
    assert scale[1].isnan() and not scale[0].isnan()


def test_scales_kernel_declines_layouts_it_cannot_read():
    from flash_attn_sm120.kernels import bwd_fixed_point_scales as fps

    x = torch.randn(2, 64, 4, 64, device="cuda").to(torch.bfloat16)
    transposed = x.transpose(0, 1).contiguous().transpose(0, 1)  # batches not s-major
    assert fps.rows_heads_words(transposed) is None
    assert fps.rows_heads_words(x[..., 4:]) is None  # rows of 60 elements, 8-byte offsets
    assert fps.fixed_point_scales(x, transposed, x, x, x) is None


@pytest.mark.parametrize("layout", ["dense", "varlen", "seqused", "many"])
@pytest.mark.parametrize("d,tile_m,threads,atom,swap", [(128, 64, 256, 4, False), (96, 64, 128, 4, False),
                                                        (64, 128, 256, 4, True)])
def test_fixed_point_postprocess_equals_dequantize_then_upstream(layout, d, tile_m, threads, atom, swap):
    """Bit for bit, with a softmax scale that is not a power of two (so that folding 2^-k_h into it would
    change the rounding); dense, packed, dense with seqused, and more than 256 sequences (upstream's
    batch-lookup aid)."""
    import cutlass
    from flash_attn.cute.interface import _bwd_postprocess_convert
    from flash_attn_sm120.kernels.bwd_fixed_point_post import postprocess_dq_fixed

    gen = torch.Generator(device="cuda").manual_seed(d + tile_m)
    h, hdim_pad = 4, -(-d // 32) * 32
    cu = used = None
    if layout in ("varlen", "many"):
        lens = [300, 1, 129, 64] if layout == "varlen" else [1 + (7 * i) % 37 for i in range(300)]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
        padded = sum(-(-n // tile_m) * tile_m + tile_m for n in lens)  # upstream's padded offsets, generously
        accum = torch.randint(-2**50, 2**50, (h, padded * hdim_pad), generator=gen, device="cuda")
        dq_shape = (sum(lens), h, d)
    else:
        b, s = 2, 333
        used = torch.tensor([333, 150], dtype=torch.int32, device="cuda") if layout == "seqused" else None
        accum = torch.randint(-2**50, 2**50, (b, h, -(-s // tile_m) * tile_m * hdim_pad), generator=gen, device="cuda")
        dq_shape = (b, s, h, d)
    inverse = torch.tensor([2.0 ** -40, 2.0 ** -52, 2.0 ** -45, float("nan")], device="cuda")
    softmax_scale = d ** -0.5
    want = torch.full(dq_shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    got = torch.full_like(want, float("nan"))
    _bwd_postprocess_convert(fp.dequantize(accum, inverse), want, softmax_scale, cu, used, 120, cutlass.BFloat16, d,
                             tile_m, threads, atom, swap, fake_mode=False, hdim_multiple_of=32)
    postprocess_dq_fixed(accum, inverse, got, softmax_scale, cu, used, cutlass.BFloat16, d, tile_m, threads, atom, swap)
    rows = got if used is None else got[:, :150]  # (seqused: rows past a sequence's used length stay unwritten)
    assert rows.select(-2, 3).isnan().all()  # the NaN head
    assert not rows.narrow(-2, 0, 3).isnan().any()  # every other element written
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("case_kw,seqlens", [
    (dict(head_dim=128, head_dim_v=128, qhead_per_kvhead=2, mask="none", mods="document"), ((300,), (300,))),
    # (more n_blocks than m_blocks on the d96 rotated entry's 64x128 tile: fixed point on the key's entry)
    (dict(head_dim=96, head_dim_v=96, qhead_per_kvhead=1, mask="none", dtype="float16"), ((120,), (333,))),
    (dict(head_dim=64, head_dim_v=64, qhead_per_kvhead=4, mask="causal", q_layout="padded", k_layout="padded"),
     ((200, 90), (260, 150))),
    # the loss uses the LSE too: dLSE enters D, the scales come from dq_scales' wider bound
    (dict(head_dim=128, head_dim_v=128, qhead_per_kvhead=2, mask="none", return_lse=True), ((300,), (280,))),
    (dict(head_dim=96, head_dim_v=96, qhead_per_kvhead=1, mask="causal", q_layout="packed", k_layout="packed",
          return_lse=True), ((200, 130), (260, 90))),
])
def test_the_plans_own_fixed_point_calls_run_twice_bitwise_and_correct(case_kw, seqlens, monkeypatch):
    """Calls the plan now serves in fixed point without forcing (no mask where no rotated turns entry serves
    the call, a mask_mod that replaces the mask, seqused, packed, an LSE gradient): the harness runs the
    public backward twice, bit for bit, and against fp32 autograd."""
    from flash_attn_sm120 import driver_bwd, testing

    case = testing.AttnCase(backward=True, deterministic=True, **case_kw)
    pad = dict(pad_q=5, pad_k=9) if case.q_layout == "padded" else {}
    problem = testing.AttnProblem(*seqlens, nheads_kv=2, seed=41, **pad)
    assert testing.deterministic_order(case, problem) == "fixed"
    calls = []  # the driver's fixed-point postprocess and its torch scales path, counted
    post, torch_scales = driver_bwd.postprocess_dq_fixed, driver_bwd.bwd_fixed_point.dq_scales
    monkeypatch.setattr(driver_bwd, "postprocess_dq_fixed", lambda *a, **kw: calls.append("post") or post(*a, **kw))
    monkeypatch.setattr(driver_bwd.bwd_fixed_point, "dq_scales",
                        lambda *a, **kw: calls.append(("torch", kw.get("dlse") is not None)) or torch_scales(*a, **kw))
    testing.run_case("cpasync-table", "public", case, problem)
    assert calls.count("post") >= 2  # both backward runs in fixed point
    if case.return_lse:  # dLSE takes the torch path with the wider bound
        assert ("torch", True) in calls and ("torch", False) not in calls
    elif case.q_layout != "padded":  # the one-launch scales kernel (seqused takes the masked torch path)
        assert not [c for c in calls if c != "post"]


@pytest.mark.parametrize("causal", [False, True])
def test_a_dominant_lse_gradient_stays_correct_in_fixed_point(causal):
    """A loss dominated by the LSE (dO ~1e-3, dLSE ~1e3): the old bound (without dLSE) would overflow the int64
    sums. dQ/dK/dV against fp32 autograd of the same loss, deterministic (fixed point without a causal mask,
    the turns with one), relative Frobenius error within bf16's."""
    from flash_attn_sm120 import flash_attn_func

    gen = torch.Generator(device="cuda").manual_seed(12)
    b, s, h, d = 2, 384, 4, 128
    q, k, v = (torch.randn(b, s, h, d, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_(True)
               for _ in range(3))
    g = (torch.randn(b, s, h, d, generator=gen, device="cuda") * 1e-3).to(torch.bfloat16)
    g_lse = torch.randn(b, h, s, generator=gen, device="cuda") * 1e3
    out, lse = flash_attn_func(q, k, v, causal=causal, deterministic=True, return_lse=True)
    got = torch.autograd.grad((out.float() * g.float()).sum() + (lse * g_lse).sum(), (q, k, v))
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    scores = torch.einsum("bqhd,bkhd->bhqk", leaves[0], leaves[1]) * d ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    ref_lse = torch.logsumexp(scores, dim=-1)
    ref_out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), leaves[2])
    ref = torch.autograd.grad((ref_out * g.float()).sum() + (ref_lse * g_lse).sum(), leaves)
    for name, a, r in zip(("dq", "dk", "dv"), got, ref):
        err = ((a.float() - r).norm() / r.norm()).item()
        assert a.isfinite().all() and err < 2e-2, (name, err)

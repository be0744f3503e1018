"""Fixed-point deterministic dQ (kernels/bwd_fixed_point.py) on the CPU: the scales' bound, the int64
accumulator's fp32 view, the conversion back, the plan's choice, the kernel's refusals, and sm_120a code
(one 64-bit reduction per dQ element, spill-free on every table entry)."""

import itertools
import math

import pytest

torch = pytest.importorskip("torch")

from flash_attn_sm120 import bwd_plans, codegen, driver_bwd  # noqa: E402
from flash_attn_sm120.config_bwd import load_bwd_table, select_bwd_config  # noqa: E402
from flash_attn_sm120.kernels import bwd_fixed_point as fp  # noqa: E402


def _qkv(h=4, hk=2, d=64, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda hh: (torch.randn(2, 50, hh, d, generator=gen) * scale).to(torch.bfloat16)  # noqa: E731
    return mk(hk), mk(hk), mk(h)


@pytest.mark.parametrize("scale", [1e-8, 1e-3, 1.0, 1e3, 1e8])
def test_scales_bound_every_partial_sum(scale):
    """2^k_h times the worst case of the docstring's bound stays under 2^59, within a factor 2 of it
    (the largest power of two that fits), and the inverse is exact."""
    k, v, do = _qkv(scale=scale)
    s, inv = fp.dq_scales(k, v, do)
    assert s.dtype == inv.dtype == torch.float32 and s.shape == (4,)
    for h in range(4):
        hk = h // 2
        bound = 2 * v.shape[-1] * do[..., h, :].float().abs().max() * v[..., hk, :].float().abs().max() * \
            k[..., hk, :].float().abs().max()
        product = float(bound) * float(s[h])
        if fp.SCALE_LOG2_RANGE[0] < math.log2(float(s[h])) < fp.SCALE_LOG2_RANGE[1]:
            assert 2.0 ** (fp.SCALE_LOG2_CEILING - 1) < product <= 2.0 ** fp.SCALE_LOG2_CEILING
        else:
            assert product <= 2.0 ** fp.SCALE_LOG2_CEILING
        assert float(s[h]) * float(inv[h]) == 1.0
        assert math.log2(float(s[h])).is_integer()


def test_a_real_dq_sum_fits_and_converts_back():
    """The exact dQ accumulator of random attention, in fixed point at the computed scale: within the
    bound, and back to fp32 within fp32's rounding."""
    k, v, do = _qkv(h=2, hk=2, d=32, seed=3)
    q = torch.randn(2, 50, 2, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    qf, kf, vf, dof = (t.double() for t in (q, k, v, do))
    p = torch.softmax(torch.einsum("bthd,bshd->bhts", qf, kf) / math.sqrt(32), dim=-1)
    o = torch.einsum("bhts,bshd->bthd", p, vf)
    dp = torch.einsum("bthd,bshd->bhts", dof, vf)
    ds = p * (dp - (dof * o).sum(-1).transpose(1, 2)[..., None])
    dq = torch.einsum("bhts,bshd->bhtd", ds, kf)  # (b, h, t, d): before the softmax scale, as accumulated
    s, inv = fp.dq_scales(k, v, do)
    fixed = torch.round(dq * s.double().view(1, -1, 1, 1))
    assert fixed.abs().max() < 2.0 ** fp.SCALE_LOG2_CEILING
    back = fp.dequantize(fixed.to(torch.int64).reshape(2, 2, -1), inv).reshape(dq.shape)
    assert torch.allclose(back.double(), dq, rtol=2 ** -23, atol=float(inv.max()))


def test_non_finite_heads_get_nan_scales_only_there():
    k, v, do = _qkv()
    do[0, 3, 1, 5] = float("nan")
    do[1, 7, 2, 0] = float("inf")
    s, inv = fp.dq_scales(k, v, do)
    assert s[[0, 3]].isfinite().all() and s[[1, 2]].isnan().all() and inv[[1, 2]].isnan().all()
    zero = torch.zeros_like(do)  # a zero bound: the clamped largest scale, finite
    s0, _ = fp.dq_scales(k, v, zero)
    assert (s0 == 2.0 ** fp.SCALE_LOG2_RANGE[1]).all()


@pytest.mark.parametrize("shape", [(2, 3, 256), (4, 1024)])
def test_accumulator_view_indexes_the_int64_elements(shape):
    """Element e of the fp32 view sits at byte 4e of the buffer, element e of the int64 accumulator at 8e:
    the kernel's address 2p - base."""
    acc, view = fp.fixed_accumulator(shape, "cpu")
    assert acc.dtype == torch.int64 and view.dtype == torch.float32 and view.shape == acc.shape
    assert view.is_contiguous() and view.data_ptr() == acc.data_ptr() and (acc == 0).all()
    base = acc.data_ptr()
    for index in itertools.product(*(range(0, n, max(1, n // 3)) for n in shape)):
        e = sum(i * st for i, st in zip(index, view.stride()))
        p = view[index].data_ptr()
        assert p == base + 4 * e and acc[index].data_ptr() == base + 8 * e == 2 * p - base


def test_dequantize_scales_each_head():
    acc = torch.arange(2 * 3 * 4, dtype=torch.int64).reshape(2, 3, 4) - 10
    inv = torch.tensor([1.0, 0.5, 0.25])
    out = fp.dequantize(acc, inv)
    assert out.dtype == torch.float32 and torch.equal(out, acc.float() * inv.view(1, 3, 1))
    varlen = fp.dequantize(acc[0], inv)
    assert torch.equal(varlen, acc[0].float() * inv.view(3, 1))


CFG = select_bwd_config(load_bwd_table(), 128, 128, False, False, False)
NONE = (None, None, None, None)


def test_the_plan_takes_fixed_point_for_all_but_dense_causal_calls_where_allowed():
    """Fixed point is the plan's choice where its bound holds, except for dense causal or windowed calls
    (the descending turns measured faster there), which take it only when forced."""
    assert bwd_plans.fixed_point_allowed(False)  # dense, varlen and block-sparse calls alike
    assert not bwd_plans.fixed_point_allowed(True)  # a user's score_mod_bwd: no bound
    for causal, index in itertools.product((False, True), (NONE, (1, 1, None, None), (None, None, 1, 1))):
        plan = driver_bwd.deterministic_plan(132, CFG, causal, 4096, 4096, index, fixed_point=True, local=True)
        if index == NONE:  # a dense window: descending turns
            assert plan["dq_descending"] and plan["reverse_n_blocks"] and not plan["dq_fixed_point"]
        else:
            assert plan["dq_fixed_point"] and sum(plan.values()) == 1 and plan == bwd_plans.FIXED_POINT_PLAN
        for allowed in (False, True):  # no window: turns, except where fixed point is allowed and not dense causal
            plan = driver_bwd.deterministic_plan(132, CFG, causal, 4096, 4096, index, fixed_point=allowed)
            if allowed and (index != NONE or not causal):
                assert plan == bwd_plans.FIXED_POINT_PLAN
            else:
                assert not plan["dq_fixed_point"] and plan["fused_turns"]
    with driver_bwd.force_deterministic_plan(fused_turns=True):  # forced turns win over fixed point
        assert not driver_bwd.deterministic_plan(132, CFG, True, 512, 512, NONE, fixed_point=True,
                                                 local=True)["dq_fixed_point"]
    with driver_bwd.force_deterministic_plan(dq_fixed_point=True):  # forced fixed point, where allowed
        assert driver_bwd.deterministic_plan(132, CFG, True, 512, 512, NONE, fixed_point=True)["dq_fixed_point"]
        with pytest.raises(ValueError, match="bound does not cover"):
            driver_bwd.deterministic_plan(132, CFG, True, 512, 512, NONE, fixed_point=False)


def test_the_kernel_refuses_fixed_point_off_its_rules():
    import cutlass

    from flash_attn_sm120.kernels.bwd_mods import FlashAttentionBackwardSm120Mods

    args = (cutlass.BFloat16, 128, 128, 1, CFG)
    with pytest.raises(ValueError, match="option of deterministic"):
        FlashAttentionBackwardSm120Mods(*args, dq_fixed_point=True)
    with pytest.raises(ValueError, match="takes no turns"):
        FlashAttentionBackwardSm120Mods(*args, deterministic=True, dq_fixed_point=True, fused_turns=True)
    with pytest.raises(ValueError, match="modifier step"):
        driver_bwd.FlashAttentionBackwardSm120Tuned(*args, deterministic=True, dq_fixed_point=True)
    # a sliding window: the turns (counted from the window's edges) and fixed point both take it; two dQ
    # accumulators (CTA n into n % 2) do not follow a window's turns
    FlashAttentionBackwardSm120Mods(*args, is_local=True, deterministic=True, fused_turns=True)
    FlashAttentionBackwardSm120Mods(*args, is_local=True, deterministic=True, dq_fixed_point=True)
    with pytest.raises(ValueError, match="dq_split"):
        FlashAttentionBackwardSm120Mods(*args, is_local=True, deterministic=True, fused_turns=True, dq_split=True)


@pytest.mark.parametrize("d,causal,local,gqa,varlen", [
    (64, False, False, 1, False), (64, True, False, 2, False), (96, False, False, 1, False),
    (96, True, False, 1, False), (128, False, False, 1, False), (128, True, False, 4, False),
    (128, False, True, 1, False),
    (128, True, False, 4, True), (64, True, False, 1, True), (96, False, False, 2, True),  # varlen: the plan's choice
])
def test_sm120a_code_adds_each_element_once_in_64_bits_without_spills(d, causal, local, gqa, varlen):
    cfg = select_bwd_config(load_bwd_table(), d, d, causal, local, False)
    cubin, _ = codegen.compile_bwd_cubin(cfg, d, causal=causal, local=local, qhead_per_kvhead=gqa, varlen=varlen,
                                         deterministic=True, ordering={"dq_fixed_point": True})
    res, _, sass = codegen.inspect_cubin(cubin)
    assert res["stack"] == 0 and res["local"] == 0, res
    lines = sass.splitlines()
    red64 = [ln for ln in lines if "REDG.E.ADD.64" in ln]
    f2i = [ln for ln in lines if "F2I.S64" in ln]
    per_thread = cfg.m_block * -(-d // 32) * 32 // cfg.num_threads  # the dQ tile's elements per thread
    assert len(red64) == len(f2i) == per_thread, (len(red64), len(f2i), per_thread)
    if gqa == 1:  # no fp32 adds at all (with GQA the dK/dV epilogue adds fp32, in head order)
        assert not [ln for ln in lines if "REDG.E.ADD.F32" in ln]


@pytest.mark.parametrize("causal,gqa", [(False, 1), (True, 2)])
def test_block_sparse_walk_in_fixed_point_keeps_the_non_deterministic_walk(causal, gqa):
    """The walk with fixed-point dQ takes no list turns: no turn spins in its code, two stages allowed, its
    adds in 64 bits, spill-free."""
    from flash_attn_sm120.driver_bwd import Mods, kernel_for

    cfg = select_bwd_config(load_bwd_table(), 128, 128, causal, False, True)
    walk = []
    cubin, _ = codegen.compile_bwd_cubin(cfg, 128, causal=causal, qhead_per_kvhead=gqa, deterministic=True,
                                         block_sparse=(2, 2, True), ordering={"dq_fixed_point": True},
                                         kernel_out=walk)
    assert not walk[0].turn_lists and walk[0].dq_fixed_point
    res, _, sass = codegen.inspect_cubin(cubin)
    assert res["stack"] == 0 and res["local"] == 0, res
    assert "REDG.E.ADD.64" in sass and "F2I.S64" in sass
    import cutlass

    two_stages = kernel_for(cutlass.BFloat16, 128, 128, 1, cfg, Mods(), block_sparse_key=(2, 2, True, None, False),
                            deterministic=True, dq_fixed_point=True, ordered_tiles=True)
    assert not two_stages.turn_lists


def _scale_by_python_ints(p_do: int, p_k: int, p_v: int, dtype, head_dim_v: int):
    """k_h (or None: non-finite) from the 16-bit patterns with Python's exact integers and fractions."""
    from fractions import Fraction

    mant_bits, bias = fp.FORMATS[dtype]
    value = Fraction(2 * head_dim_v)
    for p in (p_do, p_k, p_v):
        field, mantissa = p >> mant_bits, p & ((1 << mant_bits) - 1)
        if field == (1 << (15 - mant_bits)) - 1:
            return None
        m = mantissa | (1 << mant_bits) if field else mantissa
        value *= Fraction(m) * Fraction(2) ** (max(field, 1) - bias - mant_bits)
    low, high = fp.SCALE_LOG2_RANGE
    if value == 0:
        return high
    k = high
    while k > low and value * Fraction(2) ** k > 2 ** fp.SCALE_LOG2_CEILING:
        k -= 1
    return k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scales_from_patterns_are_the_largest_power_of_two_that_fits(dtype):
    """scales_from_patterns (the kernel's integer arithmetic) against exact rationals on random patterns:
    normal, subnormal, zero, around the clamp and non-finite; 2^k * 2^-k == 1 and NaN only where non-finite."""
    gen = torch.Generator().manual_seed(11)
    patterns = torch.randint(0, 0x8000, (3, 400), generator=gen, dtype=torch.int64)
    mant_bits = fp.FORMATS[dtype][0]
    patterns[:, :40] &= (1 << mant_bits) - 1  # subnormal or zero
    patterns[0, 40:50] = 0
    head_dim_v = 128
    scale, inverse = fp.scales_from_patterns(*patterns, dtype, head_dim_v)
    for i in range(patterns.shape[1]):
        k = _scale_by_python_ints(*(int(p[i]) for p in patterns), dtype, head_dim_v)
        if k is None:
            assert scale[i].isnan() and inverse[i].isnan()
        else:
            assert float(scale[i]) == 2.0 ** k and float(inverse[i]) == 2.0 ** -k, (i, k, float(scale[i]))


def test_max_patterns_are_the_sign_cleared_bits_of_each_heads_max():
    x = torch.tensor([[[1.5, -3.0], [0.0, -0.0]], [[-2.0, 0.25], [float("nan"), 1.0]]], dtype=torch.bfloat16)
    p = fp.max_patterns(x)
    assert p.tolist() == [int(torch.tensor(3.0, dtype=torch.bfloat16).view(torch.int16)), 0x7FC0]


@pytest.mark.parametrize("dtype,d,dv,packed", [("bfloat16", 128, 128, False), ("float16", 96, 96, False),
                                               ("bfloat16", 64, 64, True), ("bfloat16", 192, 128, True)])
def test_sm120a_scales_kernel_reads_16_bytes_per_load_and_adds_nothing_else(dtype, d, dv, packed):
    """The scales kernel on sm_120a: 16-byte loads, two-halves integer maxima, one red.max per warp and the
    counter's atomic, no spills."""
    import tempfile

    from flash_attn_sm120.kernels import bwd_fixed_point_scales as fps
    from flash_attn_sm120.occupancy import cubin_of

    with tempfile.TemporaryDirectory() as tmp:
        _, compiled = fps._compile(dtype, d, dv, packed, packed,
                                   options=f"--keep-cubin --dump-dir={tmp} --gpu-arch=sm_120a")
        res, hist, sass = codegen.inspect_cubin(cubin_of(compiled))
    assert res["stack"] == 0 and res["local"] == 0, res
    loads = [ln for ln in sass.splitlines() if "LDG" in ln and "LDG.E.128" not in ln]
    assert len(loads) == 4 * packed, loads  # packed: the two cu_seqlens' first and last entries, 4 bytes each
    loads = [ln for ln in sass.splitlines() if "LDG.E.128" in ln]
    assert loads and all("LDG.E.128" in ln for ln in loads), loads[:3]
    assert hist.get("VIMNMX", 0) >= len(loads) * 4  # two halves per 32-bit word, no conversion
    assert hist.get("REDG", 0) == 1  # one red.max per warp (the counter and the reads are ATOMG)


@pytest.mark.parametrize("varlen,swap", [(False, False), (True, False), (False, True)])
def test_sm120a_fixed_point_postprocess_loads_int64_once_and_converts_each(varlen, swap):
    import tempfile

    import cutlass
    from flash_attn_sm120.kernels import bwd_fixed_point_post as post
    from flash_attn_sm120.occupancy import cubin_of

    tile_m, threads, d = 64, 256, 128
    with tempfile.TemporaryDirectory() as tmp:
        compiled = post._compile(cutlass.BFloat16, d, tile_m, threads, 4, swap, varlen, False, False, 32,
                                 options=f"--keep-cubin --dump-dir={tmp} --gpu-arch=sm_120a")
        res, hist, sass = codegen.inspect_cubin(cubin_of(compiled))
    assert res["stack"] == 0 and res["local"] == 0, res
    per_thread = tile_m * d // threads
    assert len([ln for ln in sass.splitlines() if "LDG.E.64" in ln]) == per_thread
    assert len([ln for ln in sass.splitlines() if "I2F" in ln and "S64" in ln]) == per_thread
    assert hist.get("FMUL", 0) == 2 * per_thread  # 2^-k_h, then the softmax scale: upstream's two roundings


def test_scales_ignore_the_rows_no_sequence_uses():
    """Padding past seqused (dense or packed) and rows past the last packed sequence may hold NaN: the scales
    come from the used rows only, the same as for tensors holding just those rows."""
    gen = torch.Generator().manual_seed(5)
    mk = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16)  # noqa: E731
    # dense (b, s, h, d) with seqused
    k, v, do = mk(2, 40, 2, 64), mk(2, 40, 2, 64), mk(2, 40, 4, 64)
    used = torch.tensor([25, 40], dtype=torch.int32)
    for t in (k, v, do):
        t[0, 25:] = float("nan")
    got = fp.dq_scales(k, v, do, seqused_q=used, seqused_k=used)
    assert not any(g.isnan().any() for g in got)
    trimmed = [torch.cat([t[0, :25], t[1]]) for t in (k, v, do)]  # the used rows as one packed batch
    want = fp.dq_scales(*trimmed)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # packed (total, h, d): cu_seqlens ending before the tensor's end, seqused inside the sequences
    k, v, do = mk(100, 2, 64), mk(100, 2, 64), mk(100, 4, 64)
    cu = torch.tensor([0, 30, 70, 90], dtype=torch.int32)
    used = torch.tensor([30, 10, 20], dtype=torch.int32)
    for t in (k, v, do):
        t[90:] = float("inf")  # past the last sequence
        t[40:70] = float("nan")  # past the second sequence's used length
    got = fp.dq_scales(k, v, do, cu, cu, used, used)
    rows = torch.cat([torch.arange(0, 30), torch.arange(30, 40), torch.arange(70, 90)])
    want = fp.dq_scales(*(t[rows] for t in (k, v, do)))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    only_cu = fp.dq_scales(k, v, do, cu, cu)  # without seqused the NaN rows count
    assert only_cu[0].isnan().all()


@pytest.mark.parametrize("dlse_scale", [0.0, 1e-3, 1.0, 1e3, 1e6])
def test_a_gradient_of_the_lse_widens_the_bound(dlse_scale):
    """With dLSE the backward's D becomes D - dLSE: the exact dQ accumulator (fp64, dS = P (dP - D + dLSE))
    stays under 2^59 at the scales, within 2 bits of the largest power of two that fits; without dLSE's
    term the scales could overflow int64 once |dLSE| dominates."""
    b, t, h, d = 2, 50, 2, 32
    gen = torch.Generator().manual_seed(8)
    q, k, v, do = (torch.randn(b, t, h, d, generator=gen).to(torch.bfloat16) for _ in range(4))
    do = (do.float() * 1e-3).to(torch.bfloat16)
    dlse = torch.randn(b, h, t, generator=gen) * dlse_scale
    qf, kf, vf, dof = (x.double() for x in (q, k, v, do))
    p = torch.softmax(torch.einsum("bthd,bshd->bhts", qf, kf) / math.sqrt(d), dim=-1)
    o = torch.einsum("bhts,bshd->bthd", p, vf)
    dp = torch.einsum("bthd,bshd->bhts", dof, vf)
    delta = (dof * o).sum(-1).transpose(1, 2) - dlse.double()
    dq = torch.einsum("bhts,bshd->bhtd", p * (dp - delta[..., None]), kf)
    scale, inverse = fp.dq_scales(k, v, do, dlse=dlse)
    assert torch.equal(scale.double() * inverse.double(), torch.ones(h, dtype=torch.float64))
    peak = (dq.abs().amax(dim=(0, 2, 3)) * scale.double())
    assert (peak <= 2.0 ** fp.SCALE_LOG2_CEILING).all(), peak
    bound = (k.double().abs().amax(dim=(0, 1, 3)) * (2 * d * do.double().abs().amax(dim=(0, 1, 3))
             * v.double().abs().amax(dim=(0, 1, 3)) + dlse.abs().amax(dim=(0, 2)).double()))
    assert ((bound * scale.double()) > 2.0 ** (fp.SCALE_LOG2_CEILING - 2)).all()
    if dlse_scale >= 1e3:  # the bound without dLSE would not have held
        plain, _ = fp.dq_scales(k, v, do)
        assert ((dq.abs().amax(dim=(0, 2, 3)) * plain.double()) > 2.0 ** fp.SCALE_LOG2_CEILING).any()
    dlse[0, 1, 3] = float("nan")
    scale, _ = fp.dq_scales(k, v, do, dlse=dlse)
    assert scale[1].isnan() and not scale[0].isnan()


def test_the_lse_gradient_counts_only_the_used_rows():
    dense = torch.tensor([[[1.0, 2.0, float("nan")], [3.0, -4.0, 0.0]]])  # (b=1, h=2, s=3)
    assert fp._max_abs_dlse(dense, None, torch.tensor([2])).tolist() == [2.0, 4.0]
    packed = torch.tensor([[1.0, -5.0, float("inf")], [2.0, 0.5, float("nan")]])  # (h=2, total=3)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    assert fp._max_abs_dlse(packed, cu, None).tolist() == [5.0, 2.0]
    assert fp._max_abs_dlse(packed, cu, torch.tensor([1, 0], dtype=torch.int32)).tolist() == [1.0, 2.0]


def test_a_score_mod_bwd_alone_keeps_the_call_off_fixed_point():
    """A user's score_mod_bwd can return any dS: no bound covers it, with or without a score_mod; softcap's
    pair is covered. And a window with only a score_mod_bwd is refused like one with a score_mod."""
    from flash_attn_sm120.testing_mods import position_scale, position_scale_bwd

    resolve = lambda **kw: driver_bwd.resolve_mods(kw.pop("softcap", 0.0), kw.get("score_mod"),  # noqa: E731
                                                   kw.get("score_mod_bwd"), None, None, None)
    assert not driver_bwd.fixed_point_for(resolve(score_mod_bwd=position_scale_bwd), True)
    assert not driver_bwd.fixed_point_for(resolve(score_mod=position_scale, score_mod_bwd=position_scale_bwd), True)
    assert driver_bwd.fixed_point_for(resolve(softcap=10.0), True)
    assert driver_bwd.fixed_point_for(resolve(), True) and not driver_bwd.fixed_point_for(resolve(), False)


def test_the_callers_O_widens_the_bound_and_a_NaN_in_Q_gives_NaN_scales():
    """The bound holds for any O the caller passes (max(|V|, |O|)); for the forward's own O (|O| <= max|V|)
    the scales are unchanged. A NaN or inf in Q makes its head's scales NaN, in both bound paths."""
    k, v, do = _qkv(h=4, hk=2)
    q = torch.randn(2, 50, 4, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    base = fp.dq_scales(k, v, do)
    own_o = (v.float().repeat_interleave(2, dim=2) * 0.5).to(torch.bfloat16)  # |O| <= max|V|
    assert all(torch.equal(a, b) for a, b in zip(fp.dq_scales(k, v, do, q=q, out=own_o), base))
    big_o = own_o.clone()
    big_o[1, 3, 2, 0] = 1000.0
    wide, _ = fp.dq_scales(k, v, do, q=q, out=big_o)
    assert wide[2] < base[0][2] and torch.equal(wide[[0, 1, 3]], base[0][[0, 1, 3]])
    q[0, 0, 3, 0] = float("inf")
    for dlse in (None, torch.zeros(2, 4, 50)):
        scale, inverse = fp.dq_scales(k, v, do, q=q, out=own_o, dlse=dlse)
        assert scale[3].isnan() and inverse[3].isnan() and not scale[:3].isnan().any()

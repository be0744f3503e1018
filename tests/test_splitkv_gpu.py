"""SplitKV, paged KV and decode on the GPU (SM120, or SM80+ in SM120 emulation).

Every case is checked against an fp32 reference over the gathered dense KV
(flash_attn_sm120.bench.reference_attention, per sequence), with outputs and LSE poisoned with
NaN before the call and unused page-pool slots filled with NaN: out must be within 2x the error
of the same reference computed in the inputs' precision + 1e-3, LSE likewise.

    FLASH_ATTN_SM120_EMULATE=1 python -m pytest -q tests/test_splitkv_gpu.py   (conftest sets it)
"""

import random

import pytest
import torch

import flash_attn_sm120
from flash_attn_sm120 import driver_splitkv, splitkv
from flash_attn_sm120 import bench
from flash_attn_sm120.bench import reference_attention, write_pages
from flash_attn_sm120.device import device_info

pytestmark = pytest.mark.gpu


def _emulate():
    return device_info().emulate_host_smem


# ------------------------------------------------------------------------------------------------
# reference over the gathered dense KV
# ------------------------------------------------------------------------------------------------


def _gather(pool, page_table_row, length):
    """Rows 0..length-1 of one sequence from a page pool (num_pages, page_size, h, d)."""
    page_size = pool.shape[1]
    pages = page_table_row[: -(-length // page_size)].long()
    return pool[pages].reshape(-1, *pool.shape[2:])[:length]


def _reference(q_seqs, k_seqs, v_seqs, causal, window, scale=None):
    """Per sequence: (fp32 out, fp32 lse, low-precision out, lse) lists; empty K -> 0 / -inf."""
    res = []
    for q, k, v in zip(q_seqs, k_seqs, v_seqs):
        if k.shape[0] == 0:
            o = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], device=q.device)
            lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
            res.append((o, lse, o, lse))
            continue
        o32, l32 = reference_attention(q[None], k[None], v[None], causal=causal, window=window, softmax_scale=scale)
        olp, llp = reference_attention(q[None], k[None], v[None], causal=causal, window=window, softmax_scale=scale,
                                       upcast=False)
        res.append((o32[0], l32[0], olp[0].float(), llp[0]))
    return res


def _check(outs, lses, refs, what):
    for i, (o, lse, (o32, l32, olp, llp)) in enumerate(zip(outs, lses, refs)):
        assert not torch.isnan(o).any(), f"{what} seq {i}: NaN in out (unwritten or read from a poisoned slot)"
        err = (o.float() - o32).abs().max().item() if o.numel() else 0.0
        base = (olp - o32).abs().max().item() if o.numel() else 0.0
        assert err <= 2 * base + 1e-3, f"{what} seq {i}: out error {err:.3g} vs low-precision reference {base:.3g}"
        if lse is None:
            continue
        finite = torch.isfinite(l32)
        assert torch.equal(torch.isfinite(lse), finite), f"{what} seq {i}: LSE finiteness differs"
        if finite.any():
            lerr = (lse[finite] - l32[finite]).abs().max().item()
            lbase = (llp[finite] - l32[finite]).abs().max().item()
            assert lerr <= 2 * lbase + 1e-3, f"{what} seq {i}: LSE error {lerr:.3g} vs {lbase:.3g}"


def _poison_allocator(*numels):
    """Leave NaN in the caching allocator's free blocks, so unwritten buffers show up as NaN."""
    bufs = [torch.full((n,), float("nan"), device="cuda") for n in numels]
    del bufs


# ------------------------------------------------------------------------------------------------
# paged KV
# ------------------------------------------------------------------------------------------------


def _paged_problem(rng, *, batch, seqlen_q, hk, group, d, page_size, max_len, min_len=1, dtype=torch.bfloat16,
                   zero_len=False):
    lens = [rng.randint(min_len, max_len) for _ in range(batch)]
    if zero_len:
        lens[0] = 0
    max_pages = -(-max(max_len, 1) // page_size)
    num_pages = batch * max_pages + 7  # spare pages, poisoned
    pool_k = torch.full((num_pages, page_size, hk, d), float("nan"), device="cuda", dtype=dtype)
    pool_v = torch.full((num_pages, page_size, hk, d), float("nan"), device="cuda", dtype=dtype)
    perm = torch.randperm(num_pages, device="cuda")[: batch * max_pages].to(torch.int32)
    page_table = perm.view(batch, max_pages).contiguous()  # shuffled, non-contiguous pages
    for b, n in enumerate(lens):
        for p in range(-(-n // page_size)):
            rows = min(page_size, n - p * page_size)  # the last page's tail stays NaN
            page = page_table[b, p].item()
            pool_k[page, :rows] = torch.randn(rows, hk, d, device="cuda").to(dtype)
            pool_v[page, :rows] = torch.randn(rows, hk, d, device="cuda").to(dtype)
    q = torch.randn(batch, seqlen_q, hk * group, d, device="cuda").to(dtype)
    seqused_k = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, pool_k, pool_v, page_table, seqused_k, lens


def _run_paged(q, pool_k, pool_v, page_table, seqused_k, lens, *, causal, window, num_splits):
    b, sq, h, _ = q.shape
    _poison_allocator(64 * b * sq * h * q.shape[-1], 2 * b * sq * h * q.shape[-1])
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, sq), float("nan"), device="cuda")
    driver_splitkv.forward(
        q, pool_k, pool_v, page_table=page_table, seqused_k=seqused_k, num_splits=num_splits,
        softmax_scale=None, causal=causal, window_size_left=window[0], window_size_right=window[1], softcap=None,
        pack_gqa=None, need_lse=True, emulate_host_smem=_emulate(), out=out, lse=lse,
    )
    refs = _reference(
        [q[i] for i in range(b)],
        [_gather(pool_k, page_table[i], n) for i, n in enumerate(lens)],
        [_gather(pool_v, page_table[i], n) for i, n in enumerate(lens)],
        causal, window,
    )
    return [out[i] for i in range(b)], [lse[i] for i in range(b)], refs


def _paged_cases():
    rng = random.Random(1234)
    cases = []
    for i in range(24):
        cases.append(dict(
            batch=rng.choice([1, 3, 5]),
            seqlen_q=rng.choice([1, 1, 2, 7, 16]),
            hk=rng.choice([1, 2, 4]),
            group=rng.choice([1, 4, 8]),
            page_size=rng.choice([16, 32, 48, 64, 128, 256, 512]),
            max_len=rng.choice([200, 1000, 3000]),
            num_splits=[1, 2, 7, 0][i % 4],
            mask=rng.choice(["none", "causal", "local"]),
            seed=rng.randrange(1 << 30),
        ))
    return cases


@pytest.mark.parametrize("case", _paged_cases(), ids=lambda c: (
    f"b{c['batch']}q{c['seqlen_q']}hk{c['hk']}g{c['group']}p{c['page_size']}k{c['max_len']}"
    f"s{c['num_splits']}-{c['mask']}"))
def test_paged_decode_matches_reference(case):
    torch.manual_seed(case["seed"])
    rng = random.Random(case["seed"])
    q, pk, pv, pt, used, lens = _paged_problem(
        rng, batch=case["batch"], seqlen_q=case["seqlen_q"], hk=case["hk"], group=case["group"], d=128,
        page_size=case["page_size"], max_len=case["max_len"],
    )
    window = (rng.randint(0, 300), rng.randint(0, 8)) if case["mask"] == "local" else (None, None)
    outs, lses, refs = _run_paged(q, pk, pv, pt, used, lens, causal=case["mask"] == "causal", window=window,
                                  num_splits=case["num_splits"])
    _check(outs, lses, refs, str(case))


@pytest.mark.parametrize("d", [64, 96, 192, 256])
@pytest.mark.parametrize("num_splits", [1, 0])
def test_paged_head_dims_and_empty_sequence(d, num_splits):
    rng = random.Random(d)
    q, pk, pv, pt, used, lens = _paged_problem(rng, batch=3, seqlen_q=4, hk=2, group=4, d=d, page_size=32,
                                               max_len=700, zero_len=True)
    outs, lses, refs = _run_paged(q, pk, pv, pt, used, lens, causal=False, window=(None, None), num_splits=num_splits)
    _check(outs, lses, refs, f"d={d}")


@pytest.mark.parametrize("page_size", [16, 64, 512])
@pytest.mark.parametrize("mask", ["causal", "local"])
def test_paged_prefill_matches_reference(page_size, mask):
    rng = random.Random(page_size)
    q, pk, pv, pt, used, lens = _paged_problem(rng, batch=2, seqlen_q=300, hk=2, group=4, d=128,
                                               page_size=page_size, max_len=1500, min_len=300)
    window = (128, 0) if mask == "local" else (None, None)
    for splits in (1, 3):
        outs, lses, refs = _run_paged(q, pk, pv, pt, used, lens, causal=mask == "causal", window=window,
                                      num_splits=splits)
        _check(outs, lses, refs, f"prefill page={page_size} {mask} splits={splits}")


@pytest.mark.parametrize("d", [80, 112, 128])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_paged_prefill_at_head_dims_whose_gathers_limit_tile_n(d, mask):
    """Paged prefill runs kernel_config(paged=True)'s tile: at d=80 / 112 the page gathers move 64
    rows per pass with 4 warps (128 with 8), so the table's 48-key and 8-warp tiles must give way
    (fwd_splitkv_paged.paged_tile_error); at d=128 the 48-key entries stay. Lengths are not tile multiples."""
    rng = random.Random(d)
    q, pk, pv, pt, used, lens = _paged_problem(rng, batch=2, seqlen_q=300, hk=2, group=4, d=d, page_size=64,
                                               max_len=1000, min_len=300)
    for splits in (1, 3):
        outs, lses, refs = _run_paged(q, pk, pv, pt, used, lens, causal=mask == "causal", window=(None, None),
                                      num_splits=splits)
        _check(outs, lses, refs, f"prefill d={d} {mask} splits={splits}")


def test_paged_through_varlen_api_with_cu_seqlens_q():
    rng = random.Random(7)
    q4, pk, pv, pt, used, lens = _paged_problem(rng, batch=3, seqlen_q=5, hk=2, group=4, d=128, page_size=64,
                                                max_len=900)
    qlens = [5, 2, 4]
    q = torch.cat([q4[i, :n] for i, n in enumerate(qlens)])
    cu_q = torch.tensor([0, 5, 7, 11], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_sm120.flash_attn_varlen_func(
        q, pk, pv, cu_seqlens_q=cu_q, max_seqlen_q=5, seqused_k=used, page_table=pt, causal=True, num_splits=0,
        return_lse=True,
    )
    refs = _reference([q4[i, :n] for i, n in enumerate(qlens)],
                      [_gather(pk, pt[i], n) for i, n in enumerate(lens)],
                      [_gather(pv, pt[i], n) for i, n in enumerate(lens)], True, (None, None))
    starts = [0, 5, 7]
    _check([out[s:s + n] for s, n in zip(starts, qlens)], [lse[:, s:s + n] for s, n in zip(starts, qlens)], refs,
           "varlen paged")


# ------------------------------------------------------------------------------------------------
# SplitKV on dense KV
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 4096), (16, 1000), (128, 2048), (700, 3000)])
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("num_splits", [2, 7, 0])
def test_dense_splitkv_matches_reference(seqlen_q, seqlen_k, mask, num_splits):
    torch.manual_seed(seqlen_q * 31 + seqlen_k)
    b, h, hk, d = 2, 16, 4, 128
    q = torch.randn(b, seqlen_q, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, seqlen_k, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, seqlen_k, hk, d, device="cuda", dtype=torch.bfloat16)
    window = (200, 16) if mask == "local" else (None, None)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, seqlen_q), float("nan"), device="cuda")
    driver_splitkv.forward(
        q, k, v, num_splits=num_splits, softmax_scale=None, causal=mask == "causal", window_size_left=window[0],
        window_size_right=window[1], softcap=None, pack_gqa=None, need_lse=True, emulate_host_smem=_emulate(),
        out=out, lse=lse,
    )
    refs = _reference([q[i] for i in range(b)], [k[i] for i in range(b)], [v[i] for i in range(b)],
                      mask == "causal", window)
    _check([out[i] for i in range(b)], [lse[i] for i in range(b)], refs, f"dense split={num_splits} {mask}")


@pytest.mark.parametrize("group", [1, 8])
def test_dense_splitkv_seqused_k_and_api(group):
    torch.manual_seed(group)
    b, sq, sk, hk, d = 4, 1, 5000, 2, 64
    q = torch.randn(b, sq, hk * group, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.float16)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.float16)
    lens = [5000, 1, 77, 0]
    used = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_sm120.flash_attn_varlen_func(q, k, v, seqused_k=used, num_splits=0, return_lse=True)
    refs = _reference([q[i] for i in range(b)], [k[i, :n] for i, n in enumerate(lens)],
                      [v[i, :n] for i, n in enumerate(lens)], False, (None, None))
    _check([out[i] for i in range(b)], [lse[i] for i in range(b)], refs, "seqused_k")


def test_dense_splitkv_varlen_cu_seqlens():
    torch.manual_seed(3)
    qlens, klens = [1, 16, 3, 9], [4000, 100, 2500, 1]
    h, hk, d = 8, 2, 128
    q = torch.randn(sum(qlens), h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(klens), hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(klens), hk, d, device="cuda", dtype=torch.bfloat16)
    cu = lambda xs: torch.tensor([0] + [sum(xs[: i + 1]) for i in range(len(xs))], dtype=torch.int32, device="cuda")
    for splits in (2, 7, 0):
        out, lse = flash_attn_sm120.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu(qlens), cu_seqlens_k=cu(klens), max_seqlen_q=16, max_seqlen_k=4000,
            causal=True, num_splits=splits, return_lse=True,
        )
        qs, ks = [0] + list(torch.tensor(qlens).cumsum(0)), [0] + list(torch.tensor(klens).cumsum(0))
        refs = _reference([q[qs[i]:qs[i + 1]] for i in range(4)], [k[ks[i]:ks[i + 1]] for i in range(4)],
                          [v[ks[i]:ks[i + 1]] for i in range(4)], True, (None, None))
        _check([out[qs[i]:qs[i + 1]] for i in range(4)], [lse[:, qs[i]:qs[i + 1]] for i in range(4)], refs,
               f"varlen split={splits}")


def test_decode_without_split_uses_decode_config():
    """num_splits=1 decode on dense KV: the decode table's tiles on the cp.async family."""
    torch.manual_seed(0)
    q = torch.randn(8, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8, 2048, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(8, 2048, 8, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = flash_attn_sm120.flash_attn_func(q, k, v, return_lse=True)
    refs = _reference([q[i] for i in range(8)], [k[i] for i in range(8)], [v[i] for i in range(8)], False, (None, None))
    _check([out[i] for i in range(8)], [lse[i] for i in range(8)], refs, "decode no split")


def test_split_autograd_uses_combined_lse():
    """The backward (upstream's) gets the combined out / LSE: grads match the unsplit call's."""
    torch.manual_seed(5)
    base = [torch.randn(1, n, 8, 64, device="cuda", dtype=torch.bfloat16) for n in (4, 3000, 3000)]
    grads = {}
    for splits in (1, 5):
        q, k, v = [t.clone().requires_grad_(True) for t in base]
        out, _ = flash_attn_sm120.flash_attn_func(q, k, v, num_splits=splits)
        out.float().sum().backward()
        grads[splits] = (q.grad.float(), k.grad.float(), v.grad.float())
    for g1, g5 in zip(grads[1], grads[5]):
        assert (g1 - g5).abs().max().item() <= 2e-2 * g1.abs().max().item() + 1e-3


def test_chooser_sees_this_gpus_sm_count():
    info = device_info()
    p = driver_splitkv.plan(head_dim=128, head_dim_v=128, causal=False, local=False, window_size_left=None,
                            window_size_right=None, batch=1, max_seqlen_q=1, max_seqlen_k=32768, num_heads=32,
                            num_heads_kv=8, pack_gqa=True, num_splits=0, num_sms=info.num_sms)
    assert p.num_splits == splitkv.choose_num_splits(total_mblocks=8, n_blocks=p.n_blocks, num_sms=info.num_sms,
                                                     ctas_per_sm=p.ctas_per_sm)
    assert p.num_splits * 8 <= splitkv.MIN_WAVES * info.num_sms * p.ctas_per_sm  # long KV: up to ~2 waves


@pytest.mark.parametrize("paged", [False, True])
def test_decode_step_captures_in_cuda_graph(paged):
    """Inference engines capture the decode step in a CUDA graph: the split kernel, its fp32
    partials and upstream's combine must all capture (no host sync, current stream), and a replay
    over new data written into the captured inputs must match the reference."""
    torch.manual_seed(11 + paged)
    b, sk, h, hk, d, page = 2, 3000, 32, 8, 128, 64
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    kwargs = dict(num_splits=0, return_lse=True)
    if paged:
        pages = -(-sk // page)
        table = torch.randperm(b * pages, device="cuda").to(torch.int32).view(b, pages).contiguous()
        pool_k = torch.zeros(b * pages, page, hk, d, device="cuda", dtype=torch.bfloat16)
        pool_v = torch.zeros_like(pool_k)
        kwargs.update(page_table=table, seqused_k=torch.full((b,), sk, dtype=torch.int32, device="cuda"))

        def load(kk, vv):  # write the dense KV into the shuffled pages
            write_pages(pool_k, kk, table)
            write_pages(pool_v, vv, table)
        load(k, v)
        call = lambda: flash_attn_sm120.flash_attn_varlen_func(q, pool_k, pool_v, **kwargs)
    else:
        call = lambda: flash_attn_sm120.flash_attn_func(q, k, v, **kwargs)
    eager_out, _ = call()  # compile outside the capture
    graph, (out, lse) = bench.capture_graph(call)
    assert driver_splitkv.plan(
        head_dim=d, head_dim_v=d, causal=False, local=False, window_size_left=None, window_size_right=None,
        batch=b, max_seqlen_q=1, max_seqlen_k=sk, num_heads=h, num_heads_kv=hk, pack_gqa=True, num_splits=0,
        num_sms=device_info().num_sms,
    ).num_splits > 1, "the case must exercise the split + combine path"
    new = [torch.randn_like(t) for t in (q, k, v)]
    q.copy_(new[0])
    if paged:
        load(new[1], new[2])
    else:
        k.copy_(new[1])
        v.copy_(new[2])
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    refs = _reference([new[0][i] for i in range(b)], [new[1][i] for i in range(b)], [new[2][i] for i in range(b)],
                      False, (None, None))
    _check([out[i] for i in range(b)], [lse[i] for i in range(b)], refs, f"graph replay paged={paged}")
    assert not torch.equal(out, eager_out), "the replay must compute on the new inputs"


def test_validation_memo_keys_on_alignment_and_never_caches_failures():
    """The public API skips re-validating metadata that passed before; a view with the same shape
    and strides but a misaligned address, or another dtype, must still be refused every time."""
    q = torch.randn(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 512, 2, 64, device="cuda", dtype=torch.bfloat16)
    flash_attn_sm120.flash_attn_func(q, kv, kv, num_splits=0)
    flash_attn_sm120.flash_attn_func(q, kv, kv, num_splits=0)  # memo hit
    flat = torch.randn(kv.numel() + 8, device="cuda", dtype=torch.bfloat16)
    shifted = flat[1:1 + kv.numel()].view_as(kv)  # same shape and strides, 2-byte offset
    assert shifted.stride() == kv.stride()
    for _ in range(2):
        with pytest.raises(ValueError, match="aligned"):
            flash_attn_sm120.flash_attn_func(q, shifted, shifted, num_splits=0)
        with pytest.raises(TypeError, match="dtype"):
            flash_attn_sm120.flash_attn_func(q.float(), kv, kv, num_splits=0)


def test_repeated_decode_calls_match_and_follow_this_calls_page_table():
    """Repeated calls reuse the memoized CallPlan (driver_splitkv._PLANS): a repeat is bit-identical
    to the first call, and a paged call whose page table differs from the first call's (same shape,
    so the same plan) follows its own table."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv = torch.randn(2, 3000, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    first = flash_attn_sm120.flash_attn_func(q, kv, kv, num_splits=0)[0]
    again = flash_attn_sm120.flash_attn_func(q, kv, kv, num_splits=0)[0]
    assert torch.equal(first, again)
    _check([first[i] for i in range(2)], [None, None],
           _reference([q[i] for i in range(2)], [kv[i] for i in range(2)], [kv[i] for i in range(2)], False,
                      (None, None)), "dense decode")

    page, lens = 16, [700, 333]
    pool_k = torch.randn(2 * 44, page, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    pool_v = torch.randn_like(pool_k)
    qv = torch.randn(2, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    used = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for seed in (1, 2, 3):  # three page tables of one shape: one plan, three different gathers
        table = torch.randperm(2 * 44, generator=torch.Generator().manual_seed(seed)).view(2, 44)
        table = table.to(torch.int32).cuda()
        out = flash_attn_sm120.flash_attn_varlen_func(
            qv, pool_k, pool_v, cu_seqlens_q=cu_q, seqused_k=used, page_table=table, max_seqlen_q=1, num_splits=0,
        )[0]
        ks = [_gather(pool_k, table[i], lens[i]) for i in range(2)]
        vs = [_gather(pool_v, table[i], lens[i]) for i in range(2)]
        _check([out[i:i + 1] for i in range(2)], [None, None],
               _reference([qv[i:i + 1] for i in range(2)], ks, vs, False, (None, None)), f"paged table {seed}")

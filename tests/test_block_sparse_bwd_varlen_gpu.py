"""The block-sparse backward on varlen calls (flash_attn_varlen_func's block_sparse_tensors_bwd), against the fp32
autograd reference of the mask the lists mean, sequence by sequence (upstream's rule, gradients poisoned first).

Sequences of 0 rows, of fewer keys than one block, not block multiples, seqlen_q != seqlen_k; GQA; a mask_mod on
the partial blocks; the lists per sequence (FlexAttention's padded-batch form) and packed (upstream's varlen form,
transposed: block_sparse_bwd.py)."""

import pytest

torch = pytest.importorskip("torch")

import flash_attn_sm120  # noqa: E402
from flash_attn_sm120 import testing, testing_mods, testing_sparse  # noqa: E402
from test_block_sparse_gpu import _ref, _varlen_case, check_deterministic_runs  # noqa: E402

pytestmark = pytest.mark.gpu

LENS_Q, LENS_K = (300, 0, 128, 700, 5), (517, 64, 100, 700, 1000)


def _per_sequence(maps, rows=None, cols=None):
    """Backward lists per sequence: each map (h, q_blocks, kv_blocks) transposed into (batch, h, rows, cols),
    zero-padded (skipped) or cut to `rows` K/V blocks."""
    rows = rows or max(m.shape[2] for m in maps)
    cols = cols or max(m.shape[1] for m in maps)
    out = torch.zeros(len(maps), maps[0].shape[0], rows, cols, dtype=torch.int32, device="cuda")
    for b, m in enumerate(maps):
        t = m.transpose(1, 2)[:, :rows]
        out[b, :, :t.shape[1], :t.shape[2]] = t
    return out


def _lists(maps, block, with_full, form, rows=None):
    if form == "packed":
        return testing_sparse.varlen_lists_from_maps([m.transpose(1, 2).contiguous() for m in maps], block, with_full)
    return testing_sparse.lists_from_map(_per_sequence(maps, rows), block, with_full)


def _run(q, k, v, cu, lens, api_kw, causal=False, seed=0):
    """(out, dq, dk, dv, dout) of flash_attn_varlen_func, the gradients NaN-poisoned first."""
    (cu_q, cu_k), (lens_q, lens_k) = cu, lens
    g = torch.Generator(device="cuda").manual_seed(seed)
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), device="cuda", dtype=q.dtype, generator=g)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with testing.poisoned_outputs():  # out, and the backward driver's dq/dk/dv, start as NaN: every row written
        out = flash_attn_sm120.flash_attn_varlen_func(
            *leaves, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
            causal=causal, **api_kw)[0]
        out.backward(dout)
    return out.detach(), *(t.grad for t in leaves), dout


def check_varlen_bwd(q, k, v, cu, lens, maps, block, api_kw, twin=None, causal=False, with_full=True, seed=0,
                     kv_rows=None):
    """flash_attn_varlen_func's out and dq/dk/dv against each sequence's fp32 reference; `kv_rows`: the lists'
    rows (K/V blocks past them are skipped)."""
    (cu_q, cu_k), (lens_q, lens_k) = cu, lens
    out, dq, dk, dv, dout = _run(q, k, v, cu, lens, api_kw, causal, seed)
    for i, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        rows_q, rows_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if sq == 0:  # no query sees these keys
            assert (dk[rows_k] == 0).all() and (dv[rows_k] == 0).all(), f"dk/dv of sequence {i}"
            continue
        kinds = maps[i][None].clone()
        if kv_rows is not None:
            kinds[..., kv_rows:] = testing_sparse.SKIP
        if not with_full:
            kinds = torch.where(kinds > 0, testing_sparse.PARTIAL, testing_sparse.SKIP).to(torch.int32)
        keep = testing_sparse.keep_from_map(kinds, block, sq, sk, twin, causal)
        keep = keep.expand(1, q.shape[1], sq, sk)
        g_out = dout[None, rows_q]

        def grads(upcast):
            ts = [t[None, r].detach().clone().float().requires_grad_() if upcast else
                  t[None, r].detach().clone().requires_grad_() for t, r in ((q, rows_q), (k, rows_k), (v, rows_k))]
            o = _ref(*ts, keep, upcast)[0]
            o.backward(g_out.float() if upcast else g_out)
            return [o.detach()] + [t.grad for t in ts]

        ref, pt = grads(True), grads(False)
        ours = (out[None, rows_q], dq[None, rows_q], dk[None, rows_k], dv[None, rows_k])
        for name, a, r, p in zip(("out", "dq", "dk", "dv"), ours, ref, pt):
            testing.assert_close_to_ref(f"{name}[{i}]", a, r, p, q.dtype)
    return out, dq, dk, dv


@pytest.mark.parametrize("form", ["per_sequence", "packed"])
@pytest.mark.parametrize("d,block", [(64, (128, 128)), (128, (128, 128)), (128, (64, 128)), (96, (128, 256))])
@pytest.mark.parametrize("with_full", [True, False])
def test_varlen_backward_lists(form, d, block, with_full):
    """Both forms of the lists, a mask_mod on the partial blocks, GQA 4:2, sequences of every awkward length."""
    h, hk = 4, 2
    q, k, v, maps, cu = _varlen_case(LENS_Q, LENS_K, h, hk, d, block, seed=d + 3 * with_full + len(form))
    prefix = testing_mods.spec("prefix")
    twin = lambda bi, hi, qi, ki: prefix.keep_twin(bi, hi, qi, ki, None)  # noqa: E731
    api = dict(mask_mod=prefix.mask_mod, block_sparse_tensors=testing_sparse.varlen_lists_from_maps(maps, block, with_full),
               block_sparse_tensors_bwd=_lists(maps, block, with_full, form))
    check_varlen_bwd(q, k, v, cu, (LENS_Q, LENS_K), maps, block, api, twin, with_full=with_full)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_backward_lists_with_fewer_rows(causal):
    """Per-sequence lists with fewer K/V rows than the longest sequence has blocks: the K/V tiles past them
    take no step (dK/dV zero there, no dQ from them), the kernel reading no count past the rows."""
    h, hk, d, block = 4, 4, 128, (128, 128)
    q, k, v, maps, cu = _varlen_case(LENS_Q, LENS_K, h, hk, d, block, seed=71 + causal, density=0.7)
    api = dict(block_sparse_tensors_bwd=_lists(maps, block, True, "per_sequence", rows=3))
    # the forward must mean the same mask: its lists cut to the same K/V blocks
    cut = [m.clone() for m in maps]
    for m in cut:
        m[..., 3:] = testing_sparse.SKIP
    api["block_sparse_tensors"] = testing_sparse.varlen_lists_from_maps(cut, block, True)
    check_varlen_bwd(q, k, v, cu, (LENS_Q, LENS_K), maps, block, api, causal=causal, kv_rows=3)


def test_varlen_backward_lists_deterministic():
    """deterministic=True without a score_mod (fixed-point dQ): right against the reference, and bitwise over
    3 runs."""
    h, hk, d, block = 4, 2, 128, (128, 128)
    q, k, v, maps, cu = _varlen_case(LENS_Q, LENS_K, h, hk, d, block, seed=81, density=0.6)
    api = dict(deterministic=True, block_sparse_tensors=testing_sparse.varlen_lists_from_maps(maps, block, True),
               block_sparse_tensors_bwd=_lists(maps, block, True, "packed"))
    check_deterministic_runs([check_varlen_bwd(q, k, v, cu, (LENS_Q, LENS_K), maps, block, api, seed=5)
                              for _ in range(3)])


def test_varlen_backward_lists_deterministic_turns_with_score_mod():
    """deterministic=True with a user score_mod: dQ in the list turns (ascending K/V tile). Bitwise over 3 runs,
    and within a bf16 rounding of the non-deterministic walk (checked against the reference above)."""
    h, hk, d, block = 4, 2, 128, (128, 128)
    q, k, v, maps, cu = _varlen_case(LENS_Q, LENS_K, h, hk, d, block, seed=83, density=0.6)
    pos = testing_mods.spec("position")
    api = dict(score_mod=pos.score_mod, score_mod_bwd=pos.score_mod_bwd,
               block_sparse_tensors=testing_sparse.varlen_lists_from_maps(maps, block, True),
               block_sparse_tensors_bwd=_lists(maps, block, True, "per_sequence"))
    lens = (LENS_Q, LENS_K)
    runs = [_run(q, k, v, cu, lens, dict(api, deterministic=True), seed=7)[:4] for _ in range(3)]
    check_deterministic_runs(runs, _run(q, k, v, cu, lens, api, seed=7)[:4])


def test_seqused_k_cache_with_per_sequence_lists():
    """flash_attn_varlen_func on a (batch, seqlen_k) K/V cache with seqused_k, dense q, per-sequence lists."""
    b, h, sq, sk, d, block = 3, 4, 300, 1000, 128, (128, 128)
    g = torch.Generator(device="cuda").manual_seed(91)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for s in (sq, sk, sk))
    used = torch.tensor([1000, 333, 1], dtype=torch.int32, device="cuda")
    kinds = testing_sparse.random_block_map(b, h, 3, 8, density=0.6, full_share=0.5, generator=g)
    bwd = testing_sparse.lists_from_map(kinds.transpose(2, 3).contiguous(), block)
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with testing.poisoned_outputs():
        out = flash_attn_sm120.flash_attn_varlen_func(*leaves, seqused_k=used, max_seqlen_k=sk,
                                                      block_sparse_tensors=testing_sparse.lists_from_map(kinds, block),
                                                      block_sparse_tensors_bwd=bwd)[0]
        out.backward(dout)
    for i in range(b):
        n = int(used[i])
        keep = testing_sparse.keep_from_map(kinds[i:i + 1], block, sq, sk)[..., :n].expand(1, h, sq, n)

        def grads(upcast):
            ts = [t[i:i + 1, :rows].detach().clone() for t, rows in ((q, sq), (k, n), (v, n))]
            ts = [(t.float() if upcast else t).requires_grad_() for t in ts]
            o = _ref(*ts, keep, upcast)[0]
            o.backward(dout[i:i + 1].float() if upcast else dout[i:i + 1])
            return [o.detach()] + [t.grad for t in ts]

        ref, pt = grads(True), grads(False)
        ours = (out[i:i + 1], leaves[0].grad[i:i + 1], leaves[1].grad[i:i + 1, :n], leaves[2].grad[i:i + 1, :n])
        for name, a, r, p in zip(("out", "dq", "dk", "dv"), ours, ref, pt):
            testing.assert_close_to_ref(f"{name}[{i}]", a, r, p, q.dtype)

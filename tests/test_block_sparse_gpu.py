"""Block-sparse forward (upstream's BlockSparseTensorsTorch) against an fp32 reference on a GPU.

The reference is dense attention under the mask the lists mean (testing_sparse.keep_from_map): full
blocks attended, partial blocks through the mask_mod's PyTorch twin, every other block skipped.
Tolerance is upstream's rule (testing.assert_close_to_ref); out and LSE are NaN-poisoned first.
"""

import pytest

torch = pytest.importorskip("torch")

import flash_attn_sm120  # noqa: E402
from flash_attn_sm120 import driver, testing, testing_mods, testing_sparse  # noqa: E402
from flash_attn_sm120.testing_ref import attention_ref  # noqa: E402

pytestmark = pytest.mark.gpu


def _inputs(b, sq, sk, h, hk, d, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=dtype, generator=g)
               for s, n in ((sq, h), (sk, hk), (sk, hk)))
    return q, k, v, g


def _ref(q, k, v, keep, upcast, **kw):
    outs, lses = [], []
    for i in range(q.shape[0]):  # keep is per batch row; attention_ref's keep_fn is per sequence
        kb = keep[i:i + 1]
        out, lse = attention_ref(q[i:i + 1], k[i:i + 1], v[i:i + 1], upcast=upcast, keep_fn=lambda h, qi, ki: kb, **kw)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def check(q, k, v, keep, api_kw: dict, ref_kw: dict | None = None, fn=None):
    """`fn` (default flash_attn_func) against the fp32 reference of `keep`; NaN in q/k/v stands for memory
    that must not be read (the reference sees zeros there, and `keep` must exclude it)."""
    ref_kw = ref_kw or {}
    with testing.poisoned_outputs():
        out, lse = (fn or flash_attn_sm120.flash_attn_func)(q, k, v, return_lse=True, **api_kw)
    q, k, v = (t.nan_to_num(0.0) for t in (q, k, v))
    ref_out, ref_lse = _ref(q.float(), k.float(), v.float(), keep, True, **ref_kw)
    pt_out, pt_lse = _ref(q, k, v, keep, False, **ref_kw)
    testing.assert_close_to_ref("out", out, ref_out, pt_out, q.dtype)
    testing.assert_lse_close(lse, ref_lse, pt_lse, 1e-2, 1e-3)
    return out, lse


def _map_case(b, h, sq, sk, block, seed, density=0.4, full_share=0.5, heads=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    m, n = -(-sq // block[0]), -(-sk // block[1])
    return testing_sparse.random_block_map(b, heads or h, m, n, density=density, full_share=full_share, generator=g)


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("with_full", [True, False])
def test_random_lists_with_mask_mod(d, with_full):
    """Random partial/full/skipped blocks of 128 x 128 (two K/V tiles per block at tile_n 64), a mask_mod
    on the partial ones; seqlens not multiples of the block."""
    b, h, sq, sk = 2, 4, 517, 700
    q, k, v, _ = _inputs(b, sq, sk, h, h, d, seed=d)
    kinds = _map_case(b, h, sq, sk, (128, 128), seed=d + with_full)
    sparse = testing_sparse.lists_from_map(kinds, (128, 128), with_full=with_full)
    prefix = testing_mods.spec("prefix")
    if not with_full:  # the lists put full blocks among the partial ones: the mask_mod applies to all
        kinds = torch.where(kinds > 0, testing_sparse.PARTIAL, testing_sparse.SKIP).to(torch.int32)
    keep = testing_sparse.keep_from_map(kinds, (128, 128), sq, sk, lambda bi, hi, qi, ki: prefix.keep_twin(bi, hi, qi, ki, None))
    check(q, k, v, keep, dict(mask_mod=prefix.mask_mod, block_sparse_tensors=sparse))


@pytest.mark.parametrize("pack", [False, True])
def test_launch_order_changes_no_bit(monkeypatch, pack):
    """Tiles launch longest first (block_sparse.tile_order, kernels/ordered_scheduler.py). Any permutation
    must compute the same bits: the default order, its reverse and a random one, against each other and
    the reference (packed GQA: tiles of packed rows, the grid over KV heads)."""
    from flash_attn_sm120 import block_sparse

    b, h, hk, sq, sk, d = 2, 4, 2 if pack else 4, 900, 1300, 128
    q, k, v, _ = _inputs(b, sq, sk, h, hk, d, seed=21)
    kinds = _map_case(b, h, sq, sk, (128, 128), seed=22, density=0.3, heads=1 if pack else h)
    sparse = testing_sparse.lists_from_map(kinds, (128, 128))
    keep = testing_sparse.keep_from_map(kinds, (128, 128), sq, sk).expand(b, h, sq, sk)
    real = block_sparse.tile_order
    orders = []

    def recorded(*args, **kwargs):
        orders.append(real(*args, **kwargs))
        return orders[-1]

    monkeypatch.setattr(block_sparse, "tile_order", recorded)
    out, lse = check(q, k, v, keep, dict(block_sparse_tensors=sparse, pack_gqa=pack))
    assert orders, "the block-sparse forward did not order its tiles"
    default = orders[-1]
    assert sorted(default.tolist()) == list(range(default.numel()))
    g = torch.Generator(device="cuda").manual_seed(3)
    for other in (default.flip(0), default[torch.randperm(default.numel(), device="cuda", generator=g)]):
        monkeypatch.setattr(block_sparse, "tile_order", lambda *a, _o=other, **kw: _o)
        out2, lse2 = flash_attn_sm120.flash_attn_func(q, k, v, return_lse=True, block_sparse_tensors=sparse,
                                                      pack_gqa=pack)
        assert torch.equal(out2, out) and torch.equal(lse2, lse)


@pytest.mark.parametrize("d,pack,with_full", [(64, False, True), (128, True, True), (96, False, False)])
def test_seqused_k_cache_with_lists(d, pack, with_full):
    """flash_attn_varlen_func with seqused_k on a (batch, seqlen_k) K/V cache and dense-form lists drawn over
    the cache's width, so that they name blocks past seqused_k: the host views the cache as packed sequences
    and cuts the lists at seqused_k (block_sparse.seqused_cache_as_packed). The unused rows hold NaN; a
    sequence with no key (out 0, LSE -inf), one ending inside a block, one using the whole cache; packed GQA
    with lists shared by the heads."""
    b, h, sq, sk = 3, 4, 300, 1000
    hk = 2 if pack else h
    q, k, v, _ = _inputs(b, sq, sk, h, hk, d, seed=51 + d)
    used = torch.tensor([1000, 333, 0], dtype=torch.int32, device="cuda")
    for i, n in enumerate(used.tolist()):
        k[i, n:] = float("nan")
        v[i, n:] = float("nan")
    kinds = _map_case(b, h, sq, sk, (128, 128), seed=52 + d, density=0.6, heads=1 if pack else h)
    sparse = testing_sparse.lists_from_map(kinds, (128, 128), with_full=with_full)
    if not with_full:
        kinds = torch.where(kinds > 0, testing_sparse.PARTIAL, testing_sparse.SKIP).to(torch.int32)
    keep = testing_sparse.keep_from_map(kinds, (128, 128), sq, sk).expand(b, h, sq, sk).clone()
    for i, n in enumerate(used.tolist()):
        keep[i, :, :, n:] = False
    out, lse = check(q, k, v, keep, dict(block_sparse_tensors=sparse, seqused_k=used, pack_gqa=pack),
                     fn=flash_attn_sm120.flash_attn_varlen_func)
    assert torch.all(out[2] == 0) and torch.all(torch.isinf(lse[2]))


def test_kernel_takes_its_tiles_from_the_order(monkeypatch):
    """Not a permutation on purpose: every CTA given tile 0 (m_block 0, head 0, batch 0) writes only that
    tile, so every other row of out stays NaN-poisoned; shows the kernel reads its tile from the order."""
    from flash_attn_sm120 import block_sparse

    b, h, sq, sk, d = 1, 2, 512, 512, 128
    q, k, v, _ = _inputs(b, sq, sk, h, h, d, seed=61)
    kinds = torch.full((b, h, 4, 4), testing_sparse.FULL, dtype=torch.int32, device="cuda")
    sparse = testing_sparse.lists_from_map(kinds, (128, 128))
    tiles = []

    def all_tile_zero(*args, **kwargs):
        tiles.append(kwargs["num_block"])
        return torch.zeros(kwargs["batch"] * kwargs["grid_heads"] * kwargs["num_block"], dtype=torch.int32,
                           device="cuda")

    monkeypatch.setattr(block_sparse, "tile_order", all_tile_zero)
    with testing.poisoned_outputs():
        out = flash_attn_sm120.flash_attn_func(q, k, v, block_sparse_tensors=sparse)[0]
    rows = sq // tiles[0]  # the tile's rows
    assert torch.isfinite(out[0, :rows, 0]).all()
    assert torch.isnan(out[0, rows:, 0]).all() and torch.isnan(out[0, :, 1]).all()


@pytest.mark.parametrize("block", [(64, 128), (256, 128), (128, 256), (128, 64)])
def test_block_sizes(block):
    """Q and KV subtiles: 64-row blocks (the 4-warp tile), 256-row blocks (two Q tiles each), 256-key
    blocks (four K/V tiles each) and 64-key blocks; no mask_mod (partial blocks computed whole)."""
    b, h, sq, sk, d = 1, 3, 640, 1000, 128
    q, k, v, _ = _inputs(b, sq, sk, h, h, d, seed=sum(block))
    kinds = _map_case(b, h, sq, sk, block, seed=7, density=0.5)
    keep = testing_sparse.keep_from_map(kinds, block, sq, sk)
    check(q, k, v, keep, dict(block_sparse_tensors=testing_sparse.lists_from_map(kinds, block)))


def test_empty_rows_and_compact_indices():
    """Q blocks with no block at all (O = 0, LSE = -inf) and index tensors narrower than the KV blocks."""
    b, h, sq, sk, d = 2, 2, 384, 1024, 64
    q, k, v, _ = _inputs(b, sq, sk, h, h, d, seed=3)
    kinds = torch.zeros(b, h, 3, 8, dtype=torch.int32, device="cuda")
    kinds[0, 0, 0, [1, 6]] = testing_sparse.FULL
    kinds[1, 1, 2, 7] = testing_sparse.PARTIAL
    kinds[0, 1, 1, [0, 2, 3]] = testing_sparse.FULL
    sparse = testing_sparse.lists_from_map(kinds, (128, 128))
    width = 3  # at most 3 blocks per row in either list
    sparse = sparse._replace(mask_block_idx=sparse.mask_block_idx[..., :width].contiguous(),
                             full_block_idx=sparse.full_block_idx[..., :width].contiguous())
    keep = testing_sparse.keep_from_map(kinds, (128, 128), sq, sk)
    out, lse = check(q, k, v, keep, dict(block_sparse_tensors=sparse))
    assert torch.all(out[1, :, 0] == 0) and torch.all(torch.isinf(lse[1, 0]))


@pytest.mark.parametrize("pack", [True, False])
def test_gqa(pack):
    """GQA 8:2: lists shared by every head (size-1 head dim, packed GQA allowed) or per query head
    (packing is turned off, upstream's rule)."""
    b, h, hk, sq, sk, d = 2, 8, 2, 300, 520, 128
    q, k, v, _ = _inputs(b, sq, sk, h, hk, d, seed=5)
    kinds = _map_case(b, h, sq, sk, (128, 128), seed=9, heads=1 if pack else h)
    keep = testing_sparse.keep_from_map(kinds, (128, 128), sq, sk)
    check(q, k, v, keep.expand(b, h, sq, sk), dict(block_sparse_tensors=testing_sparse.lists_from_map(kinds, (128, 128))))


def test_causal_with_lists():
    """causal=True without a mask_mod: the causal mask applies inside every visited block."""
    b, h, sq, sk, d = 1, 4, 600, 600, 128
    q, k, v, _ = _inputs(b, sq, sk, h, h, d, seed=13)
    kinds = _map_case(b, h, sq, sk, (128, 128), seed=2, density=0.7)
    keep = testing_sparse.keep_from_map(kinds, (128, 128), sq, sk, causal=True)
    check(q, k, v, keep, dict(causal=True, block_sparse_tensors=testing_sparse.lists_from_map(kinds, (128, 128))))


def test_document_mask_from_upstream_helper():
    """A document mask over an aux tensor, its lists from upstream's compute_block_sparsity (by import)."""
    from flash_attn.cute.compute_block_sparsity import compute_block_sparsity

    b, h, s, d = 2, 4, 1000, 128
    q, k, v, g = _inputs(b, s, s, h, h, d, seed=17)
    doc = testing_mods.spec("document")
    aux = testing_mods.make_aux("document", [s] * b, [s] * b, h, "cuda", g)
    sparse = compute_block_sparsity(128, 128, b, h, s, s, doc.mask_mod, aux, "cuda")
    bi = torch.arange(b, device="cuda").view(b, 1, 1, 1)
    qi, ki = torch.arange(s, device="cuda").view(1, 1, -1, 1), torch.arange(s, device="cuda").view(1, 1, 1, -1)
    keep = doc.keep_twin(bi, None, qi, ki, aux).expand(b, h, s, s)
    check(q, k, v, keep, dict(mask_mod=doc.mask_mod, aux_tensors=aux, block_sparse_tensors=sparse))


def test_flex_block_mask_with_sink():
    """Lists from PyTorch's create_block_mask (sliding window + 64 global tokens), with a learnable sink."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    import cutlass.cute as cute
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    window, glob = 256, 64

    @cute.jit
    def window_global(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        near = (q_idx - kv_idx <= cute.full_like(q_idx, window)) & (kv_idx - q_idx <= cute.full_like(q_idx, window))
        return near | (kv_idx < cute.full_like(kv_idx, glob)) | (q_idx < cute.full_like(q_idx, glob))

    def window_global_twin(b, h, qi, ki):
        return ((qi - ki).abs() <= window) | (ki < glob) | (qi < glob)

    b, h, s, d = 1, 4, 1536, 128
    q, k, v, g = _inputs(b, s, s, h, h, d, seed=19)
    bm = flex.create_block_mask(lambda b_, h_, qi, ki: window_global_twin(b_, h_, qi, ki), b, h, s, s,
                                device="cuda", BLOCK_SIZE=(128, 128))
    _, _, kv_cnt, kv_idx, full_cnt, full_idx, *_ = bm.as_tuple()
    sparse = BlockSparseTensorsTorch(kv_cnt, kv_idx, full_cnt, full_idx, block_size=(128, 128))
    sink = torch.randn(h, device="cuda", generator=g, dtype=torch.float32)
    qi, ki = torch.arange(s, device="cuda").view(1, 1, -1, 1), torch.arange(s, device="cuda").view(1, 1, 1, -1)
    keep = window_global_twin(None, None, qi, ki).expand(b, h, s, s)
    check(q, k, v, keep, dict(mask_mod=window_global, block_sparse_tensors=sparse, learnable_sink=sink),
          dict(learnable_sink=sink))


def test_refusals():
    q, k, v, _ = _inputs(1, 256, 256, 2, 2, 128, seed=1)
    kinds = _map_case(1, 2, 256, 256, (128, 128), seed=1)
    sparse = testing_sparse.lists_from_map(kinds, (128, 128))
    with pytest.raises(ValueError, match="not a multiple"):
        flash_attn_sm120.flash_attn_func(q, k, v, block_sparse_tensors=sparse._replace(block_size=(96, 128)))
    with pytest.raises(NotImplementedError, match="head dims"):
        q2, k2, v2, _ = _inputs(1, 256, 256, 2, 2, 192, seed=1)
        flash_attn_sm120.flash_attn_func(q2, k2, v2, block_sparse_tensors=sparse)
    assert driver.compile_count["fwd"] >= 0


# ---- backward: block_sparse_tensors_bwd (Q-direction lists) ------------------------------------------

def _grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def check_bwd(q, k, v, keep, api_kw: dict, seed: int = 0):
    """Forward and dq/dk/dv against the fp32 autograd reference of the dense mask `keep` (upstream's rule)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), device="cuda", dtype=q.dtype, generator=g)
    with testing.poisoned_outputs():
        ours = _grads(lambda *t: flash_attn_sm120.flash_attn_func(*t, **api_kw)[0], q, k, v, dout)
    ref = _grads(lambda *t: _ref(*t, keep, True)[0], q.float(), k.float(), v.float(), dout.float())
    pt = _grads(lambda *t: _ref(*t, keep, False)[0], q, k, v, dout)
    for name, a, r, p in zip(("out", "dq", "dk", "dv"), ours, ref, pt):
        testing.assert_close_to_ref(name, a, r, p, q.dtype)


def _both_lists(kinds, block, with_full=True):
    return (testing_sparse.lists_from_map(kinds, block, with_full),
            testing_sparse.lists_from_map(kinds.transpose(2, 3).contiguous(), block, with_full))


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("with_full", [True, False])
def test_backward_random_lists_with_mask_mod(d, with_full):
    b, h, sq, sk = 2, 4, 517, 700
    q, k, v, _ = _inputs(b, sq, sk, h, h, d, seed=d + 1)
    kinds = _map_case(b, h, sq, sk, (128, 128), seed=d + 2)
    prefix = testing_mods.spec("prefix")
    fwd, bwd = _both_lists(kinds, (128, 128), with_full)
    if not with_full:
        kinds = torch.where(kinds > 0, testing_sparse.PARTIAL, testing_sparse.SKIP).to(torch.int32)
    keep = testing_sparse.keep_from_map(kinds, (128, 128), sq, sk, lambda bi, hi, qi, ki: prefix.keep_twin(bi, hi, qi, ki, None))
    check_bwd(q, k, v, keep, dict(mask_mod=prefix.mask_mod, block_sparse_tensors=fwd, block_sparse_tensors_bwd=bwd))


@pytest.mark.parametrize("heads", [1, 8])
def test_backward_launch_order(monkeypatch, heads):
    """The backward's K/V tiles launch longest list first (block_sparse.tile_order). Against the reference
    with the default order, then with its reverse and a random order: dK/dV are each CTA's own sums (MHA),
    so bitwise equal; dQ (atomics) equal within rounding. GQA 4:2 with lists shared by every head too."""
    from flash_attn_sm120 import block_sparse

    b, h, sq, sk, d = 2, 4, 700, 1100, 128
    hk = h if heads > 1 else 2
    q, k, v, _ = _inputs(b, sq, sk, h, hk, d, seed=41)
    kinds = _map_case(b, h, sq, sk, (128, 128), seed=43, density=0.3, heads=1 if heads == 1 else h)
    fwd, bwd = _both_lists(kinds, (128, 128))
    keep = testing_sparse.keep_from_map(kinds, (128, 128), sq, sk).expand(b, h, sq, sk)
    real, calls = block_sparse.tile_order, []

    def recorded(*args, **kwargs):
        calls.append((kwargs, real(*args, **kwargs)))
        return calls[-1][1]

    monkeypatch.setattr(block_sparse, "tile_order", recorded)
    api = dict(block_sparse_tensors=fwd, block_sparse_tensors_bwd=bwd)
    check_bwd(q, k, v, keep, api)
    assert len(calls) == 2, "the forward and the backward each order their tiles"
    bwd_kw, default = calls[1]  # the backward's: K/V tiles of every query head
    assert bwd_kw["grid_heads"] == h and default.numel() == b * h * bwd_kw["num_block"]
    assert sorted(default.tolist()) == list(range(default.numel()))
    g = torch.Generator(device="cuda").manual_seed(5)
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=q.dtype, generator=g)
    grads = []
    for other in (None, default.flip(0), default[torch.randperm(default.numel(), device="cuda", generator=g)]):
        if other is not None:
            monkeypatch.setattr(block_sparse, "tile_order",
                                lambda *a, _o=other, **kw: _o if kw == bwd_kw else real(*a, **kw))
        grads.append(_grads(lambda *t: flash_attn_sm120.flash_attn_func(*t, **api)[0], q, k, v, dout))
    for other in grads[1:]:
        if hk == h:
            assert torch.equal(other[2], grads[0][2]) and torch.equal(other[3], grads[0][3])
        for a, ref in zip(other[1:], grads[0][1:]):
            torch.testing.assert_close(a, ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("d,cfg", [
    (128, "bwd-w8-64x64-q1do1-a242"), (128, "bwd-w8-64x64-q2do1-a242"),
    (64, "bwd-w4-64x64-q2do2-a444"), (64, "bwd-w8-64x128-q2do2-a244"), (96, "bwd-w4-32x64-q2do2-a222"),
])
def test_backward_walk_stages(d, cfg):
    """The list walk with one or two Q / dO stages: each step loads the listed tile one (Q) or as many
    positions ahead as its stages (dO), and position 0 loads the first ones in upstream's commit groups.
    Lists of 0 to 5 sparse blocks (1 to 4 tiles each) cover every prefetch across a list's end, with mask
    and full lists mixed, and short rows (seqlen_q 517: the last sparse block is cut)."""
    from flash_attn_sm120 import driver_bwd
    from flash_attn_sm120.config_bwd import bwd_config_from_name

    b, h, sq, sk = 2, 3, 517, 700
    q, k, v, _ = _inputs(b, sq, sk, h, h, d, seed=d + 7)
    kinds = _map_case(b, h, sq, sk, (128, 128), seed=d + 11, density=0.5)
    kinds[0, 0, :, 0] = testing_sparse.SKIP  # a K/V tile that no Q tile sees
    kinds[0, 1, :, 1] = testing_sparse.FULL  # one that every Q tile sees
    prefix = testing_mods.spec("prefix")
    fwd, bwd = _both_lists(kinds, (128, 128))
    keep = testing_sparse.keep_from_map(kinds, (128, 128), sq, sk, lambda bi, hi, qi, ki: prefix.keep_twin(bi, hi, qi, ki, None))
    with driver_bwd.force_config(bwd_config_from_name(cfg)):
        check_bwd(q, k, v, keep, dict(mask_mod=prefix.mask_mod, block_sparse_tensors=fwd, block_sparse_tensors_bwd=bwd))


@pytest.mark.parametrize("heads", [1, 8])
def test_backward_gqa(heads):
    """GQA 8:2: query heads of a group add into one dK/dV; lists shared (1 head) or per query head."""
    b, h, hk, sq, sk, d = 2, 8, 2, 300, 520, 128
    q, k, v, _ = _inputs(b, sq, sk, h, hk, d, seed=23)
    kinds = _map_case(b, h, sq, sk, (128, 128), seed=29, heads=heads)
    fwd, bwd = _both_lists(kinds, (128, 128))
    keep = testing_sparse.keep_from_map(kinds, (128, 128), sq, sk).expand(b, h, sq, sk)
    check_bwd(q, k, v, keep, dict(block_sparse_tensors=fwd, block_sparse_tensors_bwd=bwd))


@pytest.mark.parametrize("block", [(256, 128), (64, 128), (128, 256)])
def test_backward_block_sizes(block):
    b, h, sq, sk, d = 1, 3, 640, 1000, 128
    q, k, v, _ = _inputs(b, sq, sk, h, h, d, seed=sum(block) + 1)
    kinds = _map_case(b, h, sq, sk, block, seed=31, density=0.5)
    fwd, bwd = _both_lists(kinds, block)
    check_bwd(q, k, v, testing_sparse.keep_from_map(kinds, block, sq, sk),
              dict(block_sparse_tensors=fwd, block_sparse_tensors_bwd=bwd))


@pytest.mark.parametrize("bwd_lists", [True, False])
def test_backward_flex_document_mask(bwd_lists):
    """Both directions' lists from PyTorch's create_block_mask over a document mask (an aux tensor);
    without backward lists the backward is dense with the mask_mod everywhere (upstream's meaning)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    b, h, s, d = 2, 4, 1000, 64
    q, k, v, g = _inputs(b, s, s, h, h, d, seed=37)
    doc = testing_mods.spec("document")
    aux = testing_mods.make_aux("document", [s] * b, [s] * b, h, "cuda", g)
    ids = aux[0]
    bm = flex.create_block_mask(lambda b_, h_, qi, ki: ids[b_, qi] == ids[b_, ki], b, h, s, s, device="cuda",
                                BLOCK_SIZE=(128, 128))
    _, _, kv_cnt, kv_idx, fkv_cnt, fkv_idx, q_cnt, q_idx, fq_cnt, fq_idx, *_ = bm.as_tuple()
    fwd = BlockSparseTensorsTorch(kv_cnt, kv_idx, fkv_cnt, fkv_idx, block_size=(128, 128))
    bwd = BlockSparseTensorsTorch(q_cnt, q_idx, fq_cnt, fq_idx, block_size=(128, 128)) if bwd_lists else None
    bi = torch.arange(b, device="cuda").view(b, 1, 1, 1)
    qi, ki = torch.arange(s, device="cuda").view(1, 1, -1, 1), torch.arange(s, device="cuda").view(1, 1, 1, -1)
    keep = doc.keep_twin(bi, None, qi, ki, aux).expand(b, h, s, s)
    check_bwd(q, k, v, keep, dict(mask_mod=doc.mask_mod, aux_tensors=aux, block_sparse_tensors=fwd,
                                  block_sparse_tensors_bwd=bwd))


@pytest.mark.parametrize("mask,block", [("causal", (128, 128)), ("causal", (256, 128)), ("local", (128, 64))])
def test_backward_lists_with_causal_or_window(mask, block):
    """Backward lists with causal=True or a sliding window and no mask_mod: the rule applies inside every listed
    tile, as in the forward (the walk's m range stays the whole sequence), mask and full lists alike."""
    b, h, sq, sk, d = 2, 3, 700, 640, 128
    q, k, v, _ = _inputs(b, sq, sk, h, h, d, seed=41 + block[0])
    kinds = _map_case(b, h, sq, sk, block, seed=43, density=0.6)
    fwd, bwd = _both_lists(kinds, block)
    keep = testing_sparse.keep_from_map(kinds, block, sq, sk)
    qi, ki = torch.arange(sq, device="cuda").view(-1, 1), torch.arange(sk, device="cuda").view(1, -1)
    shift = sk - sq  # bottom-right aligned, as upstream
    if mask == "causal":
        keep, kw = keep & (ki <= qi + shift), dict(causal=True)
    else:
        keep, kw = keep & (ki <= qi + shift + 30) & (ki >= qi + shift - 200), dict(window_size=(200, 30))
    check_bwd(q, k, v, keep, dict(block_sparse_tensors=fwd, block_sparse_tensors_bwd=bwd, **kw))


@pytest.mark.parametrize("case", ["mha-full", "gqa-masklists", "causal-subtiles"])
def test_backward_lists_deterministic(case):
    """deterministic=True with backward lists and no score_mod: dQ added in 64-bit fixed point
    (kernels/bwd_fixed_point.py), bitwise-identical dq/dk/dv over three runs and right against the fp32
    reference; with mask lists only, GQA (head-ordered dK/dV), and sparse blocks spanning two K/V tiles of the
    kernel under causal."""
    b, h, hk, sq, sk, d, block, with_full, kw = {
        "mha-full": (2, 4, 4, 517, 700, 128, (128, 128), True, {}),
        "gqa-masklists": (1, 8, 2, 640, 520, 64, (128, 128), False, {}),
        "causal-subtiles": (1, 4, 4, 900, 900, 128, (128, 256), True, dict(causal=True)),
    }[case]
    q, k, v, g = _inputs(b, sq, sk, h, hk, d, seed=47)
    kinds = _map_case(b, h, sq, sk, block, seed=53, density=0.6)
    if not with_full:
        kinds = torch.where(kinds > 0, testing_sparse.PARTIAL, testing_sparse.SKIP).to(torch.int32)
    fwd, bwd = _both_lists(kinds, block, with_full)
    keep = testing_sparse.keep_from_map(kinds, block, sq, sk, causal=bool(kw)).expand(b, h, sq, sk)
    api = dict(block_sparse_tensors=fwd, block_sparse_tensors_bwd=bwd, deterministic=True, **kw)
    check_bwd(q, k, v, keep, api)
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), device="cuda", dtype=q.dtype, generator=g)
    runs = [_grads(lambda *t: flash_attn_sm120.flash_attn_func(*t, **api)[0], q, k, v, dout)[1:] for _ in range(3)]
    for later in runs[1:]:
        for name, a, r in zip(("dq", "dk", "dv"), runs[0], later):
            assert torch.equal(a, r), f"{case}: {name} differs between deterministic runs"


def test_backward_lists_deterministic_turns_with_score_mod():
    """deterministic=True with backward lists and a user score_mod (no bound for fixed point): dQ in turns from
    the lists (ascending K/V tile). Bitwise-identical over three runs, and within a bf16 rounding of the
    non-deterministic walk (whose sums the other tests check against the fp32 reference)."""
    b, h, hk, sq, sk, d, block = 1, 4, 2, 640, 700, 128, (128, 128)
    q, k, v, g = _inputs(b, sq, sk, h, hk, d, seed=59)
    kinds = _map_case(b, h, sq, sk, block, seed=61, density=0.6)
    fwd, bwd = _both_lists(kinds, block)
    pos = testing_mods.spec("position")
    api = dict(block_sparse_tensors=fwd, block_sparse_tensors_bwd=bwd, score_mod=pos.score_mod,
               score_mod_bwd=pos.score_mod_bwd)
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), device="cuda", dtype=q.dtype, generator=g)
    call = lambda **kw: _grads(lambda *t: flash_attn_sm120.flash_attn_func(*t, **api, **kw)[0], q, k, v, dout)  # noqa: E731
    with testing.poisoned_outputs():
        runs = [call(deterministic=True) for _ in range(3)]
    check_deterministic_runs(runs, call(deterministic=False))


def check_deterministic_runs(runs, free=None):
    """(out, dq, dk, dv) of deterministic runs: bitwise equal to the first; with `free` (the non-deterministic
    call's), finite and within a bf16 rounding of it."""
    for later in runs[1:]:
        for name, a, r in zip(("out", "dq", "dk", "dv"), runs[0], later):
            assert torch.equal(a, r), f"{name} differs between deterministic runs"
    for name, a, r in zip(("out", "dq", "dk", "dv"), runs[0], free or ()):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.float(), r.float(), atol=2e-2 * r.float().abs().max().item(), rtol=2e-2,
                                   msg=lambda m: f"{name}: {m}")


def _varlen_case(lens_q, lens_k, h, hk, d, block, seed, with_full=True, density=0.5):
    """Packed q/k/v, per-sequence random block maps and their varlen lists (upstream's layout)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(sum(lens), n, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for lens, n in ((lens_q, h), (lens_k, hk), (lens_k, hk)))
    maps = [testing_sparse.random_block_map(1, h, -(-sq // block[0]), -(-sk // block[1]), density=density,
                                            full_share=0.5, generator=g)[0]
            for sq, sk in zip(lens_q, lens_k)]
    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
          for lens in (lens_q, lens_k)]
    return q, k, v, maps, cu


@pytest.mark.parametrize("d,block", [(64, (128, 128)), (128, (128, 128)), (128, (64, 128)), (96, (128, 256))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_full", [True, False])
def test_varlen_lists(d, block, causal, with_full):
    """Upstream's varlen lists (2-D, cu_total_m_blocks, cu_block_idx_offsets) through flash_attn_varlen_func:
    sequences of 0 rows, of fewer keys than one block, not block multiples, seqlen_q != seqlen_k; GQA; a
    mask_mod on the partial blocks (causal cases: the causal mask inside the listed tiles instead); each
    sequence against the fp32 reference of the mask the lists mean."""
    lens_q, lens_k = (300, 0, 128, 700, 5), (517, 64, 100, 700, 1000)
    h, hk = 4, 2
    q, k, v, maps, (cu_q, cu_k) = _varlen_case(lens_q, lens_k, h, hk, d, block, seed=d + causal + 2 * with_full)
    sparse = testing_sparse.varlen_lists_from_maps(maps, block, with_full)
    # a mask_mod replaces the causal mask (upstream's _resolve_causal_local_window): causal cases go without one
    prefix = None if causal else testing_mods.spec("prefix")
    with testing.poisoned_outputs():
        out, lse = flash_attn_sm120.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
            causal=causal, mask_mod=None if causal else prefix.mask_mod, block_sparse_tensors=sparse,
            return_lse=True)
    for i, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        if sq == 0:
            continue
        kinds = maps[i][None] if with_full else torch.where(maps[i][None] > 0, testing_sparse.PARTIAL, 0).int()
        twin = None if causal else (lambda bi, hi, qi, ki: prefix.keep_twin(bi, hi, qi, ki, None))
        keep = testing_sparse.keep_from_map(kinds, block, sq, sk, twin, causal)
        rows_q, rows_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        qs, ks, vs = q[None, rows_q], k[None, rows_k], v[None, rows_k]
        ref_out, ref_lse = _ref(qs.float(), ks.float(), vs.float(), keep, True)
        pt_out, pt_lse = _ref(qs, ks, vs, keep, False)
        testing.assert_close_to_ref(f"out[{i}]", out[None, rows_q], ref_out, pt_out, q.dtype)
        testing.assert_lse_close(lse[None, :, rows_q], ref_lse, pt_lse, 1e-2, 1e-3)


def test_varlen_lists_refusals_name_the_problem():
    """Upstream's rules for varlen lists, as ValueErrors: packed q needs them; varlen K needs
    cu_block_idx_offsets; the sparse Q block must be one kernel tile (no config has 256 rows here)."""
    lens = (300, 77)
    q, k, v, maps, (cu_q, cu_k) = _varlen_case(lens, lens, 2, 2, 128, (128, 128), seed=3)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=300, max_seqlen_k=300)
    dense_form = testing_sparse.lists_from_map(torch.zeros(2, 2, 3, 3, dtype=torch.int32, device="cuda"), (128, 128))
    with pytest.raises(ValueError, match="cu_total_m_blocks"):
        flash_attn_sm120.flash_attn_varlen_func(q, k, v, block_sparse_tensors=dense_form, **kw)
    no_offsets = testing_sparse.varlen_lists_from_maps(maps, (128, 128), offsets=False)
    with pytest.raises(ValueError, match="cu_block_idx_offsets"):
        flash_attn_sm120.flash_attn_varlen_func(q, k, v, block_sparse_tensors=no_offsets, **kw)
    _, _, _, maps256, _ = _varlen_case(lens, lens, 2, 2, 128, (256, 128), seed=3)
    with pytest.raises(ValueError, match="one kernel tile"):
        flash_attn_sm120.flash_attn_varlen_func(
            q, k, v, block_sparse_tensors=testing_sparse.varlen_lists_from_maps(maps256, (256, 128)), **kw)


def test_forward_captures_in_cuda_graph():
    """A block-sparse forward captured in a CUDA graph after an eager call (the usual warm-up) reuses the
    cached launch order, so the graph holds the attention kernel and no sort; the order stays alive when
    the cache drops it, and a replay over new q/k/v written into the captured inputs matches the reference."""
    from flash_attn_sm120 import bench, block_sparse

    b, h, sq, sk, d = 2, 4, 600, 900, 64
    q, k, v, _ = _inputs(b, sq, sk, h, h, d, seed=23)
    kinds = _map_case(b, h, sq, sk, (128, 128), seed=23, density=0.3)
    sparse = testing_sparse.lists_from_map(kinds, (128, 128))
    call = lambda: flash_attn_sm120.flash_attn_func(q, k, v, return_lse=True, block_sparse_tensors=sparse)  # noqa: E731
    call()  # compile and cache the order outside the capture
    graph, (out, lse) = bench.capture_graph(call)
    block_sparse._ORDER_CACHE.clear()  # the graph's order must not depend on the cache
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    keep = testing_sparse.keep_from_map(kinds, (128, 128), sq, sk)
    ref_out, ref_lse = _ref(q.float(), k.float(), v.float(), keep, True)
    pt_out, pt_lse = _ref(q, k, v, keep, False)
    testing.assert_close_to_ref("out", out, ref_out, pt_out, q.dtype)
    testing.assert_lse_close(lse, ref_lse, pt_lse, 1e-2, 1e-3)

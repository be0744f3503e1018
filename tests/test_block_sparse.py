"""Block sparsity on a CPU: sparse block sizes, config choice, refusals, the test lists, sm_120a codegen.

The GPU half (tests/test_block_sparse_gpu.py) checks results against an fp32 reference.
"""

import itertools
import weakref

import pytest

torch = pytest.importorskip("torch")

from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # noqa: E402

from flash_attn_sm120 import block_sparse, block_sparse_bwd, testing_sparse  # noqa: E402
from flash_attn_sm120.config import FwdConfig  # noqa: E402


def _tensors(b=1, h=2, m=4, n=8, block_size=None, ndim=3):
    cnt = torch.zeros((b, h, m) if ndim == 3 else (h, m), dtype=torch.int32)
    idx = torch.zeros((b, h, m, n) if ndim == 3 else (h, m * n), dtype=torch.int32)
    return BlockSparseTensorsTorch(cnt, idx, block_size=block_size)


def test_block_size_given_or_inferred():
    assert block_sparse.sparse_block_size(_tensors(block_size=(128, 64)), 500, 500) == (128, 64)
    # 4 Q blocks of 4 rows and 8 KV blocks of 8 keys: only 1 x 1 splits them so (upstream's rule: the
    # block size is inferred only where one size fits; 4 blocks of 512 rows fit 128 .. 170)
    assert block_sparse.sparse_block_size(_tensors(), 4, 8) == (1, 1)
    with pytest.raises(ValueError, match="cannot infer"):
        block_sparse.sparse_block_size(_tensors(), 512, 1024)
    with pytest.raises(ValueError, match="positive"):
        block_sparse.sparse_block_size(_tensors(block_size=(0, 128)), 256, 256)
    with pytest.raises(ValueError, match="cu_total_m_blocks"):  # 2-D lists are the varlen form only
        block_sparse.sparse_block_size(_tensors(ndim=2, block_size=(128, 128)), 256, 256)
    varlen = _tensors(ndim=2)._replace(cu_total_m_blocks=torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="need block_size"):
        block_sparse.sparse_block_size(varlen, 0, 0)
    assert block_sparse.sparse_block_size(varlen._replace(block_size=(128, 256)), 0, 0) == (128, 256)


def test_candidates_divide_the_block():
    c = block_sparse.forward_candidates(128, 128, (128, 128))
    assert c == [FwdConfig(256, 128, 64, 2, False, "tma"), FwdConfig(128, 64, 64, 2, False, "tma")]
    assert block_sparse.forward_candidates(128, 128, (64, 128)) == [FwdConfig(128, 64, 64, 2, False, "tma")]
    assert block_sparse.forward_candidates(64, 64, (128, 128))[0] == FwdConfig(128, 128, 64, 1, False, "tma")
    assert block_sparse.forward_candidates(96, 96, (128, 128))[0] == FwdConfig(128, 128, 32, 1, False, "tma")
    assert block_sparse.forward_candidates(64, 64, (128, 64))[0].tile_n == 64
    assert block_sparse.forward_candidates(128, 128, (96, 128)) == []
    assert block_sparse.forward_candidates(192, 192, (128, 128)) == []
    for d, configs in block_sparse.CONFIGS.items():
        for cfg in configs:
            assert cfg.family == "tma" and cfg.error(d, d) is None, (d, cfg)


def test_refusal_messages():
    assert isinstance(block_sparse.no_config_error((96, 128), 128, 128, []), ValueError)
    assert "not a multiple" in str(block_sparse.no_config_error((96, 128), 128, 128, []))
    err = block_sparse.no_config_error((128, 128), 192, 192, [])
    assert isinstance(err, NotImplementedError) and "head dims 192/192" in str(err)
    err = block_sparse.no_config_error((128, 128), 128, 128, ["varlen (cu_seqlens_q) is not supported"])
    assert isinstance(err, NotImplementedError) and "varlen" in str(err)


def test_lists_from_map_ascend_and_mean_what_the_map_says():
    g = torch.Generator().manual_seed(0)
    kinds = testing_sparse.random_block_map(2, 3, 5, 7, density=0.5, full_share=0.5, generator=g, device="cpu")
    t = testing_sparse.lists_from_map(kinds, (64, 64))
    for cnt, idx, kind in ((t.mask_block_cnt, t.mask_block_idx, 1), (t.full_block_cnt, t.full_block_idx, 2)):
        for b in range(2):
            for h in range(3):
                for m in range(5):
                    want = (kinds[b, h, m] == kind).nonzero().flatten().tolist()
                    assert idx[b, h, m, :cnt[b, h, m]].tolist() == want  # ascending, packed left
    merged = testing_sparse.lists_from_map(kinds, (64, 64), with_full=False)
    assert merged.full_block_cnt is None
    assert torch.equal(merged.mask_block_cnt, (kinds > 0).sum(-1).to(torch.int32))
    keep = testing_sparse.keep_from_map(kinds, (64, 64), 300, 420, lambda b, h, qi, ki: ki <= qi)
    assert keep.shape == (2, 3, 300, 420)
    assert bool(keep[0, 0, 10, 5]) == (int(kinds[0, 0, 0, 0]) == 2 or (int(kinds[0, 0, 0, 0]) == 1))
    assert bool(keep[0, 0, 5, 10]) == (int(kinds[0, 0, 0, 0]) == 2)  # partial: the twin drops ki > qi


def _codegen_cases():
    for d, configs in block_sparse.CONFIGS.items():
        for cfg in configs:
            for causal, dtype in ((False, "bfloat16"), (True, "bfloat16"), (False, "float16")):
                yield pytest.param(cfg, d, causal, dtype, id=f"d{d}-{cfg.name}-{'causal' if causal else 'full'}-{dtype}")


@pytest.mark.parametrize("cfg,d,causal,dtype", list(_codegen_cases()))
def test_block_sparse_configs_compile_spill_free_for_sm120a(cfg, d, causal, dtype):
    """Every CONFIGS entry, with mask and full lists and two K/V tiles per 128-key block, is spill-free
    (no stack, no local memory) in the sm_120a cubin."""
    from flash_attn_sm120 import codegen

    kernels = []
    cubin, _ = codegen.compile_fwd_cubin(cfg, d, causal=causal, dtype=dtype,
                                         block_sparse=(128 // cfg.tile_m, 128 // cfg.tile_n, True), kernel_out=kernels)
    res, _, sass = codegen.inspect_cubin(cubin)
    assert res["stack"] == 0 and res["local"] == 0, res
    assert kernels[0].kv_subtile_factor == 128 // cfg.tile_n


@pytest.mark.parametrize("d", [64, 96, 128])
def test_block_sparse_backward_walk_compiles_spill_free_for_sm120a(d):
    """The backward walk (kernels/bwd_block_sparse.py) on each head dim's table config with one Q/dO stage, a
    mask_mod and both lists, as block_sparse_bwd.plan builds it: spill-free on sm_120a."""
    from dataclasses import replace

    from flash_attn_sm120 import codegen, driver_bwd
    from flash_attn_sm120.config_bwd import load_bwd_table, select_bwd_config
    from flash_attn_sm120.kernels.bwd_block_sparse import FlashAttentionBackwardSm120BlockSparse
    from flash_attn_sm120.testing_mods import prefix_lm

    cfg = replace(select_bwd_config(load_bwd_table(), d, d, False, False, modifiers=True), stages_q=1, stages_do=1,
                  v_in_regs=False)
    kernels = []
    cubin, _ = codegen.compile_bwd_cubin(cfg, d, mods=driver_bwd.Mods(mask_mod=prefix_lm), kernel_out=kernels,
                                         block_sparse=(128 // cfg.m_block, 128 // cfg.n_block, True))
    res, _, _ = codegen.inspect_cubin(cubin)
    assert res["stack"] == 0 and res["local"] == 0, res
    assert isinstance(kernels[0], FlashAttentionBackwardSm120BlockSparse) and kernels[0].has_full


@pytest.mark.parametrize("d,mask,det,full,subtiles,gqa", [
    (128, "causal", False, True, (1, 2), 1), (128, "local", False, True, (1, 1), 1), (128, "none", True, True, (1, 1), 1),
    (64, "causal", True, False, (2, 2), 4), (96, "local", True, True, (1, 1), 2)])
def test_block_sparse_backward_walk_with_windows_and_turns_compiles_for_sm120a(d, mask, det, full, subtiles, gqa):
    """The walk with a causal mask or window inside its tiles (the mainloop built without one) and with the
    deterministic turns (driver_bwd.SPARSE_DETERMINISTIC_PLAN): spill-free on sm_120a, the dQ adds REDs."""
    from dataclasses import replace

    from flash_attn_sm120 import codegen, driver_bwd
    from flash_attn_sm120.config_bwd import load_bwd_table, select_bwd_config

    causal, local = mask == "causal", mask == "local"
    # as the driver takes the table's config for the walk: one stage each, V in shared memory
    cfg = replace(select_bwd_config(load_bwd_table(), d, d, causal, local, modifiers=True), stages_q=1, stages_do=1,
                  v_in_regs=False)
    kernels = []
    cubin, _ = codegen.compile_bwd_cubin(cfg, d, causal=causal, local=local, deterministic=det, qhead_per_kvhead=gqa,
                                         block_sparse=(*subtiles, full), kernel_out=kernels,
                                         ordering=driver_bwd.SPARSE_DETERMINISTIC_PLAN if det else None)
    res, hist, _ = codegen.inspect_cubin(cubin)
    assert res["stack"] == 0 and res["local"] == 0, res
    assert hist.get("ATOMG", 0) == 0 and hist.get("REDG", 0) > 0, hist
    kernel = kernels[0]
    assert (kernel.is_causal, kernel.is_local, kernel.mask_causal, kernel.mask_local) == (False, False, causal, local)
    assert kernel.deterministic == det and kernel.fused_turns == det


@pytest.mark.parametrize("name,d,gqa", [("bwd-w8-64x64-q2do1-a242", 128, 1), ("bwd-w8-64x128-q2do2-a244", 64, 2),
                                         ("bwd-w4-32x64-q2do2-a222", 96, 1)])
def test_block_sparse_backward_walk_with_two_stages_compiles_for_sm120a(name, d, gqa):
    """The walk with two Q (and dO) stages, as a given config runs it (tests/test_block_sparse_gpu.py's
    test_backward_walk_stages): spill-free on sm_120a with full lists and Q subtiles."""
    from flash_attn_sm120 import codegen
    from flash_attn_sm120.config_bwd import bwd_config_from_name

    cfg = bwd_config_from_name(name)
    res, _, _ = codegen.inspect_cubin(codegen.compile_bwd_cubin(
        cfg, d, qhead_per_kvhead=gqa, block_sparse=(128 // cfg.m_block, 128 // cfg.n_block, True))[0])
    assert res["stack"] == 0 and res["local"] == 0, res


def _turns_by_definition(cnt, idx, fcnt, fidx, num_q):
    """For each list entry (n, i) naming Q block m: the KV blocks n' < n whose lists name m, counted."""
    b, h, n, w = idx.shape
    names = [[[set(idx[bi, hi, ni, :cnt[bi, hi, ni]].tolist()) | (set(fidx[bi, hi, ni, :fcnt[bi, hi, ni]].tolist())
                                                                   if fidx is not None else set())
               for ni in range(n)] for hi in range(h)] for bi in range(b)]
    out = []
    for c, x in ((cnt, idx), (fcnt, fidx)):
        if x is None:
            out.append(None)
            continue
        t = torch.zeros_like(x, dtype=torch.int32)
        for bi, hi, ni in itertools.product(range(b), range(h), range(n)):
            for i in range(int(c[bi, hi, ni])):
                m = int(x[bi, hi, ni, i])
                t[bi, hi, ni, i] = sum(m in names[bi][hi][nj] for nj in range(ni))
        out.append(t)
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("with_full", [True, False])
def test_dq_turns_rank_each_entry_among_the_kv_blocks_naming_its_q_block(seed, with_full):
    """block_sparse.dq_turns against its definition on random backward lists (entries past a count are 0)."""
    from flash_attn_sm120 import testing_sparse

    g = torch.Generator().manual_seed(seed)
    kinds = testing_sparse.random_block_map(2, 3, 7, 5, density=0.5, full_share=0.5 if with_full else 0.0, generator=g,
                                            device="cpu")
    bwd = testing_sparse.lists_from_map(kinds.transpose(2, 3).contiguous(), (64, 64), with_full)
    got = block_sparse.dq_turns(bwd.mask_block_cnt, bwd.mask_block_idx, bwd.full_block_cnt, bwd.full_block_idx, 7)
    want = _turns_by_definition(bwd.mask_block_cnt, bwd.mask_block_idx, bwd.full_block_cnt, bwd.full_block_idx, 7)
    for gt, wt, idx in zip(got, want, (bwd.mask_block_idx, bwd.full_block_idx)):
        if idx is None:
            assert gt is None
            continue
        assert gt.dtype == torch.int32 and gt.shape == idx.shape and gt.is_contiguous()
        assert torch.equal(gt, wt)
    # every Q block's turns among its visitors are 0, 1, ..., visitors - 1: no turn is skipped or taken twice
    for bi, hi in itertools.product(range(2), range(3)):
        seen = {}
        for t, c, x in ((got[0], bwd.mask_block_cnt, bwd.mask_block_idx), (got[1], bwd.full_block_cnt, bwd.full_block_idx)):
            if x is None:
                continue
            for ni in range(5):
                for i in range(int(c[bi, hi, ni])):
                    seen.setdefault(int(x[bi, hi, ni, i]), []).append(int(t[bi, hi, ni, i]))
        for turns in seen.values():
            assert sorted(turns) == list(range(len(turns)))


def test_block_sparse_backward_kernel_refuses_what_the_walk_cannot_do():
    import cutlass

    from flash_attn_sm120.config_bwd import load_bwd_table, select_bwd_config
    from flash_attn_sm120.kernels.bwd_block_sparse import FlashAttentionBackwardSm120BlockSparse

    cfg = select_bwd_config(load_bwd_table(), 128, 128, False, False, modifiers=True)  # the walk's entry
    two_q = cfg.__class__(**{**cfg.to_dict(), "stages_q": 2})
    with pytest.raises(ValueError, match="block-sparse backward with list turns takes one Q and one dO stage"):
        FlashAttentionBackwardSm120BlockSparse(cutlass.BFloat16, 128, 128, 1, two_q, deterministic=True,
                                               fused_turns=True)
    # fixed-point dQ takes no turns: any stages, and no turn flags
    kernel = FlashAttentionBackwardSm120BlockSparse(cutlass.BFloat16, 128, 128, 1, two_q, deterministic=True,
                                                    dq_fixed_point=True)
    assert kernel.dq_fixed_point and not kernel.turn_lists


def test_block_sparse_backward_plan_stages():
    """The walk runs a table entry with one Q and one dO stage (faster at 10% density, measured); a given
    config keeps up to two, except deterministic (one each). Fake CUDA tensors: no GPU needed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_attn_sm120.config_bwd import bwd_config_from_name, load_bwd_table, select_bwd_config

    table_cfg = select_bwd_config(load_bwd_table(), 64, 64, False, False, modifiers=True)
    assert (table_cfg.stages_q, table_cfg.stages_do) == (2, 2)  # the d64 entry has two of each
    given = bwd_config_from_name("bwd-w8-64x128-q2do2-a244")
    with FakeTensorMode(allow_non_fake_inputs=True):
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int32, device="cuda")  # noqa: E731
        q = torch.zeros(1, 512, 2, 64, dtype=torch.bfloat16, device="cuda")
        lists = BlockSparseTensorsTorch(z(1, 2, 4), z(1, 2, 4, 4), None, None, block_size=(128, 128))
        plan = lambda cfg, given, det: block_sparse_bwd.plan(  # noqa: E731
            lists, q, q, cfg, head_dim_v=64, causal=False, local=False, deterministic=det, varlen=False,
            config_given=given)[0]
        assert (plan(table_cfg, False, False).stages_q, plan(table_cfg, False, False).stages_do) == (1, 1)
        assert (plan(given, True, False).stages_q, plan(given, True, False).stages_do) == (2, 2)
        assert (plan(given, True, True).stages_q, plan(given, True, True).stages_do) == (1, 1)


def test_block_sparse_backward_prefers_its_own_d128_config():
    """Without a given config, a d128 walk with no causal/local mask, no score_mod or aux tensors, dense layout
    and deterministic=False takes SPARSE_BWD_CONFIGS' 32x128 (a282); otherwise, or where its tile does not divide the
    sparse block, the table's entry as before. Fake CUDA tensors: no GPU needed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_attn_sm120.config_bwd import load_bwd_table, select_bwd_config

    table_cfg = select_bwd_config(load_bwd_table(), 128, 128, False, False, modifiers=True)
    preferred = block_sparse_bwd.SPARSE_BWD_CONFIGS[128]
    assert preferred.name == "bwd-w8-32x128-q1do1-a282" and preferred != table_cfg
    pick = block_sparse_bwd.sparse_preferred_config
    assert pick(128, 128, False, False, False, False, False) == preferred
    for args in [(128, 128, True, False, False, False, False), (128, 128, False, True, False, False, False),
                 (128, 128, False, False, True, False, False), (128, 128, False, False, False, True, False),
                 (128, 128, False, False, False, False, True), (64, 64, False, False, False, False, False)]:
        assert pick(*args) is None
    with FakeTensorMode(allow_non_fake_inputs=True):
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int32, device="cuda")  # noqa: E731
        q = torch.zeros(1, 512, 2, 128, dtype=torch.bfloat16, device="cuda")
        for block, want in (((128, 128), preferred.name), ((128, 64), table_cfg.name.replace("q2do1", "q1do1"))):
            # Q-direction lists: a count per K/V block, Q block indices
            n_kv, n_q = 512 // block[1], 512 // block[0]
            lists = BlockSparseTensorsTorch(z(1, 2, n_kv), z(1, 2, n_kv, n_q), None, None, block_size=block)
            cfg = block_sparse_bwd.plan(lists, q, q, table_cfg, head_dim_v=128, causal=False, local=False,
                                                deterministic=False, varlen=False, config_given=False,
                                                preferred=preferred)[0]
            assert cfg.name == want, (block, cfg.name)


def test_block_sparse_backward_preferred_config_compiles_spill_free_for_sm120a():
    from dataclasses import replace

    from flash_attn_sm120 import codegen, driver_bwd
    from flash_attn_sm120.testing_mods import prefix_lm

    for d, cfg in block_sparse_bwd.SPARSE_BWD_CONFIGS.items():
        cfg = replace(cfg, stages_q=1, stages_do=1, v_in_regs=False)
        for mods in (driver_bwd.Mods(mask_mod=prefix_lm), driver_bwd.Mods()):
            cubin, _ = codegen.compile_bwd_cubin(cfg, d, mods=mods,
                                                 block_sparse=(128 // cfg.m_block, 128 // cfg.n_block, True))
            res, _, _ = codegen.inspect_cubin(cubin)
            assert res["stack"] == 0 and res["local"] == 0, (cfg.name, mods, res)


def test_varlen_lists_choose_a_tma_tile_of_one_sparse_q_block():
    """flash_attn_varlen_func's lists (upstream's varlen form, fake CUDA tensors): a TMA config whose tile_m
    is the sparse Q block; upstream's rules as ValueErrors (dense-form lists with packed q, varlen K
    without cu_block_idx_offsets, a Q block no tile matches)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_attn_sm120 import driver

    h, d = 2, 128

    def lists(block, offsets=True, total_m=4, total_idx=10):
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int32, device="cuda")  # noqa: E731
        return BlockSparseTensorsTorch(z(h, total_m), z(h, total_idx), z(h, total_m), z(h, total_idx),
                                       cu_total_m_blocks=z(3), cu_block_idx_offsets=z(3) if offsets else None,
                                       block_size=block)

    with FakeTensorMode():
        q = torch.empty(300 + 77, h, d, dtype=torch.bfloat16, device="cuda")
        cu = torch.zeros(3, dtype=torch.int32, device="cuda")
        call = dict(causal=False, local=False, pack_gqa=False, pack_gqa_chosen=False, config=None, cu_seqlens_q=cu,
                    cu_seqlens_k=cu, has_lse=True, seqused_q=None, seqused_k=None, window_size_left=None,
                    window_size_right=None, score_mod=None, mask_mod=None, aux_tensors=None, emulate_host_smem=None)
        for block in ((128, 128), (64, 128), (128, 256)):
            statics, norm = driver.choose_block_sparse(q, q, q, lists(block), **call)
            assert statics.config.family == "tma" and statics.config.tile_m == block[0], (block, statics.config)
            assert statics.has_cu_seqlens_q and statics.block_sparse[0] == 1  # one Q tile per sparse block
            assert statics.block_sparse[-1] is True  # the key knows cu_block_idx_offsets is there
        dense_form = BlockSparseTensorsTorch(torch.zeros(2, h, 3, dtype=torch.int32, device="cuda"),
                                             torch.zeros(2, h, 3, 3, dtype=torch.int32, device="cuda"),
                                             block_size=(128, 128))
        with pytest.raises(ValueError, match="cu_total_m_blocks"):
            driver.choose_block_sparse(q, q, q, dense_form, **call)
        with pytest.raises(ValueError, match="cu_block_idx_offsets"):
            driver.choose_block_sparse(q, q, q, lists((128, 128), offsets=False), **call)
        with pytest.raises(ValueError, match="one kernel tile"):
            driver.choose_block_sparse(q, q, q, lists((256, 128)), **call)


def _normalized(mask_cnt, full_cnt=None, q_subtile=1):
    from flash_attn.cute.block_sparsity import NormalizedBlockSparseConfig

    idx = torch.zeros(*mask_cnt.shape, 4, dtype=torch.int32)
    tensors = BlockSparseTensorsTorch(mask_cnt, idx, full_cnt, None if full_cnt is None else idx)
    return NormalizedBlockSparseConfig(tensors, None, q_subtile, 1)


def test_tile_order_is_a_longest_first_permutation_of_the_grid():
    """block_sparse.tile_order: a permutation of the linear tiles m + M * (head + H * batch), by descending
    weighted list length, ties in grid order; Q subtiles share their sparse row's work."""
    g = torch.Generator().manual_seed(0)
    b, h, rows = 2, 3, 5
    mask_cnt = torch.randint(0, 6, (b, h, rows), dtype=torch.int32, generator=g)
    full_cnt = torch.randint(0, 6, (b, h, rows), dtype=torch.int32, generator=g)
    for subtiles in (1, 2):
        num_block = rows * subtiles - (1 if subtiles == 2 else 0)  # a last sparse row with one tile
        order = block_sparse.tile_order(_normalized(mask_cnt, full_cnt, subtiles), batch=b, grid_heads=h,
                                        num_block=num_block, tiles_per_sparse_row=subtiles)
        assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(b * h * num_block))
        m, head, batch = order % num_block, order // num_block % h, order // (num_block * h)
        work = (block_sparse.MASK_BLOCK_WEIGHT * mask_cnt + block_sparse.FULL_BLOCK_WEIGHT * full_cnt)[
            batch.long(), head.long(), (m // subtiles).long()]
        assert torch.all(work[:-1] >= work[1:])  # longest first
        ties = work[:-1] == work[1:]
        assert torch.all(order[:-1][ties] < order[1:][ties])  # stable: grid order among equals
    # the global row of a window + global-tokens mask goes first, whatever its head and batch
    mask_cnt = torch.full((2, 4, 8), 3, dtype=torch.int32)
    mask_cnt[1, 3, 0] = 64
    order = block_sparse.tile_order(_normalized(mask_cnt), batch=2, grid_heads=4, num_block=8, tiles_per_sparse_row=1)
    assert order[0].item() == 0 + 8 * (3 + 4 * 1)


def test_head_groups_order_is_longest_first_within_each_group():
    """block_sparse.head_groups(g): a permutation whose groups of g consecutive (batch, head) pairs come in grid
    order, each group's tiles longest first (ties in grid order); grid_order() inside restores the identity and
    the default returns once the block ends."""
    g = torch.Generator().manual_seed(1)
    b, h, rows = 2, 3, 4
    mask_cnt = torch.randint(0, 7, (b, h, rows), dtype=torch.int32, generator=g)
    norm = _normalized(mask_cnt)
    default = block_sparse.tile_order(norm, batch=b, grid_heads=h, num_block=rows, tiles_per_sparse_row=1)
    for group in (1, 2, 4, 6):
        with block_sparse.head_groups(group):
            order = block_sparse.tile_order(norm, batch=b, grid_heads=h, num_block=rows, tiles_per_sparse_row=1)
            with block_sparse.grid_order():
                assert block_sparse.tile_order(norm, batch=b, grid_heads=h, num_block=rows,
                                               tiles_per_sparse_row=1).tolist() == list(range(b * h * rows))
        assert sorted(order.tolist()) == list(range(b * h * rows))
        pair = order // rows  # head + h * batch
        groups = pair // group
        assert torch.all(groups[:-1] <= groups[1:])  # the groups in grid order
        work = mask_cnt.reshape(-1, rows)[pair.long(), (order % rows).long()]
        same = groups[:-1] == groups[1:]
        assert torch.all(work[:-1][same] >= work[1:][same])  # longest first within a group
        ties = same & (work[:-1] == work[1:])
        assert torch.all(order[:-1][ties] < order[1:][ties])
    assert torch.equal(block_sparse.tile_order(norm, batch=b, grid_heads=h, num_block=rows, tiles_per_sparse_row=1),
                       default)
    with block_sparse.head_groups(b * h):  # one group: the default order
        assert torch.equal(block_sparse.tile_order(norm, batch=b, grid_heads=h, num_block=rows,
                                                   tiles_per_sparse_row=1), default)
    with pytest.raises(ValueError, match="at least one head"):
        block_sparse.head_groups(0)


def test_tile_order_packed_gqa_and_broadcast_lists():
    """Lists expanded over the query heads (stride 0) with packed GQA: the grid has the KV heads and
    tiles of packed rows (tile m reads sparse row m // (qhead_per_kvhead * subtiles)); lists with a
    size-1 batch expand over the batch."""
    rows, qh, kv_heads, batch = 4, 4, 2, 3
    cnt = torch.tensor([1, 9, 2, 5], dtype=torch.int32).view(1, 1, rows)
    norm = _normalized(cnt.expand(batch, kv_heads * qh, rows))
    order = block_sparse.tile_order(norm, batch=batch, grid_heads=kv_heads, num_block=rows * qh,
                                    tiles_per_sparse_row=qh)
    assert sorted(order.tolist()) == list(range(batch * kv_heads * rows * qh))
    first = order[: batch * kv_heads * qh] % (rows * qh)  # every tile of sparse row 1 (9 blocks) first
    assert torch.all(first // qh == 1)
    norm = _normalized(cnt)
    order = block_sparse.tile_order(norm, batch=batch, grid_heads=1, num_block=rows, tiles_per_sparse_row=1)
    assert (order[:batch] % rows).tolist() == [1, 1, 1]


def test_tile_order_cache_follows_in_place_updates():
    """The order is cached per count tensors; an in-place update of the counts (a new version) recomputes."""
    cnt = torch.tensor([[[1, 2, 3]]], dtype=torch.int32)
    norm = _normalized(cnt)
    kw = dict(batch=1, grid_heads=1, num_block=3, tiles_per_sparse_row=1)
    assert block_sparse.tile_order(norm, **kw).tolist() == [2, 1, 0]
    assert block_sparse.tile_order(norm, **kw) is block_sparse.tile_order(norm, **kw)
    cnt[0, 0, 0] = 7
    assert block_sparse.tile_order(norm, **kw).tolist() == [0, 2, 1]


def test_only_fixed_grids_order_their_tiles():
    """Varlen q (its own scheduler) and persistent configs (their own stride) launch in grid order."""
    cfg = FwdConfig(256, 128, 64, 2, False, "tma")
    assert block_sparse.orders_tiles(cfg, varlen_q=False)
    assert not block_sparse.orders_tiles(cfg, varlen_q=True)
    from dataclasses import replace

    assert not block_sparse.orders_tiles(replace(cfg, persistent=True), varlen_q=False)


def test_lists_cut_at_seqused_k():
    """block_sparse.cut_lists_at: each list keeps its entries below ceil(seqused_k / block) (a prefix: the
    lists ascend); the counts become per batch row; the indices are untouched."""
    b, h, m, n, block = 3, 2, 4, 8, 128
    g = torch.Generator().manual_seed(1)
    kinds = (torch.rand(b, h, m, n, generator=g) < 0.5).to(torch.int32) * testing_sparse.FULL
    kinds[0, :, :, :] = testing_sparse.PARTIAL
    tensors = testing_sparse.lists_from_map(kinds, (block, block))
    used = torch.tensor([1024, 300, 0], dtype=torch.int32)
    cut = block_sparse.cut_lists_at(tensors, used, block)
    assert cut.mask_block_idx is tensors.mask_block_idx and cut.full_block_idx is tensors.full_block_idx
    limit = [8, 3, 0]
    for name in ("mask_block", "full_block"):
        cnt, idx, new = (getattr(tensors, name + "_cnt"), getattr(tensors, name + "_idx"),
                         getattr(cut, name + "_cnt"))
        assert new.dtype == torch.int32 and new.shape == (b, h, m)
        for bi, hi, mi in itertools.product(range(b), range(h), range(m)):
            listed = idx[bi, hi, mi, : cnt[bi, hi, mi]].tolist()
            assert new[bi, hi, mi] == sum(1 for x in listed if x < limit[bi])
    # lists shared by the batch (size-1 batch dim) become per batch row
    shared = tensors._replace(mask_block_cnt=tensors.mask_block_cnt[:1], mask_block_idx=tensors.mask_block_idx[:1],
                              full_block_cnt=None, full_block_idx=None)
    cut = block_sparse.cut_lists_at(shared, used, block)
    assert cut.mask_block_cnt.shape == (b, h, m) and torch.all(cut.mask_block_cnt[2] == 0)
    assert torch.equal(cut.mask_block_cnt[0], shared.mask_block_cnt[0])


def test_seqused_cache_becomes_packed_sequences():
    """block_sparse.seqused_cache_as_packed: the (batch, seqlen_k) cache as packed sequences of seqlen_k rows
    (a view when the dims merge), cu_seqlens_k 0, s, 2s, ...; dense-form lists cut and given block_size;
    varlen-form lists unchanged."""
    b, sk, hk, d = 2, 512, 2, 64
    k = torch.randn(b, sk, hk, d)
    v = torch.randn(b, sk, hk, d)
    kinds = torch.full((b, 2, 3, 4), testing_sparse.FULL, dtype=torch.int32)
    tensors = testing_sparse.lists_from_map(kinds, (128, 128))
    used = torch.tensor([512, 129], dtype=torch.int32)
    pk, pv, cu, used_out, cut = block_sparse.seqused_cache_as_packed(k, v, used, tensors, seqlen_q=384)
    assert torch.equal(used_out, used)
    assert pk.shape == (b * sk, hk, d) and pk.data_ptr() == k.data_ptr() and torch.equal(pv.view_as(v), v)
    assert cu.tolist() == [0, sk, 2 * sk] and cu.dtype == torch.int32
    assert cut.block_size == (128, 128)
    assert cut.full_block_cnt[0].unique().tolist() == [4] and cut.full_block_cnt[1].unique().tolist() == [2]
    strided = torch.randn(b, 2 * sk, hk, d)[:, :sk]  # a slice of a longer cache: copied to merge the dims
    pk, _, _, _, _ = block_sparse.seqused_cache_as_packed(strided, strided, used, tensors, seqlen_q=384)
    assert torch.equal(pk.view(b, sk, hk, d), strided)
    z = lambda *shape: torch.zeros(*shape, dtype=torch.int32)  # noqa: E731
    varlen = BlockSparseTensorsTorch(z(2, 4), z(2, 10), cu_total_m_blocks=z(3), cu_block_idx_offsets=z(3),
                                     block_size=(128, 128))
    assert block_sparse.seqused_cache_as_packed(k, v, used, varlen, seqlen_q=0, packed_q=True)[4] is varlen
    # seqused_k past the cache is clamped (the next sequence's rows are not this one's keys)
    assert block_sparse.seqused_cache_as_packed(k, v, torch.tensor([600, 9], dtype=torch.int32), tensors,
                                                seqlen_q=384)[3].tolist() == [512, 9]
    # the lists' layout is checked first, as ValueErrors
    with pytest.raises(ValueError, match="cu_total_m_blocks"):
        block_sparse.seqused_cache_as_packed(k, v, used, varlen, seqlen_q=0)
    with pytest.raises(ValueError, match="int32"):
        block_sparse.seqused_cache_as_packed(k, v, used, tensors._replace(mask_block_cnt=tensors.mask_block_cnt.long()),
                                             seqlen_q=384)
    wide = tensors._replace(mask_block_idx=torch.zeros(b, 2, 3, 9, dtype=torch.int32))
    with pytest.raises(ValueError, match="<= 4"):
        block_sparse.seqused_cache_as_packed(k, v, used, wide, seqlen_q=384)


def test_seqused_k_cache_lists_choose_a_tma_config():
    """Lists with seqused_k and no cu_seqlens_k (fake CUDA tensors): after the packed view, the TMA family serves
    the call (before: NotImplementedError, the family cannot bound a 4-D cache's reads at seqused_k)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_attn_sm120 import driver

    b, sq, sk, h, d = 2, 300, 1000, 4, 128
    with FakeTensorMode():
        q = torch.empty(b, sq, h, d, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(b, sk, h, d, dtype=torch.bfloat16, device="cuda")
        used = torch.zeros(b, dtype=torch.int32, device="cuda")
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int32, device="cuda")  # noqa: E731
        lists = BlockSparseTensorsTorch(z(b, h, 3), z(b, h, 3, 8), z(b, h, 3), z(b, h, 3, 8), block_size=(128, 128))
        pk, pv, cu_k, used, cut = block_sparse.seqused_cache_as_packed(k, k, used, lists, seqlen_q=sq)
        assert pk.shape == (b * sk, h, d) and cu_k.shape == (b + 1,)
        call = dict(causal=False, local=False, pack_gqa=False, pack_gqa_chosen=False, config=None, cu_seqlens_q=None,
                    cu_seqlens_k=cu_k, has_lse=True, seqused_q=None, seqused_k=used, window_size_left=None,
                    window_size_right=None, score_mod=None, mask_mod=None, aux_tensors=None, emulate_host_smem=None)
        statics, norm = driver.choose_block_sparse(q, pk, pv, cut, **call)
        assert statics.config.family == "tma" and statics.has_cu_seqlens_k and statics.has_seqused_k
        assert statics.ordered_tiles  # dense q: the tiles launch longest first


@pytest.mark.parametrize("d", sorted(block_sparse.CONFIGS))
def test_seqused_k_cache_walk_compiles_spill_free_for_sm120a(d):
    """The first sparse config of each head dim with packed K/V and seqused_k under a dense q (what
    seqused_cache_as_packed makes of a seqused_k cache): spill-free on sm_120a."""
    from flash_attn_sm120 import codegen

    cfg = block_sparse.CONFIGS[d][0]
    cubin, _ = codegen.compile_fwd_cubin(cfg, d, block_sparse=(128 // cfg.tile_m, 128 // cfg.tile_n, True),
                                         varlen=("cu_seqlens_k", "seqused_k"))
    res, _, _ = codegen.inspect_cubin(cubin)
    assert res["stack"] == 0 and res["local"] == 0, res


def test_tile_order_cache_matches_only_the_same_live_tensors():
    """A cache entry holds weak references to the count tensors it was computed from: another tensor that
    happens to get the same id and address (a freed mask's memory reused by the next one) does not match."""
    cnt = torch.tensor([[[1, 2, 3]]], dtype=torch.int32)
    kw = dict(batch=1, grid_heads=1, num_block=3, tiles_per_sparse_row=1)
    first = block_sparse.tile_order(_normalized(cnt), **kw)
    assert block_sparse.tile_order(_normalized(cnt), **kw) is first  # a new view of the same tensor: cached
    key = next(k for k, (order, _) in block_sparse._ORDER_CACHE.items() if order is first)
    other = torch.zeros(1)
    block_sparse._ORDER_CACHE[key] = (first, (weakref.ref(other),))  # as if `cnt` had died and its id been reused
    again = block_sparse.tile_order(_normalized(cnt), **kw)
    assert again is not first and again.tolist() == first.tolist()


def test_tile_order_under_graph_capture_reuses_and_pins_the_cached_order(monkeypatch):
    """Under CUDA-graph capture (simulated: block_sparse._capturing) a cached order is returned, so the graph
    holds no sort, and pinned while its count tensors live, even after the cache drops it; an order first
    computed during capture is not cached (its values exist only at replay). The pin goes with the counts."""
    import gc

    cnt = torch.tensor([[[1, 2, 3]]], dtype=torch.int32)
    kw = dict(batch=1, grid_heads=1, num_block=3, tiles_per_sparse_row=1)
    eager = block_sparse.tile_order(_normalized(cnt), **kw)
    monkeypatch.setattr(block_sparse, "_capturing", lambda tensors: True)
    captured = block_sparse.tile_order(_normalized(cnt), **kw)
    assert captured is eager
    block_sparse._ORDER_CACHE.clear()
    assert any(order is eager for order in block_sparse._PINNED.values())
    cold = torch.tensor([[[3, 1, 2]]], dtype=torch.int32)
    in_capture = block_sparse.tile_order(_normalized(cold), **kw)
    assert in_capture.tolist() == [0, 2, 1] and not block_sparse._ORDER_CACHE
    del cnt, eager, captured
    gc.collect()
    assert not block_sparse._PINNED

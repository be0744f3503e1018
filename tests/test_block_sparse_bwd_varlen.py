"""The block-sparse backward with varlen calls, on the CPU: the packed lists' copy into the per-sequence form
(block_sparse_bwd.py), element by element against a plain-Python reading of the layout; the refusals; and the
varlen walk (`rows_end`) compiled for sm_120a. tests/test_block_sparse_bwd_varlen_gpu.py runs it."""

import pytest

torch = pytest.importorskip("torch")

from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # noqa: E402

from flash_attn_sm120 import block_sparse_bwd  # noqa: E402


def _packed(rows_per_seq, q_blocks_per_seq, heads, seed, offsets=True, with_full=True):
    """Random packed backward lists: per sequence b, rows_per_seq[b] K/V blocks each listing some of
    q_blocks_per_seq[b] Q blocks (ascending, count first), as plain lists and as the packed tensors."""
    g = torch.Generator().manual_seed(seed)
    truth = []  # truth[kind][b][h][j] = the list of Q blocks
    tensors = {}
    for kind in ("mask", "full") if with_full else ("mask",):
        cnt, idx, per_kind = [], [], []
        for b, (rows, qb) in enumerate(zip(rows_per_seq, q_blocks_per_seq)):
            per_head_cnt, per_head_idx, seq = [], [], []
            for h in range(heads):
                lists = []
                for _ in range(rows):
                    chosen = sorted(torch.randperm(qb, generator=g)[:int(torch.randint(0, qb + 1, (1,), generator=g))]
                                    .tolist()) if qb else []
                    lists.append(chosen)
                seq.append(lists)
                per_head_cnt.append([len(x) for x in lists])
                # junk past each count: the copy must not care
                per_head_idx.append([v for x in lists for v in x + [7777] * (qb - len(x))])
            per_kind.append(seq)
            cnt.append(torch.tensor(per_head_cnt, dtype=torch.int32).view(heads, rows))
            idx.append(torch.tensor(per_head_idx, dtype=torch.int32).view(heads, rows * qb))
        truth.append(per_kind)
        tensors[kind] = (torch.cat(cnt, 1).contiguous(), torch.cat(idx, 1).contiguous())
    cu_rows = torch.tensor([0, *torch.tensor(rows_per_seq).cumsum(0).tolist()], dtype=torch.int32)
    entries = [r * q for r, q in zip(rows_per_seq, q_blocks_per_seq)]
    cu_entries = torch.tensor([0, *torch.tensor(entries).cumsum(0).tolist()], dtype=torch.int32)
    full = tensors.get("full", (None, None))
    lists = BlockSparseTensorsTorch(*tensors["mask"], *full, cu_total_m_blocks=cu_rows,
                                    cu_block_idx_offsets=cu_entries if offsets else None, block_size=(128, 64))
    return lists, truth


@pytest.mark.parametrize("with_full", [True, False])
def test_packed_lists_become_per_sequence(with_full):
    """Sequences of 3, 0, 1 and 5 K/V blocks over 2, 4, 0 and 3 Q blocks: every row's count and its
    entries land at (sequence, head, row), zeros elsewhere, counts never past the copy's width."""
    rows, qbs, heads = (3, 0, 1, 5), (2, 4, 0, 3), 2
    lists, truth = _packed(rows, qbs, heads, seed=1, with_full=with_full)
    bound_q, bound_k = 4 * 128, 6 * 64  # one row and one column more than the longest sequence
    out = block_sparse_bwd.per_sequence_lists(lists, batch=4, bound_q=bound_q, bound_k=bound_k, q_varlen=True,
                                              block_size=(128, 64))
    pairs = [(out.mask_block_cnt, out.mask_block_idx)] + ([(out.full_block_cnt, out.full_block_idx)] if with_full
                                                         else [])
    assert (out.full_block_cnt is None) == (not with_full)
    for (cnt, idx), kind in zip(pairs, truth):
        assert cnt.shape == (4, heads, 6) and idx.shape == (4, heads, 6, 4)
        assert cnt.dtype == idx.dtype == torch.int32 and cnt.is_contiguous() and idx.is_contiguous()
        for b in range(4):
            for h in range(heads):
                for j in range(6):
                    want = kind[b][h][j] if j < rows[b] else []
                    assert cnt[b, h, j].item() == len(want), (b, h, j)
                    assert idx[b, h, j, :len(want)].tolist() == want, (b, h, j)
                    assert (idx[b, h, j, qbs[b] if j < rows[b] else 0:] == 0).all(), (b, h, j)


def test_packed_lists_without_offsets_are_uniform_in_q():
    """Dense q (no cu_seqlens_q / seqused_q): without cu_block_idx_offsets every sequence has
    ceil(seqlen_q / block_q) Q blocks, so its entries start at its first row times that."""
    rows, qbs, heads = (2, 3), (3, 3), 1
    lists, truth = _packed(rows, qbs, heads, seed=2, offsets=False, with_full=False)
    out = block_sparse_bwd.per_sequence_lists(lists, batch=2, bound_q=3 * 128, bound_k=3 * 64, q_varlen=False,
                                              block_size=(128, 64))
    for b in range(2):
        for j in range(rows[b]):
            want = truth[0][b][0][j]
            assert out.mask_block_idx[b, 0, j, :len(want)].tolist() == want
    with pytest.raises(ValueError, match="needs cu_block_idx_offsets"):
        block_sparse_bwd.per_sequence_lists(lists, batch=2, bound_q=384, bound_k=192, q_varlen=True,
                                            block_size=(128, 64))


def test_short_bounds_cut_rows_and_counts():
    """A copy sized by host bounds smaller than a sequence's blocks keeps the rows and columns it has (the
    kernel then skips the K/V tiles past its rows); a count is cut to the width, never past it."""
    lists, _ = _packed((4,), (3,), 1, seed=3, with_full=False)
    lists = lists._replace(mask_block_cnt=torch.full_like(lists.mask_block_cnt, 3),
                           mask_block_idx=torch.tensor([[0, 1, 2] * 4], dtype=torch.int32))
    out = block_sparse_bwd.per_sequence_lists(lists, batch=1, bound_q=2 * 128, bound_k=2 * 64, q_varlen=True,
                                              block_size=(128, 64))
    assert out.mask_block_cnt.tolist() == [[[2, 2]]]
    assert out.mask_block_idx.tolist() == [[[[0, 1], [0, 1]]]]


def test_per_sequence_lists_pass_through_and_bad_ranks_are_named():
    cnt, idx = torch.zeros(2, 1, 3, dtype=torch.int32), torch.zeros(2, 1, 3, 5, dtype=torch.int32)
    lists = BlockSparseTensorsTorch(cnt, idx, block_size=(128, 128))
    assert block_sparse_bwd.per_sequence_lists(lists, batch=2, bound_q=1, bound_k=1, q_varlen=True,
                                               block_size=(128, 128)) is lists
    with pytest.raises(ValueError, match=r"\(batch, heads, kv_blocks\) counts"):
        block_sparse_bwd.per_sequence_lists(lists._replace(mask_block_cnt=cnt[0]), batch=2, bound_q=1, bound_k=1,
                                            q_varlen=True, block_size=(128, 128))
    packed = BlockSparseTensorsTorch(cnt[:, 0], idx[:, 0].reshape(2, 15), cu_total_m_blocks=torch.tensor([0, 1]),
                                     cu_block_idx_offsets=torch.tensor([0, 5]), block_size=(128, 128))
    with pytest.raises(ValueError, match="batch \\+ 1 = 3 entries"):
        block_sparse_bwd.per_sequence_lists(packed, batch=2, bound_q=1, bound_k=1, q_varlen=True,
                                            block_size=(128, 128))
    with pytest.raises(ValueError, match="must be 2-D"):
        block_sparse_bwd.per_sequence_lists(packed._replace(mask_block_cnt=cnt), batch=1, bound_q=1, bound_k=1,
                                            q_varlen=True, block_size=(128, 128))


def test_check_refuses_varlen_only_without_per_sequence_lists():
    """The walk's check (lifted into patch 0006, whose interface gives no per-sequence lists) refuses varlen
    there; this package's driver converts the lists and passes."""

    block_sparse_bwd.check_block_sparse(False, True, turns_from_lists=True, per_sequence_lists=True)
    block_sparse_bwd.check_block_sparse(True, True, turns_from_lists=True, per_sequence_lists=True)
    with pytest.raises(NotImplementedError, match="varlen"):
        block_sparse_bwd.check_block_sparse(False, True, turns_from_lists=True)


@pytest.mark.parametrize("d,det,full,subtiles,gqa", [
    (128, False, True, (1, 2), 1), (64, False, True, (2, 1), 2), (96, False, False, (1, 1), 1),
    (128, True, True, (1, 1), 2)])
def test_varlen_walk_compiles_spill_free_for_sm120a(d, det, full, subtiles, gqa):
    """The varlen walk (packed q and k, `rows_end`: a K/V tile past the lists' rows reads no count) on each head
    dim's table config as the driver takes it, with a mask_mod, with and without full lists, and with the
    deterministic list turns: spill-free on sm_120a, no tile order (upstream's varlen grid)."""
    from dataclasses import replace

    from flash_attn_sm120 import codegen, driver_bwd
    from flash_attn_sm120.config_bwd import load_bwd_table, select_bwd_config
    from flash_attn_sm120.testing_mods import prefix_lm

    cfg = replace(select_bwd_config(load_bwd_table(), d, d, False, False, modifiers=True), stages_q=1, stages_do=1,
                  v_in_regs=False)
    kernels = []
    cubin, _ = codegen.compile_bwd_cubin(
        cfg, d, mods=driver_bwd.Mods(mask_mod=prefix_lm), kernel_out=kernels, block_sparse=(*subtiles, full),
        varlen=True, deterministic=det, qhead_per_kvhead=gqa,
        ordering=driver_bwd.SPARSE_DETERMINISTIC_PLAN if det else None)
    res, _, _ = codegen.inspect_cubin(cubin)
    assert res["stack"] == 0 and res["local"] == 0, res
    kernel = kernels[0]
    assert kernel.rows_end and not kernel.ordered_tiles and kernel.has_full == full


def test_counts_are_cut_to_each_sequence_q_blocks():
    """A packed count past its sequence's Q blocks (malformed) would walk zero-filled entries (Q tile 0 again):
    the copy cuts it to the sequence's own Q blocks, not just to the copy's width."""
    lists, _ = _packed((2, 1), (2, 4), 1, seed=4, with_full=False)
    lists = lists._replace(mask_block_cnt=torch.full_like(lists.mask_block_cnt, 9))
    out = block_sparse_bwd.per_sequence_lists(lists, batch=2, bound_q=4 * 128, bound_k=2 * 64, q_varlen=True,
                                              block_size=(128, 64))
    assert out.mask_block_cnt.tolist() == [[[2, 2]], [[4, 0]]]


def test_deterministic_turns_take_compact_varlen_lists(monkeypatch):
    """Per-sequence lists narrower than a sequence's Q blocks (upstream allows compact index tensors) name Q
    blocks past their width: the plan gives the list turns every Q block of the host bound, and with that count
    the turns of such lists are right (a count of the width alone scattered out of range)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_attn_sm120 import block_sparse
    from flash_attn_sm120.config_bwd import bwd_config_from_name

    b, h, d = 2, 2, 128
    cnt = torch.tensor([[[2, 1, 0]] * h] * b, dtype=torch.int32)
    idx = torch.tensor([[[[1, 4], [4, 0], [0, 0]]] * h] * b, dtype=torch.int32)  # width 2, Q block 4 named
    seen = {}
    monkeypatch.setattr(block_sparse, "dq_turns", lambda *a: seen.setdefault("q_blocks", a[4]) and (None, None))
    with FakeTensorMode():  # upstream's normalization takes CUDA tensors only: fake ones
        q = torch.empty(700, h, d, dtype=torch.bfloat16, device="cuda")  # packed: 2 sequences, up to 600 rows
        k = torch.empty(900, h, d, dtype=torch.bfloat16, device="cuda")
        lists = BlockSparseTensorsTorch(torch.empty(b, h, 3, dtype=torch.int32, device="cuda"),
                                        torch.empty(b, h, 3, 2, dtype=torch.int32, device="cuda"),
                                        block_size=(128, 128))
        _, (_, key) = block_sparse_bwd.plan(
            lists, q, k, bwd_config_from_name("bwd-w8-64x64-q1do1-a242"), head_dim_v=d, causal=False, local=False,
            deterministic=True, varlen=True, config_given=True, batch=b, bounds=(600, 700), q_varlen=True)
    assert key[4] is True and seen["q_blocks"] == 5  # ceil(600 / 128), not the width 2
    monkeypatch.undo()
    turns, _ = block_sparse.dq_turns(cnt, idx, None, None, seen["q_blocks"])
    # Q block 4 is named by K/V blocks 0 and 1 of each sequence: turns 0 then 1; Q block 1 by block 0 only
    assert turns[0, 0, 0].tolist() == [0, 0] and turns[0, 0, 1, 0].item() == 1

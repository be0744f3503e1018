"""deterministic=True on the GPU: bitwise-identical dq/dk/dv over repeated runs, and correct.

Each case runs the public API's forward and autograd backward three times on the same inputs and
output gradient; the three gradients must be equal bit for bit (torch.equal), and the first within
upstream's rule of fp32 autograd through the reference (2x the input-precision reference's error,
plus an atol). The plan's default is fixed-point dQ (kernels/bwd_fixed_point.py; more cases in
test_bwd_fixed_point_gpu.py), so the unforced cases here run it on the shapes that once selected each turn
order: GQA causal d128, no mask (m_blocks a multiple of the n_blocks, equal, and neither), varlen GQA (the
ordered dK/dV), the d64 and d96 table entries, more n_block CTAs than the GPU holds at once. The turn
orders themselves (calls with a user score_mod) run forced through driver_bwd.force_deterministic_plan,
every one of them, and with seqused_k through a score_mod.
"""

from contextlib import nullcontext

import pytest

torch = pytest.importorskip("torch")

from flash_attn_sm120 import driver_bwd, flash_attn_func, flash_attn_varlen_func, testing  # noqa: E402

pytestmark = pytest.mark.gpu


def _grads(fn, q, k, v, g, **kw):
    out, _ = fn(q, k, v, **kw)
    return torch.autograd.grad(out, (q, k, v), g)


def _reference_grads(q, k, v, g, causal):
    out = []
    for upcast in (True, False):
        leaves = [(t.detach().float() if upcast else t.detach().clone()).requires_grad_(True) for t in (q, k, v)]
        o, _ = testing.attention_ref(*leaves, causal=causal, upcast=upcast, reorder_ops=not upcast)
        out.append(torch.autograd.grad(o, leaves, g.to(o.dtype)))
    return out


def _check(actual, ref, pt, atol=2e-3):
    for name, a, r, lo in zip(("dq", "dk", "dv"), actual, ref, pt):
        assert a.isfinite().all(), name
        err, bound = (a.float() - r).abs().max().item(), 2 * (lo.float() - r).abs().max().item() + atol
        assert err <= bound, (name, err, bound)


def _assert_bitwise(runs):
    """Every run's (dq, dk, dv) equal to the first's, bit for bit."""
    for other in runs[1:]:
        for a, c in zip(runs[0], other):
            assert torch.equal(a, c)


def _inputs(b, sq, sk, h, hk, d, seed, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=torch.float32).to(dtype).requires_grad_(True)  # noqa: E731
    return mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d), torch.randn(b, sq, h, d, generator=gen, device="cuda").to(dtype)


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal", [
    (2, 1000, 1000, 8, 2, 128, True),   # GQA causal d128: descending dQ order, ordered dK/dV
    (1, 777, 900, 4, 4, 128, False),
    (2, 513, 513, 8, 2, 64, True),      # the d64 entry (Q/dO 2 stages)
    (1, 600, 700, 6, 3, 96, False),     # the d96 entry (4 warps, 32x64: the widened preprocess pass)
    (2, 900, 900, 6, 6, 96, True),      # the d96 turns entry: 8 warps 64x128, V in registers, descending turns
    (1, 700, 700, 4, 4, 96, False),     # the d96 rotated turns entry (no mask, MHA): 11 m_blocks, 6 n_blocks
    (1, 1000, 700, 4, 2, 128, False),   # rotated, d128's 32x128 tile: 32 m_blocks, 6 n_blocks (neither divides), GQA
    (2, 256, 1024, 4, 4, 128, False),   # rotated: as many m_blocks as n_blocks (8)
    (1, 1024, 1024, 4, 4, 128, False),  # rotated: m_blocks a multiple of the n_blocks (32, 8)
    (2, 2048, 1030, 4, 4, 64, False),   # rotated, the d64 entry's 64x128 tile: 32 m_blocks, 9 n_blocks
    (1, 512, 1024, 2, 2, 64, False),    # rotated, 2/2 Q/dO stages, M == N == 8 (the wait-before-step crossing)
])
def test_dense_bitwise_and_correct(b, sq, sk, h, hk, d, causal):
    if (d, causal, h == hk) == (96, False, True):  # the driver's own routing to the rotated entry
        case = testing.AttnCase(head_dim=d, head_dim_v=d, backward=True, deterministic=True, mask="none")
        assert testing.deterministic_order(case, testing.AttnProblem((sq,) * b, (sk,) * b, nheads_kv=hk)) == "rotated"
    q, k, v, g = _inputs(b, sq, sk, h, hk, d, seed=sq + d)
    runs = [_grads(flash_attn_func, q, k, v, g, causal=causal, deterministic=True) for _ in range(3)]
    _assert_bitwise(runs)
    _check(runs[0], *_reference_grads(q, k, v, g, causal))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_turns_entries_on_gqa(dtype):
    """The table's turns entries (config_bwd turns_only) on GQA calls, forced onto the entry in the plan's own
    ordering (causal keys: descending turns; "none" keys: the rotated turns), ordered dK/dV. Both serve GQA
    since this passed for them (causal: session 35, w43a; "none": session 37, w46;
    config_bwd.ROTATED_ENTRIES_SERVE_GQA)."""
    from flash_attn_sm120 import bwd_plans
    from flash_attn_sm120.config_bwd import load_bwd_table

    entries = [e for e in load_bwd_table() if e.turns_only]
    assert entries
    for e in entries:
        causal = e.mask == "causal"
        q, k, v, g = _inputs(2, 700, 700, 8, 2, e.head_dim, seed=e.head_dim, dtype=dtype)
        order = nullcontext() if causal else driver_bwd.force_deterministic_plan(dq_rotated=True, fused_turns=True)
        assert causal or bwd_plans.rotated_walk_fits(e.config, 700, 700, 132)
        with driver_bwd.force_config(e.config), order:
            runs = [_grads(flash_attn_func, q, k, v, g, causal=causal, deterministic=True) for _ in range(3)]
        _assert_bitwise(runs)
        _check(runs[0], *_reference_grads(q, k, v, g, causal))


def test_varlen_gqa_bitwise_and_correct():
    lens_q, lens_k = (300, 77, 512), (350, 90, 512)
    gen = torch.Generator(device="cuda").manual_seed(5)
    mk = lambda n, hh: torch.randn(n, hh, 128, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_(True)  # noqa: E731
    q, k, v = mk(sum(lens_q), 8), mk(sum(lens_k), 2), mk(sum(lens_k), 2)
    g = torch.randn(q.shape, generator=gen, device="cuda").to(torch.bfloat16)
    cq = torch.tensor([0, 300, 377, 889], dtype=torch.int32, device="cuda")
    ck = torch.tensor([0, 350, 440, 952], dtype=torch.int32, device="cuda")
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=512, max_seqlen_k=512, causal=True, deterministic=True)
    runs = [_grads(flash_attn_varlen_func, q, k, v, g, **kw) for _ in range(3)]
    _assert_bitwise(runs)
    for i in range(3):  # per sequence against the reference
        sl_q, sl_k = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        ref, pt = _reference_grads(q[sl_q][None], k[sl_k][None], v[sl_k][None], g[sl_q][None], True)
        _check([runs[0][0][sl_q][None], runs[0][1][sl_k][None], runs[0][2][sl_k][None]], ref, pt)


def test_more_n_blocks_than_resident_ctas():
    """sk / n_block above the GPU's SM count: causal runs descending turns with the reversed launch,
    which needs no residency."""
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    s = (n_sms + 9) * 64
    q, k, v, g = _inputs(1, s, s, 2, 2, 128, seed=11)
    runs = [_grads(flash_attn_func, q, k, v, g, causal=True, deterministic=True) for _ in range(2)]
    _assert_bitwise(runs)
    _check(runs[0], *_reference_grads(q, k, v, g, True))


def test_more_n_blocks_than_resident_ctas_no_mask():
    """Without a mask, more n_blocks than SMs: the rotated order is refused, the ascending one runs."""
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    s = (n_sms + 9) * 64
    q, k, v, g = _inputs(1, s, s, 1, 1, 128, seed=12)
    runs = [_grads(flash_attn_func, q, k, v, g, causal=False, deterministic=True) for _ in range(2)]
    _assert_bitwise(runs)
    _check(runs[0], *_reference_grads(q, k, v, g, False))


@pytest.mark.parametrize("causal,flags", [
    (True, dict(dq_descending=True)),  # session 8's orders
    (False, dict()),
    (True, dict(dq_descending=True, barrier_release=True)),
    (False, dict(barrier_release=True, fetch_early=True)),
    (True, dict(dq_descending=True, reverse_n_blocks=True)),
    (False, dict(dq_rotated=True)),
    (False, dict(dq_rotated=True, fetch_early=True)),
    (True, dict(dq_descending=True, reverse_n_blocks=True, barrier_release=True, release_deferred=True,
                fetch_early=True)),
    (False, dict(dq_rotated=True, barrier_release=True, release_deferred=True, fetch_early=True, fetch_relaxed=True)),
    (False, dict(barrier_release=True, release_deferred=True)),  # ascending, deferred
    (True, dict(dq_descending=True, reverse_n_blocks=True, barrier_release=True, release_deferred=True,
                warp_turns=True)),  # per-warp turns
    (False, dict(dq_rotated=True, barrier_release=True, release_deferred=True, warp_turns=True)),
    (False, dict(warp_turns=True)),  # ascending, per-warp turns released at the m_block's end
    (True, dict(dq_descending=True, reverse_n_blocks=True, barrier_release=True, release_deferred=True,
                late_dq_adds=True)),  # the dQ adds and their wait at the m_block's end (modifier step)
    (False, dict(dq_rotated=True, barrier_release=True, release_deferred=True, late_dq_adds=True)),
    (False, dict(late_dq_adds=True)),
    # the turns on the step's own barriers; two dQ accumulators (bwd_deterministic.py: fused_turns, dq_split)
    (True, dict(dq_descending=True, reverse_n_blocks=True, fused_turns=True)),
    (False, dict(dq_rotated=True, fused_turns=True)),
    (False, dict(fused_turns=True)),
    (True, dict(dq_descending=True, reverse_n_blocks=True, fused_turns=True, fused_fetch=True)),
    (False, dict(dq_rotated=True, fused_turns=True, fused_fetch=True)),
    (False, dict(fused_turns=True, fused_fetch=True)),  # ascending: early reads that often miss the turn
    (True, dict(dq_descending=True, reverse_n_blocks=True, barrier_release=True, release_deferred=True, dq_split=True)),
    (False, dict(dq_rotated=True, barrier_release=True, release_deferred=True, dq_split=True)),
    (True, dict(dq_descending=True, reverse_n_blocks=True, dq_split=True, fused_turns=True)),
    (False, dict(dq_rotated=True, dq_split=True, fused_turns=True)),
    (False, dict(dq_split=True, fused_turns=True)),  # ascending
    (True, dict(dq_split=True, barrier_release=True)),  # ascending, causal
])
def test_every_forced_ordering_is_bitwise_and_correct(causal, flags):
    q, k, v, g = _inputs(2, 900, 900, 4, 2, 128, seed=21 + len(flags) + causal)
    with driver_bwd.force_deterministic_plan(**flags):
        runs = [_grads(flash_attn_func, q, k, v, g, causal=causal, deterministic=True) for _ in range(3)]
    _assert_bitwise(runs)
    _check(runs[0], *_reference_grads(q, k, v, g, causal))


def test_causal_seqused_k_bitwise_and_correct():
    """seqused_k with a causal mask (padded K/V): the grid's n_blocks past the used keys still visit the
    last m_blocks, so the plan takes ascending turns (descending ones, counted from the used keys, would
    hang). The harness runs the backward twice (bitwise) and against fp32 autograd."""
    case = testing.AttnCase("bfloat16", 128, 128, 1, None, "causal", 0.0, False, "padded", "padded", True,
                            mods="position", deterministic=True)  # (a score_mod: turns, not fixed point)
    problem = testing.AttnProblem((100, 70), (120, 200), nheads_kv=2, pad_q=28, pad_k=56, seed=31)
    assert testing.deterministic_order(case, problem) == "ascending"
    testing.run_case("cpasync-table", "public", case, problem)


SPLIT_FUSED = {True: dict(dq_descending=True, reverse_n_blocks=True, dq_split=True, fused_turns=True),
               False: dict(dq_rotated=True, dq_split=True, fused_turns=True)}
FUSED_FETCH = {True: dict(dq_descending=True, reverse_n_blocks=True, fused_turns=True, fused_fetch=True),
               False: dict(dq_rotated=True, fused_turns=True, fused_fetch=True)}


@pytest.mark.parametrize("flags", [SPLIT_FUSED, FUSED_FETCH], ids=["split_fused", "fused_fetch"])
@pytest.mark.parametrize("d,causal,sq,sk", [
    (64, True, 700, 700), (64, False, 1024, 512),  # the d64 entry: 64x128, Q/dO 2/2 stages
    (96, True, 600, 600), (96, False, 640, 640),   # the d96 entry: 4 warps, one Q stage (the wait after dK)
])
def test_fused_orders_at_every_entry(d, causal, sq, sk, flags):
    """dq_split + fused_turns, and fused_turns + fused_fetch, on the other table entries (their steps
    place the wait differently)."""
    q, k, v, g = _inputs(2, sq, sk, 4, 2, d, seed=40 + d + causal)
    with driver_bwd.force_deterministic_plan(**flags[causal]):
        runs = [_grads(flash_attn_func, q, k, v, g, causal=causal, deterministic=True) for _ in range(3)]
    _assert_bitwise(runs)
    _check(runs[0], *_reference_grads(q, k, v, g, causal))


def test_split_with_seqused_is_bitwise_and_correct():
    """dq_split with seqused_q / seqused_k (padded batches): the kernel finds its group's tiles from the
    allocated accumulator, not from the used length (ascending turns, as the plan takes there)."""
    case = testing.AttnCase("bfloat16", 128, 128, 1, None, "none", 0.0, False, "padded", "padded", True,
                            deterministic=True)
    problem = testing.AttnProblem((100, 170), (120, 200), nheads_kv=2, pad_q=60, pad_k=56, seed=32)
    with driver_bwd.force_deterministic_plan(dq_split=True, fused_turns=True):
        testing.run_case("cpasync-table", "public", case, problem)


# deterministic=True with a sliding window and a user score_mod (session 38): no fixed point (no bound for a user's
# score_mod_bwd), so turns counted from the window's edges (kernels/bwd_deterministic.dq_turn): descending with the
# shortest-first launch on dense calls, ascending on varlen and seqused_k ones. One-sided negative windows as
# upstream means them (right -1: keys strictly before the diagonal, so a row can be empty).
@pytest.mark.parametrize("mask,layouts,d,ratio,mods,problem,order", [
    ("local_lr", ("dense", "dense"), 128, 2, "position",
     testing.AttnProblem((700, 700), (700, 700), nheads_kv=2, window_left=150, window_right=40, seed=1),
     "descending+reversed"),
    ("causal_l", ("dense", "dense"), 64, 1, "alibi",
     testing.AttnProblem((1000,), (1000,), nheads_kv=3, window_left=200, seed=2), "descending+reversed"),
    ("local_r", ("dense", "dense"), 96, 1, "position",
     testing.AttnProblem((300,), (500,), nheads_kv=2, window_right=-1, seed=3), "descending+reversed"),
    ("local_l", ("dense", "dense"), 128, 4, "position",
     testing.AttnProblem((400,), (650,), nheads_kv=1, window_left=-1, seed=4), "descending+reversed"),
    ("causal_l", ("packed", "packed"), 128, 2, "position",
     testing.AttnProblem((300, 1, 517), (300, 90, 517), nheads_kv=2, window_left=100, seed=5), "ascending"),
    ("local_lr", ("padded", "padded"), 64, 2, "alibi",
     testing.AttnProblem((200, 333), (260, 400), nheads_kv=2, window_left=64, window_right=7, pad_q=20, pad_k=44,
                         seed=6), "ascending"),
], ids=["lr-gqa-d128", "causal-left-d64", "right-neg-d96", "left-neg-gqa4-d128", "packed-causal-left",
        "seqused-lr-d64"])
def test_windows_with_a_score_mod_take_turns(mask, layouts, d, ratio, mods, problem, order):
    case = testing.AttnCase("bfloat16", d, d, ratio, None, mask, 0.0, False, *layouts, True, mods=mods,
                            deterministic=True)
    assert testing.deterministic_order(case, problem) == order
    testing.run_case("cpasync-table", "public", case, problem)


# Dense windows without a user score_mod take the same descending turns (session 38: faster than fixed point there);
# packed ones keep fixed point.
@pytest.mark.parametrize("mask,layouts,d,ratio,problem,order", [
    ("local_lr", ("dense", "dense"), 128, 2,
     testing.AttnProblem((600, 600), (700, 700), nheads_kv=2, window_left=200, window_right=50, seed=11),
     "descending+reversed"),
    ("causal_l", ("dense", "dense"), 96, 1,
     testing.AttnProblem((900,), (900,), nheads_kv=3, window_left=128, seed=12), "descending+reversed"),
    ("local_l", ("dense", "dense"), 64, 4,
     testing.AttnProblem((500,), (520,), nheads_kv=1, window_left=-1, seed=13), "descending+reversed"),
    ("local_lr", ("packed", "packed"), 128, 2,
     testing.AttnProblem((300, 517), (300, 517), nheads_kv=2, window_left=100, window_right=0, seed=14), "fixed"),
], ids=["lr-gqa-d128", "causal-left-d96", "left-neg-gqa4-d64", "packed-fixed"])
def test_windows_without_a_score_mod(mask, layouts, d, ratio, problem, order):
    case = testing.AttnCase("bfloat16", d, d, ratio, None, mask, 0.0, False, *layouts, True, deterministic=True)
    assert testing.deterministic_order(case, problem) == order
    testing.run_case("cpasync-table", "public", case, problem)

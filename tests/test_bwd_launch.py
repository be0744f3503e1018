"""The backward's launch plan (driver_bwd.launch_plan): masks applied only to tiles that need them, and the
longest-first causal launch (an option, off in the plan: it measured slower). CPU only: the formulas the kernel runs (kernels/bwd_sm120.py lpt_coords /
lpt_section_heads, kernels/bwd_mask.py tile_needs_mask) checked on ints against their definitions, the plan's
rule, and sm_120a codegen of the table's causal entries with the plan on (GPU: tests/test_bwd_gpu.py)."""

import itertools
import os
import random
from types import SimpleNamespace

import pytest

from flash_attn_sm120 import driver_bwd
from flash_attn_sm120.kernels.bwd_mask import tile_needs_mask
from flash_attn_sm120.kernels.bwd_sm120 import LPT_L2_BYTES, lpt_coords, lpt_row_bytes, lpt_section_heads


def _causal_steps(n_block, tile_n, tile_m, seqlen):
    """m_blocks a causal CTA walks (seqlen_q == seqlen_k): from the diagonal to the end."""
    return -(-seqlen // tile_m) - n_block * tile_n // tile_m


@pytest.mark.parametrize("num_block,heads", [(1, 1), (1, 7), (5, 1), (7, 3), (16, 12), (13, 40)])
def test_lpt_coords_is_a_permutation_that_starts_each_section_longest_first(num_block, heads):
    for section in range(1, heads + 1):
        coords = [lpt_coords(i, num_block, heads, section) for i in range(num_block * heads)]
        assert sorted(coords) == sorted(itertools.product(range(num_block), range(heads)))  # every CTA once
        # sections: consecutive launches of `section` heads (the last one the remainder), and within one the
        # n_blocks never decrease: under a causal mask every CTA starts no shorter than the ones after it
        for start in range(0, heads, section):
            width = min(section, heads - start)
            part = coords[start * num_block:(start + width) * num_block]
            assert {h for _, h in part} == set(range(start, start + width))
            assert [n for n, _ in part] == sorted(n for n, _ in part)


def test_lpt_order_ends_on_the_shortest_ctas():
    """The last launches of the grid are the shortest CTAs of the last section (what balances the tail)."""
    num_block, heads = 64, 32
    section = 8
    order = [lpt_coords(i, num_block, heads, section) for i in range(num_block * heads)]
    steps = [_causal_steps(n, 64, 64, 4096) for n, _ in order]
    assert steps[-section:] == [1] * section and steps[-len(order) // 4] > 1
    upstream = [(i % num_block, i // num_block) for i in range(num_block * heads)]  # one head's n_blocks, next head
    assert [_causal_steps(n, 64, 64, 4096) for n, _ in upstream][-num_block] == 64  # a long CTA near the end


def test_lpt_section_heads_keeps_the_working_set_within_the_budget():
    row = lpt_row_bytes(128, 128, 2)
    assert row == 128 * 2 * 2 + 128 * 4 + 8
    for num_block, tile_n, heads in [(128, 64, 16), (64, 64, 32), (16, 128, 128), (1024, 64, 8), (1, 64, 1)]:
        s = lpt_section_heads(num_block, tile_n, row, heads)
        assert 1 <= s <= heads
        per_head = num_block * tile_n * row
        assert s == 1 or s * per_head <= LPT_L2_BYTES
        assert s == heads or (s + 1) * per_head > LPT_L2_BYTES


def _brute_force(mask, m_block, n_block, seqlen, causal):
    """Whether apply_mask_any_layout's rules mask any element of the tile."""
    shift = mask.seqlen_k - mask.seqlen_q
    for r in range(m_block * mask.tile_m, (m_block + 1) * mask.tile_m):
        for c in range(n_block * mask.tile_n, (n_block + 1) * mask.tile_n):
            if (seqlen and c >= mask.seqlen_k) or (causal and c > r + shift):
                return True
    return False


@pytest.mark.parametrize("seed", range(6))
def test_tile_needs_mask_matches_the_elementwise_rules(seed):
    rng = random.Random(seed)
    for _ in range(150):
        tile_m, tile_n = rng.choice([(32, 64), (64, 64), (64, 128), (32, 128), (128, 32)])
        mask = SimpleNamespace(tile_m=tile_m, tile_n=tile_n, seqlen_q=rng.randint(1, 700), seqlen_k=rng.randint(1, 700))
        n_block = rng.randrange(-(-mask.seqlen_k // tile_n))
        m_block = rng.randrange(-(-mask.seqlen_q // tile_m))
        for seqlen, causal in itertools.product((False, True), repeat=2):
            expect = _brute_force(mask, m_block, n_block, seqlen, causal)
            assert bool(tile_needs_mask(mask, m_block, n_block, seqlen, causal, False)) == expect
        assert tile_needs_mask(mask, m_block, n_block, True, False, True)  # local windows mask every tile


def test_benchmark_launch_variants_are_plans_the_kernel_runs():
    """prepare.py --launch-variants: every forced plan is one launch_plan accepts for the problems it is
    meant for (the lpt variants: causal, dense, deterministic=False; the rest: any dense call)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from prepare_bwd import LAUNCH_VARIANTS

    for name, flags in LAUNCH_VARIANTS.items():
        for causal in ((True,) if flags.get("lpt") else (False, True)):
            with driver_bwd.force_launch_plan(**flags):
                plan = driver_bwd.launch_plan(causal, False, False, dense_k=True)
            assert all(plan[k] == v for k, v in flags.items()), name


def test_launch_plan_rule_and_forcing():
    """The measured choice: masks skipped where a tile needs none without a causal mask or window, the
    longest-first launch, the wide dQ adds and the package's step for plain calls off; forcing is allowed
    where the kernel can run it."""
    off = dict(lpt=False, dq_wide_adds=False, own_step=False)
    assert driver_bwd.launch_plan(False, False, False, dense_k=True) == dict(off, mask_where_needed=True)
    assert driver_bwd.launch_plan(False, False, True, dense_k=False) == dict(off, mask_where_needed=True)
    for causal, local in [(True, False), (False, True)]:
        assert driver_bwd.launch_plan(causal, local, False, dense_k=True) == dict(off, mask_where_needed=False)
    with driver_bwd.force_launch_plan(lpt=True, mask_where_needed=True):
        assert driver_bwd.launch_plan(True, False, False, dense_k=True) == dict(off, lpt=True, mask_where_needed=True)
    with driver_bwd.force_launch_plan(dq_wide_adds=True):
        for causal, local, det, dense in itertools.product((False, True), repeat=4):
            assert driver_bwd.launch_plan(causal, local, det, dense_k=dense)["dq_wide_adds"] is True
    for causal, local, det, dense in [(False, False, False, True), (True, True, False, True),
                                      (True, False, True, True), (True, False, False, False)]:
        with driver_bwd.force_launch_plan(lpt=True), pytest.raises(ValueError, match="lpt needs a causal"):
            driver_bwd.launch_plan(causal, local, det, dense_k=dense)
    with pytest.raises(ValueError, match="unknown launch flags"):
        driver_bwd.force_launch_plan(lpt_order=True)


def test_kernel_refuses_lpt_where_the_plan_would_not_use_it():
    import cutlass

    from flash_attn_sm120.kernels.bwd_sm120 import FlashAttentionBackwardSm120Tuned
    from flash_attn_sm120.kernels.bwd_tiling import upstream_bwd_config

    for kw in (dict(is_causal=False), dict(is_causal=True, deterministic=True), dict(is_local=True)):
        with pytest.raises(ValueError, match="lpt"):
            FlashAttentionBackwardSm120Tuned(cutlass.BFloat16, 64, config=upstream_bwd_config(64), lpt=True, **kw)


@pytest.fixture(scope="module")
def sm120a():
    os.environ.update(CUTE_DSL_ARCH="sm_120a", FLASH_ATTENTION_ARCH="sm_120", FLASH_ATTENTION_NUM_SMS="188")


@pytest.mark.parametrize("d,causal,plain_mha", [(64, True, False), (96, True, False), (128, True, False),
                                                (128, True, True), (128, False, False), (96, False, False)])
def test_table_entries_with_each_launch_option_compile_spill_free(sm120a, d, causal, plain_mha):
    """The table's kernels (plain_mha: the entry plain MHA calls take) with the plan's choice and with each
    option forced on (the longest-first scheduler where causal, the mask branch) build for sm_120a without
    local memory and with the same tensor-core work."""
    from flash_attn_sm120 import codegen
    from flash_attn_sm120.config_bwd import load_bwd_table, select_bwd_config

    cfg = select_bwd_config(load_bwd_table(), d, d, causal, False, plain_mha=plain_mha)
    rows = {}
    for name, ordering in (("plan", None), ("on", dict(lpt=causal, mask_where_needed=True)),
                           ("off", dict(lpt=False, mask_where_needed=False))):
        cubin, _ = codegen.compile_bwd_cubin(cfg, d, causal=causal, ordering=ordering)
        usage, hist, _ = codegen.inspect_cubin(cubin)
        rows[name] = hist
        assert usage["local"] == 0 and usage["stack"] == 0, (name, usage)
    assert rows["plan"]["HMMA"] == rows["on"]["HMMA"] == rows["off"]["HMMA"]
    assert rows["plan"] == rows["on" if not causal else "off"]  # the plan is one of the two


def test_candidate_files_take_a_deterministic_only_flag(tmp_path):
    """prepare.py --bwd-configs: "deterministic" is true (time both), false, or "only" (a tile for the
    deterministic path, timed deterministic alone); anything else is refused by name."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from prepare_bwd import read_bwd_candidates

    base = dict(num_threads=256, m_block=64, n_block=128, stages_q=1, stages_do=1)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"a": {**base, "deterministic": "only"}, "b": {**base, "deterministic": True},
                                "c": base}))
    assert {n: det for n, (_, _, det) in read_bwd_candidates(path).items()} == {"a": "only", "b": True, "c": False}
    path.write_text(json.dumps({"bad": {**base, "deterministic": "yes"}}))
    with pytest.raises(ValueError, match="'bad'.*deterministic"):
        read_bwd_candidates(path)


def test_candidate_files_name_a_deterministic_plan_that_exists(tmp_path):
    """A candidate's "det_plan" is a prepare_bwd.DET_VARIANTS name; a misspelt one is refused by name."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from prepare_bwd import read_bwd_candidates, read_det_plans

    base = dict(num_threads=256, m_block=64, n_block=128, stages_q=1, stages_do=1, deterministic="only")
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"a": {**base, "det_plan": "det_fixed_point"}, "b": base}))
    assert read_det_plans(path) == {"a": "det_fixed_point"}
    assert set(read_bwd_candidates(path)) == {"a", "b"}
    path.write_text(json.dumps({"a": {**base, "det_plan": "fixed"}}))
    with pytest.raises(ValueError, match="'a': det_plan 'fixed'"):
        read_det_plans(path)
    path.write_text(json.dumps({"a": {**base, "deterministic": False, "det_plan": "det_fixed_point"}}))
    with pytest.raises(ValueError, match="'a': det_plan needs"):  # it would be ignored
        read_det_plans(path)


def test_a_candidates_forced_ordering_runs_where_the_variant_does():
    """A det_plan candidate keeps deterministic_variants' filter: turn orders need a dense call without a
    window; fixed point runs varlen too."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from prepare_bwd import config_candidates

    from flash_attn_sm120.kernels.bwd_tiling import BwdConfig

    cfg = BwdConfig(256, 64, 128, 1, 1, atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=4, v_in_regs=True)
    info = SimpleNamespace(emulated=True)
    impls = config_candidates(info, {"t": (cfg, [96]), "f": (cfg, [96]), "plain": (cfg, [96])}, deterministic=True,
                              det_plans={"t": "det_fused", "f": "det_fixed_point"})
    prob = lambda **kw: SimpleNamespace(**{**dict(head_dim=96, dv=96, is_varlen=False, window=(None, None)), **kw})  # noqa: E731
    support = {i.name: (i.supports(prob()), i.supports(prob(is_varlen=True)), i.supports(prob(window=(32, 0))))
               for i in impls}
    assert support == {"t": (True, False, False), "f": (True, True, False), "plain": (True, True, True)}


def test_a_det_variants_launch_flags_hold_inside_its_run():
    """A DET_VARIANTS entry with "launch" (det_fixed_point_mask_always) forces those launch_plan flags beside
    its ordering while the backward runs, and only then; one without leaves the plan as it is."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from types import SimpleNamespace

    from prepare_bwd import BwdImpl, with_ordering

    from flash_attn_sm120 import bwd_plans

    seen = []

    def inner(p, x, poisoned):
        seen.append((bwd_plans.launch_plan(False, False, True, True)["mask_where_needed"], bwd_plans.plan_forced()))

    prob = SimpleNamespace(causal=False)
    for variant in ("det_fixed_point_mask_always", "det_fixed_point"):
        with_ordering(BwdImpl("c", inner), variant).run(prob, None, False)
    assert seen == [(False, True), (True, True)]
    assert bwd_plans.launch_plan(False, False, True, True)["mask_where_needed"]  # popped after the run

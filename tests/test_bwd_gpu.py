"""The SM120 backward (driver_bwd.py) on a GPU against fp32 autograd, with NaN-poisoned dq/dk/dv.

Every case runs the public API's forward and autograd backward (`testing.check_backward`): each
gradient within upstream's rule (2x the error of the same reference in the inputs' precision, plus
an atol) on valid rows, and every valid element written. Configs: upstream's own SM120 config, the
fallbacks, every entry of flash_attn_sm120/configs/sm120_bwd.toml, and 8-warp / 128-row tiles, dense and varlen, MHA,
GQA and MQA, causal, local (negative windows included), softcap, the LSE's own gradient, fp16.
"""

import pytest

torch = pytest.importorskip("torch")

from flash_attn_sm120 import driver_bwd, testing  # noqa: E402
from flash_attn_sm120.config_bwd import BWD_FALLBACKS, load_bwd_table  # noqa: E402
from flash_attn_sm120.kernels.bwd_tiling import BwdConfig, bwd_config_error, upstream_bwd_config  # noqa: E402
from flash_attn_sm120.testing import AttnCase, AttnProblem  # noqa: E402

pytestmark = pytest.mark.gpu

EXTRA = [
    BwdConfig(256, 64, 128, 2, 2, atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=2),  # PR 2771's d64 shape
    BwdConfig(256, 128, 64, 1, 1, atom_m_sdp=4, atom_n_dkv=4, atom_m_dq=4),
    BwdConfig(256, 64, 64, 1, 1, atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=2, v_in_regs=True),
    BwdConfig(128, 64, 64, 1, 1, dq_swapab=True),
    BwdConfig(128, 32, 64, 1, 1, atom_m_sdp=2, atom_n_dkv=2, atom_m_dq=2),  # d96: the preprocess's widened pass
]
CONFIGS = ([("upstream", upstream_bwd_config(64)), ("upstream", upstream_bwd_config(128))]
           + [(f"fallback{i}", c) for i, c in enumerate(BWD_FALLBACKS)]
           + [(f"table-d{e.head_dim}-{e.mask}{'-' + e.kind if e.kind else ''}", e.config) for e in load_bwd_table()]
           + [("extra", c) for c in EXTRA])


def _run(cfg, case, problem):
    inputs = testing.make_inputs(case, problem, "cuda", requires_grad=True)
    with driver_bwd.force_config(cfg):
        return testing.check_backward(inputs, case, problem)


@pytest.mark.parametrize("label,cfg", CONFIGS, ids=[f"{n}-{c.name}" for n, c in CONFIGS])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_configs_dense(label, cfg, d):
    if bwd_config_error(d, d, cfg) is not None:
        pytest.skip(bwd_config_error(d, d, cfg))
    for mask, hk, ratio, sq, sk in (("none", 2, 1, 200, 333), ("causal", 1, 4, 257, 300)):
        case = AttnCase("bfloat16", d, d, ratio, None, mask)
        _run(cfg, case, AttnProblem((sq, sq), (sk, sk), nheads_kv=hk, seed=d + sq))


@pytest.mark.parametrize("layout,mask", [("dense", "none"), ("dense", "causal"), ("packed", "causal")])
def test_tiles_shorter_than_the_preprocess_pass_on_a_large_grid(layout, mask):
    """d96 with 32-row tiles, where upstream's preprocess at its default multiple covers 64 rows a pass:
    the driver widens the pass (preprocess_multiple) and zeroes dQaccum itself. At b1 s4096 h16 the
    unwidened pass zeroed the next head's first dPsum rows (wrong dQ/dK/dV, session 15); varlen runs the
    padded per-sequence offsets."""
    from flash_attn_sm120.kernels.bwd_tiling import preprocess_multiple

    cfg = BwdConfig(128, 32, 64, 1, 1, atom_m_sdp=2, atom_n_dkv=2, atom_m_dq=2)
    assert bwd_config_error(96, 96, cfg) is None and preprocess_multiple(96, 32) == 64
    lens = (4096,) if layout == "dense" else (1500, 33, 2100)
    case = AttnCase("bfloat16", 96, 96, 1, None, mask, q_layout=layout, k_layout=layout)
    _run(cfg, case, AttnProblem(lens, lens, nheads_kv=16, seed=31))


FEATURES = [
    # (id, case, problem)
    ("varlen-gqa-causal", AttnCase("bfloat16", 128, 128, 2, None, "causal", q_layout="packed", k_layout="packed"),
     AttnProblem((77, 300, 5), (90, 300, 64), nheads_kv=2, seed=1)),
    ("seqused-padded", AttnCase("float16", 64, 64, 1, None, "none", q_layout="padded", k_layout="padded"),
     AttnProblem((65, 130), (129, 200), nheads_kv=2, pad_q=7, pad_k=13, seed=2)),
    ("mqa-local", AttnCase("bfloat16", 96, 96, 8, None, "local_lr"),
     AttnProblem((300,), (300,), nheads_kv=1, window_left=40, window_right=7, seed=3)),
    ("negative-window", AttnCase("bfloat16", 128, 128, 1, None, "local_lr"),
     AttnProblem((200,), (333,), nheads_kv=2, window_left=300, window_right=-70, seed=4)),
    ("negative-left", AttnCase("bfloat16", 64, 64, 2, None, "local_l"),
     AttnProblem((190,), (190,), nheads_kv=1, window_left=-20, seed=5)),
    ("softcap-lse", AttnCase("bfloat16", 128, 128, 1, None, "causal", softcap=15.0, return_lse=True),
     AttnProblem((129,), (129,), nheads_kv=3, seed=6)),
    ("causal-sq-gt-sk", AttnCase("bfloat16", 64, 64, 1, None, "causal"),
     AttnProblem((300,), (100,), nheads_kv=2, seed=7)),
    ("d192", AttnCase("bfloat16", 192, 192, 2, None, "causal"), AttnProblem((150,), (150,), nheads_kv=1, seed=8)),
    ("d256", AttnCase("bfloat16", 256, 256, 1, None, "none"), AttnProblem((100,), (150,), nheads_kv=1, seed=9)),
    # d200-224: the 64-row 4-warp fallback (the preprocess's 64-row passes need m_block >= 64)
    ("d224-gqa", AttnCase("bfloat16", 224, 224, 2, None, "causal"), AttnProblem((300,), (300,), nheads_kv=2, seed=11)),
    ("d200", AttnCase("float16", 200, 200, 1, None, "none"), AttnProblem((1100,), (700,), nheads_kv=3, seed=12)),
    ("d80-dv64", AttnCase("float16", 80, 64, 1, None, "none"), AttnProblem((70,), (90,), nheads_kv=2, seed=10)),
    # plain MHA calls at d128 causal take the table's plain_mha_only entry (4 warps, V across sQ and sdO)
    ("plain-mha-d128-causal", AttnCase("bfloat16", 128, 128, 1, None, "causal"),
     AttnProblem((1000, 1000), (1000, 1000), nheads_kv=3, seed=13)),
    ("plain-mha-d128-causal-fp16", AttnCase("float16", 128, 128, 1, None, "causal"),
     AttnProblem((700,), (900,), nheads_kv=2, seed=14)),
    # plain GQA calls at d128 causal take the plain_only entry (8 warps 32x128, V in registers)
    ("plain-gqa-d128-causal", AttnCase("bfloat16", 128, 128, 4, None, "causal"),
     AttnProblem((1000, 1000), (1000, 1000), nheads_kv=2, seed=15)),
    ("plain-gqa-d128-causal-fp16", AttnCase("float16", 128, 128, 8, None, "causal"),
     AttnProblem((900,), (1100,), nheads_kv=1, seed=16)),
    # packed GQA calls (cu_seqlens) take the plain_only entry too; packed MHA calls the key's entry
    ("plain-mha-d128-causal-varlen", AttnCase("bfloat16", 128, 128, 1, None, "causal", q_layout="packed",
                                              k_layout="packed"),
     AttnProblem((500, 77, 1000), (600, 77, 1000), nheads_kv=2, seed=17)),
    ("plain-gqa-d128-causal-varlen-fp16", AttnCase("float16", 128, 128, 4, None, "causal", q_layout="packed",
                                                   k_layout="packed"),
     AttnProblem((33, 1200, 400), (33, 1100, 700), nheads_kv=2, seed=18)),
]


@pytest.mark.parametrize("name,case,problem", FEATURES, ids=[f[0] for f in FEATURES])
def test_features_on_the_table_choice(name, case, problem):
    """The dispatcher's own choice (table or fallback) on each feature."""
    inputs = testing.make_inputs(case, problem, "cuda", requires_grad=True)
    testing.check_backward(inputs, case, problem)


def test_no_recompile_for_new_lengths():
    case = AttnCase("bfloat16", 64, 64, 2, None, "causal")
    testing.check_backward(testing.make_inputs(case, AttnProblem((130,), (150,), nheads_kv=1, seed=1), "cuda", True),
                           case, AttnProblem((130,), (150,), nheads_kv=1, seed=1))
    before = driver_bwd.compile_count["bwd"]
    p = AttnProblem((250,), (260,), nheads_kv=1, seed=2)
    testing.check_backward(testing.make_inputs(case, p, "cuda", True), case, p)
    assert driver_bwd.compile_count["bwd"] == before


ON = {"lpt": True, "mask_where_needed": True}


@pytest.mark.parametrize("d,ratio,plan", [(128, 1, ON), (64, 4, ON), (128, 2, {"lpt": False, "mask_where_needed": False})],
                         ids=["d128-mha", "d64-gqa4", "d128-gqa2-plan-off"])
def test_longest_first_launch_with_several_sections(d, ratio, plan):
    """Causal, the launch plan's options forced on: the longest-first order (LongestFirstNBlockScheduler) over
    3 batches x 8 KV heads x ratio, with sections of heads smaller than the grid's heads (the last one a
    remainder), key and query lengths that are not tile multiples, and the mask only where a tile needs it;
    and both forced off (the benchmark's `launch_before` variant)."""
    from flash_attn_sm120.config_bwd import select_bwd_config
    from flash_attn_sm120.kernels.bwd_sm120 import lpt_row_bytes, lpt_section_heads

    cfg = select_bwd_config(load_bwd_table(), d, d, True, False)
    heads = 3 * 8 * ratio
    section = lpt_section_heads(-(-1600 // cfg.n_block), cfg.n_block, lpt_row_bytes(d, d, 2), heads)
    assert 1 < section < heads and heads % section, (section, heads)  # several sections, the last one partial
    case = AttnCase("bfloat16", d, d, ratio, None, "causal")
    problem = AttnProblem((1500,) * 3, (1600,) * 3, nheads_kv=8, seed=d + ratio)
    inputs = testing.make_inputs(case, problem, "cuda", requires_grad=True)
    with driver_bwd.force_launch_plan(**plan):
        testing.check_backward(inputs, case, problem)

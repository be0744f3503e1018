"""The modifier backward on the CPU: rules, plumbing, and sm_120a codegen (kernels/bwd_mods.py).

GPU results against an fp32 reference are in test_mods_bwd_gpu.py.
"""

import pytest

torch = pytest.importorskip("torch")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from quack.compile_utils import make_fake_tensor  # noqa: E402

from flash_attn_sm120 import codegen, compile_ops, driver_bwd, interface, validation  # noqa: E402
from flash_attn_sm120.config_bwd import load_bwd_table, select_bwd_config  # noqa: E402
from flash_attn_sm120.driver_bwd import Mods  # noqa: E402
from flash_attn_sm120.kernels.bwd_mods import FlashAttentionBackwardSm120Mods, mod_vec_size  # noqa: E402
from flash_attn_sm120.kernels.bwd_sm120 import FlashAttentionBackwardSm120Tuned  # noqa: E402
from flash_attn_sm120.kernels.bwd_tiling import BwdConfig  # noqa: E402


from flash_attn_sm120.testing_mods import (  # noqa: E402
    position_scale,
    position_scale_bwd,
    same_document,
    scalar_scale,
    scalar_scale_bwd,
)


# ---- rules ---------------------------------------------------------------------------------------------

def test_score_mod_needs_its_backward_and_softcap_excludes_both():
    with pytest.raises(ValueError, match="score_mod_bwd is required"):
        driver_bwd.resolve_mods(0.0, position_scale, None, None, None, None)
    for mods in ((position_scale, None), (None, position_scale_bwd)):
        with pytest.raises(ValueError, match="softcap and score_mod"):
            driver_bwd.resolve_mods(30.0, *mods, None, None, None)
    softcap = driver_bwd.resolve_mods(30.0, None, None, None, None, None)
    assert softcap.score_mod is not None and softcap.score_mod_bwd is not None and not softcap.user
    assert driver_bwd.resolve_mods(30.0, None, None, same_document, [torch.zeros(1)], None).user
    assert driver_bwd.resolve_mods(0.0, position_scale, position_scale_bwd, None, None, None).user
    assert not driver_bwd.resolve_mods(0.0, None, None, None, None, (cutlass.Int32(1),)).user


def test_the_step_is_chosen_by_the_modifiers():
    """Softcap alone keeps upstream's step; a user callable or aux tensors take the modifier step."""
    statics = driver_bwd.BwdStatics("bfloat16", 64, 64, 1, False, False, False, False, 0.0, False, False, False,
                                    False, False, False, (), BwdConfig(), None)
    plain = driver_bwd.make_kernel(statics, None)
    assert type(plain) is FlashAttentionBackwardSm120Tuned
    soft = driver_bwd.make_kernel(statics, None, driver_bwd.resolve_mods(20.0, None, None, None, None, None))
    assert type(soft) is FlashAttentionBackwardSm120Tuned and soft.score_mod is not None
    mods = driver_bwd.resolve_mods(0.0, position_scale, position_scale_bwd, same_document, [torch.zeros(1)], None)
    k = driver_bwd.make_kernel(statics, None, mods)
    assert type(k) is FlashAttentionBackwardSm120Mods
    assert k.mask_mod is same_document and k.score_mod is position_scale and k.has_aux_tensors
    assert k.score_vec_size == 1  # aux tensors: per-element reads, upstream's rule
    assert mod_vec_size(position_scale, False) == 2



def test_aux_scalars_become_cute_numerics():
    out = validation.normalize_aux_scalars([2, 0.5, True, cutlass.Int32(7)])
    assert [type(x) for x in out] == [cutlass.Int32, cutlass.Float32, cutlass.Boolean, cutlass.Int32]
    assert [x.value for x in out] == [2, 0.5, 1, 7]
    assert validation.normalize_aux_scalars(None) is None and validation.normalize_aux_scalars([]) is None
    with pytest.raises(TypeError, match=r"aux_scalars\[1\].*str"):
        validation.normalize_aux_scalars([1, "x"])
    with pytest.raises(TypeError, match="list or tuple"):
        validation.normalize_aux_scalars(torch.ones(2))
    with pytest.raises(ValueError, match="int32"):
        validation.normalize_aux_scalars([1 << 40])


def test_compiled_aux_scalars_accept_cute_numerics():
    values, kinds = compile_ops._encode_scalars((cutlass.Int32(3), cutlass.Float32(0.25), cutlass.Boolean(True)))
    assert compile_ops._decode_scalars(values, kinds) == (3, 0.25, True)
    normalized = validation.normalize_aux_scalars(compile_ops._decode_scalars(values, kinds))
    assert [type(x) for x in normalized] == [cutlass.Int32, cutlass.Float32, cutlass.Boolean]


def test_backward_keywords_keep_aux_tensors_through_save_for_backward():
    cu = torch.tensor([0, 3], dtype=torch.int32)
    a, b = torch.zeros(3), torch.ones(2)
    kw = interface._bwd_kwargs(dict(causal=True), dict(cu_seqlens_q=cu), position_scale, position_scale_bwd,
                               same_document, [a, b], [cutlass.Int32(1)])
    assert kw["_tensor_names"] == ("cu_seqlens_q", "aux_tensors#0", "aux_tensors#1")
    assert kw["_tensors"][1] is a and kw["_tensors"][2] is b
    assert kw["score_mod"] is position_scale and kw["mask_mod"] is same_document and kw["causal"]
    restored = interface._restore_saved({}, kw["_tensor_names"], kw["_tensors"])
    assert restored["cu_seqlens_q"] is cu and restored["aux_tensors"] == [a, b]
    plain = interface._bwd_kwargs({}, {}, None, None, None, None, None)
    assert interface._restore_saved({}, plain["_tensor_names"], plain["_tensors"]) == {"aux_tensors": None}


# ---- sm_120a codegen ---------------------------------------------------------------------------------------

def _table_config(d: int) -> BwdConfig:
    return select_bwd_config(load_bwd_table(), d, d, False, False, modifiers=True)  # what a modifier call runs


@pytest.mark.parametrize("d", [64, 128])
def test_modifier_step_compiles_for_sm120a_without_spills(d):
    """The table's config with a position score_mod pair and a document mask_mod over an aux tensor."""
    doc = make_fake_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int()))
    cubin, _ = codegen.compile_bwd_cubin(_table_config(d), d,
                                         mods=Mods(position_scale, position_scale_bwd, same_document, (doc,)))
    res, hist, _ = codegen.inspect_cubin(cubin)
    assert hist.get("HMMA", 0) > 0
    assert res["stack"] == 0 and hist.get("LDL", 0) == 0 and hist.get("STL", 0) == 0, res


def test_modifier_step_compiles_deterministic_with_aux_scalars():
    cubin, _ = codegen.compile_bwd_cubin(_table_config(64), 64, causal=True, deterministic=True, qhead_per_kvhead=2,
                                         mods=Mods(scalar_scale, scalar_scale_bwd, None, None, (cutlass.Int32(2),)))
    assert codegen.inspect_cubin(cubin)[1].get("HMMA", 0) > 0

"""score_mod / score_mod_bwd / mask_mod with aux tensors and aux scalars, forward and backward, on a GPU.

Each modifier is a CuTe callable that depends on the element's position, head or batch (so a
backward that passed index 0, as upstream's SM80/SM120 step does, fails), and has a PyTorch twin.
The reference is dense fp32 attention with the twin applied to the scaled scores, differentiated
by autograd; the tolerance is upstream's rule (2x the same reference's error in bf16, plus atol).
dq/dk/dv and out/lse are NaN-poisoned before every call (testing.poisoned_outputs).
"""

import math

import pytest

torch = pytest.importorskip("torch")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

import flash_attn_sm120  # noqa: E402
from flash_attn_sm120 import driver_bwd, testing  # noqa: E402
from flash_attn_sm120.kernels.bwd_tiling import BwdConfig  # noqa: E402

pytestmark = pytest.mark.gpu


# ---- modifiers (CuTe, testing_mods.py) and their PyTorch twins -----------------------------------------

from flash_attn_sm120.testing_mods import (  # noqa: E402
    PREFIX,
    alibi as head_slope_bias,
    identity_bwd,
    position_scale,
    position_scale_bwd,
    prefix_lm,
    same_document,
    scalar_scale,
    scalar_scale_bwd,
)


def position_scale_ref(s, b, h, qi, ki):
    return s * (1.0 + ((qi + 2 * ki + h) % 4).to(s.dtype) / 4)


def head_slope_ref(slopes):
    return lambda s, b, h, qi, ki: s + slopes.to(s.dtype)[h] * (ki - qi).to(s.dtype)


@cute.jit
def batch_bias_scalar_scale(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars):
    bias = aux_tensors[0]
    b_frag = cute.make_rmem_tensor(1, cutlass.Int32)
    b_frag.store(b)
    value = cute.make_rmem_tensor(1, bias.element_type)
    value[0] = bias[b_frag[0]]
    return score * cute.full_like(score, cutlass.Float32(aux_scalars[0])) + value.load().to(cutlass.Float32)


# ---- reference -------------------------------------------------------------------------------------

def mods_ref(q, k, v, *, score_fn=None, keep_fn=None, softmax_scale=None, upcast=True):
    """(out, lse) of (b, sq, h, d) attention with score_fn on the scaled scores and keep_fn as mask;
    an empty row gives out 0 (and no gradient)."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    k, v = k.repeat_interleave(h // hk, dim=2), v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q * scale, k)
    dev = q.device
    bi = torch.arange(b, device=dev)[:, None, None, None]
    hi = torch.arange(h, device=dev)[None, :, None, None]
    qi = torch.arange(sq, device=dev)[None, None, :, None]
    ki = torch.arange(sk, device=dev)[None, None, None, :]
    if score_fn is not None:
        s = score_fn(s, bi, hi, qi, ki)
    if keep_fn is not None:
        keep = keep_fn(bi, hi, qi, ki).expand(b, h, sq, sk)
        empty = ~keep.any(-1, keepdim=True)
        s = s.masked_fill(~keep, float("-inf")).masked_fill(empty, 0.0)
    p = torch.softmax(s.float(), dim=-1).to(s.dtype)
    lse = torch.logsumexp(s.float(), dim=-1)
    if keep_fn is not None:
        p = p.masked_fill(empty, 0.0)
    out = torch.einsum("bhts,bshd->bthd", p.to(v.dtype), v)
    return (out if upcast else out.to(dtype)), lse


def _inputs(b, sq, sk, h, hk, d, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v, dout


def _grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _refs(q, k, v, dout, ref_kw: dict):
    """(fp32 reference, the same in the inputs' precision): each (out, dq, dk, dv)."""
    ref = _grads(lambda *t: mods_ref(*t, upcast=True, **ref_kw)[0], q.float(), k.float(), v.float(), dout.float())
    pt = _grads(lambda *t: mods_ref(*t, upcast=False, **ref_kw)[0], q, k, v, dout)
    return ref, pt


def check_against_ref(q, k, v, dout, api_kw: dict, ref_kw: dict, *, check_bwd=True):
    """The public API (forward, and backward when check_bwd) against mods_ref with upstream's rule."""
    with testing.poisoned_outputs():
        ours = _grads(lambda *t: flash_attn_sm120.flash_attn_func(*t, **api_kw)[0], q, k, v, dout) if check_bwd \
            else (flash_attn_sm120.flash_attn_func(q, k, v, **api_kw)[0],)
    ref, pt = _refs(q, k, v, dout, ref_kw)
    errs = {}
    for name, a, r, p in zip(("out", "dq", "dk", "dv"), ours, ref, pt):
        errs[name] = testing.assert_close_to_ref(name, a, r, p, q.dtype)
    return errs


# ---- forward and backward, dense ---------------------------------------------------------------------

@pytest.mark.parametrize("d", [64, 128])
def test_position_dependent_score_mod(d):
    q, k, v, dout = _inputs(2, 200, 333, 4, 2, d, seed=d)
    check_against_ref(q, k, v, dout, dict(score_mod=position_scale, score_mod_bwd=position_scale_bwd),
                      dict(score_fn=position_scale_ref))


def test_alibi_slopes_from_aux_tensor():
    q, k, v, dout = _inputs(2, 256, 256, 8, 8, 128, seed=11)
    slopes = torch.exp2(-torch.arange(1, 9, device="cuda", dtype=torch.float32))
    check_against_ref(q, k, v, dout, dict(score_mod=head_slope_bias, score_mod_bwd=identity_bwd, aux_tensors=[slopes]),
                      dict(score_fn=head_slope_ref(slopes)))


@pytest.mark.parametrize("kind,value", [("cutlass-int32", 2), ("int", 3), ("float", 0.5)])
def test_aux_scalars_forward_and_backward(kind, value):
    """Upstream's aux_scalars cases (a cutlass.Int32, as upstream's test passes): score * aux_scalars[0]."""
    q, k, v, dout = _inputs(1, 128, 128, 4, 4, 64, seed=5)
    scalar = cutlass.Int32(value) if kind == "cutlass-int32" else value
    check_against_ref(q, k, v, dout, dict(score_mod=scalar_scale, score_mod_bwd=scalar_scale_bwd, aux_scalars=[scalar]),
                      dict(score_fn=lambda s, *_: s * value))


def test_aux_tensor_and_scalar_forward():
    """Upstream's aux tensors + aux scalars forward case: score * 2 + bias[batch]."""
    q, k, v, dout = _inputs(2, 128, 128, 4, 4, 64, seed=6)
    bias = torch.randn(2, device="cuda", dtype=torch.bfloat16) * 0.1
    check_against_ref(q, k, v, dout, dict(score_mod=batch_bias_scalar_scale, aux_tensors=[bias],
                                          aux_scalars=[cutlass.Int32(2)]),
                      dict(score_fn=lambda s, b, *_: s * 2 + bias.to(s.dtype)[b]), check_bwd=False)


def _documents(b, s, seed):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(b):
        cuts = sorted(torch.randperm(s - 1, generator=g)[:4].add(1).tolist())
        ids = torch.zeros(s, dtype=torch.int32)
        for c in cuts:
            ids[c:] += 1
        docs.append(ids)
    return torch.stack(docs).cuda()


@pytest.mark.parametrize("d,hk", [(64, 4), (128, 1)])
def test_document_mask_mod(d, hk):
    q, k, v, dout = _inputs(2, 300, 300, 4, hk, d, seed=d + hk)
    doc = _documents(2, 300, seed=d)
    check_against_ref(q, k, v, dout, dict(mask_mod=same_document, aux_tensors=[doc]),
                      dict(keep_fn=lambda b, h, qi, ki: doc[b, qi] == doc[b, ki]))


def test_prefix_lm_mask_with_score_mod():
    q, k, v, dout = _inputs(2, 190, 190, 4, 2, 96, seed=9)
    check_against_ref(q, k, v, dout, dict(mask_mod=prefix_lm, score_mod=position_scale, score_mod_bwd=position_scale_bwd),
                      dict(keep_fn=lambda b, h, qi, ki: (ki <= qi) | (ki < PREFIX), score_fn=position_scale_ref))


def test_mask_mod_replaces_causal_as_upstream():
    """Upstream resolves causal/window to off when a mask_mod is given: causal=True with a mask_mod
    that keeps everything is full attention."""
    q, k, v, dout = _inputs(1, 130, 200, 2, 2, 64, seed=4)

    @cute.jit
    def keep_all(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return kv_idx >= cute.full_like(kv_idx, 0)

    check_against_ref(q, k, v, dout, dict(mask_mod=keep_all, causal=True), dict(keep_fn=lambda *a: a[3] >= 0))


def test_eight_warps_two_along_n():
    """A config with 2 warps along N of the S tile (the layout whose indices upstream's R2P mask gets wrong)."""
    q, k, v, dout = _inputs(2, 200, 333, 4, 2, 64, seed=21)
    cfg = BwdConfig(256, 64, 128, 2, 2, atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=2)
    with driver_bwd.force_config(cfg):
        check_against_ref(q, k, v, dout, dict(mask_mod=prefix_lm, score_mod=position_scale,
                                              score_mod_bwd=position_scale_bwd),
                          dict(keep_fn=lambda b, h, qi, ki: (ki <= qi) | (ki < PREFIX), score_fn=position_scale_ref))


def test_deterministic_with_mods_is_bitwise_repeatable():
    q, k, v, dout = _inputs(2, 257, 257, 8, 2, 128, seed=31)
    doc = _documents(2, 257, seed=3)
    kw = dict(mask_mod=same_document, score_mod=position_scale, score_mod_bwd=position_scale_bwd, aux_tensors=[doc],
              deterministic=True)
    runs = [_grads(lambda *t: flash_attn_sm120.flash_attn_func(*t, **kw)[0], q, k, v, dout) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0][1:], other[1:]):
            assert torch.equal(a, b)
    ref, pt = _refs(q, k, v, dout, dict(keep_fn=lambda b, h, qi, ki: doc[b, qi] == doc[b, ki],
                                        score_fn=position_scale_ref))
    for name, a, r, p in zip(("out", "dq", "dk", "dv"), runs[0], ref, pt):
        testing.assert_close_to_ref(name, a, r, p, q.dtype)


# ---- varlen: indices are sequence-local ----------------------------------------------------------------

def test_varlen_score_and_mask_mod():
    seqlens_q, seqlens_k = [77, 300, 5], [90, 300, 64]
    h, hk, d = 4, 2, 128
    dense = [_inputs(1, sq, sk, h, hk, d, seed=40 + i) for i, (sq, sk) in enumerate(zip(seqlens_q, seqlens_k))]
    cat = lambda i: torch.cat([x[i][0] for x in dense])  # noqa: E731
    q, k, v, dout = cat(0), cat(1), cat(2), cat(3)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")  # noqa
    kw = dict(cu_seqlens_q=cu(seqlens_q), cu_seqlens_k=cu(seqlens_k), max_seqlen_q=max(seqlens_q),
              max_seqlen_k=max(seqlens_k), mask_mod=prefix_lm, score_mod=position_scale,
              score_mod_bwd=position_scale_bwd)
    with testing.poisoned_outputs():
        out, dq, dk, dv = _grads(lambda *t: flash_attn_sm120.flash_attn_varlen_func(*t, **kw)[0], q, k, v, dout)
    ref_kw = dict(keep_fn=lambda b, h, qi, ki: (ki <= qi) | (ki < PREFIX), score_fn=position_scale_ref)
    oq = ok = 0
    for (qs, ks, vs, ds), sq, sk in zip(dense, seqlens_q, seqlens_k):
        ref, pt = _refs(qs, ks, vs, ds, ref_kw)
        ours = (out[oq:oq + sq], dq[oq:oq + sq], dk[ok:ok + sk], dv[ok:ok + sk])
        for name, a, r, p in zip(("out", "dq", "dk", "dv"), ours, ref, pt):
            testing.assert_close_to_ref(f"{name}[seq of {sq}x{sk}]", a, r[0], p[0], q.dtype)
        oq, ok = oq + sq, ok + sk


# ---- the rules ------------------------------------------------------------------------------------------

def test_score_mod_without_its_backward_is_refused_at_backward():
    q, k, v, dout = _inputs(1, 64, 64, 2, 2, 64, seed=1)
    q.requires_grad_()
    out = flash_attn_sm120.flash_attn_func(q, k, v, score_mod=position_scale)[0]  # the forward is fine (upstream)
    with pytest.raises(ValueError, match="score_mod_bwd is required"):
        out.backward(dout)


# ---- forward families: a mask_mod on every key block ----------------------------------------------------

@pytest.mark.parametrize("num_splits,sq", [(3, 64), (0, 1)], ids=["splits", "decode"])
def test_mask_mod_on_every_key_block_of_a_split(num_splits, sq):
    """The SplitKV kernel once skipped a mask_mod on a split's interior key blocks (found by the fuzz
    harness): a long key sequence, three splits or a decode step, the prefix-LM mask and a score_mod."""
    q, k, v, dout = _inputs(2, sq, 2000, 8, 2, 128, seed=50 + sq)
    check_against_ref(q, k, v, dout, dict(mask_mod=prefix_lm, score_mod=position_scale, num_splits=num_splits),
                      dict(keep_fn=lambda b, h, qi, ki: (ki <= qi) | (ki < PREFIX), score_fn=position_scale_ref),
                      check_bwd=False)

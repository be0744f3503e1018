"""Drop-in `flash_attn_func` / `flash_attn_varlen_func` with upstream FA4's exact parameters.

Dispatch, per call, on the device of `q`:
  * compute capability 12.x, or FLASH_ATTN_SM120_EMULATE=1 on SM80+: validate, then run this
    package's SM120 forward (driver.py); autograd's backward is upstream's `_flash_attn_bwd`
    (on a real SM120 that is upstream's SM120 backward; in emulation, the device's own);
  * any other CUDA GPU: `flash_attn.cute.flash_attn_func` / `flash_attn_varlen_func`, called
    with the same arguments, so H100/B200 users see no change at all;
  * CPU tensors: validation raises a clear error.
Both return (out, lse) like upstream; lse is None unless requested or needed for autograd.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

import flash_attn.cute.interface as upstream
from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
from flash_attn.cute.prepare_scheduler import SchedulerMetadataTensorsTorch

from flash_attn_sm120 import driver, validation
from flash_attn_sm120.device import device_info


def _sm120_target(q) -> Optional[tuple]:
    """None if the call goes to upstream; else the emulation padding target (possibly None)."""
    if not isinstance(q, torch.Tensor) or q.device.type != "cuda":
        return ("validate-only",)  # CPU or non-tensor input: validation will raise
    info = device_info(q.device)
    if not info.uses_sm120_kernels:
        return None
    return (info.emulate_host_smem,)


def _check_common_features(
    *, qv, gather_kv_indices, learnable_sink, num_splits, block_sparse_tensors, page_table=None,
    scheduler_metadata=None, requires_grad=False, deterministic=False, score_mod=None,
    score_mod_bwd=None, mask_mod=None, gather_bwd_recompute_p=False, gather_bwd_token_chunk=None,
):
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int, got {num_splits!r}")
    validation.reject_unsupported(
        qv_MLA_absorbed_attention=qv is not None,
        gather_kv_indices_sparse_MLA=gather_kv_indices is not None,
        gather_bwd_options=gather_bwd_recompute_p or gather_bwd_token_chunk is not None,
        learnable_sink=learnable_sink is not None,
        SplitKV_num_splits_other_than_1=num_splits != 1,
        block_sparsity=block_sparse_tensors is not None,
        paged_KV_page_table=page_table is not None,
        scheduler_metadata=scheduler_metadata is not None,
    )
    if requires_grad:
        validation.reject_unsupported(
            deterministic_backward=deterministic,
            score_mod_backward=score_mod is not None or score_mod_bwd is not None,
            mask_mod_backward=mask_mod is not None,
        )


class _Sm120AttnFunc(torch.autograd.Function):
    """Forward on this package's kernels, backward on upstream's."""

    @staticmethod
    def forward(ctx, q, k, v, fwd_kwargs: dict, bwd_kwargs: dict, return_lse: bool):
        needs_grad = any(t.requires_grad for t in (q, k, v)) and torch.is_grad_enabled()
        out, lse = driver.forward(q, k, v, need_lse=return_lse or needs_grad, **fwd_kwargs)
        ctx.save_for_backward(q, k, v, out, lse, *bwd_kwargs.pop("_tensors"))
        ctx.bwd_kwargs = bwd_kwargs
        ctx.return_lse = return_lse
        ctx.set_materialize_grads(False)
        if lse is not None and not return_lse:
            ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *index = ctx.saved_tensors
        kw = dict(ctx.bwd_kwargs)
        names = kw.pop("_tensor_names")
        kw.update(zip(names, index))
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = upstream._flash_attn_bwd(
            q, k, v, out, dout, lse, dlse=dlse if ctx.return_lse else None, **kw
        )[:3]
        return dq, dk, dv, None, None, None


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qv: Optional[torch.Tensor] = None,
    gather_kv_indices: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    learnable_sink: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    score_mod: Optional[Callable] = None,
    score_mod_bwd: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    aux_tensors: Optional[list] = None,
    aux_scalars: Optional[tuple] = None,
    block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None,
    block_sparse_tensors_bwd: Optional[BlockSparseTensorsTorch] = None,
    return_lse: bool = False,
    gather_bwd_recompute_p: bool = False,
    gather_bwd_token_chunk: Optional[int] = None,
):
    """Attention over (batch, seqlen, nheads, headdim) tensors; returns (out, lse)."""
    target = _sm120_target(q)
    if target is None:
        return upstream.flash_attn_func(**_locals_without_target(locals()))
    validation.validate_dense(q, k, v)
    left, right = validation.normalize_window(window_size)
    validation.check_scalars(softmax_scale, softcap)
    requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    _check_common_features(
        qv=qv, gather_kv_indices=gather_kv_indices, learnable_sink=learnable_sink, num_splits=num_splits,
        block_sparse_tensors=block_sparse_tensors or block_sparse_tensors_bwd, requires_grad=requires_grad,
        deterministic=deterministic, score_mod=score_mod, score_mod_bwd=score_mod_bwd, mask_mod=mask_mod,
        gather_bwd_recompute_p=gather_bwd_recompute_p, gather_bwd_token_chunk=gather_bwd_token_chunk,
    )
    fwd_kwargs = dict(
        softmax_scale=softmax_scale, causal=causal, window_size_left=left, window_size_right=right,
        softcap=softcap, pack_gqa=pack_gqa, emulate_host_smem=target[0], score_mod=score_mod,
        mask_mod=mask_mod, aux_tensors=aux_tensors, aux_scalars=aux_scalars,
    )
    bwd_kwargs = dict(
        softmax_scale=softmax_scale, causal=causal, softcap=softcap, window_size_left=left,
        window_size_right=right, deterministic=deterministic, _tensors=(), _tensor_names=(),
    )
    return _Sm120AttnFunc.apply(q, k, v, fwd_kwargs, bwd_kwargs, return_lse)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qv: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    min_seqlen_k: Optional[int] = None,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    gather_kv_indices: Optional[torch.Tensor] = None,
    page_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    learnable_sink: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    score_mod: Optional[Callable] = None,
    score_mod_bwd: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None,
    aux_tensors: Optional[list] = None,
    aux_scalars: Optional[tuple] = None,
    return_lse: bool = False,
    scheduler_metadata: Optional[SchedulerMetadataTensorsTorch] = None,
    seqlen_k_per_split: Optional[int] = None,
    disable_scheduler_metadata: bool = False,
    gather_bwd_recompute_p: bool = False,
    gather_bwd_token_chunk: Optional[int] = None,
):
    """Variable-length attention: q (total_q, h, d) with cu_seqlens_q, k/v likewise; returns (out, lse)."""
    target = _sm120_target(q)
    if target is None:
        return upstream.flash_attn_varlen_func(**_locals_without_target(locals()))
    validation.validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    left, right = validation.normalize_window(window_size)
    validation.check_scalars(softmax_scale, softcap)
    requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    _check_common_features(
        qv=qv, gather_kv_indices=gather_kv_indices, learnable_sink=learnable_sink, num_splits=num_splits,
        block_sparse_tensors=block_sparse_tensors, page_table=page_table, scheduler_metadata=scheduler_metadata,
        requires_grad=requires_grad, deterministic=deterministic, score_mod=score_mod,
        score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, gather_bwd_recompute_p=gather_bwd_recompute_p,
        gather_bwd_token_chunk=gather_bwd_token_chunk,
    )
    index = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k)
    present = {n: t for n, t in index.items() if t is not None}
    fwd_kwargs = dict(
        softmax_scale=softmax_scale, causal=causal, window_size_left=left, window_size_right=right,
        softcap=softcap, pack_gqa=pack_gqa, emulate_host_smem=target[0], score_mod=score_mod,
        mask_mod=mask_mod, aux_tensors=aux_tensors, aux_scalars=aux_scalars, **index,
    )
    bwd_kwargs = dict(
        softmax_scale=softmax_scale, causal=causal, softcap=softcap, window_size_left=left,
        window_size_right=right, deterministic=deterministic, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, _tensors=tuple(present.values()), _tensor_names=tuple(present),
    )
    return _Sm120AttnFunc.apply(q, k, v, fwd_kwargs, bwd_kwargs, return_lse)


def _locals_without_target(scope: dict) -> dict:
    return {name: value for name, value in scope.items() if name != "target"}

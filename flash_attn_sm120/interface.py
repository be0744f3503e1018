"""Drop-in `flash_attn_func` / `flash_attn_varlen_func` with upstream FA4's exact parameters.

Dispatch, per call, on the device of `q`:
  * compute capability 12.x, or FLASH_ATTN_SM120_EMULATE=1 on SM80+: validate, then run this
    package's SM120 forward (driver.py, driver_splitkv.py); autograd's backward is this package's
    SM120 backward (driver_bwd.py), in emulation too;
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
from flash_attn.cute.cute_dsl_utils import maybe_contiguous
from flash_attn.cute.prepare_scheduler import SchedulerMetadataTensorsTorch

from flash_attn_sm120 import compile_ops, driver, driver_bwd, driver_splitkv, sinks, validation, validation_paged
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
    *, qv, gather_kv_indices, num_splits, block_sparse_tensors, page_table=None,
    scheduler_metadata=None, requires_grad=False, deterministic=False, score_mod=None,
    score_mod_bwd=None, mask_mod=None, gather_bwd_recompute_p=False, gather_bwd_token_chunk=None,
):
    # scheduler_metadata: upstream's SM120 path takes it as a scheduling hint only (no result changes);
    # these kernels schedule without it: checked as upstream checks it (validation.check_scheduler_metadata)
    # and not read
    if (qv is None and gather_kv_indices is None and block_sparse_tensors is None
            and not requires_grad and not gather_bwd_recompute_p and gather_bwd_token_chunk is None):
        return  # the common case, decided without building the feature tables below (per-call host time)
    # upstream's own check first: its gather_bwd options without gather_kv_indices are a ValueError
    upstream._validate_gather_bwd_kwargs(gather_kv_indices, gather_bwd_recompute_p, gather_bwd_token_chunk)
    validation.reject_unsupported(
        qv_MLA_absorbed_attention=qv is not None,
        gather_kv_indices_sparse_MLA=gather_kv_indices is not None,
        block_sparsity_with_paged_KV=block_sparse_tensors is not None and page_table is not None,
    )
    if requires_grad:
        validation.reject_unsupported(paged_KV_backward=page_table is not None)


def _run_forward(q, k, v, fwd_kwargs: dict, need_lse: bool):
    """(out, lse or None) from the right driver: paged, split (num_splits != 1) and decode-shaped
    calls go to driver_splitkv, the rest to driver."""
    route = {n: fwd_kwargs.pop(n, None) for n in ("page_table", "num_splits", "max_seqlen_q", "max_seqlen_k")}
    route["num_splits"] = 1 if route["num_splits"] is None else route["num_splits"]
    # block sparsity runs unsplit (the TMA family walks the lists; num_splits is a speed hint)
    sparse = fwd_kwargs.pop("block_sparse_tensors", None)
    if sparse is None and driver_splitkv.takes_this_path(q=q, page_table=route["page_table"], num_splits=route["num_splits"],
                                      cu_seqlens_q=fwd_kwargs.get("cu_seqlens_q"),
                                      max_seqlen_q=route["max_seqlen_q"]):
        return driver_splitkv.forward(q, k, v, need_lse=need_lse, **route, **fwd_kwargs)
    return driver.forward(q, k, v, need_lse=need_lse, block_sparse_tensors=sparse, **fwd_kwargs)


def _forward(q, k, v, fwd_kwargs: dict, bwd_kwargs: Optional[dict], return_lse: bool, requires_grad: bool,
             learnable_sink: Optional[torch.Tensor] = None, want_lse: Optional[bool] = None):
    """Through autograd when a backward may follow; otherwise straight to the driver (no graph to
    record: autograd.Function's per-call cost matters to small decode calls). want_lse: whether the
    LSE comes back (upstream: when asked, or when an input requires grad, grad mode or not)."""
    want_lse = return_lse if want_lse is None else want_lse
    if not requires_grad:
        if learnable_sink is not None:  # folded into the kernels' output tile (kernels/sink_fold.py)
            fwd_kwargs = dict(fwd_kwargs, learnable_sink=learnable_sink)
        return _run_forward(q, k, v, fwd_kwargs, need_lse=want_lse)
    return _Sm120AttnFunc.apply(q, k, v, learnable_sink, fwd_kwargs, bwd_kwargs, return_lse, requires_grad)


class _Sm120AttnFunc(torch.autograd.Function):
    """Forward and backward on this package's SM120 kernels (driver*.py, driver_bwd.py)."""

    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, fwd_kwargs: dict, bwd_kwargs: dict, return_lse: bool, needs_grad: bool):
        # needs_grad comes from the caller: grad mode is always off inside Function.forward, and the
        # backward needs the LSE even when the caller did not ask for it
        # with a sink the kernels return (O', LSE'), what the backward differentiates (sinks.py)
        if learnable_sink is not None:
            fwd_kwargs = dict(fwd_kwargs, learnable_sink=learnable_sink.detach())
        out, lse = _run_forward(q, k, v, fwd_kwargs, need_lse=return_lse or needs_grad)
        ctx.save_for_backward(q, k, v, out, lse, learnable_sink, *bwd_kwargs.pop("_tensors"))
        ctx.bwd_kwargs = bwd_kwargs
        ctx.return_lse = return_lse
        # the LSE stays differentiable when the caller did not ask for it, as upstream's does (its gradient
        # is dropped in backward); marking it would make lse.sum().backward() an error here only
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, learnable_sink, *index = ctx.saved_tensors
        kw = dict(ctx.bwd_kwargs)
        kw = _restore_saved(kw, kw.pop("_tensor_names"), index)
        if dout is None:
            dout = torch.zeros_like(out)
        dlse = dlse if ctx.return_lse else None
        dq = dk = dv = None
        if any(ctx.needs_input_grad[:3]):  # (a sink alone needs no dQ/dK/dV)
            dq, dk, dv = driver_bwd.backward(q, k, v, out, dout, lse, dlse=dlse, **kw)
        dsink = None
        if learnable_sink is not None and ctx.needs_input_grad[3]:
            rows = sinks.valid_rows(lse, kw.get("cu_seqlens_q"), kw.get("seqused_q"))
            dsink = sinks.sink_grad(out, dout, lse, dlse, learnable_sink, rows)
        return dq, dk, dv, dsink, None, None, None, None


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
    """Attention over (batch, seqlen, nheads, headdim) tensors; returns (out, lse).

    num_splits (SplitKV, upstream's meaning): 1 = off, n > 1 = n splits of the key sequence merged
    by a combine kernel, 0 or less = chosen from the grid and the GPU (splitkv.choose_num_splits).
    An n larger than useful is clamped silently to the number of key blocks of the chosen tile
    (more would only add empty splits) and to splitkv.MAX_SPLITS (128).
    """
    if torch.compiler.is_compiling():  # a torch.compile trace: custom ops (compile_ops.py); no locals() in Dynamo
        args = dict(
            q=q, k=k, v=v, qv=qv, gather_kv_indices=gather_kv_indices, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, learnable_sink=learnable_sink, softcap=softcap, num_splits=num_splits,
            pack_gqa=pack_gqa, deterministic=deterministic, score_mod=score_mod, score_mod_bwd=score_mod_bwd,
            mask_mod=mask_mod, aux_tensors=aux_tensors, aux_scalars=aux_scalars,
            block_sparse_tensors=block_sparse_tensors, block_sparse_tensors_bwd=block_sparse_tensors_bwd,
            return_lse=return_lse, gather_bwd_recompute_p=gather_bwd_recompute_p,
            gather_bwd_token_chunk=gather_bwd_token_chunk,
        )
        return compile_ops.traced_call(args, varlen=False)
    target = _sm120_target(q)
    if target is None:
        return upstream.flash_attn_func(**_locals_without_target(locals()))
    q, k, v, learnable_sink = _canonical(q, k, v, learnable_sink)
    validation.validate_dense_memo(q, k, v)
    left, right = validation.normalize_window(window_size)
    softcap = validation.check_scalars(softmax_scale, softcap)
    validation.check_flags(causal=causal, pack_gqa=pack_gqa, return_lse=return_lse, deterministic=deterministic)
    causal, return_lse, deterministic = bool(causal), bool(return_lse), bool(deterministic)
    num_splits = validation.check_num_splits(num_splits)
    if learnable_sink is not None:
        sinks.check_sink(learnable_sink, q.shape[-2], q.device)
    aux_scalars = validation.normalize_aux_scalars(aux_scalars)
    want_lse, requires_grad, bwd_needed = validation.grad_plan(q, k, v, learnable_sink, return_lse)
    _check_common_features(
        qv=qv, gather_kv_indices=gather_kv_indices, num_splits=num_splits,
        block_sparse_tensors=block_sparse_tensors, requires_grad=bwd_needed,
        deterministic=deterministic, score_mod=score_mod, score_mod_bwd=score_mod_bwd, mask_mod=mask_mod,
        gather_bwd_recompute_p=gather_bwd_recompute_p, gather_bwd_token_chunk=gather_bwd_token_chunk,
    )
    fwd_kwargs = dict(
        softmax_scale=softmax_scale, causal=causal, window_size_left=left, window_size_right=right,
        softcap=softcap, pack_gqa=pack_gqa, emulate_host_smem=target[0], score_mod=score_mod,
        mask_mod=mask_mod, aux_tensors=aux_tensors, aux_scalars=aux_scalars, num_splits=num_splits,
        block_sparse_tensors=block_sparse_tensors,
    )
    bwd_kwargs = _bwd_kwargs(
        dict(softmax_scale=softmax_scale, causal=causal, softcap=softcap, window_size_left=left,
             window_size_right=right, emulate_host_smem=target[0], deterministic=deterministic,
             block_sparse_tensors=block_sparse_tensors_bwd),
        {}, score_mod, score_mod_bwd, mask_mod, aux_tensors, aux_scalars,
    ) if requires_grad else None  # only the autograd Function reads them
    return _forward(q, k, v, fwd_kwargs, bwd_kwargs, return_lse, requires_grad, learnable_sink, want_lse)


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
    *,
    block_sparse_tensors_bwd: Optional[BlockSparseTensorsTorch] = None,
):
    """Variable-length attention: q (total_q, h, d) with cu_seqlens_q, k/v likewise; returns (out, lse).

    page_table (paged KV, upstream's layout): int32 (batch, max_pages_per_seq); k, v are page pools
    (num_pages, page_size, nheads_kv, d); page_size a multiple of 16 in [16, 512] and head dims
    multiples of 16. Sequence b has seqused_k[b] keys (or max_pages_per_seq * page_size without
    seqused_k). Not with cu_seqlens_k. A host max_seqlen_k longer than a page-table row holds is
    refused; seqused_k values and page indices are device data and are not checked (no sync).
    num_splits: as in flash_attn_func (1 off, n clamped to the useful maximum, <= 0 automatic).
    block_sparse_tensors_bwd (keyword only; upstream's varlen function has no such parameter, and without it
    the backward is dense with the mask_mod everywhere, as upstream's): the backward's Q-direction lists, per
    sequence or in the packed varlen form (block_sparse_bwd.py).
    """
    if torch.compiler.is_compiling():
        args = dict(
            q=q, k=k, v=v, qv=qv, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, min_seqlen_k=min_seqlen_k, seqused_q=seqused_q, seqused_k=seqused_k,
            gather_kv_indices=gather_kv_indices, page_table=page_table, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, learnable_sink=learnable_sink, softcap=softcap, num_splits=num_splits,
            pack_gqa=pack_gqa, deterministic=deterministic, score_mod=score_mod, score_mod_bwd=score_mod_bwd,
            mask_mod=mask_mod, block_sparse_tensors=block_sparse_tensors, aux_tensors=aux_tensors,
            aux_scalars=aux_scalars, return_lse=return_lse, scheduler_metadata=scheduler_metadata,
            seqlen_k_per_split=seqlen_k_per_split, disable_scheduler_metadata=disable_scheduler_metadata,
            gather_bwd_recompute_p=gather_bwd_recompute_p, gather_bwd_token_chunk=gather_bwd_token_chunk,
            block_sparse_tensors_bwd=block_sparse_tensors_bwd,
        )
        return compile_ops.traced_call(args, varlen=True)
    target = _sm120_target(q)
    if target is None:
        return upstream.flash_attn_varlen_func(
            **validation.upstream_kwargs("flash_attn_varlen_func", _locals_without_target(locals())))
    q, k, v, learnable_sink = _canonical(q, k, v, learnable_sink)
    if isinstance(page_table, torch.Tensor):
        page_table = maybe_contiguous(page_table, align_bytes=4)
    if page_table is None:
        validation.validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    else:
        validation_paged.validate_paged(
            q, k, v, page_table, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
            seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        )
    left, right = validation.normalize_window(window_size)
    softcap = validation.check_scalars(softmax_scale, softcap)
    validation.check_flags(causal=causal, pack_gqa=pack_gqa, return_lse=return_lse, deterministic=deterministic)
    causal, return_lse, deterministic = bool(causal), bool(return_lse), bool(deterministic)
    num_splits = validation.check_num_splits(num_splits)
    validation.check_scheduler_metadata(
        scheduler_metadata, cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None else q.shape[0],
        disable_scheduler_metadata)
    if learnable_sink is not None:
        sinks.check_sink(learnable_sink, q.shape[-2], q.device)
    aux_scalars = validation.normalize_aux_scalars(aux_scalars)
    want_lse, requires_grad, bwd_needed = validation.grad_plan(q, k, v, learnable_sink, return_lse)
    _check_common_features(
        qv=qv, gather_kv_indices=gather_kv_indices, num_splits=num_splits,
        block_sparse_tensors=block_sparse_tensors, page_table=page_table,
        requires_grad=bwd_needed, deterministic=deterministic, score_mod=score_mod,
        score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, gather_bwd_recompute_p=gather_bwd_recompute_p,
        gather_bwd_token_chunk=gather_bwd_token_chunk,
    )
    index = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k)
    present = {n: t for n, t in index.items() if t is not None}
    fwd_kwargs = dict(
        softmax_scale=softmax_scale, causal=causal, window_size_left=left, window_size_right=right,
        softcap=softcap, pack_gqa=pack_gqa, emulate_host_smem=target[0], score_mod=score_mod,
        mask_mod=mask_mod, aux_tensors=aux_tensors, aux_scalars=aux_scalars, page_table=page_table,
        num_splits=num_splits, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        block_sparse_tensors=block_sparse_tensors, **index,
    )
    bwd_kwargs = _bwd_kwargs(
        dict(softmax_scale=softmax_scale, causal=causal, softcap=softcap, window_size_left=left,
             window_size_right=right, emulate_host_smem=target[0], deterministic=deterministic,
             max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, block_sparse_tensors=block_sparse_tensors_bwd),
        present, score_mod, score_mod_bwd, mask_mod, aux_tensors, aux_scalars,
    ) if requires_grad else None  # only the autograd Function reads them
    return _forward(q, k, v, fwd_kwargs, bwd_kwargs, return_lse, requires_grad, learnable_sink, want_lse)


_AUX = "aux_tensors#"  # saved-tensor names of the aux tensors, in order


def _bwd_kwargs(scalars: dict, index: dict, score_mod, score_mod_bwd, mask_mod, aux_tensors, aux_scalars) -> dict:
    """driver_bwd.backward's keywords as the autograd Function keeps them: tensors (varlen index, aux)
    go through save_for_backward (`_tensors`, named by `_tensor_names`), the rest as they are."""
    tensors = dict(index)
    tensors.update({f"{_AUX}{i}": t for i, t in enumerate(aux_tensors or ())})
    mods = dict(score_mod=score_mod, score_mod_bwd=score_mod_bwd, mask_mod=mask_mod,
                aux_scalars=tuple(aux_scalars) if aux_scalars else None)
    return dict(scalars, **mods, _tensors=tuple(tensors.values()), _tensor_names=tuple(tensors))


def _restore_saved(kw: dict, names, tensors) -> dict:
    """The inverse of _bwd_kwargs' split: index tensors by name, aux tensors back into one list."""
    aux = []
    for name, t in zip(names, tensors):
        if name.startswith(_AUX):
            aux.append(t)
        else:
            kw[name] = t
    kw["aux_tensors"] = aux or None
    return kw


def _canonical(q, k, v, learnable_sink) -> tuple:
    """Upstream's canonical layouts (its maybe_contiguous, as its interface applies them): q/k/v copied when
    their rows are not 16-byte aligned or their last dim is strided, the sink when not 4-byte aligned.
    Through autograd like any copy; non-tensors pass through to validation's TypeError."""
    q, k, v = (_aligned_rows(maybe_contiguous(t)) if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    if isinstance(learnable_sink, torch.Tensor):
        learnable_sink = maybe_contiguous(learnable_sink, align_bytes=4)
    return q, k, v, learnable_sink


def _aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy where a stride is not a multiple of 16 bytes: maybe_contiguous keeps a tensor
    torch calls contiguous, whose size-1 dims may carry any stride, and the validation checks every stride."""
    step = max(1, 16 // t.element_size())
    if all(s % step == 0 for s in t.stride()[:-1]):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _locals_without_target(scope: dict) -> dict:
    return {name: value for name, value in scope.items() if name != "target"}

"""The SM120 backward driver: config choice, buffers, compile cache and the three launches.

A thin replacement for the SM120 branch of upstream's `_flash_attn_bwd`, which hard-codes 4 warps,
64x64 tiles and no tuning. One backward is three kernels:

  1. upstream's preprocess (imported): dPsum = rowsum(dO * O) (minus dLSE when the LSE had a
     gradient), LSE in log2 units (an empty row's -inf becomes 0, so its P is 0), dQ accumulator zeroed;
  2. the main kernel (kernels/bwd_sm120.py, a BwdConfig from flash_attn_sm120/configs/sm120_bwd.toml): one CTA per
     n_block of K/V walks the m_blocks of Q/dO that can see it, writes dK/dV (MHA) or adds them into
     fp32 accumulators (GQA: several query heads share one KV head), and adds dQ into its fp32
     accumulator with atomics;
  3. upstream's postprocess (imported): the fp32 accumulators to the output dtype, dQ and dK scaled
     by the softmax scale. It reads the accumulators in the main kernel's thread layout, so it gets
     the main kernel's warps, atom layout and swapAB flag. With the launch plan's dq_wide_adds the dQ
     accumulator has the wide adds' layout, and this package's subclass of it reads dQ
     (kernels/bwd_postprocess.py).

The main kernel is cached per compile key and, in SM120 emulation, padded and occupancy-checked
like every forward kernel (driver.compile_verified). The pre/postprocess kernels are upstream's,
memory-bound and unpadded: they are listed as unchecked (occupancy.note_unchecked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

import cutlass
import cutlass.cute as cute
from flash_attn.cute import utils as fa_utils
from flash_attn.cute.cache_utils import JITCache
from flash_attn.cute.cute_dsl_utils import get_aux_tensor_metadata, get_broadcast_dims, to_cute_aux_tensor, to_cute_tensor
from flash_attn.cute.interface import (
    _bwd_postprocess_convert,
    _bwd_preprocess,
    _resolve_causal_local_window,
    maybe_contiguous,
)
from flash_attn.cute.utils import AuxData

from flash_attn_sm120 import block_sparse, block_sparse_bwd, driver, occupancy
from flash_attn_sm120.bwd_plans import (  # noqa: F401  (re-exported: the driver's plans, by their old names)
    _LAUNCH_FLAGS,
    _ORDERING_FLAGS,
    _OWN_STEP_FLAGS,
    FIXED_POINT_PLAN,
    SPARSE_DETERMINISTIC_PLAN,
    deterministic_plan,
    fixed_point_allowed,
    force_deterministic_plan,
    force_launch_plan,
    launch_plan,
    plan_forced,
    rotated_entry_fits,
)
from flash_attn_sm120.config_bwd import (
    entry_kinds,
    load_bwd_table,
    rotated_turns_config,
    select_bwd_config,
)
from flash_attn_sm120.device import device_info
from flash_attn_sm120.driver import compile_verified, quiet_compile
from flash_attn_sm120.kernels.bwd_block_sparse import FlashAttentionBackwardSm120BlockSparse
from flash_attn_sm120.kernels import bwd_fixed_point, bwd_fixed_point_scales
from flash_attn_sm120.kernels.bwd_fixed_point_post import postprocess_dq_fixed
from flash_attn_sm120.kernels.bwd_deterministic import dq_groups
from flash_attn_sm120.kernels.bwd_mods import FlashAttentionBackwardSm120Mods
from flash_attn_sm120.kernels.bwd_postprocess import postprocess_dq_wide
from flash_attn_sm120.kernels.bwd_sm120 import FlashAttentionBackwardSm120Tuned
from flash_attn_sm120.kernels.bwd_tiling import BwdConfig, bwd_config_error, preprocess_multiple
from flash_attn_sm120.kernels.fwd_cpasync import _round_up
from flash_attn_sm120.kernels.ordered_scheduler import with_tile_order

_TORCH_TO_CUTE = {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}
HDIM_MULTIPLE = 32  # accumulator head-dim padding of upstream's SM80/SM120 backward (no SM90 swap)
POSTPROCESS_ARCH = 120  # upstream's pre/postprocess read the accumulators in SM80/SM120 MMA layout
UNCHECKED = "bwd pre/postprocess (upstream, unpadded); fixed-point dQ scales and postprocess (unpadded)"


@dataclass(frozen=True)
class BwdStatics:
    """Everything a compiled backward main kernel is specialized on (the compile key)."""

    dtype: str
    head_dim: int
    head_dim_v: int
    qhead_per_kvhead: int
    causal: bool
    local: bool
    has_window_left: bool
    has_window_right: bool
    softcap: float
    has_cu_seqlens_q: bool
    has_cu_seqlens_k: bool
    has_seqused_q: bool
    has_seqused_k: bool
    single_q_block: bool  # one m_block / n_block: upstream keys on these (TVM stride specialization)
    single_k_block: bool
    broadcast: tuple
    config: BwdConfig
    emulate_host_smem: Optional[object]  # hardware.EmulationHost in emulation
    deterministic: bool = False
    dq_descending: bool = False  # deterministic dQ turn order (kernels/bwd_deterministic.py)
    dq_rotated: bool = False  # the other deterministic ordering flags (deterministic_plan, _ORDERING_FLAGS)
    reverse_n_blocks: bool = False
    fetch_early: bool = False
    barrier_release: bool = False
    release_deferred: bool = False
    fetch_relaxed: bool = False
    warp_turns: bool = False
    late_dq_adds: bool = False
    diag_no_wait: bool = False  # benchmark diagnostics, not deterministic (kernels/bwd_sm120.py)
    diag_no_sync: bool = False
    dq_split: bool = False  # bwd_deterministic.dq_groups(True) dQ accumulators, summed before the postprocess (dense only)
    fused_turns: bool = False
    fused_fetch: bool = False
    dq_fixed_point: bool = False  # deterministic dQ in 64-bit fixed point (kernels/bwd_fixed_point.py)
    lpt: bool = False  # launch_plan: causal CTAs longest first
    mask_where_needed: bool = False  # launch_plan: mask only the tiles with a masked element
    dq_wide_adds: bool = False  # launch_plan: 16-byte dQ adds, the accumulator read by kernels/bwd_postprocess.py
    own_step: bool = False  # launch_plan: this package's step without modifiers (a diagnostic)
    # user modifiers (kernels/bwd_mods.py), by hash; the aux tensors' and scalars' compile-time facts
    score_mod_hash: object = False
    score_mod_bwd_hash: object = False
    mask_mod_hash: object = False
    aux_metadata: object = None
    aux_scalar_kinds: Optional[tuple] = None
    # block sparsity (kernels/bwd_block_sparse.py): (q_subtile, kv_subtile, has full lists, stride-0 dims,
    # varlen: per-sequence lists whose rows may end early)
    block_sparse: Optional[tuple] = None
    # block sparsity: K/V tiles launched longest first, in an order the host computes (block_sparse.tile_order)
    ordered_tiles: bool = False

    @property
    def has_mods(self) -> bool:
        return bool(self.score_mod_hash or self.score_mod_bwd_hash or self.mask_mod_hash)

    @property
    def describe(self) -> str:
        flags = [f for f, on in (("causal", self.causal), ("local", self.local), ("softcap", self.softcap),
                                  ("varlen", self.has_cu_seqlens_q or self.has_cu_seqlens_k),
                                  ("deterministic", self.deterministic), ("score_mod", self.score_mod_hash),
                                  ("mask_mod", self.mask_mod_hash), ("block_sparse", self.block_sparse)) if on]
        return (f"{self.config.name} d={self.head_dim}/{self.head_dim_v} {self.dtype} "
                f"qhead_per_kvhead={self.qhead_per_kvhead}{' ' + ','.join(flags) if flags else ''}")


_compile_cache = JITCache()
_verified_keys: set = set()
_forced_config: list[BwdConfig] = []
compile_count = {"bwd": 0}


class force_config(driver.force_config):
    """Context manager: every backward inside uses `config` (tests, the search, the research loop)."""

    _stack = _forced_config


def clear_cache() -> None:
    global _compile_cache
    _compile_cache = JITCache()
    _verified_keys.clear()


def choose_config(head_dim: int, head_dim_v: int, causal: bool, local: bool, config: Optional[BwdConfig],
                  modifiers: bool = False, plain_mha: bool = False, plain: bool = False,
                  turns: bool = False) -> BwdConfig:
    """The given or forced config (refused with the reason if SM120 cannot run it), else the table's
    (its modifier entries for a call with user modifiers: `Mods.user`; its plain-MHA and plain entries
    for a plain MHA / plain call; its turns entries for a deterministic call whose dQ takes turns:
    config_bwd)."""
    if config is None and _forced_config:
        config = _forced_config[-1]
    if config is None:
        return select_bwd_config(load_bwd_table(), head_dim, head_dim_v, causal, local, modifiers, plain_mha, plain,
                                 turns)
    err = bwd_config_error(head_dim, head_dim_v, config)
    if err is not None:
        raise ValueError(f"SM120 backward config {config.name} not implementable: {err}")
    return config


@dataclass(frozen=True)
class Mods:
    """A call's FlexAttention-style modifiers (upstream's meanings); softcap is folded into score_mod."""

    score_mod: Optional[object] = None
    score_mod_bwd: Optional[object] = None
    mask_mod: Optional[object] = None
    aux_tensors: Optional[tuple] = None
    aux_scalars: Optional[tuple] = None
    from_softcap: bool = False  # score_mod / score_mod_bwd are upstream's softcap pair (index-free)

    @property
    def user(self) -> bool:
        """Whether they need the modifier step (kernels/bwd_mods.py): a user's callable or aux data;
        softcap alone runs upstream's step, which applies it."""
        user_score = not self.from_softcap and (self.score_mod is not None or self.score_mod_bwd is not None)
        return user_score or self.mask_mod is not None or self.aux_tensors is not None


def resolve_mods(softcap: float, score_mod, score_mod_bwd, mask_mod, aux_tensors, aux_scalars) -> Mods:
    """Upstream's rules: softcap excludes score_mod/score_mod_bwd and becomes its own pair; a score_mod
    needs its score_mod_bwd (the backward cannot differentiate a CuTe callable)."""
    if softcap:
        if score_mod is not None or score_mod_bwd is not None:
            raise ValueError("softcap and score_mod/score_mod_bwd cannot be used together")
        score_mod = fa_utils.create_softcap_scoremod(softcap)
        score_mod_bwd = fa_utils.create_softcap_scoremod_bwd(softcap)
    elif score_mod is not None and score_mod_bwd is None:
        raise ValueError("score_mod_bwd is required for the backward of a call with a score_mod (upstream's rule): "
                         "pass score_mod_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors) "
                         "returning d(loss)/d(score) from d(loss)/d(score_mod(score))")
    aux_tensors = tuple(aux_tensors) if aux_tensors else None
    return Mods(score_mod, score_mod_bwd, mask_mod, aux_tensors, tuple(aux_scalars) if aux_scalars else None,
                from_softcap=bool(softcap))


def make_kernel(statics: BwdStatics, host, mods: Optional[Mods] = None) -> FlashAttentionBackwardSm120Tuned:
    """The main kernel of `statics`: upstream's step (softcap included) or, with user modifiers or aux
    data, the modifier step that sees each element's indices (kernels/bwd_mods.py)."""
    if mods is None:
        mods = resolve_mods(statics.softcap, None, None, None, None, None)
    return kernel_for(_TORCH_TO_CUTE[getattr(torch, statics.dtype)], statics.head_dim, statics.head_dim_v,
                      statics.qhead_per_kvhead, statics.config, mods, block_sparse_key=statics.block_sparse,
                      is_causal=statics.causal, is_local=statics.local,
                      emulate_host_smem=host, deterministic=statics.deterministic, **ordering_flags(statics),
                      **({"ordered_tiles": True} if statics.ordered_tiles else {}))


def ordering_flags(statics: BwdStatics) -> dict:
    """The deterministic ordering's and the launch plan's kernel keywords (kernels/bwd_sm120.py) of a
    compile key."""
    return {f: getattr(statics, f) for f in _ORDERING_FLAGS + _LAUNCH_FLAGS}


def kernel_for(dtype, head_dim: int, head_dim_v: int, qhead_per_kvhead: int, config: BwdConfig, mods: Mods,
               block_sparse_key: Optional[tuple] = None, **kwargs) -> FlashAttentionBackwardSm120Tuned:
    """The kernel object for these modifiers (the driver's and the codegen report's one choice); kwargs:
    the tuned class's keywords (is_causal, is_local, emulate_host_smem, deterministic, dq_descending).
    block_sparse_key: BwdStatics.block_sparse, for the block-sparse walk (kernels/bwd_block_sparse.py)."""
    args = (dtype, head_dim, head_dim_v, qhead_per_kvhead, config)
    kwargs.update(score_mod=mods.score_mod, score_mod_bwd=mods.score_mod_bwd)
    own_step = kwargs.pop("own_step", False)  # the launch plan's: only chooses this package's step (the walk's own)
    if block_sparse_key is not None:  # (q_subtile, kv_subtile, has full lists, stride-0 dims, varlen rows)
        q_sub, kv_sub, has_full, _pattern, rows_end = block_sparse_key
        return FlashAttentionBackwardSm120BlockSparse(
            *args, mask_mod=mods.mask_mod, has_aux_tensors=mods.aux_tensors is not None, q_subtile_factor=q_sub,
            kv_subtile_factor=kv_sub, has_full=has_full, rows_end=rows_end, **kwargs)
    # options of the modifier step (this package's own step), P/dS and V in registers among them
    if mods.user or config.pds_in_regs or config.v_in_regs or own_step or any(kwargs.get(f) for f in _OWN_STEP_FLAGS):
        return FlashAttentionBackwardSm120Mods(*args, mask_mod=mods.mask_mod,
                                               has_aux_tensors=mods.aux_tensors is not None, **kwargs)
    return FlashAttentionBackwardSm120Tuned(*args, **kwargs)


def compile_kernel(kernel, q, k, v, do, lse_log2, dpsum, dq_accum, dk, dv, cu_q, cu_k, used_q, used_k,
                   window_left, window_right, dq_sem=None, dkv_sem=None, dq_scale=None, options: str = "",
                   aux: AuxData = AuxData(None, None), blocksparse=None):
    """cute.compile with upstream's SM80/SM120 backward call convention (cute tensors or fakes).
    dq_sem / dkv_sem: the deterministic ordering's semaphores (upstream's dQ and dK slots); with
    dq_fixed_point the int64 dQ accumulator and, in dV's slot, dq_scale (kernels/bwd_fixed_point.py);
    aux: the modifiers' aux tensors (cute tensors) and scalars."""
    return quiet_compile(
        kernel, q, k, v, do, lse_log2, dpsum, dq_accum, dk, dv, 1.0, cu_q, cu_k, used_q, used_k,
        window_left, window_right,
        dq_sem, dkv_sem, dq_scale,  # dQ / dK / dV semaphore slots (deterministic; dK's serves dV too)
        aux, blocksparse,  # aux data, block sparsity (kernels/bwd_block_sparse.py)
        None,  # varlen tile-count hint
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        options=("--enable-tvm-ffi " + options).strip(),
    )


def fixed_point_for(mods: Mods, deterministic: bool) -> bool:
    """Whether a deterministic call's bound allows fixed-point dQ: no user score function. A score_mod_bwd
    alone counts (it can return any dS, which no bound covers); softcap's pair is covered."""
    user_score = not mods.from_softcap and (mods.score_mod is not None or mods.score_mod_bwd is not None)
    return deterministic and fixed_point_allowed(user_score)


def _host_bound(max_seqlen, total: int) -> int:
    return total if max_seqlen is None or isinstance(max_seqlen, torch.Tensor) else min(int(max_seqlen), total)


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    *,
    softmax_scale: Optional[float],
    causal: bool,
    window_size_left: Optional[int],
    window_size_right: Optional[int],
    softcap: Optional[float] = 0.0,
    emulate_host_smem=None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    dlse: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    config: Optional[BwdConfig] = None,
    dq: Optional[torch.Tensor] = None,
    dk: Optional[torch.Tensor] = None,
    dv: Optional[torch.Tensor] = None,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    aux_tensors: Optional[list] = None,
    aux_scalars: Optional[tuple] = None,
    block_sparse_tensors=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of validated forward inputs on this package's SM120 backward.

    Shapes as upstream: q (b, sq, h, d) or varlen (total_q, h, d) with cu_seqlens_q; lse (b, h, sq) or
    (h, total_q); dlse like lse (the LSE's own gradient, or None). dq/dk/dv: buffers to write (shaped
    like q/k/v, last dim contiguous), else new ones. score_mod / score_mod_bwd / mask_mod / aux_tensors /
    aux_scalars: the forward's modifiers, upstream's meanings (kernels/bwd_mods.py). block_sparse_tensors:
    upstream's Q-direction lists (`block_sparse_tensors_bwd`; kernels/bwd_block_sparse.py).
    """
    mods = resolve_mods(float(softcap or 0.0), score_mod, score_mod_bwd, mask_mod, aux_tensors, aux_scalars)
    causal, local, window_size_left, window_size_right = _resolve_causal_local_window(
        causal, window_size_left, window_size_right, mask_mod
    )
    # deterministic dQ: in 64-bit fixed point where its bound holds and turns serve badly (a window; the
    # block-sparse walk, whose list turns wait), else in turns (bwd_plans.deterministic_plan)
    fixed_point = fixed_point_for(mods, bool(deterministic))
    sparse_fixed = fixed_point and block_sparse_tensors is not None
    q, k, v, out, dout, lse, dlse = (maybe_contiguous(t) for t in (q, k, v, out, dout, lse, dlse))
    dq, dk, dv = (torch.empty_like(x) if g is None else _checked_grad(name, g, x)
                  for name, g, x in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)))
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    num_heads, head_dim = q.shape[-2:]
    num_heads_kv, head_dim_v = v.shape[-2:]
    qhead_per_kvhead = num_heads // num_heads_kv
    softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    varlen_q, varlen_k = cu_seqlens_q is not None, cu_seqlens_k is not None
    seqused = seqused_q is not None or seqused_k is not None
    # host bounds (a tensor max_seqlen, as upstream allows, bounds nothing on the host: the total is used)
    seqlen_q = _host_bound(max_seqlen_q, q.shape[0]) if varlen_q else q.shape[1]
    seqlen_k = _host_bound(max_seqlen_k, k.shape[0]) if varlen_k else k.shape[1]
    # a dense call without a mask takes the rotated turns where its key's turns entry runs them
    rotated = (rotated_turns_config(load_bwd_table(), head_dim, head_dim_v) if deterministic and config is None
               and not _forced_config and not (causal or local or varlen_q or varlen_k or seqused) else None)
    rotated_entry = rotated is not None and rotated_entry_fits(rotated, seqlen_q, seqlen_k,
                                                               device_info(q.device).num_sms)
    # the table's modifier, plain, plain-MHA and turns entries where they serve (config_bwd.entry_kinds)
    kinds = entry_kinds(deterministic=bool(deterministic), causal=causal, local=local,
                        qhead_per_kvhead=qhead_per_kvhead, packed=varlen_q or varlen_k, seqused=seqused,
                        block_sparse=block_sparse_tensors is not None, score_mod=mods.score_mod is not None,
                        user_mods=mods.user, fixed_point=fixed_point, plan_forced=plan_forced(),
                        rotated_entry=rotated_entry)
    cfg = choose_config(head_dim, head_dim_v, causal, local, config, **kinds)
    batch = cu_seqlens_q.shape[0] - 1 if varlen_q else q.shape[0]
    sparse = None  # upstream's normalized lists and their compile key
    if block_sparse_tensors is not None:
        varlen = varlen_q or varlen_k or seqused_q is not None or seqused_k is not None
        cfg, sparse = block_sparse_bwd.plan(block_sparse_tensors, q, k, cfg, head_dim_v=head_dim_v, causal=causal,
                                         local=local, deterministic=deterministic and not sparse_fixed, varlen=varlen,
                                         batch=batch, bounds=(seqlen_q, seqlen_k), q_varlen=varlen_q or seqused_q is not None,
                                         config_given=config is not None or bool(_forced_config),
                                         preferred=block_sparse_bwd.sparse_preferred_config(
                                             head_dim, head_dim_v, causal, local,
                                             mods.score_mod is not None or mods.aux_tensors is not None,
                                             bool(deterministic), varlen))
    statics = BwdStatics(
        dtype=str(q.dtype).replace("torch.", ""), head_dim=head_dim, head_dim_v=head_dim_v,
        qhead_per_kvhead=qhead_per_kvhead, causal=causal, local=local,
        has_window_left=window_size_left is not None, has_window_right=window_size_right is not None,
        softcap=float(softcap or 0.0), has_cu_seqlens_q=varlen_q, has_cu_seqlens_k=varlen_k,
        has_seqused_q=seqused_q is not None, has_seqused_k=seqused_k is not None,
        single_q_block=_round_up(seqlen_q, cfg.m_block) == cfg.m_block,
        single_k_block=_round_up(seqlen_k, cfg.n_block) == cfg.n_block,
        broadcast=tuple(get_broadcast_dims(t) for t in (q, k, v, dout)), config=cfg,
        emulate_host_smem=emulate_host_smem, deterministic=bool(deterministic),
        **(deterministic_plan(device_info(q.device).num_sms, cfg, causal, seqlen_q, seqlen_k, index_tensors=(
            cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), fixed_point=fixed_point, local=local,
            rotated_entry=kinds["turns"] and rotated_entry) if deterministic else {}),
        **launch_plan(causal, local, bool(deterministic), dense_k=not varlen_k),
        score_mod_hash=_hash(score_mod), score_mod_bwd_hash=_hash(score_mod_bwd), mask_mod_hash=_hash(mask_mod),
        aux_metadata=get_aux_tensor_metadata(list(mods.aux_tensors)) if mods.aux_tensors else None,
        aux_scalar_kinds=tuple(type(s) for s in mods.aux_scalars) if mods.aux_scalars else None,
        block_sparse=None if sparse is None else sparse[1],
    )
    turn_lists = deterministic and sparse is not None and not sparse_fixed
    if deterministic and sparse is not None:  # the list walk: fixed point, or turns from its lists (dq_turns)
        statics = replace(statics, **(FIXED_POINT_PLAN if sparse_fixed else SPARSE_DETERMINISTIC_PLAN))
    order = None  # the list walk's launch order, longest first (the walk with list turns keeps the grid's;
    # a varlen call keeps upstream's grid, whose tile order the ordered scheduler does not know)
    if sparse is not None and not turn_lists and not sparse[1][4]:
        statics = replace(statics, ordered_tiles=True)
        order = block_sparse.tile_order(sparse[0], batch=batch, grid_heads=num_heads,
                                        num_block=-(-seqlen_k // cfg.n_block),
                                        tiles_per_sparse_row=sparse[0].kv_subtile_factor)
    buffers = _allocate(q, k, statics, batch, seqlen_q, seqlen_k, varlen_q, varlen_k)
    dq_accum, dpsum, lse_log2, dk_accum, dv_accum = buffers
    dq_accum_fixed = None
    if statics.dq_fixed_point:  # the int64 accumulator, and the fp32 view of it that the kernel partitions
        dq_accum_fixed, dq_accum = bwd_fixed_point.fixed_accumulator(tuple(dq_accum.shape), q.device)
    cute_dtype = _TORCH_TO_CUTE[q.dtype]
    occupancy.note_unchecked(UNCHECKED)
    # the preprocess's pass must not cover more rows than the tile (preprocess_multiple); with a wider
    # multiple its dQ accumulator layout differs, so the accumulator is zeroed here instead of there
    multiple = preprocess_multiple(head_dim_v, cfg.m_block)
    zeroed = statics.dq_split or statics.dq_fixed_point  # zeroed at allocation
    preprocess_zeroes = multiple == HDIM_MULTIPLE and not zeroed
    if multiple != HDIM_MULTIPLE and not zeroed:
        dq_accum.zero_()
    _bwd_preprocess(
        out, dout, dpsum, lse, lse_log2, dq_accum if preprocess_zeroes else None, cu_seqlens_q, seqused_q, dlse,
        cute_dtype, head_dim, head_dim_v, cfg.m_block, fake_mode=False, hdim_multiple_of=multiple,
    )
    gqa = qhead_per_kvhead > 1
    dk_target, dv_target = (dk_accum, dv_accum) if gqa else (dk, dv)
    tensors = (q.detach(), k.detach(), v.detach(), dout, lse_log2, dpsum, dq_accum, dk_target, dv_target)
    index = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    sems = _semaphores(q, k, statics, batch, seqlen_q, seqlen_k) if deterministic else (None, None, None)
    inverse_scale = None
    if statics.dq_fixed_point:  # the int64 accumulator in dQ's slot, the per-head scales in dV's
        # one launch; torch where it cannot (layouts, seqused) or where the LSE's gradient widens the bound
        fast = None if dlse is not None else bwd_fixed_point_scales.fixed_point_scales(q, k, v, out, dout, *index)
        scale, inverse_scale = fast or bwd_fixed_point.dq_scales(k, v, dout, *index, dlse=dlse, q=q, out=out)
        sems = (dq_accum_fixed, sems[1], scale)
    if statics not in _verified_keys:
        _compile_checked(statics, tensors, index, sems, window_size_left, window_size_right, q.device, mods,
                         None if sparse is None else sparse[0], order)
    aux = with_tile_order(AuxData(list(mods.aux_tensors) if mods.aux_tensors else None, mods.aux_scalars), order)
    _compile_cache[statics](*tensors, softmax_scale, *index, window_size_left, window_size_right,
                            *sems, aux, None if sparse is None else block_sparse.launch_tuple(sparse[0]), None)
    post = dict(fake_mode=False, hdim_multiple_of=HDIM_MULTIPLE)
    if statics.dq_split:  # the groups' accumulators, summed in group order (deterministic)
        groups = dq_accum.view(*dq_accum.shape[:-1], dq_groups(True), -1).unbind(-2)
        dq_accum = groups[0] + groups[1]  # a new contiguous tensor in upstream's layout
        for g in groups[2:]:
            dq_accum += g
    if statics.dq_fixed_point:  # int64 -> fp32 * 2^-k_h -> dQ in one pass (same bits as dequantize + upstream's)
        postprocess_dq_fixed(dq_accum_fixed, inverse_scale, dq, softmax_scale, cu_seqlens_q, seqused_q, cute_dtype,
                             head_dim, cfg.m_block, cfg.num_threads, cfg.atom_m_dq, cfg.dq_swapab,
                             hdim_multiple_of=HDIM_MULTIPLE)
    elif statics.dq_wide_adds:  # the accumulator in the wide adds' layout: this package's postprocess reads it
        postprocess_dq_wide(dq_accum, dq, softmax_scale, cu_seqlens_q, seqused_q, cute_dtype, head_dim, cfg.m_block,
                            cfg.num_threads, cfg.atom_m_dq, cfg.dq_swapab, hdim_multiple_of=HDIM_MULTIPLE)
    else:
        _bwd_postprocess_convert(dq_accum, dq, softmax_scale, cu_seqlens_q, seqused_q, POSTPROCESS_ARCH, cute_dtype,
                                 head_dim, cfg.m_block, cfg.num_threads, cfg.atom_m_dq, cfg.dq_swapab, **post)
    if gqa:
        for accum, grad, scale, d in ((dk_accum, dk, softmax_scale, head_dim), (dv_accum, dv, 1.0, head_dim_v)):
            _bwd_postprocess_convert(accum, grad, scale, cu_seqlens_k, seqused_k, POSTPROCESS_ARCH, cute_dtype, d,
                                     cfg.n_block, cfg.num_threads, cfg.atom_n_dkv, cfg.dkv_swapab, **post)
    return dq, dk, dv


def _hash(fn) -> object:
    return fa_utils.hash_callable(fn) if fn is not None else False


def _checked_grad(name: str, g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if g.shape != like.shape or g.dtype != like.dtype or g.device != like.device or g.stride(-1) != 1:
        raise ValueError(f"{name} must be a {like.dtype} tensor of shape {tuple(like.shape)}, last dim contiguous, on "
                         f"{like.device}, got {g.dtype} {tuple(g.shape)} on {g.device}")
    return g


def _allocate(q, k, statics: BwdStatics, batch: int, seqlen_q: int, seqlen_k: int, varlen_q: bool, varlen_k: bool):
    """(dq_accum, dpsum, lse_log2, dk_accum, dv_accum) in upstream's layouts for this config's tiles.

    Varlen rows are padded per sequence (one extra m_block / n_block each), as upstream's kernels
    index them. The dK/dV accumulators exist for GQA only, zeroed (the kernel adds into them).
    """
    cfg, dev, f32 = statics.config, q.device, torch.float32
    num_heads, num_heads_kv = q.shape[-2], k.shape[-2]
    hd, hdv = _round_up(statics.head_dim, HDIM_MULTIPLE), _round_up(statics.head_dim_v, HDIM_MULTIPLE)
    if varlen_q:
        rows_q = (q.shape[0] + (batch + 1) * cfg.m_block - 1) // cfg.m_block * cfg.m_block
        dq_accum = torch.empty(num_heads, rows_q * hd, dtype=f32, device=dev)
        dpsum = torch.empty(num_heads, rows_q, dtype=f32, device=dev)
    else:
        rows_q = _round_up(seqlen_q, cfg.m_block)
        if statics.dq_split:  # group g's tiles at [g * rows_q * hd, (g + 1) * rows_q * hd) of each row
            dq_accum = torch.zeros(batch, num_heads, dq_groups(True) * rows_q * hd, dtype=f32, device=dev)
        else:
            dq_accum = torch.empty(batch, num_heads, rows_q * hd, dtype=f32, device=dev)
        dpsum = torch.empty(batch, num_heads, rows_q, dtype=f32, device=dev)
    lse_log2 = torch.empty_like(dpsum)
    dk_accum = dv_accum = None
    if statics.qhead_per_kvhead > 1:
        if varlen_k:
            rows_k = (k.shape[0] + (batch + 1) * cfg.n_block - 1) // cfg.n_block * cfg.n_block
            shape_k, shape_v = (num_heads_kv, rows_k * hd), (num_heads_kv, rows_k * hdv)
        else:
            rows_k = _round_up(seqlen_k, cfg.n_block)
            shape_k, shape_v = (batch, num_heads_kv, rows_k * hd), (batch, num_heads_kv, rows_k * hdv)
        dk_accum = torch.zeros(shape_k, dtype=f32, device=dev)
        dv_accum = torch.zeros(shape_v, dtype=f32, device=dev)
    return dq_accum, dpsum, lse_log2, dk_accum, dv_accum


def _semaphores(q, k, statics: BwdStatics, batch: int, seqlen_q: int, seqlen_k: int):
    """Zeroed int32 turn counters for upstream's dQ / dK / dV semaphore slots: dQ per (batch, head,
    m_block), dK/dV per (batch, KV head, n_block) in dK's slot, nothing in dV's."""
    cfg = statics.config
    m_blocks, n_blocks = -(-seqlen_q // cfg.m_block), -(-seqlen_k // cfg.n_block)
    groups = dq_groups(statics.dq_split)  # dq_split: group g's counters at [g * M, (g + 1) * M)
    dq_sem = torch.zeros(batch, q.shape[-2], groups * max(m_blocks, 1), dtype=torch.int32, device=q.device)
    dkv_sem = None
    if statics.qhead_per_kvhead > 1:
        dkv_sem = torch.zeros(batch, k.shape[-2], max(n_blocks, 1), dtype=torch.int32, device=q.device)
    # (dq_fixed_point: dQ's slot becomes the int64 accumulator, dV's the scales, in backward())
    return None if statics.dq_fixed_point else dq_sem, dkv_sem, None


def _compile_checked(statics: BwdStatics, tensors, index, sems, window_left, window_right, device,
                     mods: Optional[Mods] = None, sparse=None, order=None) -> None:
    """Compile and occupancy-check the main kernel of `statics`, once per process."""
    cute_tensors = [to_cute_tensor(t) for t in tensors]
    cute_index = [to_cute_tensor(t, assumed_align=4) if t is not None else None for t in index]
    cute_sems = [to_cute_tensor(t, assumed_align=4) if t is not None else None for t in sems]
    aux = AuxData(None, None)
    if mods is not None and (mods.aux_tensors or mods.aux_scalars):
        aux = AuxData([to_cute_aux_tensor(t) for t in mods.aux_tensors] if mods.aux_tensors else None,
                      mods.aux_scalars)
    aux = with_tile_order(aux, None if order is None else to_cute_tensor(order, assumed_align=4, leading_dim=0))
    _compile_cache[statics] = compile_verified(
        lambda host: make_kernel(replace(statics, emulate_host_smem=host), host, mods),
        lambda kernel, options: compile_kernel(kernel, *cute_tensors, *cute_index, window_left, window_right,
                                               *cute_sems, options=options, aux=aux,
                                               blocksparse=None if sparse is None else block_sparse.cute_tensors(sparse)),
        statics.emulate_host_smem, device, statics.describe,
    )
    compile_count["bwd"] += 1
    _verified_keys.add(statics)

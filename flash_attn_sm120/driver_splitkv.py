"""The SM120 decode / long-context driver: SplitKV, paged KV and decode configs.

Per call (after the interface has validated the inputs):
  1. config: the decode table (decode.py) for decode-shaped problems (seqlen_q <= 16), else the
     prefill table (config.py); `driver.force_config` overrides both;
  2. splits: `splitkv.resolve_num_splits` with upstream's num_splits meaning, this GPU's SM count
     and the config's CTAs per SM from hardware.py's SM120 occupancy model;
  3. dense KV without splits goes to driver.forward (the cp.async family, unchanged); anything
     paged or split runs the splitkv kernel family (kernels/fwd_splitkv.py): with splits it
     writes fp32 partial O / LSE that upstream's `FlashAttentionForwardCombine` merges: the
     compiled combine kernel upstream's `_flash_attn_fwd_combine` would pick (same compile key,
     same cache), looked up once per CallPlan and then called directly, because the wrapper's
     per-call checks cost as much host time as the decode kernel's GPU time.
Compiled kernels are cached per (driver.FwdStatics, split, paged) key, like driver.py's.
"""

from __future__ import annotations

import math
from functools import lru_cache
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch

import cutlass.cute as cute
from flash_attn.cute.cache_utils import JITCache, JITPersistentCache
from flash_attn.cute.cute_dsl_utils import get_broadcast_dims, to_cute_aux_tensor, to_cute_tensor
from cutlass import Float32
from flash_attn.cute.interface import (
    _compile_fwd_combine,
    _flash_attn_fwd_combine,
    _resolve_causal_local_window,
    torch2cute_dtype_map,
)
from flash_attn.cute.utils import AuxData

from flash_attn_sm120 import driver, hardware, occupancy, splitkv
from flash_attn_sm120.config import (
    _FALLBACKS,
    FwdConfig,
    family_entries,
    load_fwd_table,
    select_fwd_config,
    upstream_fwd_config,
)
from flash_attn_sm120.decode import (
    DECODE_FAMILY,
    is_decode,
    load_decode_table,
    load_prefill_table,
    select_decode_config,
    select_prefill_config,
)
from flash_attn_sm120.driver import FwdStatics, build_statics, quiet_compile
from flash_attn_sm120.kernels.fwd_splitkv import FlashAttentionForwardSm120SplitKV
from flash_attn_sm120.kernels.fwd_splitkv_paged import paged_tile_error


@dataclass(frozen=True)
class SplitKVStatics:
    """Compile key of a splitkv kernel: the cp.async key plus split / paged."""

    fwd: FwdStatics
    is_split_kv: bool
    paged: bool
    page_table_broadcast: tuple = ()


@dataclass(frozen=True)
class SplitPlan:
    """Host decisions of one call (pure data, for tests and the benchmark's labels)."""

    config: FwdConfig
    num_splits: int
    decode: bool
    n_blocks: int
    total_mblocks: int
    ctas_per_sm: int


@lru_cache(maxsize=1024)  # pure; saves the feasibility checks on every call
def kernel_config(
    config: FwdConfig, head_dim: int, head_dim_v: int, causal: bool = False, local: bool = False,
    paged: bool = False,
) -> FwdConfig:
    """`config`'s tiles on the splitkv family unless it is a TMA-family config; else the decode
    table's `[[prefill]]` entry of the same (bucket, mask); else the forward table's cp.async entry of
    that key (the dense driver's fallback); else upstream's tile, then fixed fallbacks.

    A TMA config's tiles were measured on the TMA kernel, not on this cp.async mainloop with page
    gathers: some are slow here (d96 causal 8w 256x64 s2: 1.25x dense) and one computed wrong results
    (8w 256x48 s1, paged, d128; configs/measurements/2026-11-29_paged_prefill_emulated.md), so they
    are never reused. Upstream's tile spills here on sm_120a at causal d64 / d96 / d128. The
    `[[prefill]]` entries are the fastest spill-free tiles measured on paged prefill, and every key's
    choice compiles spill-free (tests/test_splitkv_cpu.py). Paged, a candidate must also be a tile the
    page gathers can fill (`paged_tile_error`: e.g. tile_n 48 at d=112 is not).
    """
    own = None if config.family == "tma" else config
    prefill = select_prefill_config(load_prefill_table(), head_dim, head_dim_v, causal, local)
    try:
        cpasync = select_fwd_config(family_entries("cpasync"), head_dim, head_dim_v, causal, local)
    except ValueError:  # no cp.async entry fits these head dims
        cpasync = None
    candidates = (own, prefill, cpasync, upstream_fwd_config(max(head_dim, head_dim_v))) + _FALLBACKS
    for cfg in (c for c in candidates if c is not None):
        candidate = replace(cfg, family=DECODE_FAMILY)
        if candidate.error(head_dim, head_dim_v) is None and not (
            paged and paged_tile_error(cfg.num_threads, cfg.tile_n, head_dim, head_dim_v)
        ):
            return candidate
    raise ValueError(f"no SM120 splitkv config fits head dims ({head_dim}, {head_dim_v})")


def plan(
    *,
    head_dim: int,
    head_dim_v: int,
    causal: bool,
    local: bool,
    window_size_left: Optional[int],
    window_size_right: Optional[int],
    batch: int,
    max_seqlen_q: Optional[int],
    max_seqlen_k: int,
    num_heads: int,
    num_heads_kv: int,
    pack_gqa: bool,
    num_splits: int,
    num_sms: int,
    config: Optional[FwdConfig] = None,
    paged: bool = False,
) -> SplitPlan:
    """Config and split count for a call (pure: tables, the occupancy model, splitkv's chooser)."""
    decode = is_decode(max_seqlen_q)
    if config is None and driver._forced_config:
        config = driver._forced_config[-1]
    if config is None and decode:
        config = select_decode_config(load_decode_table(), head_dim, head_dim_v)
    if config is None:
        config = select_fwd_config(load_fwd_table(), head_dim, head_dim_v, causal, local)
    kcfg = kernel_config(config, head_dim, head_dim_v, causal, local, paged)
    smem = kcfg.smem_bytes(head_dim, head_dim_v) + hardware.DSL_STATIC_SMEM
    ctas_per_sm = hardware.sm120_occupancy(smem, kcfg.num_threads).ctas_per_sm
    n_blocks = splitkv.num_n_blocks(
        max_seqlen_k, kcfg.tile_n, local=local, window_left=window_size_left, window_right=window_size_right,
        tile_m=kcfg.tile_m,
    )
    rows_q = max_seqlen_q if max_seqlen_q is not None else 1
    total = splitkv.total_m_blocks(
        batch=batch, max_seqlen_q=rows_q, num_heads=num_heads, num_heads_kv=num_heads_kv, tile_m=kcfg.tile_m,
        pack_gqa=pack_gqa,
    )
    splits = splitkv.resolve_num_splits(
        num_splits, total_mblocks=total, n_blocks=n_blocks, num_sms=num_sms, ctas_per_sm=ctas_per_sm
    )
    return SplitPlan(kcfg if splits > 1 else config, splits, decode, n_blocks, total, ctas_per_sm)


def make_splitkv_kernel(statics: SplitKVStatics, score_mod=None, mask_mod=None, has_aux_tensors: bool = False):
    """The kernel object for a compile key (no compilation)."""
    return driver.make_kernel(statics.fwd, score_mod, mask_mod, has_aux_tensors,
                              kernel_cls=FlashAttentionForwardSm120SplitKV, is_split_kv=statics.is_split_kv)


def compile_splitkv_kernel(
    kernel, q, k, v, o, lse, cu_q, cu_k, used_q, used_k, page_table, window_left, window_right, aux: AuxData,
    options: str = "", learnable_sink=None,
):
    """cute.compile with upstream's SM80/SM120 forward call convention, page table included."""
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return quiet_compile(
        kernel, q, k, v, o, lse, 1.0,
        cu_q, cu_k, used_q, used_k, page_table,
        window_left, window_right,
        learnable_sink,
        None,  # block sparsity
        aux,
        None, None,  # varlen tile-count hints (optional)
        stream,
        options=("--enable-tvm-ffi " + options).strip(),
    )


def combine_kernel_params(head_dim: int, num_splits: int) -> dict:
    """The FlashAttentionForwardCombine parameters upstream's `_flash_attn_fwd_combine` picks
    (flash_attn/cute/interface.py) for fp32 partials of this head dim and split count."""
    k_block_size = 64 if head_dim <= 64 else 128
    tile_m = 8 if k_block_size % 128 == 0 else (16 if k_block_size % 64 == 0 else 32)
    log_max_splits = max(math.ceil(math.log2(max(num_splits, 1))), 4)
    if tile_m == 8:
        log_max_splits = max(log_max_splits, 5)
    return dict(tile_m=tile_m, k_block_size=k_block_size, log_max_splits=log_max_splits)


def combine_compile_key(arch: int, out: torch.Tensor, num_splits: int, *, varlen: bool, seqused: bool,
                        lse: bool) -> tuple:
    """The key under which `_flash_attn_fwd_combine` caches the combine kernel for these outputs
    (fp32 partials, no dynamic splits, no virtual batch, no semaphore)."""
    p = combine_kernel_params(out.shape[-1], num_splits)
    return (arch, torch2cute_dtype_map[out.dtype], Float32, out.shape[-1], out.shape[-2], p["tile_m"],
            p["k_block_size"], p["log_max_splits"], varlen, seqused, lse, False, False, False)


def combine_kernel(key: tuple):
    """Upstream's compiled combine kernel for `key`, compiled into upstream's own cache if missing."""
    cache = _flash_attn_fwd_combine.compile_cache
    if key not in cache:
        cache[key] = _compile_fwd_combine(*key)
    return cache[key]


def _make_cache():
    path = os.environ.get(driver.CACHE_DIR_ENV)
    return JITPersistentCache(Path(path) / "fwd_splitkv") if path else JITCache()


_compile_cache = _make_cache()
_verified_keys: set = set()  # keys whose compiled kernel passed the occupancy check (driver.compile_verified)
compile_count = {"splitkv": 0}


def clear_cache() -> None:
    global _compile_cache
    _compile_cache = _make_cache()
    _verified_keys.clear()
    _PLANS.clear()


def statics_emulated(cp: "CallPlan") -> bool:
    return cp.compile_key is not None and cp.compile_key[0].fwd.emulate_host_smem is not None


def _host_int(x) -> Optional[int]:
    return int(x) if isinstance(x, int) and not isinstance(x, bool) else None


def takes_this_path(
    *, q: torch.Tensor, page_table, num_splits: int, cu_seqlens_q, max_seqlen_q
) -> bool:
    """Paged, split, or decode-shaped calls come here; everything else goes to driver.forward."""
    if page_table is not None or num_splits != 1:
        return True
    seqlen_q = q.shape[1] if cu_seqlens_q is None else _host_int(max_seqlen_q)
    return is_decode(seqlen_q)


@dataclass
class CallPlan:
    """Everything `forward` decides from a call's metadata: route, config, splits, compile key.

    Pure in the key built by `_plan_key` (shapes, strides, dtype, device, flags, host ints), so it
    is memoized per key: a decode step repeats the same metadata every call and its whole host
    path is on the critical path (the GPU part of a b=1 decode is ~10 us).
    """

    split: SplitPlan
    kv_capacity: int  # keys K/V can hold: dense seqlen_k, or pages per row x page size
    window_left: Optional[int]  # resolved by upstream's window rule (as the compile key's flags)
    window_right: Optional[int]
    to_driver: bool  # dense and unsplit: driver.forward runs it (with the arguments as given)
    driver_config: Optional[FwdConfig]
    softmax_scale: float
    score_mod: Optional[Callable]  # softcap folded in
    compile_key: Optional[tuple]
    combine_arch: int
    kernel: object = None  # the compiled kernel, once the first call has looked it up
    combine: object = None  # the compiled combine kernel, likewise


_PLANS: dict = {}
_PLANS_MAX = 4096


def _meta(t: Optional[torch.Tensor]):
    return None if t is None else (t.shape, t.stride())


def _plan_key(q, k, v, *, page_table, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
              max_seqlen_k, num_splits, causal, window_size_left, window_size_right, softcap, softmax_scale,
              pack_gqa, need_lse, emulate_host_smem, out, lse, config, num_sms, info, learnable_sink=None) -> tuple:
    return (
        info, _meta(q), _meta(k), _meta(v), q.dtype, q.device, _meta(page_table), _meta(cu_seqlens_q),
        _meta(cu_seqlens_k), seqused_q is not None, seqused_k is not None, _host_int(max_seqlen_q),
        _host_int(max_seqlen_k), num_splits, causal, window_size_left, window_size_right, softcap, softmax_scale,
        pack_gqa, need_lse, emulate_host_smem, _meta(out), _meta(lse), config, num_sms,
        driver._forced_config[-1] if driver._forced_config else None,
        None if learnable_sink is None else (learnable_sink.dtype, learnable_sink.shape, learnable_sink.device),
    )


def make_call_plan(
    q, k, v, *, page_table, num_splits, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
    max_seqlen_k, causal, window_size_left, window_size_right, softcap, softmax_scale, pack_gqa, need_lse, lse,
    emulate_host_smem, score_mod, mask_mod, aux_tensors, aux_scalars, config, num_sms, info, learnable_sink=None,
) -> CallPlan:
    """The host decisions of one call (see `forward`); reads only metadata, never tensor data.
    info: the device's DeviceInfo (SM count, capability)."""
    num_heads, head_dim = q.shape[-2:]
    num_heads_kv, head_dim_v = v.shape[-2:]
    varlen_q = cu_seqlens_q is not None
    batch = cu_seqlens_q.shape[0] - 1 if varlen_q else q.shape[0]
    if varlen_q:
        max_q = _host_int(max_seqlen_q)
        if max_q is None:
            max_q = q.shape[0]  # an upper bound: no auto split estimate is made too large a grid
    else:
        max_q = q.shape[1]
    if page_table is not None:
        capacity = page_table.shape[1] * k.shape[1]
        max_k = min(_host_int(max_seqlen_k) or capacity, capacity)
    else:
        capacity = k.shape[-3]
        max_k = _host_int(max_seqlen_k) if cu_seqlens_k is not None and _host_int(max_seqlen_k) else capacity

    causal_r, local, left, right = _resolve_causal_local_window(causal, window_size_left, window_size_right, mask_mod)
    pack = driver.resolve_pack_gqa(pack_gqa, num_heads // num_heads_kv)
    p = plan(
        head_dim=head_dim, head_dim_v=head_dim_v, causal=causal_r, local=local, window_size_left=left,
        window_size_right=right, batch=batch, max_seqlen_q=max_q, max_seqlen_k=max_k, num_heads=num_heads,
        num_heads_kv=num_heads_kv, pack_gqa=pack, num_splits=num_splits, num_sms=num_sms or info.num_sms,
        config=config, paged=page_table is not None,
    )
    score_mod = driver.softcap_score_mod(softcap, score_mod)
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    common = dict(split=p, kv_capacity=capacity, window_left=left, window_right=right, softmax_scale=scale,
                  score_mod=score_mod, combine_arch=info.capability[0] * 10 + info.capability[1])
    if page_table is None and p.num_splits == 1:
        cfg = replace(p.config, family="cpasync") if p.config.family == DECODE_FAMILY else p.config
        return CallPlan(**common, to_driver=True, driver_config=cfg if (p.decode or config is not None) else None,
                        compile_key=None)

    kcfg = kernel_config(p.config, head_dim, head_dim_v, causal_r, local, page_table is not None)
    is_split = p.num_splits > 1
    statics = SplitKVStatics(
        build_statics(
            q, k, v, causal=causal_r, local=local, pack_gqa=pack, has_lse=is_split or need_lse or lse is not None,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
            window_size_left=left, window_size_right=right, score_mod=score_mod, mask_mod=mask_mod,
            aux_tensors=aux_tensors, config=kcfg, emulate_host_smem=emulate_host_smem, learnable_sink=learnable_sink,
        ),
        is_split_kv=is_split,
        paged=page_table is not None,
        page_table_broadcast=get_broadcast_dims(page_table) if page_table is not None else (),
    )
    aux_scalars = tuple(aux_scalars) if aux_scalars else None
    key = (statics, tuple(type(s) for s in aux_scalars) if aux_scalars else None)
    return CallPlan(**common, to_driver=False, driver_config=None, compile_key=key)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: Optional[float],
    causal: bool,
    window_size_left: Optional[int],
    window_size_right: Optional[int],
    softcap: Optional[float],
    pack_gqa: Optional[bool],
    need_lse: bool,
    emulate_host_smem: Optional[tuple],
    page_table: Optional[torch.Tensor] = None,
    num_splits: int = 1,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    score_mod: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    aux_tensors: Optional[list] = None,
    aux_scalars: Optional[tuple] = None,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    config: Optional[FwdConfig] = None,
    num_sms: Optional[int] = None,
    learnable_sink: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run a (possibly paged, possibly split) SM120 forward on validated inputs; (out, lse or None).

    num_splits: 1 = no split, n > 1 = n splits clamped to the useful maximum (the number of key
    blocks of the chosen tile, and splitkv.MAX_SPLITS), <= 0 = chosen by splitkv.choose_num_splits.
    out / lse: optional preallocated outputs, (b, s, h, dv) / (b, h, s) (varlen: (total_q, h, dv) /
    (h, total_q)); lse is written when given or when need_lse. learnable_sink (h,): upstream's sink, folded
    into split 0's output tile (the combine counts it once per row).
    Calls without score_mod / mask_mod / aux tensors reuse the CallPlan of earlier calls with the
    same metadata; per call then only the outputs are allocated and the kernels launched.
    """
    from flash_attn_sm120.device import device_info

    args = dict(
        info=device_info(q.device), page_table=page_table, num_splits=num_splits, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        causal=causal, window_size_left=window_size_left, window_size_right=window_size_right, softcap=softcap,
        softmax_scale=softmax_scale, pack_gqa=pack_gqa, need_lse=need_lse, lse=lse,
        emulate_host_smem=emulate_host_smem, config=config, num_sms=num_sms, learnable_sink=learnable_sink,
    )
    memo = score_mod is None and mask_mod is None and aux_tensors is None and not aux_scalars
    key = _plan_key(q, k, v, out=out, **args) if memo else None
    cp = _PLANS.get(key) if memo else None
    if cp is None:
        cp = make_call_plan(q, k, v, score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux_tensors,
                            aux_scalars=aux_scalars, **args)
        if memo:
            if len(_PLANS) >= _PLANS_MAX:
                _PLANS.clear()
            _PLANS[key] = cp
    if cp.to_driver:
        return driver.forward(
            q, k, v, config=cp.driver_config, softmax_scale=softmax_scale, causal=causal,
            window_size_left=window_size_left, window_size_right=window_size_right, softcap=softcap,
            pack_gqa=pack_gqa, need_lse=need_lse, emulate_host_smem=emulate_host_smem, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k, score_mod=score_mod,
            mask_mod=mask_mod, aux_tensors=aux_tensors, aux_scalars=aux_scalars, out=out, lse=lse,
            learnable_sink=learnable_sink,
        )

    num_heads, head_dim_v = q.shape[-2], v.shape[-1]
    varlen_q = cu_seqlens_q is not None
    out, lse, lse_shape = driver.allocate_outputs(q, num_heads, head_dim_v, varlen_q, need_lse, out, lse)
    if cp.kv_capacity == 0 or out.numel() == 0:
        return driver.empty_result(out, lse, learnable_sink)

    splits = cp.split.num_splits
    if splits > 1:
        o_kernel = torch.empty(splits, *out.shape, dtype=torch.float32, device=q.device)
        lse_kernel = torch.empty(splits, *lse_shape, dtype=torch.float32, device=q.device)
    else:
        o_kernel, lse_kernel = out, lse
    aux_scalars = tuple(aux_scalars) if aux_scalars else None
    kernel = cp.kernel
    if kernel is None:
        if cp.compile_key not in _verified_keys:
            statics = cp.compile_key[0]
            index = [to_cute_tensor(t, assumed_align=4, leading_dim=0) if t is not None else None
                     for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)]
            tensors = [to_cute_tensor(t) for t in (q, k, v, o_kernel)]
            cute_lse = to_cute_tensor(lse_kernel, assumed_align=4) if lse_kernel is not None else None
            cute_pages = to_cute_tensor(page_table, assumed_align=4, leading_dim=1) if page_table is not None else None
            cute_aux = AuxData([to_cute_aux_tensor(t) for t in aux_tensors] if aux_tensors is not None else None,
                               aux_scalars)
            host = statics.fwd.emulate_host_smem
            if cp.compile_key not in _compile_cache or driver.launch_mode(host, q.device) != "sm120":
                _compile_cache[cp.compile_key] = driver.compile_verified(
                    lambda h: make_splitkv_kernel(replace(statics, fwd=replace(statics.fwd, emulate_host_smem=h)),
                                                  cp.score_mod, mask_mod, aux_tensors is not None),
                    lambda kobj, options: compile_splitkv_kernel(
                        kobj, *tensors, cute_lse, *index, cute_pages, cp.window_left, cp.window_right, cute_aux,
                        options=options, learnable_sink=driver.sink_tensor(learnable_sink),
                    ),
                    host, q.device,
                    f"splitkv {driver.describe(statics.fwd)}{' split' if statics.is_split_kv else ''}"
                    f"{' paged' if statics.paged else ''}",
                )
                compile_count["splitkv"] += 1
            _verified_keys.add(cp.compile_key)
        kernel = _compile_cache[cp.compile_key]
        if memo:
            cp.kernel = kernel
    kernel(
        q.detach(), k.detach(), v.detach(), o_kernel, lse_kernel, cp.softmax_scale,
        cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
        cp.window_left, cp.window_right, learnable_sink, None, AuxData(aux_tensors, aux_scalars), None, None,
    )
    if splits > 1:
        combine = cp.combine
        if combine is None:
            combine = combine_kernel(combine_compile_key(
                cp.combine_arch, out, splits, varlen=varlen_q, seqused=seqused_q is not None, lse=lse is not None,
            ))
            if memo:
                cp.combine = combine
            if statics_emulated(cp):
                occupancy.note_unchecked("upstream FlashAttentionForwardCombine (split combine, not padded)")
        # the combine reads LSE partials token-major: (splits, b, s, h) / (splits, total_q, h) views;
        # the last three arguments (dynamic splits, virtual batch, semaphore) are unused here
        combine(o_kernel, lse_kernel.transpose(-1, -2), out, lse.transpose(-1, -2) if lse is not None else None,
                cu_seqlens_q, seqused_q, None, None, None)
    return out, lse

"""The SM120 forward driver: allocation, compile cache keyed by (problem statics, config), launch.

A thin replacement for the SM120 branch of upstream's `_flash_attn_fwd`, which hard-codes its
kernel class, 4 warps and two tiles. It imports upstream's helpers (tensor conversion, causal /
local resolution, softcap score_mod, callable hashing) and never touches upstream's globals or
environment variables, so upstream FA4 keeps working unchanged in the same process.

Compiled kernels live in an in-process cache; with FLASH_ATTN_SM120_CACHE_DIR set they are also
exported to (and loaded from) that directory through upstream's JITPersistentCache, which lets
several processes compile in parallel and a later process skip compilation.
"""

from __future__ import annotations

import math
import os
import tempfile
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch

import cutlass
import cutlass.cute as cute
from flash_attn.cute import utils as fa_utils
from flash_attn.cute.cache_utils import JITCache, JITPersistentCache
from flash_attn.cute.cute_dsl_utils import get_aux_tensor_metadata, get_broadcast_dims, to_cute_aux_tensor, to_cute_tensor
from flash_attn.cute.interface import _resolve_causal_local_window
from flash_attn.cute.utils import AuxData

from flash_attn_sm120 import block_sparse, hardware, occupancy, sinks
from flash_attn_sm120.config import FwdConfig, family_entries, load_fwd_table, select_fwd_config
from flash_attn_sm120.device import device_info
from flash_attn_sm120.kernels import FAMILIES
from flash_attn_sm120.kernels.ordered_scheduler import with_tile_order

CACHE_DIR_ENV = "FLASH_ATTN_SM120_CACHE_DIR"

_TORCH_TO_CUTE = {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}


@dataclass(frozen=True)
class FwdStatics:
    """Everything a compiled forward kernel is specialized on (the compile key)."""

    dtype: str
    head_dim: int
    head_dim_v: int
    qhead_per_kvhead: int
    causal: bool
    local: bool
    pack_gqa: bool
    has_lse: bool
    has_cu_seqlens_q: bool
    has_cu_seqlens_k: bool
    has_seqused_q: bool
    has_seqused_k: bool
    has_window_left: bool
    has_window_right: bool
    score_mod_hash: object
    mask_mod_hash: object
    aux_metadata: object
    broadcast: tuple
    config: FwdConfig
    emulate_host_smem: Optional[object]  # hardware.EmulationHost in emulation
    sink_dtype: Optional[str] = None  # a learnable_sink's, folded into the output tile (kernels/sink_fold.py)
    # block sparsity (block_sparse.statics_key): (q_subtile, kv_subtile, has full lists, stride-0 dims)
    block_sparse: Optional[tuple] = None
    num_sms: Optional[int] = None  # the GPU's, for a persistent config's grid (None otherwise)
    # block sparsity: tiles launched longest first, in an order the host computes (block_sparse.tile_order)
    ordered_tiles: bool = False


# A persistent launch's SM count for tests and the sanitizer: a small wave makes every CTA walk many tiles
# of a small problem (the cross-tile handoffs of the Q slot and the K/V rings). Unset: the GPU's.
PERSISTENT_SMS_ENV = "FLASH_ATTN_SM120_PERSISTENT_SMS"


def _persistent_num_sms(config: FwdConfig, device: torch.device) -> Optional[int]:
    """A persistent config launches one wave: this GPU's SM count (SM120's default off a GPU)."""
    if not config.persistent:
        return None
    forced = os.environ.get(PERSISTENT_SMS_ENV)
    if forced:
        try:
            count = int(forced.strip())
        except ValueError:
            count = 0
        if count < 1:
            raise ValueError(f"{PERSISTENT_SMS_ENV}={forced!r}: expected a positive SM count")
        return count
    if device.type != "cuda":
        return hardware.DEFAULT_NUM_SMS
    return device_info(device).num_sms


def make_kernel(statics: FwdStatics, score_mod=None, mask_mod=None, has_aux_tensors: bool = False,
                kernel_cls: Optional[type] = None, **extra):
    """The kernel object for a compile key (no compilation).

    kernel_cls defaults to the config's family; `extra` goes to its constructor (e.g. is_split_kv).
    """
    cfg = statics.config
    cls = kernel_cls or FAMILIES[cfg.family].kernel_cls
    if statics.block_sparse is not None:
        extra = dict(extra, q_subtile_factor=statics.block_sparse[0], kv_subtile_factor=statics.block_sparse[1])
    if cfg.pingpong:
        extra = dict(extra, pingpong=True)
    if cfg.lpt is not None:
        extra = dict(extra, lpt=cfg.lpt)
    if cfg.persistent:
        extra = dict(extra, persistent=True, num_sms=statics.num_sms)
    if cfg.q_stages != 1:
        extra = dict(extra, q_stages=cfg.q_stages)
    if cfg.dynamic:
        extra = dict(extra, dynamic=True)
    if statics.ordered_tiles:
        extra = dict(extra, ordered_tiles=True)
    return cls(
        _TORCH_TO_CUTE[getattr(torch, statics.dtype)],
        statics.head_dim,
        statics.head_dim_v,
        statics.qhead_per_kvhead,
        is_causal=statics.causal,
        is_local=statics.local,
        pack_gqa=statics.pack_gqa,
        tile_m=cfg.tile_m,
        tile_n=cfg.tile_n,
        num_stages=cfg.num_stages,
        num_threads=cfg.num_threads,
        Q_in_regs=cfg.q_in_regs,
        score_mod=score_mod,
        mask_mod=mask_mod,
        has_aux_tensors=has_aux_tensors,
        emulate_host_smem=statics.emulate_host_smem,
        **extra,
    )


# The CuTe DSL warns at every compile that upstream's AuxData argument "cannot be converted to a
# JitArgument": it is a compile-time structure by design. Filtered at this package's own compile calls only.
_AUX_DATA_WARNING = r"Argument aux_data \(position \d+\) cannot be converted to a JitArgument"


def quiet_compile(*args, **kwargs):
    """cute.compile without the DSL's AuxData warning (the only one filtered)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_AUX_DATA_WARNING, category=UserWarning)
        return cute.compile(*args, **kwargs)


def compile_kernel(kernel, q, k, v, o, lse, cu_q, cu_k, used_q, used_k, window_left, window_right, aux: AuxData,
                   options: str = "", learnable_sink=None, blocksparse=None):
    """cute.compile with upstream's SM80/SM120 forward call convention (cute tensors or fakes)."""
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return quiet_compile(
        kernel, q, k, v, o, lse, 1.0,
        cu_q, cu_k, used_q, used_k,
        None,  # page table
        window_left, window_right,
        learnable_sink,
        blocksparse,
        aux,
        None, None,  # varlen tile-count hints (optional)
        stream,
        options=("--enable-tvm-ffi " + options).strip(),
    )


def describe(statics: FwdStatics) -> str:
    """A compile key in words, for error messages."""
    flags = [f for f, on in (("causal", statics.causal), ("local", statics.local), ("pack_gqa", statics.pack_gqa),
                              ("varlen", statics.has_cu_seqlens_q or statics.has_cu_seqlens_k),
                              ("score_mod", statics.score_mod_hash), ("mask_mod", statics.mask_mod_hash),
                              ("sink", statics.sink_dtype), ("block_sparse", statics.block_sparse)) if on]
    return (f"{statics.config.name} d={statics.head_dim}/{statics.head_dim_v} {statics.dtype} "
            f"qhead_per_kvhead={statics.qhead_per_kvhead}{' ' + ','.join(flags) if flags else ''}")


def launch_mode(emulate_host_smem, device: torch.device) -> str:
    """How a compiled kernel's occupancy is judged: 'emulated' (padded, must match SM120), 'sm120' (a real
    SM120: the model is what is checked) or 'unpadded' (another GPU without padding: recorded only)."""
    if emulate_host_smem is not None:
        return "emulated"
    return "sm120" if torch.cuda.get_device_capability(device)[0] == 12 else "unpadded"


def compile_verified(make: Callable, compile_fn: Callable, host, device: torch.device, name: str):
    """Compile the kernel `make(host)` with `compile_fn(kernel, options)` and verify its occupancy.

    `host`: the hardware.EmulationHost the kernel pads for (None: no padding). The cubin is kept and
    loaded through the driver (occupancy.py). In emulation the padding assumed the host's static shared
    memory (EmulationHost.static_smem, 0 at first); if the compiled kernel has another, it is padded
    again with the measured value and recompiled, once. Then the host's CTAs per SM must equal
    SM120's, else RuntimeError.
    """
    kernel = make(host)  # a config that cannot run is refused here, before any device work
    mode = launch_mode(host, device)
    with torch.cuda.device(device):
        compiled, host_fn = _compile_and_measure(kernel, compile_fn)
        if mode == "emulated" and host_fn.static_smem != host.static_smem:
            host = host.with_static(host_fn.static_smem)
            kernel = make(host)
            compiled, host_fn = _compile_and_measure(kernel, compile_fn)
        occupancy.check(name, kernel, host_fn, mode)
    return compiled


def _compile_and_measure(kernel, compile_fn):
    """(compiled, the host driver's answer for it); the cubin is kept only as long as it is read."""
    with tempfile.TemporaryDirectory() as tmp:
        compiled = compile_fn(kernel, f"--keep-cubin --dump-dir={tmp}")
        return compiled, occupancy.measure(compiled, kernel)


def _make_cache():
    path = os.environ.get(CACHE_DIR_ENV)
    return JITPersistentCache(Path(path) / "fwd") if path else JITCache()


_compile_cache = _make_cache()
_verified_keys: set = set()  # keys whose compiled kernel passed the occupancy check in this process
_forced_config: list[FwdConfig] = []


class force_config:
    """Context manager: every forward inside uses `config` instead of the table's choice.

    For tests (the fuzz registry forces each kernel path) and the research loop. A subclass with its
    own `_stack` forces another driver's configs (driver_bwd.force_config).
    """

    _stack = _forced_config

    def __init__(self, config):
        self.config = config

    def __enter__(self):
        self._stack.append(self.config)
        return self.config

    def __exit__(self, *exc):
        self._stack.pop()


# compile events, for tests and benchmarks that must see whether a call compiled
compile_count = {"fwd": 0}


def clear_cache() -> None:
    global _compile_cache
    _compile_cache = _make_cache()
    _verified_keys.clear()


def build_statics(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    local: bool,
    pack_gqa: bool,
    has_lse: bool,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    seqused_q: Optional[torch.Tensor],
    seqused_k: Optional[torch.Tensor],
    window_size_left: Optional[int],
    window_size_right: Optional[int],
    score_mod: Optional[Callable],
    mask_mod: Optional[Callable],
    aux_tensors: Optional[list],
    config: FwdConfig,
    emulate_host_smem: Optional[tuple],
    learnable_sink: Optional[torch.Tensor] = None,
    block_sparse_key: Optional[tuple] = None,
) -> FwdStatics:
    """The compile key of a forward call (resolved causal/local flags, resolved config)."""
    return FwdStatics(
        dtype=str(q.dtype).replace("torch.", ""),
        head_dim=q.shape[-1],
        head_dim_v=v.shape[-1],
        qhead_per_kvhead=q.shape[-2] // v.shape[-2],
        causal=causal,
        local=local,
        pack_gqa=pack_gqa,
        has_lse=has_lse,
        has_cu_seqlens_q=cu_seqlens_q is not None,
        has_cu_seqlens_k=cu_seqlens_k is not None,
        has_seqused_q=seqused_q is not None,
        has_seqused_k=seqused_k is not None,
        has_window_left=window_size_left is not None,
        has_window_right=window_size_right is not None,
        score_mod_hash=fa_utils.hash_callable(score_mod) if score_mod is not None else False,
        mask_mod_hash=fa_utils.hash_callable(mask_mod) if mask_mod is not None else False,
        aux_metadata=get_aux_tensor_metadata(aux_tensors) if aux_tensors is not None else None,
        broadcast=tuple(get_broadcast_dims(t) for t in (q, k, v)),
        config=config,
        emulate_host_smem=emulate_host_smem,
        sink_dtype=None if learnable_sink is None else str(learnable_sink.dtype).replace("torch.", ""),
        block_sparse=block_sparse_key,
        num_sms=_persistent_num_sms(config, q.device),
    )


def sink_tensor(learnable_sink: Optional[torch.Tensor]):
    """The cute tensor a kernel compiles a learnable_sink (h,) as (upstream's conversion), or None."""
    return None if learnable_sink is None else to_cute_tensor(learnable_sink, assumed_align=4, leading_dim=0)


def _route(statics: FwdStatics, pack_gqa_chosen: bool, config_given: bool, causal: bool, local: bool) -> FwdStatics:
    """Make the compile key one its family can serve.

    A family may refuse some keys (`unsupported_reason`, e.g. the TMA family refuses varlen and GQA
    packing). A defaulted pack_gqa is turned off first; a table-chosen config then falls back to the
    table's cp.async entry; an explicitly requested config that still cannot run raises.
    """
    check = getattr(FAMILIES[statics.config.family].kernel_cls, "unsupported_reason", None)
    if check is None or check(statics) is None:
        return statics
    if statics.pack_gqa and not pack_gqa_chosen:
        unpacked = replace(statics, pack_gqa=False)
        if check(unpacked) is None:
            return unpacked
    reason = check(statics)
    if config_given:
        cfg = statics.config
        bad_config = cfg.error(statics.head_dim, statics.head_dim_v)  # the family's rule and the config's flags
        if bad_config is not None:
            raise ValueError(f"SM120 forward config not implementable: {bad_config}")
        raise NotImplementedError(f"kernel family {cfg.family!r} cannot run this call: {reason}")
    # the table's cp.async entry of the same (bucket, mask), listed after the faster family's
    fallback = select_fwd_config(family_entries("cpasync"), statics.head_dim, statics.head_dim_v, causal, local)
    return replace(statics, config=fallback, num_sms=None)  # num_sms keys persistent TMA configs only


def table_config(q, v, causal: bool, local: bool, cu_seqlens_q=None, seqused_q=None, cu_seqlens_k=None,
                 seqused_k=None) -> FwdConfig:
    """The table's choice for a call: by head dims, mask, dtype, varlen or not and (dense calls) seqlen_q."""
    # varlen (packed q, or per-sequence lengths) leaves the short-sequence entries out
    seqlen_q = q.shape[1] if q.dim() == 4 and cu_seqlens_q is None and seqused_q is None else None
    varlen = any(t is not None for t in (cu_seqlens_q, seqused_q, cu_seqlens_k, seqused_k))
    return select_fwd_config(load_fwd_table(), q.shape[-1], v.shape[-1], causal, local,
                             dtype=str(q.dtype).replace("torch.", ""), seqlen_q=seqlen_q, varlen=varlen)


def choose_statics(
    q, k, v, *, causal: bool, local: bool, pack_gqa: bool, pack_gqa_chosen: bool, has_lse: bool, cu_seqlens_q,
    cu_seqlens_k, seqused_q, seqused_k, window_size_left, window_size_right, score_mod, mask_mod, aux_tensors,
    config: Optional[FwdConfig], emulate_host_smem: Optional[tuple], learnable_sink: Optional[torch.Tensor] = None,
) -> FwdStatics:
    """The compile key `forward` runs (reads only metadata, so `explain` can ask it too): the given
    or forced config, else the table's; then the family's routing (`_route`)."""
    config_given = config is not None or bool(_forced_config)
    if config is None and _forced_config:
        config = _forced_config[-1]
    if config is None:
        config = table_config(q, v, causal, local, cu_seqlens_q, seqused_q, cu_seqlens_k, seqused_k)
    statics = build_statics(
        q, k, v, causal=causal, local=local, pack_gqa=pack_gqa, has_lse=has_lse,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
        window_size_left=window_size_left, window_size_right=window_size_right, score_mod=score_mod,
        mask_mod=mask_mod, aux_tensors=aux_tensors, config=config, emulate_host_smem=emulate_host_smem,
        learnable_sink=learnable_sink,
    )
    return _route(statics, pack_gqa_chosen, config_given, causal, local)


def choose_block_sparse(
    q, k, v, tensors, *, causal: bool, local: bool, pack_gqa: bool, pack_gqa_chosen: bool, config: Optional[FwdConfig],
    **build,
) -> tuple[FwdStatics, object]:
    """(compile key, upstream's normalized sparse config) of a block-sparse forward: the given or forced
    config, else the first of block_sparse.forward_candidates that the TMA family serves."""
    packed_q, packed_k = build.get("cu_seqlens_q") is not None, build.get("cu_seqlens_k") is not None
    block_sparse.check_varlen_form(tensors, packed_q=packed_q,
                                   varlen_k=packed_k or build.get("seqused_k") is not None)
    # the lists' shapes: with packed q the varlen form carries its own; with packed K the index width
    # stands for the longest sequence's K/V blocks
    batch = build["cu_seqlens_q"].numel() - 1 if packed_q else q.shape[0]
    seqlen_q = 0 if packed_q else q.shape[1]
    if packed_k and not packed_q:
        if tensors.block_size is None:
            raise ValueError("block sparsity with packed K/V (cu_seqlens_k) needs block_size: the lists' shapes do "
                             "not give it")
        seqlen_k = tensors.mask_block_idx.shape[-1] * int(tensors.block_size[1])
    else:
        seqlen_k = 0 if packed_k else k.shape[1]
    block_size = block_sparse.sparse_block_size(tensors, seqlen_q, seqlen_k)
    if pack_gqa and (packed_q or not block_sparse.heads_broadcast(tensors)):
        # upstream's rule: packed GQA needs the same lists for every head; varlen lists hold one Q tile
        # per sparse block of positions, which a packed tile (positions of several heads) is not
        pack_gqa = False
    config_given = config is not None or bool(_forced_config)
    if config is None and _forced_config:
        config = _forced_config[-1]
    varlen_q = packed_q or build.get("seqused_q") is not None
    candidates = [config] if config_given else block_sparse.forward_candidates(q.shape[-1], v.shape[-1], block_size,
                                                                               varlen_q=varlen_q)
    if packed_q and candidates and not any(c.tile_m == block_size[0] for c in candidates):
        # upstream's varlen lists hold one Q tile per sparse block (its normalize refuses other sizes)
        rows = sorted({c.tile_m for c in candidates})
        raise ValueError(f"varlen block sparsity needs the sparse Q block to be one kernel tile ({rows} rows at head "
                         f"dim {q.shape[-1]}), got block_size {tuple(block_size)}")
    reasons = []
    for cfg in candidates:
        if cfg.family != "tma":
            reasons.append(f"config {cfg.name} is not a TMA config")
            continue
        if not block_sparse.divides(cfg, block_size):
            raise ValueError(f"block sparsity: config {cfg.name}'s tile does not divide the sparse block {block_size}")
        if packed_q and cfg.tile_m != block_size[0]:
            # upstream's varlen lists hold one Q tile per sparse block
            reasons.append(f"varlen block sparsity needs tile_m == the sparse Q block {block_size[0]} "
                           f"(config {cfg.name} has tile_m={cfg.tile_m})")
            continue
        norm = block_sparse.normalize(tensors, cfg, batch=batch, num_heads=q.shape[-2], seqlen_q=seqlen_q,
                                      seqlen_k=seqlen_k, block_size=block_size, device=q.device)
        statics = build_statics(q, k, v, causal=causal, local=local, pack_gqa=pack_gqa, config=cfg,
                                block_sparse_key=block_sparse.statics_key(norm), **build)
        statics = replace(statics, ordered_tiles=block_sparse.orders_tiles(cfg, varlen_q=varlen_q))
        check = FAMILIES["tma"].kernel_cls.unsupported_reason
        if check(statics) is not None and statics.pack_gqa and not pack_gqa_chosen:
            statics = replace(statics, pack_gqa=False)
        reason = check(statics)
        if reason is None:
            return statics, norm
        reasons.append(reason)
    raise block_sparse.no_config_error(block_size, q.shape[-1], v.shape[-1], reasons)


def resolve_pack_gqa(pack_gqa: Optional[bool], qhead_per_kvhead: int) -> bool:
    """Upstream's default: GQA heads are packed into the M tile unless the caller says otherwise;
    never with one query head per KV head."""
    if qhead_per_kvhead == 1:
        return False
    return qhead_per_kvhead > 1 if pack_gqa is None else pack_gqa


def softcap_score_mod(softcap: Optional[float], score_mod: Optional[Callable]) -> Optional[Callable]:
    """The score_mod a call runs: softcap (0 or None = off) becomes upstream's softcap score_mod."""
    if softcap is None or softcap == 0.0:
        return score_mod
    if score_mod is not None:
        raise ValueError("softcap and score_mod cannot be used together")
    return fa_utils.create_softcap_scoremod(softcap)


def allocate_outputs(q: torch.Tensor, num_heads: int, head_dim_v: int, varlen_q: bool, need_lse: bool,
                     out: Optional[torch.Tensor], lse: Optional[torch.Tensor]):
    """(out, lse, lse_shape): the caller's buffers, else new ones; lse only when given or needed.
    Shapes: out (b, s, h, dv) / varlen (total_q, h, dv); lse (b, h, s) / varlen (h, total_q)."""
    q_rows = (q.shape[0],) if varlen_q else tuple(q.shape[:2])
    if out is None:
        out = torch.empty(*q_rows, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
    lse_shape = (q.shape[0], num_heads, q.shape[1]) if not varlen_q else (num_heads, q.shape[0])
    if lse is None and need_lse:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    return out, lse, lse_shape


def empty_result(out: torch.Tensor, lse: Optional[torch.Tensor], learnable_sink: Optional[torch.Tensor] = None):
    """No keys (or no queries): zero output, -inf LSE (the sink's logit with one), no kernel."""
    out.zero_()
    if lse is not None:
        lse.fill_(float("-inf"))
        if learnable_sink is not None:
            lse.copy_(sinks.sink_like_lse(learnable_sink, lse).expand_as(lse))
    return out, lse


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
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    score_mod: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    aux_tensors: Optional[list] = None,
    aux_scalars: Optional[tuple] = None,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    config: Optional[FwdConfig] = None,
    learnable_sink: Optional[torch.Tensor] = None,
    block_sparse_tensors=None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run the SM120 forward on validated inputs; returns (out, lse or None). learnable_sink (h,):
    upstream's sink, folded into the kernel's output (out and lse are the sink's result).
    block_sparse_tensors: upstream's BlockSparseTensorsTorch (block_sparse.py, the TMA family)."""
    num_heads, head_dim = q.shape[-2:]
    num_heads_kv, head_dim_v = v.shape[-2:]
    qhead_per_kvhead = num_heads // num_heads_kv
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    causal, local, window_size_left, window_size_right = _resolve_causal_local_window(
        causal, window_size_left, window_size_right, mask_mod
    )
    pack_gqa_chosen = pack_gqa is not None
    pack_gqa = resolve_pack_gqa(pack_gqa, qhead_per_kvhead)
    out, lse, _ = allocate_outputs(q, num_heads, head_dim_v, cu_seqlens_q is not None, need_lse, out, lse)
    if k.shape[-3] == 0 or out.numel() == 0:
        return empty_result(out, lse, learnable_sink)

    score_mod = softcap_score_mod(softcap, score_mod)
    build = dict(
        has_lse=lse is not None, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
        seqused_k=seqused_k, window_size_left=window_size_left, window_size_right=window_size_right,
        score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux_tensors,
        emulate_host_smem=emulate_host_smem, learnable_sink=learnable_sink,
    )
    sparse = None  # upstream's NormalizedBlockSparseConfig
    if block_sparse_tensors is not None and seqused_k is not None and cu_seqlens_k is None:
        # the TMA family bounds K/V reads per sequence only with packed K/V: the cache as packed sequences
        k, v, cu_seqlens_k, seqused_k, block_sparse_tensors = block_sparse.seqused_cache_as_packed(
            k, v, seqused_k, block_sparse_tensors, q.shape[1] if cu_seqlens_q is None else 0,
            packed_q=cu_seqlens_q is not None)
        build.update(cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k)
    if block_sparse_tensors is not None:
        statics, sparse = choose_block_sparse(q, k, v, block_sparse_tensors, causal=causal, local=local,
                                              pack_gqa=pack_gqa, pack_gqa_chosen=pack_gqa_chosen, config=config,
                                              **build)
    else:
        statics = choose_statics(q, k, v, causal=causal, local=local, pack_gqa=pack_gqa,
                                 pack_gqa_chosen=pack_gqa_chosen, config=config, **build)
    aux_scalars = tuple(aux_scalars) if aux_scalars else None
    key = (statics, tuple(type(s) for s in aux_scalars) if aux_scalars else None)
    order = _tile_order(statics, sparse, q) if statics.ordered_tiles else None
    counter = tile_counter(statics, q.device)
    if key not in _verified_keys:
        _compile_checked(key, statics, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                         window_size_left, window_size_right, score_mod, mask_mod, aux_tensors, aux_scalars,
                         learnable_sink, sparse, order, counter)
    _compile_cache[key](
        q.detach(), k.detach(), v.detach(), out.detach(), lse, softmax_scale,
        cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        None, window_size_left, window_size_right, learnable_sink,
        None if sparse is None else block_sparse.launch_tuple(sparse),
        with_tile_order(with_tile_order(AuxData(aux_tensors, aux_scalars), order), counter),
        None, None,
    )
    return out, lse


def tile_counter(statics: FwdStatics, device: torch.device) -> Optional[torch.Tensor]:
    """A dynamic persistent config's tile counter (kernels/persistent_scheduler.py): a zeroed int32 for each
    call, from the caching allocator (a stream's calls never share one), appended after the tile order. None
    for varlen q, which runs one CTA per tile."""
    if not (statics.config.dynamic and statics.config.persistent) or statics.has_cu_seqlens_q or statics.has_seqused_q:
        return None
    return torch.zeros(1, dtype=torch.int32, device=device)


def _tile_order(statics: FwdStatics, sparse, q: torch.Tensor) -> torch.Tensor:
    """The longest-first launch order of a block-sparse forward's tiles (block_sparse.tile_order)."""
    packed = statics.qhead_per_kvhead if statics.pack_gqa else 1
    rows = q.shape[1] * packed
    return block_sparse.tile_order(
        sparse, batch=q.shape[0], grid_heads=q.shape[2] // packed, num_block=-(-rows // statics.config.tile_m),
        tiles_per_sparse_row=packed * sparse.q_subtile_factor,
    )


def _compile_checked(key, statics, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                     window_size_left, window_size_right, score_mod, mask_mod, aux_tensors, aux_scalars,
                     learnable_sink=None, sparse=None, order=None, counter=None) -> None:
    """Compile and occupancy-check the kernel of `key`, once per process.

    A kernel from FLASH_ATTN_SM120_CACHE_DIR is used as loaded on a real SM120 (the check there only
    tests the model; such a kernel leaves no record), and recompiled anywhere else: in emulation a
    padded launch runs only after its check, and an unpadded run is always recorded."""
    if key not in _compile_cache or launch_mode(statics.emulate_host_smem, q.device) != "sm120":
        index = [to_cute_tensor(t, assumed_align=4, leading_dim=0) if t is not None else None
                 for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)]
        cute_aux = [to_cute_aux_tensor(t) for t in aux_tensors] if aux_tensors is not None else None
        tensors = [to_cute_tensor(t) for t in (q, k, v, out)]
        cute_lse = to_cute_tensor(lse, assumed_align=4) if lse is not None else None
        cute_sink = sink_tensor(learnable_sink)
        _compile_cache[key] = compile_verified(
            lambda host: make_kernel(replace(statics, emulate_host_smem=host), score_mod, mask_mod,
                                     aux_tensors is not None),
            lambda kernel, options: compile_kernel(
                kernel, *tensors, cute_lse, *index, window_size_left, window_size_right,
                with_tile_order(
                    with_tile_order(AuxData(cute_aux, aux_scalars),
                                    None if order is None else to_cute_tensor(order, assumed_align=4, leading_dim=0)),
                    None if counter is None else to_cute_tensor(counter, assumed_align=4, leading_dim=0)),
                options=options, learnable_sink=cute_sink,
                blocksparse=None if sparse is None else block_sparse.cute_tensors(sparse),
            ),
            statics.emulate_host_smem, q.device, describe(statics),
        )
        compile_count["fwd"] += 1
    _verified_keys.add(key)

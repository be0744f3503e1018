"""What would run: the SM120 dispatch decision for a call, without running it (no GPU needed).

`explain(q, k, v, ...)` takes the same arguments as `flash_attn_func` / `flash_attn_varlen_func`
(tensors may be on the `meta` device: only shapes, strides and dtypes are read) and returns the
decision the drivers make for that call on an SM120 GPU with `num_sms` SMs:

  * the route: `driver` (dense, unsplit prefill: cp.async or TMA family) or `splitkv` (paged,
    split or decode-shaped calls);
  * the kernel family and config (warps, tile, stages, Q in registers), whether the decode table
    chose it, and, when the table's first choice cannot take the call (the TMA family refuses
    varlen, a GQA ratio it cannot pack, ...), why it fell back;
  * the split count, the key blocks per split and the CTAs of the grid;
  * shared memory per CTA and CTAs per SM on SM120 (hardware.py's occupancy model).

It calls the drivers' own decision functions (`driver.choose_statics`, `driver_splitkv.make_call_plan`),
so it cannot drift from what `forward` does. Input validation is the API's job: explain assumes
valid inputs.

    python -m flash_attn_sm120.explain --batch 1 --seqlen-q 1 --seqlen-k 32768 --heads 32 --heads-kv 8 --head-dim 128
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Optional

import torch

from flash_attn_sm120 import driver, driver_splitkv, hardware, splitkv, validation
from flash_attn_sm120.config import FwdConfig
from flash_attn_sm120.device import DeviceInfo
from flash_attn_sm120.kernels import FAMILIES


@dataclass(frozen=True)
class Explanation:
    route: str  # "driver" or "splitkv"
    family: str
    config: FwdConfig
    decode: bool  # the decode table chose the config
    num_splits: int
    n_blocks: int  # key blocks one M tile visits
    grid_ctas: int  # CTAs of the main kernel (splits included)
    pack_gqa: bool
    smem_bytes: int  # dynamic + static shared memory per CTA
    ctas_per_sm: int
    occupancy_limiter: str
    fallback: Optional[str]  # why the table's first choice did not run, if it did not
    num_sms: int

    def __str__(self) -> str:
        c = self.config
        lines = [
            f"route      {self.route}" + (" (decode table)" if self.decode else ""),
            f"kernel     {self.family}: {c.num_warps} warps, {c.tile_m}x{c.tile_n}, {c.num_stages} stage(s)"
            + (", Q in registers" if c.q_in_regs else "") + (", GQA packed" if self.pack_gqa else ""),
            f"splits     {self.num_splits} ({self.n_blocks} key blocks per M tile; {self.grid_ctas} CTAs on "
            f"{self.num_sms} SMs)",
            f"SM120      {self.smem_bytes} B shared memory per CTA, {self.ctas_per_sm} CTA(s) per SM "
            f"(limited by {self.occupancy_limiter})",
        ]
        if self.fallback:
            lines.append(f"fallback   {self.fallback}")
        return "\n".join(lines)


def _sm120(num_sms: int) -> DeviceInfo:
    return DeviceInfo("SM120 (assumed)", (12, 0), num_sms, hardware.SMEM_PER_SM, hardware.SMEM_PER_BLOCK_MAX, "sm120")


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window_size: tuple = (None, None),
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    return_lse: bool = False,
    page_table: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    num_sms: int = hardware.DEFAULT_NUM_SMS,
) -> Explanation:
    """The dispatch decision for these arguments on an SM120 GPU with `num_sms` SMs (see module doc)."""
    left, right = validation.normalize_window(window_size)
    info = _sm120(num_sms)
    num_heads, num_heads_kv = q.shape[-2], v.shape[-2]
    common = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k)
    if driver_splitkv.takes_this_path(q=q, page_table=page_table, num_splits=num_splits, cu_seqlens_q=cu_seqlens_q,
                                      max_seqlen_q=max_seqlen_q):
        cp = driver_splitkv.make_call_plan(
            q, k, v, page_table=page_table, num_splits=num_splits, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            causal=causal, window_size_left=left, window_size_right=right, softcap=softcap, softmax_scale=None,
            pack_gqa=pack_gqa, need_lse=return_lse, lse=None, emulate_host_smem=None, score_mod=None, mask_mod=None,
            aux_tensors=None, aux_scalars=None, config=None, num_sms=num_sms, info=info, **common,
        )
        split = cp.split
        if not cp.to_driver:
            statics = cp.compile_key[0].fwd
            chosen = replace(split.config, family=statics.config.family)
            fallback = None
            if chosen != statics.config:  # the table's choice cannot run in the splitkv family
                why = chosen.error(q.shape[-1], v.shape[-1])
                fallback = (f"{split.config.name} cannot run in the splitkv family ({why}); "
                            f"{statics.config.name} runs instead (driver_splitkv.kernel_config)")
            return _explanation("splitkv", statics.config, (q.shape[-1], v.shape[-1]), statics.pack_gqa, split.decode,
                                split.num_splits, split.n_blocks, split.total_mblocks * split.num_splits, fallback,
                                num_sms)
        config, decode, n_blocks, total = cp.driver_config, split.decode, split.n_blocks, split.total_mblocks
    else:
        config, decode, n_blocks, total = None, False, None, None
    causal_r, local, left, right = driver._resolve_causal_local_window(causal, left, right, None)
    pack_chosen = pack_gqa is not None
    pack = driver.resolve_pack_gqa(pack_gqa, num_heads // num_heads_kv)
    table_first = config or driver.table_config(q, v, causal_r, local, common.get("cu_seqlens_q"),
                                                common.get("seqused_q"), common.get("cu_seqlens_k"),
                                                common.get("seqused_k"))
    statics = driver.choose_statics(
        q, k, v, causal=causal_r, local=local, pack_gqa=pack, pack_gqa_chosen=pack_chosen, has_lse=return_lse,
        window_size_left=left, window_size_right=right, score_mod=driver.softcap_score_mod(softcap, None),
        mask_mod=None, aux_tensors=None, config=config, emulate_host_smem=None, **common,
    )
    fallback = None
    if statics.config != table_first:
        check = getattr(FAMILIES[table_first.family].kernel_cls, "unsupported_reason", None)
        reason = check(driver.build_statics(
            q, k, v, causal=causal_r, local=local, pack_gqa=pack, has_lse=return_lse, window_size_left=left,
            window_size_right=right, score_mod=None, mask_mod=None, aux_tensors=None, config=table_first,
            emulate_host_smem=None, **common,
        )) if check else None
        fallback = f"{table_first.name} cannot run this call ({reason}); its cp.async entry runs instead"
    if n_blocks is None:
        cfg = statics.config
        n_blocks = splitkv.num_n_blocks(max_seqlen_k or k.shape[-3], cfg.tile_n, local=local, window_left=left,
                                        window_right=right, tile_m=cfg.tile_m)
        total = splitkv.total_m_blocks(
            batch=cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None else q.shape[0],
            max_seqlen_q=max_seqlen_q or q.shape[-3], num_heads=num_heads, num_heads_kv=num_heads_kv,
            tile_m=cfg.tile_m, pack_gqa=statics.pack_gqa,
        )
    return _explanation("driver", statics.config, (q.shape[-1], v.shape[-1]), statics.pack_gqa, decode, 1, n_blocks,
                        total, fallback, num_sms)


def _explanation(route: str, config: FwdConfig, head_dims: tuple[int, int], pack_gqa: bool, decode: bool,
                 num_splits: int, n_blocks: int, grid_ctas: int, fallback: Optional[str], num_sms: int) -> Explanation:
    threads = config.num_threads + (128 if config.family == "tma" else 0)  # the TMA producer warpgroup
    smem = config.smem_bytes(*head_dims) + hardware.DSL_STATIC_SMEM
    occ = hardware.sm120_occupancy(smem, threads)
    return Explanation(route, config.family, config, decode, num_splits, n_blocks, grid_ctas, pack_gqa, smem,
                       occ.ctas_per_sm, occ.limiter, fallback, num_sms)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    ap.add_argument("--seqlen-q", type=int, default=1, help="query length (default 1: a decode step)")
    ap.add_argument("--seqlen-k", type=int, default=32768, help="key length (default 32768)")
    ap.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    ap.add_argument("--heads-kv", type=int, default=8, help="key/value heads, GQA when fewer (default 8)")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim of q, k and v (default 128)")
    ap.add_argument("--causal", action="store_true", help="causal mask")
    ap.add_argument("--num-splits", type=int, default=1,
                    help="SplitKV as upstream: 1 off, n > 1 that many, <= 0 chosen for the GPU (default 1)")
    ap.add_argument("--page-size", type=int, default=0, help="paged KV with this page size (0: dense)")
    ap.add_argument("--num-sms", type=int, default=hardware.DEFAULT_NUM_SMS,
                    help=f"SMs of the SM120 GPU to plan for (default {hardware.DEFAULT_NUM_SMS})")
    args = ap.parse_args(argv)
    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(args.batch, args.seqlen_q, args.heads, args.head_dim, **meta)
    if args.page_size:
        pages = -(-args.seqlen_k // args.page_size)
        k = torch.empty(args.batch * pages, args.page_size, args.heads_kv, args.head_dim, **meta)
        table = torch.empty(args.batch, pages, device="meta", dtype=torch.int32)
        q = q.reshape(-1, args.heads, args.head_dim)
        cu = torch.empty(args.batch + 1, device="meta", dtype=torch.int32)
        print(explain(q, k, k, causal=args.causal, num_splits=args.num_splits, page_table=table, cu_seqlens_q=cu,
                      max_seqlen_q=args.seqlen_q, num_sms=args.num_sms))
    else:
        k = torch.empty(args.batch, args.seqlen_k, args.heads_kv, args.head_dim, **meta)
        print(explain(q, k, k, causal=args.causal, num_splits=args.num_splits, num_sms=args.num_sms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

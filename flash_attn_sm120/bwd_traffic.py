"""Shared-memory traffic of one backward mainloop pass, and the throughput bound it sets.

One pass (one m_block of one CTA, kernels/bwd_sm120.py) runs five products on `mma.sync`, each warp
loading its operand fragments from shared memory with `ldmatrix`:

    S  = Q K^T,   dP = dO V^T     warp tile (m / atom_m_sdp) x (n * atom_m_sdp / warps), k = d / dv
    dV = P^T dO,  dK = dS^T Q     warp tile (n / atom_n_dkv) x (dv or d * atom_n_dkv / warps), k = m
    dQ = dS K                     warp tile (m / atom_m_dq) x (d * atom_m_dq / warps), k = n

so a warp reads (rows + cols) x k elements per product: its A rows and its B columns. V in registers
drops dP's V columns; P/dS in registers drops the dV/dK products' A rows. The pass also stores P and dS
(m x n each; dS only with P/dS in registers) and receives Q and dO (cp.async, m x d and m x dv).
`codegen.main_loop_ldsm_bytes` counts the same ldmatrix bytes in the compiled SASS (tests pin them equal).

FLOPs per pass are 2 m n (3 d + 2 dv) for every layout, so FLOP per shared-memory byte ranks configs for
a GPU whose shared memory binds before its tensor cores: the SM120 emulation host (H100/H200: mma.sync
about 2,760 FLOP/clk/SM, shared memory 128 B/clk/SM). On SM120 itself mma.sync is about 2.4x slower per
SM-clock, so this bound is looser there.
"""

from __future__ import annotations

from flash_attn_sm120.kernels.fwd_cpasync import _round_up
from flash_attn_sm120.kernels.bwd_tiling import _HDIM_MULTIPLE, BwdConfig

SMEM_BYTES_PER_CLK = 128  # per SM, NVIDIA's shared-memory bandwidth since Volta (32 banks x 4 B)


def ldsm_elems_per_warp(cfg: BwdConfig, head_dim: int, head_dim_v: int) -> int:
    """Elements one warp loads with ldmatrix in one mainloop pass (module docstring)."""
    d, dv = _round_up(head_dim, _HDIM_MULTIPLE), _round_up(head_dim_v, _HDIM_MULTIPLE)
    w, m, n = cfg.num_warps, cfg.m_block, cfg.n_block
    rows_s, cols_s = m // cfg.atom_m_sdp, n * cfg.atom_m_sdp // w
    s = (rows_s + cols_s) * d
    dp = (rows_s + (0 if cfg.v_in_regs else cols_s)) * dv
    rows_kv = 0 if cfg.pds_in_regs else n // cfg.atom_n_dkv
    dv_prod = (rows_kv + dv * cfg.atom_n_dkv // w) * m
    dk_prod = (rows_kv + d * cfg.atom_n_dkv // w) * m
    dq = (m // cfg.atom_m_dq + d * cfg.atom_m_dq // w) * n
    return s + dp + dv_prod + dk_prod + dq


def pass_flops(cfg: BwdConfig, head_dim: int, head_dim_v: int) -> int:
    d, dv = _round_up(head_dim, _HDIM_MULTIPLE), _round_up(head_dim_v, _HDIM_MULTIPLE)
    return 2 * cfg.m_block * cfg.n_block * (3 * d + 2 * dv)


def pass_smem_bytes(cfg: BwdConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> int:
    """Shared-memory bytes one CTA moves in a pass: every warp's ldmatrix loads, the P/dS stores and the
    Q/dO tiles cp.async writes."""
    d, dv = _round_up(head_dim, _HDIM_MULTIPLE), _round_up(head_dim_v, _HDIM_MULTIPLE)
    loads = ldsm_elems_per_warp(cfg, head_dim, head_dim_v) * cfg.num_warps
    stores = (1 if cfg.pds_in_regs else 2) * cfg.m_block * cfg.n_block
    return (loads + stores + cfg.m_block * (d + dv)) * elem_bytes


def smem_bound_tflops(cfg: BwdConfig, head_dim: int, head_dim_v: int, num_sms: int, clock_ghz: float,
                      mma_tflops: float) -> float:
    """The backward's TFLOPS if shared memory (or, where it binds first, mma.sync at `mma_tflops`) ran
    flat out on every SM, the pre/postprocess and every other instruction free."""
    per_sm = SMEM_BYTES_PER_CLK * pass_flops(cfg, head_dim, head_dim_v) / pass_smem_bytes(cfg, head_dim, head_dim_v)
    return min(per_sm * num_sms * clock_ghz / 1e3, mma_tflops)

"""The SM120 backward's tiling as data: `BwdConfig`, its shared-memory footprint and SM120's rules for it.

Host-side only (kernels/bwd_sm120.py builds the kernel from a BwdConfig). A config is the CTA's warp
count, its m_block x n_block tile, its Q and dO ring depths, each product's warp atom layout and
swapAB flag, and whether V stays in registers. What this module answers without compiling:

  * `smem_bytes`: the dynamic shared memory of upstream's SharedStorage for a config, field by field
    in its order and alignment (upstream's SM120 `can_implement` counts Q, dO, K and V only, not sP,
    sdS, sLSE and sdPsum), with V in registers sharing sQ (`shared_qv_bytes`, `v_runs_into_sdo`);
  * `bwd_config_error`: why a config cannot run on SM120 (warp layouts that do not tile the products,
    stage rules of upstream's mainloop, the preprocess's rows per pass, 99 KB per block), or None;
  * `preprocess_rows` / `preprocess_multiple`: the head-dim multiple upstream's preprocess must run
    with so that one pass never covers more rows than a tile;
  * `dq_wide_fits`: whether the dQ tile splits into 16-byte reductions over every thread;
  * `upstream_bwd_config`: what upstream's `_flash_attn_bwd` runs on SM120 (the benchmarks' "before").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from flash_attn_sm120 import hardware
from flash_attn_sm120.kernels.fwd_cpasync import _round_up

_HDIM_MULTIPLE = 32  # upstream pads the backward's head dims to a multiple of 32
_SMEM_ALIGN = 1024  # sK, sV, sQ, sdO are 1 KB aligned
_SMALL_ALIGN = 128  # sLSE, sdPsum, sP, sdS are 128 B aligned
DQ_WIDE_ELEMS = 4  # fp32 elements per dQ reduction with dq_wide_adds (16 bytes)


@dataclass(frozen=True)
class BwdConfig:
    """Static tiling of one backward kernel (upstream's FlashAttentionBackwardSm80 parameters)."""

    num_threads: int = 128
    m_block: int = 64
    n_block: int = 64
    stages_q: int = 1
    stages_do: int = 1
    sdp_swapab: bool = False
    dkv_swapab: bool = False
    dq_swapab: bool = False
    atom_m_sdp: int = 4
    atom_n_dkv: int = 4
    atom_m_dq: int = 4
    v_in_regs: bool = False

    @property
    def num_warps(self) -> int:
        return self.num_threads // 32

    @property
    def pds_in_regs(self) -> bool:
        """P and dS stay in registers as the A operand of dV += P^T dO and dK += dS^T Q (upstream's
        Mma_dKV_is_RS condition): S/dP computed transposed (sdp_swapab) with every warp along the keys
        in both products, so that a warp's S^T accumulator rows are its dK/dV rows."""
        return (self.sdp_swapab and not self.dkv_swapab and self.atom_m_sdp == 1
                and self.atom_n_dkv == self.num_warps)

    @property
    def name(self) -> str:
        swaps = "".join(c for c, on in (("s", self.sdp_swapab), ("k", self.dkv_swapab), ("q", self.dq_swapab)) if on)
        return (f"bwd-w{self.num_warps}-{self.m_block}x{self.n_block}-q{self.stages_q}do{self.stages_do}"
                f"-a{self.atom_m_sdp}{self.atom_n_dkv}{self.atom_m_dq}{'-swap' + swaps if swaps else ''}"
                f"{'-vreg' if self.v_in_regs else ''}")

    def to_dict(self) -> dict:
        return asdict(self)


def upstream_bwd_config(head_dim: int) -> BwdConfig:
    """What upstream's `_flash_attn_bwd` runs on SM120: 4 warps, 64x64, 2 stages up to d=64, else 1."""
    stages = 2 if head_dim <= 64 else 1
    return BwdConfig(128, 64, 64, stages, stages, False, False, False, 4, 4, 4, False)


def smem_bytes(head_dim: int, head_dim_v: int, cfg: BwdConfig, elem_bytes: int = 2,
               v_into_sdo: Optional[bool] = None) -> int:
    """Dynamic shared memory of one CTA, as upstream's SharedStorage lays it out (field order kept).

    sK, sV, sQ (stages_q), sdO (stages_do): 1 KB aligned; sLSE and sdPsum (fp32, (m, stages_q) with a
    column stride rounded to 64); sP and sdS (m x n): 128 B aligned; the struct rounds to 1 KB. With
    V in registers V's prologue copy lands in sQ, and runs on into sdO where that fits one more CTA per
    SM (v_runs_into_sdo; shared_qv_bytes sizes sQ), and the unused sV field is one element, moved last.
    With P/dS in registers (`pds_in_regs`) nothing is stored to sP: it shrinks to one element (both: the
    kernel's `_get_shared_storage_cls`).
    """
    if v_into_sdo is None:
        v_into_sdo = v_runs_into_sdo(head_dim, head_dim_v, cfg, elem_bytes)
    hd, hdv = _round_up(head_dim, _HDIM_MULTIPLE), _round_up(head_dim_v, _HDIM_MULTIPLE)
    q = cfg.m_block * hd * cfg.stages_q * elem_bytes
    v = cfg.n_block * hdv * elem_bytes
    do = cfg.m_block * hdv * cfg.stages_do * elem_bytes
    fields = [
        (cfg.n_block * hd * elem_bytes, _SMEM_ALIGN),  # sK
        *([] if cfg.v_in_regs else [(v, _SMEM_ALIGN)]),  # sV
        (shared_qv_bytes(q, v, do, v_into_sdo) if cfg.v_in_regs else q, _SMEM_ALIGN),  # sQ
        (do, _SMEM_ALIGN),  # sdO
    ]
    lse = (cfg.m_block + (cfg.stages_q - 1) * _round_up(cfg.m_block, 64)) * 4
    fields += [(lse, _SMALL_ALIGN), (lse, _SMALL_ALIGN)]  # sLSE, sdPsum
    p = elem_bytes if cfg.pds_in_regs else cfg.m_block * cfg.n_block * elem_bytes
    fields += [(p, _SMALL_ALIGN), (cfg.m_block * cfg.n_block * elem_bytes, _SMALL_ALIGN)]  # sP, sdS
    if cfg.v_in_regs:
        fields.append((elem_bytes, _SMALL_ALIGN))  # sV, one element
    offset = 0
    for size, align in fields:
        offset = _round_up(offset, align) + size
    return _round_up(offset, _SMEM_ALIGN)


def shared_qv_bytes(q: int, v: int, do: int, into_sdo: bool) -> int:
    """sQ's field with V in registers: V's prologue copy lands at sQ's start, as upstream's shared Q/V
    (sQ sized max(Q, V)). `into_sdo`: it may run on into sdO, the next field, when sQ's ring ends on a
    1 KB boundary (so sdO starts right after it): nothing loads Q or dO until every warp holds its V
    (upstream's prologue: V copied to registers, then a barrier, then the first Q and dO loads), and the
    epilogue's dV staging (over V's view) waits for the main loop's last reads at a barrier."""
    return max(q, v - do) if into_sdo and q % _SMEM_ALIGN == 0 else max(q, v)


def _sm120_ctas_by_smem(dynamic_smem: int) -> int:
    """CTAs per SM that SM120's shared memory allows: 100 KB per SM, 99 KB per block, 1 KB per CTA held back.
    The occupancy model's shared-memory limit, written with the two constants patch generation maps
    into upstream (this module is lifted); a test pins the two equal."""
    reserved = 1024
    return (hardware.SMEM_PER_BLOCK_MAX + reserved) // (dynamic_smem + hardware.DSL_STATIC_SMEM + reserved)


def v_runs_into_sdo(head_dim: int, head_dim_v: int, cfg: BwdConfig, elem_bytes: int = 2) -> bool:
    """With V in registers: V's prologue copy runs from sQ on into sdO only where that fits more CTAs
    per SM on SM120 (d128 on 4 warps, 32x64: 41 KB and two CTAs, against 49 KB and one); elsewhere sQ
    stays max(Q, V), the layout the earlier measurements ran."""
    if not cfg.v_in_regs:
        return False
    apart, into = (smem_bytes(head_dim, head_dim_v, cfg, elem_bytes, v_into_sdo=f) for f in (False, True))
    return into < apart and _sm120_ctas_by_smem(into) > _sm120_ctas_by_smem(apart)


def _layout_error(what: str, rows: int, cols: int, atom: int, warps: int) -> Optional[str]:
    """An MMA over a rows x cols tile with `atom` warps along rows and the rest along cols.

    swapAB transposes the MMA and its atom layout together (upstream's _get_tiled_mma), so the warps
    along each tile side, and the 16-row granules they need, are the same either way."""
    if warps % atom:
        return f"{what}: {atom} warps along one side do not divide {warps} warps"
    if rows % (16 * atom) or cols % (16 * (warps // atom)):
        return (f"{what}: a {rows}x{cols} tile is not a multiple of {16 * atom}x{16 * (warps // atom)} "
                f"({atom}x{warps // atom} warps)")
    return None


def preprocess_rows(head_dim_v: int, threads: int = 256, multiple: int = _HDIM_MULTIPLE) -> int:
    """Rows of O/dO one pass of upstream's backward preprocess covers (its 256 threads, 16-byte loads,
    and a power-of-two k-block of 128, 64 or 32 columns that divides the head dim padded to `multiple`).
    With a tile (m_block) smaller than this it writes past its tile's dPsum rows."""
    hdv = _round_up(head_dim_v, multiple)
    k_block = 128 if hdv % 128 == 0 else 64 if hdv % 64 == 0 else 32
    return threads // (k_block // 8)


def preprocess_multiple(head_dim_v: int, m_block: int) -> Optional[int]:
    """The head-dim multiple to run upstream's preprocess with for a tile of m_block rows: the
    backward's own (32), unless a pass then covers more rows than the tile; else 64 or 128, whose wider
    k-block covers fewer rows (the columns past head_dim_v are predicated off; the caller then zeroes
    the dQ accumulator itself, whose layout keeps the multiple of 32). None if none covers few enough."""
    for multiple in (_HDIM_MULTIPLE, 64, 128):
        if preprocess_rows(head_dim_v, multiple=multiple) <= m_block:
            return multiple
    return None


def bwd_config_error(head_dim: int, head_dim_v: int, cfg: BwdConfig) -> Optional[str]:
    """Why a backward config cannot run on SM120, or None if it can."""
    if cfg.num_threads not in (128, 256):
        return f"num_threads={cfg.num_threads}: only 128 (4 warps) or 256 (8 warps) are supported"
    if head_dim % 8 or head_dim_v % 8 or not (8 <= head_dim <= 256 and 8 <= head_dim_v <= 256):
        return f"head dims ({head_dim}, {head_dim_v}) must be multiples of 8 in [8, 256]"
    if not (1 <= cfg.stages_q <= 2 and 1 <= cfg.stages_do <= 2):
        return f"stages (Q {cfg.stages_q}, dO {cfg.stages_do}) must be 1 or 2"
    # upstream's SM80/SM120 mainloop: it asserts stages_q >= stages_do; with S/dP swapped its step's LSE
    # and dPsum rows no longer match the accumulator's (an assertion; this package's step reads them per
    # column), and swapped dK/dV fails to build
    if cfg.stages_q < cfg.stages_do:
        return f"stages_q ({cfg.stages_q}) must be >= stages_do ({cfg.stages_do}) in upstream's mainloop"
    if cfg.dkv_swapab:
        return "dkv_swapab is not supported by upstream's SM80/SM120 mainloop (dq_swapab is)"
    if cfg.sdp_swapab and not cfg.pds_in_regs:
        # the modifier step (FlashAttentionBackwardSm120Mods) runs swapped S/dP only to keep P and dS in registers
        return (f"sdp_swapab runs only with P/dS in registers: atom_m_sdp=1 and atom_n_dkv=num_warps "
                f"({cfg.num_warps}), got atom_m_sdp={cfg.atom_m_sdp}, atom_n_dkv={cfg.atom_n_dkv}")
    # measured on the H200 (configs/measurements/2026-12-01_bwd_first_emulated.md): dq_swapab fails to build
    # when the padded head dim is not a multiple of 64. (V in registers, wrong dQ in upstream's step there,
    # runs on this package's step: FlashAttentionBackwardSm120Tuned refuses it on upstream's.)
    if cfg.dq_swapab and _round_up(head_dim, _HDIM_MULTIPLE) % 64:
        return f"dq_swapab needs the padded head dim ({_round_up(head_dim, _HDIM_MULTIPLE)}) to be a multiple of 64"
    if preprocess_multiple(head_dim_v, cfg.m_block) is None:
        # measured on the H200: d96 32x64 with the preprocess's 64-row passes
        # gave wrong dQ/dK/dV at b1 s4096 h16, right at s1024 -- the last m_block of a head wrote zeros
        # over the next head's first dPsum rows, a race that larger grids lose (preprocess_multiple)
        rows = preprocess_rows(head_dim_v, multiple=128)
        return (f"m_block={cfg.m_block} is smaller than the {rows} rows upstream's preprocess covers per pass "
                f"at head_dim_v={head_dim_v}: its last m_block per head would overwrite the next head's dPsum")
    warps = cfg.num_warps
    hd, hdv = _round_up(head_dim, _HDIM_MULTIPLE), _round_up(head_dim_v, _HDIM_MULTIPLE)
    for err in (
        _layout_error("S/dP", cfg.m_block, cfg.n_block, cfg.atom_m_sdp, warps),
        _layout_error("dK", cfg.n_block, hd, cfg.atom_n_dkv, warps),
        _layout_error("dV", cfg.n_block, hdv, cfg.atom_n_dkv, warps),
        _layout_error("dQ", cfg.m_block, hd, cfg.atom_m_dq, warps),
    ):
        if err is not None:
            return err
    smem = smem_bytes(head_dim, head_dim_v, cfg) + hardware.DSL_STATIC_SMEM
    if smem > hardware.SMEM_PER_BLOCK_MAX:
        return f"needs {smem} B of shared memory, SM120 allows {hardware.SMEM_PER_BLOCK_MAX} B per block"
    return None


def dq_wide_fits(cfg: BwdConfig, head_dim: int) -> bool:
    """Whether a dQ accumulator tile (m_block x padded head dim) splits into DQ_WIDE_ELEMS-element pieces
    over every thread, as the wide dQ adds and their postprocess partition it. Always, for a config that
    bwd_config_error admits: its dQ MMA tiles the tile with 16x16 per warp, 8 elements per thread."""
    return cfg.m_block * _round_up(head_dim, _HDIM_MULTIPLE) % (DQ_WIDE_ELEMS * cfg.num_threads) == 0

"""sm_120a code generation on any machine: compile a forward kernel with fake tensors, inspect it.

No GPU is needed. The kernel is traced with CuTe fake tensors (symbolic batch/sequence sizes),
compiled with `--gpu-arch=sm_120a`, and the cubin is read with `cuobjdump`:
registers and stack from `--dump-resource-usage`, an opcode histogram from `--dump-sass`
(which needs `nvdisasm`; both ship inside triton's wheel, cuobjdump also in nvidia-cuda-cuobjdump).
Shared memory is the kernel's launch size (recorded by the kernel class at trace time) plus the
cubin's static shared memory; CTAs per SM come from hardware.py's SM120 model.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Optional

from flash_attn_sm120 import hardware
from flash_attn_sm120.config import FwdConfig
from flash_attn_sm120.occupancy import cubin_of

TARGET_ARCH = "sm_120a"


@dataclass
class CodegenResult:
    name: str
    shipped: bool
    config: dict
    head_dim: int
    head_dim_v: int
    causal: bool
    dtype: str
    regs: int
    stack_bytes: int
    local_loads: int
    local_stores: int
    spill_bytes: int
    smem_bytes: int
    smem_dynamic: int
    smem_static: int
    ctas_per_sm: int
    ctas_limiter: str
    warps_per_sm: int
    sass: dict = field(default_factory=dict)
    arch: str = TARGET_ARCH
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@lru_cache(maxsize=None)
def find_tool(name: str) -> Optional[str]:
    """cuobjdump / nvdisasm: PATH, then the nvidia-cuda-cuobjdump wheel, then triton's bundle."""
    found = shutil.which(name)
    if found:
        return found
    candidates = []
    try:
        import nvidia

        for base in nvidia.__path__:
            candidates += sorted(Path(base).glob(f"cu*/bin/{name}")) + sorted(Path(base).glob(f"cuda_*/bin/{name}"))
    except ImportError:
        pass
    try:
        import triton

        candidates.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)
    except ImportError:
        pass
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return None


_RES_RE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
_SASS_RE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)", re.M)


def parse_resource_usage(text: str) -> dict:
    """Largest kernel's REG/STACK/SHARED/LOCAL from `cuobjdump --dump-resource-usage` output."""
    rows = [tuple(int(x) for x in m.groups()) for m in _RES_RE.finditer(text)]
    if not rows:
        raise ValueError("no resource usage found in cuobjdump output")
    reg, stack, shared, local = max(rows)
    return {"regs": reg, "stack": stack, "shared": shared, "local": local}


def parse_sass_histogram(text: str, full: bool = False) -> dict:
    """Opcode -> count from `cuobjdump --dump-sass`; the base opcode (before the first '.') unless full."""
    counts = Counter()
    for m in _SASS_RE.finditer(text):
        op = m.group(1)
        counts[op if full else op.split(".")[0]] += 1
    return dict(sorted(counts.items()))


_SASS_LINE_RE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_BACK_BRANCH_RE = re.compile(r"(?:^|\s)(?:U?P\w+,\s*)?0x([0-9a-f]+)")
_LDSM_BYTES = {"4": 512, "2": 256}  # ldmatrix .x4 / .x2 per warp; .x1 reads 128 B


def sass_instructions(text: str) -> list[tuple[int, Optional[str], str, str]]:
    """(address, predicate or None, opcode, operands) of each instruction in `cuobjdump --dump-sass` text."""
    return [(int(m.group(1), 16), m.group(2) and m.group(2).strip(), m.group(3), m.group(4))
            for m in _SASS_LINE_RE.finditer(text)]


def backward_branches(lines: list[tuple[int, Optional[str], str, str]]) -> list[tuple[int, int]]:
    """(target, address) of each branch to a lower address, in address order: the loops of sass_instructions'
    lines (and the returns from out-of-line code, which callers that care tell apart)."""
    spans = []
    for addr, _, op, args in lines:
        target = _BACK_BRANCH_RE.search(args) if op.split(".")[0] == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            spans.append((int(target.group(1), 16), addr))
    return spans


def main_loop_ldsm_bytes(text: str) -> int:
    """ldmatrix bytes one warp reads per pass of a kernel's longest loop (the span of its longest backward
    branch in `cuobjdump --dump-sass`): the mainloop's shared-memory operand traffic, without the prologue's."""
    lines = sass_instructions(text)
    loops = backward_branches(lines)
    if not loops:
        raise ValueError("no loop (backward branch) in this SASS")
    lo, hi = max(loops, key=lambda span: span[1] - span[0])
    return sum(_LDSM_BYTES.get(op.rsplit(".", 1)[-1], 128) for addr, _, op, _ in lines
               if lo <= addr <= hi and op.startswith("LDSM"))


def inspect_cubin(cubin: bytes) -> tuple[dict, dict, str]:
    """(resource usage, opcode histogram, raw SASS) of a cubin."""
    cuobjdump = find_tool("cuobjdump")
    if cuobjdump is None:
        raise RuntimeError("cuobjdump not found: pip install nvidia-cuda-cuobjdump (or triton)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        res = subprocess.run([cuobjdump, "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True)
        env = dict(os.environ)
        nvdisasm = find_tool("nvdisasm")
        if nvdisasm is None:
            raise RuntimeError("nvdisasm not found (it ships in triton/backends/nvidia/bin)")
        env["PATH"] = str(Path(nvdisasm).parent) + os.pathsep + env.get("PATH", "")
        sass = subprocess.run([cuobjdump, "--dump-sass", str(path)], capture_output=True, text=True, check=True, env=env)
    return parse_resource_usage(res.stdout), parse_sass_histogram(sass.stdout), sass.stdout


def compile_fwd_cubin(
    config: FwdConfig,
    head_dim: int,
    head_dim_v: Optional[int] = None,
    *,
    causal: bool = False,
    local: bool = False,
    dtype: str = "bfloat16",
    qhead_per_kvhead: int = 1,
    pack_gqa: bool = False,
    has_lse: bool = True,
    arch: str = TARGET_ARCH,
    upstream_class: bool = False,
    emulate_host_smem: Optional[tuple] = None,
    kernel_out: Optional[list] = None,
    kernel_cls: Optional[type] = None,
    learnable_sink: bool = False,
    block_sparse: Optional[tuple] = None,
    varlen: tuple = (),
) -> tuple[bytes, int]:
    """Compile one forward kernel for `arch` with fake tensors; returns (cubin, dynamic smem bytes).
    varlen: names among cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k (packed (total, h, d)
    tensors for the cu_seqlens sides).
    learnable_sink: with an fp32 (h,) sink (folded into the output tile, kernels/sink_fold.py).
    block_sparse: (q_subtile_factor, kv_subtile_factor, with full lists) for block-sparse lists
    (kernels/fwd_block_sparse.py, TMA family).

    upstream_class=True builds upstream's own FlashAttentionForwardSm120 (the reference row);
    kernel_cls builds that class with upstream's constructor arguments instead (e.g. a patched
    upstream's FlashAttentionForwardSm120Tma).
    """
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.flash_fwd_sm120 import FlashAttentionForwardSm120
    from flash_attn.cute.utils import AuxData
    from quack.compile_utils import make_fake_tensor

    from flash_attn_sm120 import driver
    from flash_attn_sm120.block_sparse import orders_tiles
    from flash_attn_sm120.kernels.ordered_scheduler import with_tile_order

    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    cdtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[dtype]
    statics = driver.FwdStatics(
        dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, qhead_per_kvhead=qhead_per_kvhead,
        causal=causal, local=local, pack_gqa=pack_gqa, has_lse=has_lse,
        has_cu_seqlens_q="cu_seqlens_q" in varlen, has_cu_seqlens_k="cu_seqlens_k" in varlen,
        has_seqused_q="seqused_q" in varlen, has_seqused_k="seqused_k" in varlen, has_window_left=local,
        has_window_right=local, score_mod_hash=False, mask_mod_hash=False, aux_metadata=None,
        broadcast=(), config=config, emulate_host_smem=emulate_host_smem,
        block_sparse=None if block_sparse is None else (
            (*block_sparse, None) + (("cu_seqlens_k" in varlen,) if "cu_seqlens_q" in varlen else ())),
        # (this package's kernel only: upstream's class or kernel_cls takes no order)
        ordered_tiles=block_sparse is not None and not upstream_class and kernel_cls is None and orders_tiles(
            config, varlen_q="cu_seqlens_q" in varlen or "seqused_q" in varlen),
    )
    if upstream_class or kernel_cls is not None:
        kernel = (kernel_cls or FlashAttentionForwardSm120)(
            cdtype, head_dim, head_dim_v, qhead_per_kvhead, is_causal=causal, is_local=local,
            pack_gqa=pack_gqa, tile_m=config.tile_m, tile_n=config.tile_n, num_stages=config.num_stages,
            num_threads=config.num_threads, Q_in_regs=config.q_in_regs,
        )
    else:
        kernel = driver.make_kernel(statics)
    b, sq, sk = cute.sym_int(), cute.sym_int(), cute.sym_int()
    h = cute.sym_int()
    hk = h if qhead_per_kvhead == 1 else cute.sym_int()
    div = 16 // (cdtype.width // 8)
    rows_q = (cute.sym_int(),) if "cu_seqlens_q" in varlen else (b, sq)
    rows_k = (cute.sym_int(),) if "cu_seqlens_k" in varlen else (b, sk)
    q = make_fake_tensor(cdtype, (*rows_q, h, head_dim), divisibility=div)
    k = make_fake_tensor(cdtype, (*rows_k, hk, head_dim), divisibility=div)
    v = make_fake_tensor(cdtype, (*rows_k, hk, head_dim_v), divisibility=div)
    o = make_fake_tensor(cdtype, (*rows_q, h, head_dim_v), divisibility=div)
    lse_shape = (h, rows_q[0]) if "cu_seqlens_q" in varlen else (b, h, sq)
    lse = make_fake_tensor(cutlass.Float32, lse_shape, divisibility=1) if has_lse else None
    nb = cute.sym_int()
    cu_q, cu_k, used_q, used_k = [
        make_fake_tensor(cutlass.Int32, (nb if name.startswith("cu") else b,), divisibility=1) if name in varlen
        else None for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k")
    ]
    window = cutlass.Int32(0) if local else None
    sink = make_fake_tensor(cutlass.Float32, (h,), divisibility=1) if learnable_sink else None
    sparse = None
    if block_sparse is not None:
        from flash_attn.cute.block_sparsity import BlockSparseTensors

        m, n = cute.sym_int(), cute.sym_int()
        if "cu_seqlens_q" in varlen:  # upstream's varlen lists: (h, total Q blocks), (h, total entries)
            lists = [make_fake_tensor(cutlass.Int32, shape, divisibility=1)
                     for shape in ((h, m), (h, n)) * (2 if block_sparse[2] else 1)]
            lists += [None] * (4 - len(lists))
            cu_m = make_fake_tensor(cutlass.Int32, (nb,), divisibility=1)
            cu_idx = make_fake_tensor(cutlass.Int32, (nb,), divisibility=1) if "cu_seqlens_k" in varlen else None
            sparse = BlockSparseTensors(*lists, cu_m, cu_idx)
        else:
            lists = [make_fake_tensor(cutlass.Int32, shape, divisibility=1)
                     for shape in ((b, h, m), (b, h, m, n)) * (2 if block_sparse[2] else 1)]
            sparse = BlockSparseTensors(*lists)
    # the block-sparse launch order rides as the last aux tensor (kernels/ordered_scheduler.py)
    order = make_fake_tensor(cutlass.Int32, (cute.sym_int(),), divisibility=1) if statics.ordered_tiles else None
    # a dynamic persistent config's tile counter rides after it (kernels/persistent_scheduler.py)
    varlen_q = "cu_seqlens_q" in varlen or "seqused_q" in varlen
    counter = (make_fake_tensor(cutlass.Int32, (1,), divisibility=1)
               if config.dynamic and config.persistent and not varlen_q else None)
    with tempfile.TemporaryDirectory() as tmp:
        compiled = driver.compile_kernel(
            kernel, q, k, v, o, lse, cu_q, cu_k, used_q, used_k, window, window,
            with_tile_order(with_tile_order(AuxData(None, None), order), counter),
            options=f"--keep-cubin --dump-dir={tmp} --gpu-arch={arch}", learnable_sink=sink, blocksparse=sparse,
        )
        cubin = cubin_of(compiled)
    if kernel_out is not None:
        kernel_out.append(kernel)
    smem = getattr(kernel, "smem_bytes_launched", None)
    if smem is None:
        smem = config.smem_bytes(head_dim, head_dim_v)
    return cubin, smem


def report_row(
    config: FwdConfig,
    head_dim: int,
    head_dim_v: Optional[int] = None,
    *,
    name: Optional[str] = None,
    shipped: bool = False,
    causal: bool = False,
    dtype: str = "bfloat16",
    upstream_class: bool = False,
    note: str = "",
    keep_sass: Optional[dict] = None,
    block_sparse: Optional[tuple] = None,
    varlen: tuple = (),
    qhead_per_kvhead: int = 1,
    pack_gqa: bool = False,
) -> CodegenResult:
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    kernels: list = []
    cubin, smem_dyn = compile_fwd_cubin(config, head_dim, head_dim_v, causal=causal, dtype=dtype,
                                        upstream_class=upstream_class, kernel_out=kernels, block_sparse=block_sparse,
                                        varlen=varlen, qhead_per_kvhead=qhead_per_kvhead, pack_gqa=pack_gqa)
    # families with extra warps (the TMA producer warpgroup) launch more threads than config.num_threads
    threads = getattr(kernels[0], "num_threads_total", config.num_threads)
    return _row_of_cubin(cubin, smem_dyn, threads, config, keep_sass,
                         name=name or f"{config.name}-d{head_dim}{'-causal' if causal else ''}", shipped=shipped,
                         head_dim=head_dim, head_dim_v=head_dim_v, causal=causal, dtype=dtype, note=note)


def bwd_report_row(
    config,
    head_dim: int,
    head_dim_v: Optional[int] = None,
    *,
    name: Optional[str] = None,
    shipped: bool = False,
    causal: bool = False,
    local: bool = False,
    dtype: str = "bfloat16",
    qhead_per_kvhead: int = 1,
    note: str = "",
    keep_sass: Optional[dict] = None,
    block_sparse: Optional[tuple] = None,
    mods=None,
    deterministic: bool = False,
) -> CodegenResult:
    """The sm_120a codegen row of one backward kernel (a kernels.bwd_tiling.BwdConfig); block_sparse:
    (q_subtile, kv_subtile, full lists) for the list walk (kernels/bwd_block_sparse.py); mods: a
    driver_bwd.Mods for the modifier step (report_mods: the one the report and tests compile);
    deterministic: the dQ order the deterministic plan gives a dense call on a turns_only entry (descending
    turns with a causal mask, the rotated turns without one)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    ordering = deterministic_report_plan(config, causal, local, turns_entry=True) if deterministic else None
    cubin, smem_dyn = compile_bwd_cubin(config, head_dim, head_dim_v, causal=causal, local=local, dtype=dtype,
                                        qhead_per_kvhead=qhead_per_kvhead, block_sparse=block_sparse, mods=mods,
                                        deterministic=deterministic, ordering=ordering)
    mask = ("-causal" if causal else "-local" if local else "") + ("-det" if deterministic else "")
    return _row_of_cubin(cubin, smem_dyn, config.num_threads, config, keep_sass,
                         name=name or f"{config.name}-d{head_dim}{mask}", shipped=shipped, head_dim=head_dim,
                         head_dim_v=head_dim_v, causal=causal, dtype=dtype, note=note)


def deterministic_report_plan(config, causal: bool, local: bool = False, turns_entry: bool = False) -> dict:
    """The ordering bwd_plans.deterministic_plan gives a dense deterministic call of this config (b2 s4096 on
    188 SMs; fixed point without a mask or with a window, descending turns with a causal mask; on a
    turns_only entry without a mask, `turns_entry`, the rotated turns)."""
    from flash_attn_sm120.bwd_plans import deterministic_plan

    return deterministic_plan(188, config, causal, 4096, 4096, fixed_point=True, local=local,
                              rotated_entry=turns_entry and not (causal or local))


def report_mods():
    """The modifiers a modifier-step codegen row compiles (and the tests pin spill-free): a position-dependent
    score_mod pair and a document mask_mod over an aux tensor (fake), the heaviest of testing_mods's."""
    import cutlass
    import cutlass.cute as cute
    from quack.compile_utils import make_fake_tensor

    from flash_attn_sm120.driver_bwd import Mods
    from flash_attn_sm120.testing_mods import position_scale, position_scale_bwd, same_document

    doc = make_fake_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int()))
    return Mods(position_scale, position_scale_bwd, same_document, (doc,))


def _row_of_cubin(cubin: bytes, smem_dyn: int, threads: int, config, keep_sass: Optional[dict], **fields) -> CodegenResult:
    res, hist, sass_text = inspect_cubin(cubin)
    if keep_sass is not None:
        keep_sass["text"] = sass_text
    smem_total = smem_dyn + res["shared"]
    occ = hardware.sm120_occupancy(smem_total, threads, res["regs"])
    return CodegenResult(
        config=config.to_dict(),
        regs=res["regs"],
        stack_bytes=res["stack"],
        local_loads=hist.get("LDL", 0),
        local_stores=hist.get("STL", 0),
        spill_bytes=res["stack"] + res["local"],
        smem_bytes=smem_total,
        smem_dynamic=smem_dyn,
        smem_static=res["shared"],
        ctas_per_sm=occ.ctas_per_sm,
        ctas_limiter=occ.limiter,
        warps_per_sm=occ.ctas_per_sm * (threads // 32),
        sass=hist,
        **fields,
    )


def max_cp_async_wait_depth(sass_text: str) -> int:
    """Largest N in `DEPBAR.LE SB0, N` (cp.async groups left in flight at a wait); 0 if none."""
    depths = [int(x, 0) for x in re.findall(r"DEPBAR\.LE\s+SB0,\s*(0x[0-9a-f]+|\d+)", sass_text)]
    return max(depths, default=0)


def compile_splitkv_cubin(
    config: FwdConfig,
    head_dim: int,
    head_dim_v: Optional[int] = None,
    *,
    split: bool = True,
    paged: bool = True,
    causal: bool = False,
    local: bool = False,
    qhead_per_kvhead: int = 4,
    pack_gqa: bool = True,
    varlen_q: bool = False,
    seqused_k: bool = True,
    dtype: str = "bfloat16",
    arch: str = TARGET_ARCH,
    emulate_host_smem: Optional[tuple] = None,
    kernel_cls: Optional[type] = None,
    learnable_sink: bool = False,
) -> tuple[bytes, int]:
    """Compile one splitkv-family kernel (driver_splitkv) for `arch`; returns (cubin, launch smem).
    learnable_sink: with an fp32 (h,) sink, folded into split 0's output tile.

    split: fp32 partial O (splits, b, s, h, dv) / LSE (splits, b, h, s) outputs; paged: K/V page
    pools (num_pages, page_size, h_kv, d) with an int32 page table. All sizes are symbolic.
    kernel_cls: build this class instead (same constructor as upstream's SM120 forward plus
    is_split_kv), e.g. the patched upstream's FlashAttentionForwardSm120SplitKV.
    """
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from flash_attn.cute.utils import AuxData
    from quack.compile_utils import make_fake_tensor

    from flash_attn_sm120 import driver, driver_splitkv

    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    statics = driver_splitkv.SplitKVStatics(
        driver.FwdStatics(
            dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, qhead_per_kvhead=qhead_per_kvhead,
            causal=causal, local=local, pack_gqa=pack_gqa, has_lse=True, has_cu_seqlens_q=varlen_q,
            has_cu_seqlens_k=False, has_seqused_q=False, has_seqused_k=seqused_k, has_window_left=local,
            has_window_right=local, score_mod_hash=False, mask_mod_hash=False, aux_metadata=None,
            broadcast=(), config=config, emulate_host_smem=emulate_host_smem,
        ),
        is_split_kv=split,
        paged=paged,
    )
    cdtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[dtype]
    if kernel_cls is None:
        kernel = driver_splitkv.make_splitkv_kernel(statics)
    else:
        kernel = kernel_cls(
            cdtype, head_dim, head_dim_v, qhead_per_kvhead, is_causal=causal, is_local=local, pack_gqa=pack_gqa,
            tile_m=config.tile_m, tile_n=config.tile_n, num_stages=config.num_stages,
            num_threads=config.num_threads, Q_in_regs=config.q_in_regs, is_split_kv=split,
        )
    sym = cute.sym_int
    div = 16 // (cdtype.width // 8)
    b, sq, h, splits = sym(), sym(), sym(), sym()
    hk = h if qhead_per_kvhead == 1 else sym()
    rows = (sym(),) if varlen_q else (b, sq)
    q = make_fake_tensor(cdtype, (*rows, h, head_dim), divisibility=div)
    if split:
        o = make_fake_tensor(Float32, (splits, *rows, h, head_dim_v), divisibility=4)
        lse_shape = (splits, h, rows[0]) if varlen_q else (splits, b, h, sq)
    else:
        o = make_fake_tensor(cdtype, (*rows, h, head_dim_v), divisibility=div)
        lse_shape = (h, rows[0]) if varlen_q else (b, h, sq)
    lse = make_fake_tensor(Float32, lse_shape, divisibility=1)
    kv_rows = (sym(), sym()) if paged else (b, sym())  # (num_pages, page_size) or (b, seqlen_k)
    k = make_fake_tensor(cdtype, (*kv_rows, hk, head_dim), divisibility=div)
    v = make_fake_tensor(cdtype, (*kv_rows, hk, head_dim_v), divisibility=div)
    batch = sym() if varlen_q else b
    page_table = make_fake_tensor(Int32, (batch, sym()), divisibility=1) if paged else None
    cu_q = make_fake_tensor(Int32, (sym(),), divisibility=1) if varlen_q else None
    used_k = make_fake_tensor(Int32, (batch,), divisibility=1) if seqused_k else None
    window = cutlass.Int32(0) if local else None
    sink = make_fake_tensor(Float32, (h,), divisibility=1) if learnable_sink else None
    with tempfile.TemporaryDirectory() as tmp:
        compiled = driver_splitkv.compile_splitkv_kernel(
            kernel, q, k, v, o, lse, cu_q, None, None, used_k, page_table, window, window, AuxData(None, None),
            options=f"--keep-cubin --dump-dir={tmp} --gpu-arch={arch}", learnable_sink=sink,
        )
        cubin = cubin_of(compiled)
    smem = getattr(kernel, "smem_bytes_launched", None)
    return cubin, smem if smem is not None else config.smem_bytes(head_dim, head_dim_v)


def compile_combine_cubin(
    head_dim: int,
    num_splits: int,
    *,
    num_heads: int = 32,
    dtype: str = "bfloat16",
    varlen: bool = False,
    arch: str = TARGET_ARCH,
) -> bytes:
    """Compile upstream's split combine kernel (fp32 partials) for `arch` with fake tensors."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from flash_attn.cute.flash_fwd_combine import FlashAttentionForwardCombine
    from quack.compile_utils import make_fake_tensor

    from flash_attn_sm120 import driver_splitkv

    cdtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[dtype]
    combine = FlashAttentionForwardCombine(cdtype, Float32, head_dim, num_heads, **driver_splitkv.combine_kernel_params(head_dim, num_splits))
    sym = cute.sym_int
    splits, h = sym(), sym()
    if varlen:
        total = sym()
        o_partial = make_fake_tensor(Float32, (splits, total, h, head_dim), divisibility=4)
        lse_partial = make_fake_tensor(Float32, (splits, total, h), divisibility=1, leading_dim=1)
        o = make_fake_tensor(cdtype, (total, h, head_dim), divisibility=8)
        lse = make_fake_tensor(Float32, (total, h), divisibility=1, leading_dim=0)
        cu = make_fake_tensor(Int32, (sym(),), divisibility=1)
    else:
        b, s = sym(), sym()
        o_partial = make_fake_tensor(Float32, (splits, b, s, h, head_dim), divisibility=4)
        lse_partial = make_fake_tensor(Float32, (splits, b, s, h), divisibility=1, leading_dim=2)
        o = make_fake_tensor(cdtype, (b, s, h, head_dim), divisibility=8)
        lse = make_fake_tensor(Float32, (b, s, h), divisibility=1, leading_dim=1)
        cu = None
    with tempfile.TemporaryDirectory() as tmp:
        compiled = cute.compile(
            combine, o_partial, lse_partial, o, lse, cu, None, None, None, None,
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=f"--enable-tvm-ffi --keep-cubin --dump-dir={tmp} --gpu-arch={arch}",
        )
        cubin = cubin_of(compiled)
    return cubin


def compile_bwd_cubin(
    config,
    head_dim: int,
    head_dim_v: Optional[int] = None,
    *,
    causal: bool = False,
    local: bool = False,
    dtype: str = "bfloat16",
    qhead_per_kvhead: int = 1,
    arch: str = TARGET_ARCH,
    emulate_host_smem=None,
    kernel_out: Optional[list] = None,
    deterministic: bool = False,
    dq_descending: bool = False,
    mods=None,
    block_sparse: Optional[tuple] = None,
    ordering: Optional[dict] = None,
    varlen: bool = False,
) -> tuple[bytes, int]:
    """Compile one backward kernel (kernels/bwd_sm120.py, a BwdConfig) for `arch` with upstream's fake
    backward tensors; returns (cubin, launched dynamic smem). With GQA, dK/dV are fp32 accumulators;
    deterministic adds the ordering semaphores (int32, batch x heads x blocks; with dq_fixed_point in
    `ordering`, the int64 dQ accumulator and per-head scales instead of dQ's). mods: a driver_bwd.Mods
    (score_mod / score_mod_bwd / mask_mod; aux tensors as fake cute tensors) for the modifier step.
    ordering: the deterministic ordering's other kernel flags (dq_rotated, reverse_n_blocks, fetch_early,
    barrier_release; driver_bwd.deterministic_plan) and the launch plan's (driver_bwd.launch_plan, its
    dense-call choice by default). varlen: packed Q and K/V with cu_seqlens_q / cu_seqlens_k."""
    import cutlass
    from flash_attn.cute.interface import make_fake_bwd_tensors
    from flash_attn.cute.utils import AuxData

    from flash_attn_sm120.driver_bwd import Mods, kernel_for, launch_plan
    from flash_attn_sm120.driver_bwd import compile_kernel as compile_bwd_kernel

    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    cdtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[dtype]
    mods = Mods() if mods is None else mods
    # the driver's launch plan for a dense call (masks only where needed without a causal mask or window)
    # unless `ordering` sets its flags
    launch = launch_plan(causal, local, deterministic, dense_k=not varlen)
    # the non-deterministic list walk launches its K/V tiles longest first, as the driver's does
    # (a varlen walk keeps upstream's grid: per-sequence lists whose rows may end early, rows_end)
    ordered = block_sparse is not None and not deterministic and not varlen
    kernel = kernel_for(cdtype, head_dim, head_dim_v, qhead_per_kvhead, config, mods,
                        block_sparse_key=None if block_sparse is None else (*block_sparse[:3], None, varlen),
                        is_causal=causal,
                        is_local=local, emulate_host_smem=emulate_host_smem, deterministic=deterministic,
                        **{"dq_descending": dq_descending, **launch, **(ordering or {})},
                        **({"ordered_tiles": True} if ordered else {}))
    aux = AuxData(list(mods.aux_tensors) if mods.aux_tensors else None, mods.aux_scalars)
    gqa = qhead_per_kvhead > 1
    (q, k, v, _o, do, _dq, dk, dv, _lse, lse_log2, dpsum, dq_accum, dk_accum, dv_accum,
     _scale) = make_fake_bwd_tensors(cdtype, has_gqa=gqa, varlen_q=varlen, varlen_k=varlen)
    window = cutlass.Int32(0) if local else None
    sems = (None, None)
    import cutlass.cute as cute
    from quack.compile_utils import make_fake_tensor

    if deterministic:
        sem = lambda: make_fake_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int(), cute.sym_int()))  # noqa: E731
        sems = (sem(), sem() if gqa else None)
        if (ordering or {}).get("dq_fixed_point"):  # the int64 accumulator and the per-head scales
            accumulator = make_fake_tensor(cutlass.Int64, (cute.sym_int(), cute.sym_int(), cute.sym_int()))
            sems = (accumulator, sems[1], make_fake_tensor(cutlass.Float32, (cute.sym_int(),), divisibility=1))
    sparse = None
    if block_sparse is not None:  # (q_subtile, kv_subtile, has full lists): Q-direction lists
        from flash_attn.cute.block_sparsity import BlockSparseTensors

        b, h, n, m = (cute.sym_int() for _ in range(4))
        fake = lambda shape: make_fake_tensor(cutlass.Int32, shape, divisibility=1)  # noqa: E731
        lists = [fake(shape) for shape in ((b, h, n), (b, h, n, m)) * (2 if block_sparse[2] else 1)]
        lists += [None] * (4 - len(lists))
        # deterministic: each list entry's dQ turn (block_sparse.dq_turns), shaped as the index lists
        turns = [fake((b, h, n, m)) if deterministic and lists[i] is not None else None for i in (1, 3)]
        sparse = BlockSparseTensors(*lists, None, None, *turns)
    if ordered:  # the launch order rides as the last aux tensor (kernels/ordered_scheduler.py)
        from flash_attn_sm120.kernels.ordered_scheduler import with_tile_order

        aux = with_tile_order(aux, make_fake_tensor(cutlass.Int32, (cute.sym_int(),), divisibility=1))
    cu_seqlens = [make_fake_tensor(cutlass.Int32, (cute.sym_int(),), divisibility=1) if varlen else None
                  for _ in range(2)]
    with tempfile.TemporaryDirectory() as tmp:
        compiled = compile_bwd_kernel(  # the driver's own call convention
            kernel, q, k, v, do, lse_log2, dpsum, dq_accum, dk_accum if gqa else dk, dv_accum if gqa else dv,
            *cu_seqlens, None, None, window, window, *sems,
            options=f"--keep-cubin --dump-dir={tmp} --gpu-arch={arch}", aux=aux, blocksparse=sparse,
        )
        cubin = cubin_of(compiled)
    if kernel_out is not None:
        kernel_out.append(kernel)
    return cubin, kernel.smem_bytes_launched

"""Test inputs for the correctness harness: a problem's static and dynamic parts, and its tensors in
every storage layout, poisoned with NaN wherever a correct kernel must not read.

A problem has a static part, `AttnCase` (everything that enters a kernel's compile key: dtype,
head dims, GQA ratio and packing, mask kind, softcap, LSE, storage layouts, backward, deterministic) and a
dynamic part, `AttnProblem` (per-sequence lengths, KV heads, window sizes, softmax scale, padding,
seed). Storage layouts of q and of k/v:

    dense   (b, s, h, d), every sequence the same length; with pad > 0 a strided view into a
            buffer whose extra rows hold NaN
    packed  (total, h, d) with cu_seqlens
    padded  (b, S, h, d) with seqused; rows past each sequence's length hold NaN
    paged   (k/v only) (num_pages, page_size, h, d) with page_table and seqused_k; pages shuffled

NaN fills every byte a correct kernel must not read, so an out-of-bounds load shows up as a NaN
output; outputs start as NaN (driver: the `out`/`lse` buffers; public API: the driver's
allocation, see `testing.poisoned_outputs`), so an element the kernel forgot to write fails the check.

`make_inputs` builds them (q, k, v and their fp32 reference copies, with modifiers' aux tensors and
block-sparse lists where the case has them); testing.py runs and checks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


Q_LAYOUTS = ("dense", "packed", "padded")
K_LAYOUTS = ("dense", "packed", "padded", "paged")
MASKS = {  # name -> (causal, has left window, has right window)
    "none": (False, False, False),
    "causal": (True, False, False),
    "local_l": (False, True, False),
    "local_r": (False, False, True),
    "local_lr": (False, True, True),
    "causal_l": (True, True, False),  # causal with a left window: local (left, 0)
}
LSE_ATOL = 1e-3


@dataclass(frozen=True)
class AttnCase:
    """The static part of a problem: one compile key per case (for a given kernel config)."""

    dtype: str = "bfloat16"
    head_dim: int = 128
    head_dim_v: int = 128
    qhead_per_kvhead: int = 1
    pack_gqa: Optional[bool] = None
    mask: str = "none"
    softcap: float = 0.0
    return_lse: bool = False
    q_layout: str = "dense"
    k_layout: str = "dense"
    backward: bool = False
    sink: bool = False  # a learnable_sink (h,) (public API only: the kernels fold it in, sink_fold.py)
    mods: str = ""  # a testing_mods.MODS name: score_mod / mask_mod / aux data (public API only)
    block_sparse: str = ""  # a testing_sparse.CASES name: random block lists (public API; dense layout, or packed
    # q and k/v: testing_sparse.varlen_case_ok)
    # the public API's deterministic=True: backward cases only, run twice and compared bit for bit
    deterministic: bool = False

    def __post_init__(self):
        if self.mask not in MASKS:
            raise ValueError(f"mask {self.mask!r} not in {list(MASKS)}")
        if self.q_layout not in Q_LAYOUTS or self.k_layout not in K_LAYOUTS:
            raise ValueError(f"layouts ({self.q_layout}, {self.k_layout}) not in {Q_LAYOUTS} x {K_LAYOUTS}")
        if self.deterministic and not self.backward:
            raise ValueError("deterministic=True needs backward=True: it orders the backward's dQ/dK/dV "
                             "additions, a forward case has nothing to order")

    @property
    def causal(self) -> bool:
        return MASKS[self.mask][0]

    @property
    def has_window(self) -> tuple[bool, bool]:
        return MASKS[self.mask][1:]

    @property
    def local(self) -> bool:
        return any(self.has_window)

    @property
    def is_dense(self) -> bool:
        return self.q_layout == "dense" and self.k_layout == "dense"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def label(self) -> str:
        dt = {"bfloat16": "bf16", "float16": "fp16"}.get(self.dtype, self.dtype)
        d = f"d{self.head_dim}" + (f"v{self.head_dim_v}" if self.head_dim_v != self.head_dim else "")
        g = f"g{self.qhead_per_kvhead}" + {None: "", True: "p", False: "u"}[self.pack_gqa]
        extra = (f"-sc{self.softcap:g}" if self.softcap else "") + ("-lse" if self.return_lse else "")
        extra += ("-sink" if self.sink else "") + (f"-mod:{self.mods}" if self.mods else "")
        extra += f"-bs:{self.block_sparse}" if self.block_sparse else ""
        bwd = ("-bwd" + ("-det" if self.deterministic else "")) if self.backward else ""
        return f"{dt}-{d}-{g}-{self.mask}{extra}-{self.q_layout}.{self.k_layout}{bwd}"


@dataclass(frozen=True)
class AttnProblem:
    """The dynamic part: sizes and values that must not trigger a recompile."""

    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]
    nheads_kv: int = 1
    window_left: Optional[int] = None
    window_right: Optional[int] = None
    softmax_scale: Optional[float] = None
    pad_q: int = 0  # extra NaN rows per sequence in dense / padded storage
    pad_k: int = 0
    page_size: int = 64
    num_splits: int = 1
    seed: int = 0

    @property
    def batch(self) -> int:
        return len(self.seqlens_q)

    def window(self, case: AttnCase) -> tuple[Optional[int], Optional[int]]:
        """(left, right) as passed to the API: None where the case has no bound on that side."""
        has_left, has_right = case.has_window
        return (self.window_left if has_left else None, self.window_right if has_right else None)

    def work(self, case: AttnCase) -> int:
        """Score elements the reference materializes (its cost)."""
        h = self.nheads_kv * case.qhead_per_kvhead
        return sum(h * sq * sk for sq, sk in zip(self.seqlens_q, self.seqlens_k))


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


@dataclass
class Layout:
    """How sequences sit in one storage tensor (q, out, dq share q's; k, v, dk, dv share k's)."""

    kind: str
    seqlens: tuple[int, ...]
    offsets: tuple[int, ...] = ()  # packed: row offsets (cu_seqlens)

    def seq(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """Sequence i of a storage tensor, as (1, len, ...)."""
        n = self.seqlens[i]
        if self.kind == "packed":
            return t[self.offsets[i] : self.offsets[i] + n].unsqueeze(0)
        return t[i : i + 1, :n]

    def lse_seq(self, lse: torch.Tensor, i: int) -> torch.Tensor:
        """Sequence i of an LSE tensor ((b, h, s), or (h, total) for packed q) as (1, h, len)."""
        n = self.seqlens[i]
        if self.kind == "packed":
            return lse[:, self.offsets[i] : self.offsets[i] + n].unsqueeze(0)
        return lse[i : i + 1, :, :n]

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """All valid rows of a storage tensor, concatenated: (sum(len), ...)."""
        parts = [self.seq(t, i)[0] for i in range(len(self.seqlens))]
        return torch.cat(parts) if parts else t.new_zeros(0, *t.shape[-2:])

    def lse_rows(self, lse: torch.Tensor) -> torch.Tensor:
        """All valid LSE entries as (sum(len), h)."""
        parts = [self.lse_seq(lse, i)[0].transpose(0, 1) for i in range(len(self.seqlens))]
        return torch.cat(parts) if parts else lse.new_zeros(0, lse.shape[-2])


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_layout: Layout
    k_layout: Layout
    index: dict = field(default_factory=dict)  # cu_seqlens_*, seqused_*, page_table, max_seqlen_*
    k_ref: Optional[torch.Tensor] = None  # paged: the contiguous K/V the pages were cut from
    v_ref: Optional[torch.Tensor] = None
    out_pad_rows: int = 0  # dense q with padding: the driver's out buffer gets the same gap
    out_gap: Optional[torch.Tensor] = None  # that gap (NaN; must stay NaN), set by forward_via_driver
    sink: Optional[torch.Tensor] = None  # learnable_sink (h,) fp32, for sink cases
    aux: Optional[list] = None  # the modifier's aux tensors (testing_mods.make_aux)
    sparse_kinds: Optional[torch.Tensor] = None  # block map of a block-sparse case (testing_sparse)

    def k_seq(self, i: int) -> torch.Tensor:
        return self.k_layout.seq(self.k if self.k_ref is None else self.k_ref, i)

    def v_seq(self, i: int) -> torch.Tensor:
        return self.k_layout.seq(self.v if self.v_ref is None else self.v_ref, i)

    def out_shape(self, head_dim_v: int) -> tuple[int, ...]:
        return (*self.q.shape[:-1], head_dim_v)

    def lse_shape(self) -> tuple[int, ...]:
        q = self.q
        return (q.shape[1], q.shape[0]) if self.q_layout.kind == "packed" else (q.shape[0], q.shape[2], q.shape[1])


def _store(kind: str, seqlens, pad: int, tail: tuple, rnd: Callable, dtype, device):
    """(storage tensor, layout, index tensors) for one of q / k / v."""
    b = len(seqlens)
    nan = float("nan")
    if kind == "dense":
        n = seqlens[0] if seqlens else 0
        if any(s != n for s in seqlens):
            raise ValueError(f"dense layout needs equal lengths, got {seqlens}")
        buf = torch.full((b, n + pad, *tail), nan, dtype=dtype, device=device)
        buf[:, :n] = rnd(b, n, *tail)
        return buf[:, :n], Layout(kind, tuple(seqlens)), {}
    if kind == "packed":
        offsets = [0]
        for s in seqlens:
            offsets.append(offsets[-1] + s)
        t = rnd(offsets[-1], *tail)
        cu = torch.tensor(offsets, dtype=torch.int32, device=device)
        return t, Layout(kind, tuple(seqlens), tuple(offsets)), {"cu_seqlens": cu}
    if kind in ("padded", "paged"):
        width = max(seqlens, default=0) + pad
        buf = torch.full((b, width, *tail), nan, dtype=dtype, device=device)
        for i, s in enumerate(seqlens):
            buf[i, :s] = rnd(s, *tail)
        used = torch.tensor(list(seqlens), dtype=torch.int32, device=device)
        return buf, Layout("padded", tuple(seqlens)), {"seqused": used}
    raise ValueError(f"unknown layout {kind!r}")


def paginate(k: torch.Tensor, v: torch.Tensor, seqlens, page_size: int, generator: torch.Generator):
    """Cut padded (b, S, h, d) K/V into shuffled pages: (k_cache, v_cache, page_table int32 (b, pages)).

    Page j of sequence i holds rows [j*page_size, (j+1)*page_size) of k[i]; unused rows are NaN.
    """
    b, width = k.shape[:2]
    per_seq = max(1, -(-width // page_size))
    num_pages = b * per_seq
    perm = torch.randperm(num_pages, generator=generator, device="cpu").to(k.device)
    table = perm.view(b, per_seq).to(torch.int32)
    caches = []
    for t in (k, v):
        cache = torch.full((num_pages, page_size, *t.shape[2:]), float("nan"), dtype=t.dtype, device=t.device)
        for i, s in enumerate(seqlens):
            for j in range(-(-s // page_size)):
                rows = t[i, j * page_size : min(s, (j + 1) * page_size)]
                cache[table[i, j].long(), : rows.shape[0]] = rows
        caches.append(cache)
    return caches[0], caches[1], table


def make_inputs(case: AttnCase, problem: AttnProblem, device="cuda", requires_grad: bool = False) -> Inputs:
    """Random q, k, v (standard normal) in the case's layouts, NaN in every unused byte."""
    if len(problem.seqlens_q) != len(problem.seqlens_k):
        raise ValueError("seqlens_q and seqlens_k must describe the same sequences")
    gen = torch.Generator(device=device).manual_seed(problem.seed)
    dtype = case.torch_dtype
    hk = problem.nheads_kv
    h = hk * case.qhead_per_kvhead

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q, q_layout, q_index = _store(case.q_layout, problem.seqlens_q, problem.pad_q, (h, case.head_dim), rnd, dtype, device)
    k, k_layout, k_index = _store(case.k_layout, problem.seqlens_k, problem.pad_k, (hk, case.head_dim), rnd, dtype, device)
    v, _, _ = _store(case.k_layout, problem.seqlens_k, problem.pad_k, (hk, case.head_dim_v), rnd, dtype, device)
    index = {f"{name}_q": t for name, t in q_index.items()}
    index.update({f"{name}_k": t for name, t in k_index.items()})
    if not case.is_dense:
        index["max_seqlen_q"] = max(problem.seqlens_q, default=0)
        index["max_seqlen_k"] = max(problem.seqlens_k, default=0)
    inputs = Inputs(q, k, v, q_layout, k_layout, index, out_pad_rows=problem.pad_q if case.q_layout == "dense" else 0)
    if case.k_layout == "paged":
        cpu_gen = torch.Generator().manual_seed(problem.seed)
        k_cache, v_cache, table = paginate(k, v, problem.seqlens_k, problem.page_size, cpu_gen)
        inputs.k_ref, inputs.v_ref = k, v
        inputs.k, inputs.v = k_cache, v_cache
        index["page_table"] = table
    if case.sink:  # logits around the scores' scale, so the sink matters
        inputs.sink = torch.randn(h, generator=gen, device=device, dtype=torch.float32) * 2
    if case.mods:
        from flash_attn_sm120 import testing_mods

        inputs.aux = testing_mods.make_aux(case.mods, problem.seqlens_q, problem.seqlens_k, h, device, gen)
    if case.block_sparse:
        from flash_attn_sm120 import testing_sparse

        if not case.is_dense and not testing_sparse.varlen_case_ok(case.block_sparse, case.q_layout, case.k_layout,
                                                                   case.backward):
            raise ValueError("block-sparse cases take the dense layout, or packed q and k/v in a case whose sparse "
                             f"Q block is one kernel tile ({sorted(testing_sparse.VARLEN_CASES)})")
        inputs.sparse_kinds = testing_sparse.case_map(case.block_sparse, problem.batch, h, max(problem.seqlens_q),
                                                      max(problem.seqlens_k), gen, device)
    if requires_grad:
        for t in (inputs.q, inputs.k, inputs.v, inputs.sink):
            if t is not None:
                t.requires_grad_(True)
    return inputs


# ------------------------------------------------------------------------------------------------
# Running the kernels
# ------------------------------------------------------------------------------------------------

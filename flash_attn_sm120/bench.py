"""Benchmark building blocks shared by scripts/prepare.py and scripts/config_search.py.

Pure parts (problem sets, FLOP counts, summaries) are CPU-tested; timing needs CUDA.

Timing follows the usual rules: warm-up first (compilation and module load stay out), CUDA events
around each call, the median of many calls with the 10th-90th percentile spread, and inputs
rotated among several copies whose total is larger than the L2 cache so that repeats are not
served from it. TFLOPS count causal attention as half of the full QK^T and PV work.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class Problem:
    """One attention shape. seqlens_q/k set = varlen batch (batch = len(seqlens_q))."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    head_dim: int
    causal: bool = False
    head_dim_v: Optional[int] = None
    window: tuple = (None, None)
    seqlens_q: Optional[tuple] = None
    seqlens_k: Optional[tuple] = None
    dtype: str = "bfloat16"
    tag: str = ""

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def is_varlen(self) -> bool:
        return self.seqlens_q is not None

    @property
    def name(self) -> str:
        gqa = f"h{self.nheads}" if self.nheads == self.nheads_kv else f"h{self.nheads}k{self.nheads_kv}"
        s = f"s{self.seqlen_q}" if self.seqlen_q == self.seqlen_k else f"sq{self.seqlen_q}sk{self.seqlen_k}"
        extra = "-varlen" if self.is_varlen else ""
        if self.window != (None, None):
            extra += f"-w{self.window[0]}_{self.window[1]}"
        return f"b{self.batch}{s}{gqa}d{self.head_dim}{'-causal' if self.causal else ''}{extra}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["name"] = self.name
        return d


def attention_flops(p: Problem) -> float:
    """Forward FLOPs: 2*sq*sk*(d + dv) per head, causal counted as half (window: the band)."""
    pairs = []
    lens = zip(p.seqlens_q, p.seqlens_k) if p.is_varlen else [(p.seqlen_q, p.seqlen_k)] * p.batch
    for sq, sk in lens:
        if p.window != (None, None):
            left = sk if p.window[0] is None else p.window[0]
            right = sk if p.window[1] is None else p.window[1]
            # rows attend to keys in [i + sk - sq - left, i + sk - sq + right] clipped to [0, sk)
            total = 0
            for i in range(sq):
                lo = max(0, i + sk - sq - left)
                hi = min(sk - 1, i + sk - sq + right)
                total += max(0, hi - lo + 1)
            pairs.append(total)
        else:
            pairs.append(sq * sk / 2 if p.causal else sq * sk)
    return 2.0 * p.nheads * (p.head_dim + p.dv) * sum(pairs)


def gemm_flops(m: int, n: int, k: int) -> float:
    """FLOPs of one (m, k) x (k, n) matrix product: a multiply and an add per term."""
    return 2.0 * m * n * k


def backward_flops(p: Problem) -> float:
    """Backward is 2.5x the forward's matmul work (5 GEMMs against 2)."""
    return 2.5 * attention_flops(p)


def kv_bytes(p: Problem) -> int:
    """Bytes of K and V read once (decode bandwidth)."""
    elem = 2
    sk_total = sum(p.seqlens_k) if p.is_varlen else p.batch * p.seqlen_k
    return sk_total * p.nheads_kv * (p.head_dim + p.dv) * elem


def _seed() -> list[Problem]:
    shapes = [(1, 8192, 16, 128), (2, 4096, 16, 128), (2, 4096, 16, 96), (4, 2048, 32, 64)]
    return [Problem(b, s, s, h, h, d, causal=c, tag="seed") for c in (False, True) for b, s, h, d in shapes]


def _real() -> list[Problem]:
    out = []
    # LLM prefill shapes, GQA 8:1 and 4:1
    # d192: DeepSeek-style query/key width; the bucket has no upstream SM120 tile that fits 99 KB without spilling
    for (h, hk, d) in [(32, 8, 128), (64, 8, 128), (32, 4, 128), (16, 4, 64), (32, 8, 64), (16, 4, 192),
                       (16, 2, 256), (8, 2, 256)]:
        for s in (512, 2048, 8192, 32768):
            b = max(1, 16384 // s)
            if d >= 192 and s > 8192:
                continue
            out.append(Problem(b, s, s, h, hk, d, causal=True, tag="real"))
    out.append(Problem(4, 4096, 4096, 32, 8, 128, causal=False, tag="real"))
    # varlen batches (ragged prompts)
    out.append(Problem(6, 0, 0, 32, 8, 128, causal=True, seqlens_q=(312, 1024, 4000, 77, 2048, 3500),
                       seqlens_k=(312, 1024, 4000, 77, 2048, 3500), tag="real"))
    out.append(Problem(4, 0, 0, 16, 4, 64, causal=True, seqlens_q=(8192, 100, 4096, 1),
                       seqlens_k=(8192, 100, 4096, 1), tag="real"))
    out.append(Problem(4, 0, 0, 32, 8, 128, causal=False, seqlens_q=(2048, 512, 3000, 1500),
                       seqlens_k=(2048, 512, 3000, 1500), tag="real"))
    return out


def _decode() -> list[Problem]:
    out = []
    for b in (1, 8, 64):
        for sk in (4096, 32768, 131072):
            if b * sk > 64 * 32768:
                continue
            for sq in (1, 16) if b == 1 else (1,):
                out.append(Problem(b, sq, sk, 32, 8, 128, causal=sq > 1, tag="decode"))
    return out


def _bwd() -> list[Problem]:
    return [replace_tag(p, "bwd") for p in _seed()]


def _bwd_real() -> list[Problem]:
    """Training shapes for the backward: GQA as LLMs train it, both masks at the shape of NVIDIA's cuDNN
    SDPA training benchmark (llama3.1: B2, 64:8 heads, d128, s8k), d64 / d192 with GQA, and packed
    documents of unequal lengths (varlen, causal). The seed
    `bwd` set (MHA) is what issue 16's gates read; this set shows what a trainer's call gets."""
    out = [Problem(2, 8192, 8192, 64, 8, 128, causal=c, tag="bwd_real") for c in (True, False)]
    out += [Problem(b, s, s, h, hk, d, causal=True, tag="bwd_real")
            for b, s, h, hk, d in ((8, 2048, 32, 8, 128), (2, 8192, 32, 8, 128), (8, 2048, 16, 4, 64),
                                   (8, 2048, 16, 4, 192))]
    out.append(Problem(4, 4096, 4096, 32, 8, 128, causal=False, tag="bwd_real"))
    # packed documents (varlen, 16k tokens): GQA and MHA at d128, GQA at d64
    docs = (4096, 1024, 2500, 512, 3000, 1800, 2048, 1404)
    out += [Problem(len(docs), 0, 0, h, hk, d, causal=True, seqlens_q=docs, seqlens_k=docs, tag="bwd_real")
            for h, hk, d in ((32, 8, 128), (16, 16, 128), (16, 4, 64))]
    return out


def replace_tag(p: Problem, tag: str) -> Problem:
    d = asdict(p)
    d["tag"] = tag
    return Problem(**d)


PROBLEM_SETS: dict[str, Callable[[], list[Problem]]] = {
    "seed": _seed,
    "real": _real,
    "decode": _decode,
    "bwd": _bwd,
    "bwd_real": _bwd_real,
}
_NOT_IN_ALL = ("bwd_real",)  # backward-only shapes: `all` times every problem forward too


def problem_set(name: str) -> list[Problem]:
    if name == "all":
        return [p for name, fn in PROBLEM_SETS.items() if name not in _NOT_IN_ALL for p in fn()]
    if name not in PROBLEM_SETS:
        raise ValueError(f"unknown problem set {name!r}; choose from {sorted(PROBLEM_SETS) + ['all']}")
    return PROBLEM_SETS[name]()


@dataclass
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int

    @property
    def spread(self) -> float:
        """Relative 10-90 percentile spread."""
        return (self.p90_ms - self.p10_ms) / self.median_ms if self.median_ms else float("nan")


def summarize_times(times_ms: Sequence[float]) -> Timing:
    xs = sorted(times_ms)
    if not xs:
        raise ValueError("no timings")
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else [xs[0]] * 9
    return Timing(statistics.median(xs), q[0], q[-1], len(xs))


def geomean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


# ----------------------------------------------------------------------------------------------
# CUDA parts
# ----------------------------------------------------------------------------------------------

def make_inputs(p: Problem, device="cuda", seed: int = 0, requires_grad: bool = False):
    """Random q, k, v (+ cu_seqlens for varlen) for a problem; never zeros."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, p.dtype)

    def rnd(*shape):
        t = torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)
        return t.requires_grad_(requires_grad)

    if p.is_varlen:
        tq, tk = sum(p.seqlens_q), sum(p.seqlens_k)
        q, k, v = rnd(tq, p.nheads, p.head_dim), rnd(tk, p.nheads_kv, p.head_dim), rnd(tk, p.nheads_kv, p.dv)
        cu = lambda lens: torch.tensor([0] + list(itertools_accumulate(lens)), dtype=torch.int32, device=device)
        return dict(q=q, k=k, v=v, cu_seqlens_q=cu(p.seqlens_q), cu_seqlens_k=cu(p.seqlens_k),
                    max_seqlen_q=max(p.seqlens_q), max_seqlen_k=max(p.seqlens_k))
    return dict(
        q=rnd(p.batch, p.seqlen_q, p.nheads, p.head_dim),
        k=rnd(p.batch, p.seqlen_k, p.nheads_kv, p.head_dim),
        v=rnd(p.batch, p.seqlen_k, p.nheads_kv, p.dv),
    )


def itertools_accumulate(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def window_mask(seqlen_q: int, seqlen_k: int, causal: bool, window, device):
    """(sq, sk) bool, True = masked, bottom-right aligned like FlashAttention, with upstream FA4's
    window meaning (`validation.window_bounds`: one negative side is a real bound)."""
    import torch

    from flash_attn_sm120.validation import window_bounds

    left, right = window_bounds(causal, *window)
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    shift = seqlen_k - seqlen_q
    mask = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right is not None:
        mask |= cols > rows + shift + right
    if left is not None:
        mask |= cols < rows + shift - left
    return mask


def reference_attention(q, k, v, causal=False, window=(None, None), softmax_scale=None, softcap=0.0,
                        upcast=True, seqlen_k_used=None):
    """Plain attention on (b, s, h, d) tensors, fp32 when upcast; GQA by head repetition.

    Processes one batch element and head group at a time so that long sequences fit.
    """
    import torch

    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    out = torch.empty(b, sq, h, v.shape[-1], dtype=torch.float32 if upcast else q.dtype, device=q.device)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
    mask = window_mask(sq, sk, causal, window, q.device)
    group = h // hk
    chunk = max(1, (1 << 26) // max(sk, 1))  # query rows per step: ~256 MB of fp32 scores
    for bi in range(b):
        for hi in range(h):
            kk, vv = k[bi, :, hi // group], v[bi, :, hi // group]
            if upcast:
                kk, vv = kk.float(), vv.float()
            for r0 in range(0, sq, chunk):
                r1 = min(sq, r0 + chunk)
                qq = q[bi, r0:r1, hi].float() if upcast else q[bi, r0:r1, hi]
                s = (qq @ kk.T).float() * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                s = s.masked_fill(mask[r0:r1], float("-inf"))
                m = s.amax(dim=-1, keepdim=True).clamp_min(-1e30)
                pexp = torch.exp(s - m)
                denom = pexp.sum(-1, keepdim=True)
                lse[bi, hi, r0:r1] = (m + torch.log(denom)).squeeze(-1)
                pr = pexp / denom.clamp_min(1e-30)
                if not upcast:
                    pr = pr.to(q.dtype)
                out[bi, r0:r1, hi] = (pr @ vv).to(out.dtype)
    empty_rows = mask.all(dim=-1)
    if empty_rows.any():
        out[:, empty_rows] = 0
        lse[:, :, empty_rows] = float("inf") * -1
    return out, lse


def write_pages(pool, dense, page_table) -> None:
    """Write dense rows (b, s, h, d) into a page pool (num_pages, page_size, h, d) through
    page_table (b, pages_per_seq): sequence i's rows j*page_size.. go to page page_table[i, j];
    the last page's tail gets zeros."""
    import torch

    b, s = dense.shape[:2]
    pages, page_size = page_table.shape[1], pool.shape[1]
    rows = torch.nn.functional.pad(dense, (0, 0, 0, 0, 0, pages * page_size - s))
    pool[page_table.reshape(-1).long()] = rows.reshape(b * pages, page_size, *dense.shape[2:])


def paged_copy(k, v, page_size: int, generator):
    """Page pools holding k, v (b, s, hk, d) in shuffled pages, and the page table (b, pages) on k's
    device; the last page's tail is zeros (write_pages). `generator`: a CPU torch.Generator."""
    import torch

    b, s = k.shape[:2]
    pages = -(-s // page_size)
    perm = torch.randperm(b * pages, generator=generator, device="cpu").to(torch.int32).to(k.device)
    table = perm.view(b, pages).contiguous()
    pool_k = torch.empty(b * pages, page_size, *k.shape[2:], dtype=k.dtype, device=k.device)
    pool_v = torch.empty(b * pages, page_size, *v.shape[2:], dtype=v.dtype, device=v.device)
    write_pages(pool_k, k, table)
    write_pages(pool_v, v, table)
    return pool_k, pool_v, table


def time_cuda(fn: Callable[[int], object], rotations: int = 3, warmup: int = 3, reps: int = 30) -> Timing:
    """Median time of fn(i) with CUDA events; i cycles over `rotations` input sets.

    Calls are queued back to back with an event pair around each and one synchronization at the
    end, so host-side launch overhead overlaps the previous call instead of being counted.
    """
    import torch

    for i in range(warmup):
        fn(i % rotations)
    torch.cuda.synchronize()
    return summarize_times(event_times(lambda i: fn(i % rotations), reps))


def host_us_per_call(fn: Callable[[int], object], rotations: int = 1, calls: int = 20) -> float:
    """CPU time to issue one call of fn(i) (launches are asynchronous, so this is the host work per call).
    When it exceeds the GPU time, calls queued back to back leave the GPU idle and the events of
    `time_cuda` measure host time: compare the two."""
    import time

    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(calls):
        fn(i % rotations)
    host = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return host


def event_times(run: Callable[[int], object], reps: int) -> list[float]:
    """Milliseconds of run(i) for i < reps: CUDA events around each, queued back to back, one sync."""
    import torch

    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i, (start, end) in enumerate(events):
        start.record()
        run(i)
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def capture_graph(capture: Callable[[], object], warm: Optional[Callable[[], object]] = None):
    """PyTorch's capture recipe for work already compiled eagerly: `warm` (default: `capture`) once on a
    side stream, which warms the allocator, then `capture` recorded into a CUDA graph. Returns (graph,
    capture's outputs: the tensors each replay rewrites)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (warm or capture)()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = capture()
    return graph, outputs


def time_cuda_graph(
    fn: Callable[[int], object], rotations: int = 3, calls: int = 0, warmup: int = 3, reps: int = 20
) -> Timing:
    """Median GPU time per call of fn(i) with the host removed: `calls` calls (default: enough to
    cycle the rotations, at least 8) captured into one CUDA graph, the graph replayed `reps` times
    between CUDA events, each replay's time divided by `calls`.

    This is how inference engines run decode steps, and it is the kernels' own time: a small
    decode call's host path (Python dispatch, validation, launches) can exceed its GPU time, and
    then `time_cuda` measures the host. Raises if fn cannot be captured (a host sync inside it).
    """
    import torch

    calls = calls or max(8, rotations)
    for i in range(warmup):  # compile and load outside the capture
        fn(i % rotations)
    graph, _ = capture_graph(lambda: [fn(i % rotations) for i in range(calls)],
                             warm=lambda: [fn(i) for i in range(rotations)])
    graph.replay()
    torch.cuda.synchronize()
    times = event_times(lambda i, g=graph: g.replay(), reps)
    del graph
    return summarize_times([t / calls for t in times])


def time_direction_ms(fn: Callable[[int], object], fwd: Callable[[int], object], *, graph: bool, bwd: bool,
                      reps: int, rotations: int = 2) -> float:
    """Median ms of fn(i): eagerly (`time_cuda`), or captured in a CUDA graph (`time_cuda_graph`). A graph-timed
    backward (`bwd`: fn runs forward and backward in one capture, since autograd runs the backward on its
    forward's stream) is that graph's time less the graph of its forward alone, `fwd`."""
    if not graph:
        return time_cuda(fn, rotations=rotations, reps=reps).median_ms
    ms = time_cuda_graph(fn, rotations=rotations, reps=reps).median_ms
    return ms - time_cuda_graph(fwd, rotations=rotations, reps=reps).median_ms if bwd else ms


def rotations_for(p: Problem, l2_bytes: int = 60 * 2**20) -> int:
    """How many input copies make the rotated working set at least 3x the L2."""
    elem = 2
    per_set = (p.batch * (p.seqlen_q * p.nheads * (p.head_dim + p.dv)) + kv_bytes(p) // elem) * elem
    if p.is_varlen:
        per_set = (sum(p.seqlens_q) * p.nheads * (p.head_dim + p.dv) + kv_bytes(p) // elem) * elem
    return rotations_for_bytes(per_set, l2_bytes)


def rotations_for_bytes(per_set: int, l2_bytes: int = 60 * 2**20) -> int:
    """How many copies of a `per_set`-byte input set make the rotated working set at least 3x the
    L2 (2 to 8 copies): the rule of rotations_for, for inputs that are not an attention problem."""
    return max(2, min(8, math.ceil(3 * l2_bytes / max(per_set, 1))))


def error_vs_reference(out, ref) -> float:
    """Max abs error, NaN-aware (NaN anywhere -> inf)."""
    import torch

    diff = (out.float() - ref.float()).abs()
    if torch.isnan(diff).any():
        return float("inf")
    return diff.max().item()

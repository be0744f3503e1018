"""Where a backward config goes wrong: per-gradient errors against fp32 autograd, and the pattern of the bad rows.

For each (head dim, config) given, runs this package's backward (driver_bwd.backward with the config
forced, dq/dk/dv poisoned with NaN) on one dense problem and prints, per gradient, the max error,
upstream's bound (2x the input-precision reference's error + atol), and for a failing gradient which
rows within an m_block (dQ) or n_block (dK/dV) and which head-dim columns hold the bad elements.

    python scripts/bwd_probe.py --emulate --case 96:128,32,64,1,1,2,4,2 --case 224:fallback
    (config: num_threads,m_block,n_block,stages_q,stages_do,atom_m_sdp,atom_n_dkv,atom_m_dq; "fallback":
     the driver's own choice for that head dim)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_case(text: str):
    from flash_attn_sm120.kernels.bwd_tiling import BwdConfig

    dim, _, spec = text.partition(":")
    if spec in ("", "fallback"):
        return int(dim), None
    t, m, n, sq, sdo, a, b, c = (int(x) for x in spec.split(","))
    return int(dim), BwdConfig(t, m, n, sq, sdo, False, False, False, a, b, c, False)


def bad_pattern(err, bound: float, block: int) -> str:
    """Rows (mod block) and columns of the elements above the bound, summarized."""
    bad = err > bound  # (batch, seqlen, heads, dim)
    rows = bad.any(dim=3).any(dim=2).any(dim=0).nonzero().flatten()
    cols = bad.any(dim=2).any(dim=1).any(dim=0).nonzero().flatten()
    in_block = sorted({int(r) % block for r in rows})
    return (f"{int(bad.sum())} bad elements; rows mod {block}: {_ranges(in_block)}; "
            f"columns: {_ranges([int(c) for c in cols])}")


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "-"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


def main(argv=None) -> int:
    import torch

    import prepare_bwd
    from flash_attn_sm120 import bench, driver_bwd
    from prepare import detect

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", required=True, help="HEAD_DIM:CONFIG or HEAD_DIM:fallback")
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--emulate", action="store_true")
    args = ap.parse_args(argv)
    info = detect(args.emulate)
    failures = 0
    for text in args.case:
        d, cfg = parse_case(text)
        p = bench.Problem(1, args.seqlen, args.seqlen, args.heads, args.heads, d, args.causal)
        x = prepare_bwd.forward_state(p, info)
        ref, pt = prepare_bwd.reference_grads(p, x)
        chosen = cfg or driver_bwd.choose_config(d, d, args.causal, False, None, plain_mha=True)  # dense MHA
        grads = [torch.full_like(x[n], float("nan")) for n in ("q", "k", "v")]
        out = driver_bwd.backward(x["q"], x["k"], x["v"], x["out"], x["dout"], x["lse"], softmax_scale=None,
                                  causal=args.causal, window_size_left=None, window_size_right=None,
                                  emulate_host_smem=info.emulate_host_smem, config=chosen, dq=grads[0], dk=grads[1],
                                  dv=grads[2])
        print(f"d{d} {chosen.name} causal={args.causal}")
        for name, a, r, lo in zip(("dq", "dk", "dv"), out, ref, pt):
            err = (a.float() - r).abs().nan_to_num(float("inf"))
            bound = prepare_bwd.grad_bound(r, lo)
            worst = err.max().item()
            verdict = "ok" if worst <= bound else "WRONG"
            failures += verdict != "ok"
            line = f"  {name}: max err {worst:.3e} bound {bound:.3e} {verdict}"
            if verdict != "ok":
                line += " -- " + bad_pattern(err, bound, chosen.m_block if name == "dq" else chosen.n_block)
            print(line, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

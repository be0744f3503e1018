"""The same-class GEMM ceiling: quack's SM120 GEMM (GemmDefaultSm120: a TMA producer warp feeding
mma.sync consumer warpgroups, the instruction class of this package's SM120 attention kernels)
timed on this GPU. prepare.py reports each problem's TFLOPS as a fraction of it (`of_ceiling`).

  python scripts/gemm_ceiling.py [--size 8192] [--tile 128x128] [--no-pingpong] [--json out.json]
  python scripts/gemm_ceiling.py --compile-only [--target sm_90a]     # trace + compile only, GPU hidden

The measurement runs in a child process (`--child`, started by `measure_ceiling`): quack picks its
kernel class from `quack.cute_dsl_utils.get_device_capacity`, which honours quack's own override
QUACK_ARCH but is cached per device, so the override must be in place before quack first asks. The
child sets QUACK_ARCH=sm_120 (dispatch: the SM120 class on any GPU; the compile target stays the
physical GPU's) and QUACK_CACHE_ENABLED=0 (compiled now, in memory: no `.o` built for another target
is loaded, and the compiled kernel's own name says which class it is) for itself only; the calling
process's environment is never changed. The child asserts the kernel is GemmDefaultSm120, checks
the product against an fp32 torch.matmul (prepare.py's rule: at most 2x the error of torch's bf16
matmul against the same reference, plus 1e-3; a wrong kernel is `incorrect` and reports no
ceiling), then times it like prepare.py does (flash_attn_sm120/bench.py's `time_cuda`: warm-up,
CUDA events around each call, median of `--reps` calls over inputs rotated past the L2, 10-90%
spread). On a GPU that is not SM120 the result is labelled `emulated`, as prepare.py labels its
modes: the SM120 class compiled for and run on another GPU (stages sized for SM120's shared memory,
a persistent grid of one CTA per SM), never an SM120 number.

`measure_ceiling(...) -> dict` never raises: a failed child gives status "error" with the tail of
its stderr, so a ceiling failure cannot cost prepare.py its attention measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
MARKER = "GEMM_CEILING_JSON: "  # the child's result line on stdout (quack / cutlass may print too)
ARCH = "sm_120"  # QUACK_ARCH in the child: quack's dispatch arch, its own documented override
CLASS = "GemmDefaultSm120"  # the class quack's quack.gemm dispatch maps capability 12.x to
KNOWN_CLASSES = ("GemmDefaultSm120", "GemmDefaultSm100", "GemmDefaultSm90", "GemmDefaultSm80")
DTYPE = "bfloat16"
TAIL = 3000  # characters of the child's stderr kept in an error result


# ---------------------------------------------------------------------------------- pure parts
def parse_tile(text: str) -> tuple[int, int]:
    """'128x128' -> (128, 128); argparse type."""
    try:
        m, n = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"tile {text!r}: expected MxN, e.g. 128x128") from None
    if m <= 0 or n <= 0 or m % 16 or n % 8:
        raise argparse.ArgumentTypeError(f"tile {text!r}: M must be a positive multiple of 16, N of 8")
    return m, n


def parse_size(text: str) -> int:
    """The cube's edge (M = N = K); argparse type. bf16 TMA rows need 16-byte alignment: multiples of 8."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected an integer") from None
    if n <= 0 or n % 8:
        raise argparse.ArgumentTypeError(f"size {n}: must be a positive multiple of 8")
    return n


def tile_str(tile: Sequence[int]) -> str:
    return f"{tile[0]}x{tile[1]}"


def mode_for(capability: Sequence[int]) -> str:
    """prepare.py's mode names (flash_attn_sm120.device.mode_for_capability with emulation on):
    `sm120` on a 12.x GPU, `emulated` on any other SM80+ GPU."""
    return "sm120" if capability[0] == 12 else "emulated"


def mode_label(mode: str, gpu: str, capability: Sequence[int], num_sms: int, target: str, grid: int) -> str:
    cc = f"{capability[0]}.{capability[1]}"
    if mode == "sm120":
        return f"SM120 native: {gpu} (cc {cc}, {num_sms} SMs)"
    return (f"SM120 GEMM class emulated on {gpu} (cc {cc}, {num_sms} SMs; quack dispatch QUACK_ARCH={ARCH}, "
            f"compiled for {target}; stages sized for SM120 smem, persistent grid of {grid} CTAs)")


def arch_name(capability: Sequence[int]) -> str:
    major, minor = capability[0], capability[1]
    return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"


def class_from_names(names: Sequence[str]) -> Optional[str]:
    """The quack GEMM class a compiled function's mangled names carry, e.g.
    'cutlass___call___quackgemm_default_epiGemmDefaultSm120_object_at_...'."""
    for cls in KNOWN_CLASSES:
        if any(cls in n for n in names):
            return cls
    return None


def error_bound(torch_rel_err: float) -> float:
    """prepare.py's correctness rule for a candidate: 2x the error of torch in the inputs' precision, + 1e-3."""
    return 2 * torch_rel_err + 1e-3


def base_result(size: int, tile: Sequence[int], pingpong: bool, persistent: bool) -> dict:
    """The fields every result has, whatever happened."""
    nan = float("nan")
    return {"status": "error", "tflops": nan, "ms": nan, "spread": nan, "size": size, "tile": tile_str(tile),
            "cluster": "1x1x1", "pingpong": pingpong, "persistent": persistent, "dtype": DTYPE, "class": None,
            "mode": None, "mode_label": None}


def child_command(size: int, tile: Sequence[int], pingpong: bool, persistent: bool, reps: int, warmup: int,
                  compile_only: bool = False, target: Optional[str] = None, python: str = sys.executable) -> list:
    cmd = [python, str(Path(__file__).resolve()), "--child", "--size", str(size), "--tile", tile_str(tile),
           "--reps", str(reps), "--warmup", str(warmup)]
    cmd += [] if pingpong else ["--no-pingpong"]
    cmd += [] if persistent else ["--no-persistent"]
    cmd += ["--compile-only"] if compile_only else []
    cmd += ["--target", target] if target else []
    return cmd


def child_env(environ, compile_only: bool = False) -> tuple[dict, list]:
    """The child's environment (a copy: `environ` is not changed) and notes on what differs.

    QUACK_ARCH=sm_120 selects quack's SM120 class; QUACK_CACHE_ENABLED=0 compiles it in the child's
    memory. A measurement drops CUTE_DSL_ARCH: the kernel must be compiled for the GPU it runs on
    (a cross-compile target such as sm_120a would not load on an H200). A compile-only child sees no
    GPU (CUDA_VISIBLE_DEVICES empty, as quack's GPU-blind compile workers): nothing is launched."""
    env = dict(environ) | {"QUACK_ARCH": ARCH, "QUACK_CACHE_ENABLED": "0"}
    notes = []
    if compile_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif "CUTE_DSL_ARCH" in env:
        notes.append(f"CUTE_DSL_ARCH={env.pop('CUTE_DSL_ARCH')} not passed to the child (it compiles for its GPU)")
    return env, notes


def parse_child_output(stdout: str) -> Optional[dict]:
    """The child's result: the JSON after the last MARKER line, or None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARKER):
            try:
                out = json.loads(line[len(MARKER):])
            except json.JSONDecodeError:
                return None
            return out if isinstance(out, dict) else None
    return None


def _tail(text, n: int = TAIL) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-n:]


def measure_ceiling(size: int = 8192, tile: Sequence[int] = (128, 128), pingpong: bool = True,
                    persistent: bool = True, reps: int = 30, warmup: int = 5, timeout: float = 600,
                    compile_only: bool = False, target: Optional[str] = None) -> dict:
    """Run the ceiling measurement in a child process and return its result dict; never raises.

    Status: "ok" (tflops, ms, spread, class, mode, ...), "incorrect" (the kernel's product failed the
    check: no ceiling), or "error" (with `error` and the child's `stderr_tail`)."""
    res = base_result(size, tile, pingpong, persistent)
    try:
        cmd = child_command(size, tile, pingpong, persistent, reps, warmup, compile_only, target)
        env, notes = child_env(os.environ, compile_only)
        res["command"] = " ".join(["QUACK_ARCH=" + ARCH, "QUACK_CACHE_ENABLED=0", "python", *cmd[1:]])
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired as e:
            return res | {"error": f"the child ran past {timeout:g} s", "stderr_tail": _tail(e.stderr)}
        out = parse_child_output(proc.stdout)
        if out is None:
            return res | {"error": f"the child exited {proc.returncode} without a result",
                          "returncode": proc.returncode, "stderr_tail": _tail(proc.stderr),
                          "stdout_tail": _tail(proc.stdout, 1000)}
        res |= out
        res["returncode"] = proc.returncode
        if notes:
            res["notes"] = res.get("notes", []) + notes
        if res.get("status") != "ok":
            res["stderr_tail"] = _tail(proc.stderr)
        return res
    except Exception as e:  # the caller's run goes on without a ceiling
        return res | {"error": f"{type(e).__name__}: {e}"[:500]}


def format_result(r: dict) -> str:
    """One line: the ceiling, what ran, and where."""
    what = (f"{r.get('class') or 'quack GEMM'} {r.get('size')}^3 {r.get('dtype')} tile {r.get('tile')} "
            f"{'pingpong' if r.get('pingpong') else 'cooperative'}{' persistent' if r.get('persistent') else ''}")
    if r.get("status") == "ok" and r.get("compile_only"):
        return f"gemm ceiling: compiled only ({what}, for {r.get('compile_target')}); stopped at: {r.get('stopped_at')}"
    if r.get("status") == "ok":
        return (f"gemm ceiling: {r['tflops']:.1f} TFLOPS {r['ms']:.3f} ms ±{100 * r['spread']:.1f}% "
                f"[{r.get('mode')}] {what} -- {r.get('mode_label')}")
    detail = r.get("error") or (f"rel err {r.get('rel_err')} > bound {r.get('err_bound')}"
                                if r.get("status") == "incorrect" else "")
    return f"gemm ceiling: {r.get('status')} ({what}): {detail}"


# ---------------------------------------------------------------------------------- the child
def _load_bench():
    """flash_attn_sm120/bench.py (prepare.py's timer) by path: a pure module, and importing the package
    would load FA4 and CuTe kernels the child does not need."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_gemm_ceiling_bench", ROOT / "flash_attn_sm120" / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def _identify(compiled_fn) -> tuple[Optional[str], str]:
    """(class, kernel name) from a compiled quack GEMM (an in-memory JIT function keeps its names)."""
    names = [str(getattr(compiled_fn, "function_name", "") or "")]
    names += [str(k) for k in (getattr(compiled_fn, "kernel_info", None) or {})]
    names = [n for n in names if n]
    return class_from_names(names), (names[-1] if names else "")[:240]


def _compiled_for(args, gemm_mod) -> list:
    """The compiled functions quack's compile cache holds for this tile / pingpong / persistence,
    read through the cache's public `cache` attribute (jit_cache's in-memory store)."""
    import inspect

    sig = inspect.signature(gemm_mod._compile_gemm)
    found = []
    for key, fn in list(gemm_mod._compile_gemm.cache.items()):
        try:
            b = sig.bind(*key).arguments
        except TypeError:
            continue
        if (tuple(b.get("tile_shape_mn", ()))[:2] == tuple(args.tile) and b.get("pingpong") == args.pingpong
                and b.get("persistent") == args.persistent):
            found.append((tuple(b.get("device_capacity", ())), fn))
    return found


def _gemm_kwargs(args) -> dict:
    return dict(C=None, tile_count_semaphore=None, tile_M=args.tile[0], tile_N=args.tile[1], cluster_M=1,
                cluster_N=1, pingpong=args.pingpong, persistent=args.persistent)


def _rel_err(x, ref) -> float:
    import torch

    d = x.float() - ref
    if not torch.isfinite(d).all():
        return float("inf")
    return (d.norm() / ref.norm().clamp_min(1e-30)).item()


def child_compile_only(args, res: dict) -> dict:
    """Trace and compile the SM120 class on meta tensors (no GPU): quack's own `gemm` entry compiles
    first and then needs the driver (the persistent grid size, the launch), where it stops."""
    import torch

    if torch.cuda.is_available():  # measure_ceiling hides the GPUs; never launch on meta tensors
        return res | {"error": "--compile-only with a visible GPU: set CUDA_VISIBLE_DEVICES= (measure_ceiling does)"}
    import quack.gemm as qg
    from quack.cute_dsl_utils import get_compile_target_capacity, get_device_capacity

    n = args.size
    dev = torch.device("meta")
    a, b = torch.empty(n, n, dtype=torch.bfloat16, device=dev), torch.empty(n, n, dtype=torch.bfloat16, device=dev)
    d = torch.empty(n, n, dtype=torch.bfloat16, device=dev)
    res["dispatch_capability"] = list(get_device_capacity(dev))
    try:
        qg.gemm(a, b, d, **_gemm_kwargs(args))
        res["stopped_at"] = None
    except Exception as e:  # expected past the compile on a machine without a GPU
        res["stopped_at"] = f"{type(e).__name__}: {e}"[:300]
    found = _compiled_for(args, qg)
    if not found:
        return res | {"status": "error", "error": f"quack compiled nothing; it stopped at: {res['stopped_at']}"}
    cap, fn = found[-1]
    cls, kernel = _identify(fn)
    res |= {"compile_only": True, "compiled": True, "class": cls, "kernel": kernel, "dispatch_capability": list(cap),
            "compile_target": arch_name(get_compile_target_capacity())}
    if cls != CLASS:
        return res | {"status": "error", "error": f"quack compiled {cls or 'an unidentified class'}, not {CLASS}"}
    return res | {"status": "ok"}


def child_measure(args, res: dict) -> dict:
    import torch

    if not torch.cuda.is_available():
        return res | {"error": "no CUDA GPU here (use --compile-only to trace and compile without one)"}
    bench = _load_bench()
    import quack.gemm as qg
    from quack.cute_dsl_utils import get_compile_target_capacity, get_device_capacity

    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    cap = (props.major, props.minor)
    res |= {"gpu": props.name, "capability": list(cap), "num_sms": props.multi_processor_count,
            "mode": mode_for(cap), "dispatch_capability": list(get_device_capacity(dev))}
    if cap[0] < 8:
        return res | {"error": f"{props.name} (cc {cap[0]}.{cap[1]}) has no mma.sync bf16: SM80+ needed"}
    if tuple(res["dispatch_capability"]) != (12, 0):
        return res | {"error": f"quack reports capability {res['dispatch_capability']}, not (12, 0): QUACK_ARCH "
                               "was not in place before quack first asked"}
    m = n = k = args.size
    per_set = (m * k + n * k + m * n) * 2
    rot = bench.rotations_for_bytes(per_set)
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda r, c: torch.randn(r, c, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)  # noqa: E731
    As, Bs = [rnd(m, k) for _ in range(rot)], [rnd(n, k) for _ in range(rot)]  # B (N, K): k-major
    Ds = [torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev) for _ in range(rot)]
    plan = qg.gemm(As[0], Bs[0], Ds[0], **_gemm_kwargs(args))  # compiles, checks, launches once
    torch.cuda.synchronize()
    cls, kernel = _identify(plan.compiled_fn)
    res |= {"class": cls, "kernel": kernel, "compile_target": arch_name(get_compile_target_capacity()),
            "grid_ctas": int(plan.max_active_clusters) if args.persistent else None, "rotations": rot,
            "b_layout": "(N, K) k-major", "accumulator": "float32"}
    res["mode_label"] = mode_label(res["mode"], props.name, cap, props.multi_processor_count,
                                   res["compile_target"], res["grid_ctas"] or 0)
    if cls != CLASS:
        return res | {"error": f"quack compiled {cls or 'an unidentified class'}, not {CLASS} ({kernel})"}
    ref = torch.matmul(As[0].float(), Bs[0].float().T)  # fp32 reference
    torch_err = _rel_err(torch.matmul(As[0], Bs[0].T), ref)
    res |= {"rel_err": _rel_err(Ds[0], ref), "torch_bf16_rel_err": torch_err, "err_bound": error_bound(torch_err)}
    if not res["rel_err"] <= res["err_bound"]:
        return res | {"status": "incorrect", "error": f"relative error {res['rel_err']:.3g} > {res['err_bound']:.3g}"}
    del ref
    t = bench.time_cuda(lambda i: qg.run_gemm_plan(plan, As[i], Bs[i], Ds[i], None), rotations=rot,
                        warmup=args.warmup, reps=args.reps)
    last = (args.reps - 1) % rot  # the last call's output, checked after the timing too
    after = _rel_err(Ds[last], torch.matmul(As[last].float(), Bs[last].float().T))
    res |= {"rel_err_after_timing": after, "ms": t.median_ms, "p10_ms": t.p10_ms, "p90_ms": t.p90_ms,
            "spread": t.spread, "reps": t.reps, "warmup": args.warmup,
            "tflops": bench.gemm_flops(m, n, k) / t.median_ms / 1e9,
            "timer": "flash_attn_sm120/bench.py time_cuda (CUDA events, median; quack.gemm.run_gemm_plan per call)"}
    if not after <= res["err_bound"]:
        return res | {"status": "incorrect", "tflops": float("nan"),
                      "error": f"relative error after timing {after:.3g} > {res['err_bound']:.3g}"}
    return res | {"status": "ok"}


def child_main(args) -> int:
    """--child: measure (or compile) in this process and print one MARKER line of JSON."""
    os.environ["QUACK_ARCH"] = ARCH  # this process only, before quack is imported
    os.environ["QUACK_CACHE_ENABLED"] = "0"
    res = base_result(args.size, args.tile, args.pingpong, args.persistent)
    try:
        import torch

        if args.compile_only and not args.target and "CUTE_DSL_ARCH" not in os.environ:
            args.target = "sm_120a"  # no GPU to take the target from
        if args.target:
            os.environ["CUTE_DSL_ARCH"] = args.target  # the compile target, before cutlass is imported
        res["torch"] = torch.__version__
        try:
            from importlib.metadata import version

            res["quack"] = version("quack-kernels")
        except Exception:
            pass
        res = child_compile_only(args, res) if args.compile_only else child_measure(args, res)
    except Exception as e:
        import traceback

        res |= {"status": "error", "error": f"{type(e).__name__}: {e}"[:800],
                "traceback": traceback.format_exc()[-TAIL:]}
    print(MARKER + json.dumps(res), flush=True)
    return 0 if res.get("status") == "ok" else 1


# ---------------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=8192, help="M = N = K (default 8192)")
    ap.add_argument("--tile", type=parse_tile, default=(128, 128), help="CTA tile MxN (default 128x128)")
    ap.add_argument("--pingpong", action=argparse.BooleanOptionalAction, default=True,
                    help="ping-pong consumer warpgroups (default); --no-pingpong: cooperative")
    ap.add_argument("--persistent", action=argparse.BooleanOptionalAction, default=True,
                    help="persistent tile scheduler, one CTA per SM (default)")
    ap.add_argument("--reps", type=int, default=30, help="timed calls (default 30)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls first (default 5)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds the child may run (default 600)")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    ap.add_argument("--compile-only", action="store_true",
                    help="trace and compile the SM120 class on meta tensors (no GPU needed), do not run it")
    ap.add_argument("--target", default=None,
                    help="--compile-only: the compile target, CUTE_DSL_ARCH in the child (default sm_120a; "
                         "sm_90a is what the measurement on an H200 compiles)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # measure_ceiling's child
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        build_parser().error("--reps must be >= 1 and --warmup >= 0")
    if args.target and not args.compile_only:
        build_parser().error("--target is for --compile-only (a measurement compiles for the GPU it runs on)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    r = measure_ceiling(args.size, args.tile, args.pingpong, args.persistent, args.reps, args.warmup,
                        args.timeout, args.compile_only, args.target)
    print(format_result(r))
    if r.get("status") != "ok" and r.get("stderr_tail"):
        print(r["stderr_tail"][-1500:], file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(r, indent=1))
    return 0 if r.get("status") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())

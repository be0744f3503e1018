"""torch.compile support: the SM120 attention as `torch.library` custom ops.

Dynamo cannot trace into a CuTe DSL launch, so under `torch.compile` the public functions
(interface.py) hand the call to `traced_call` here, which does only what a trace can hold:

  * the route is decided at trace time (`_routes_to_sm120`, a constant per device): a GPU that runs
    upstream FA4 gets `flash_attn.cute`'s own function, traced or not exactly as upstream is;
  * an SM120 call becomes one `flash_attn_sm120::fwd` node. Its fake implementation gives `out` and
    `lse` their real shapes, dtypes and strides (out (b, s, h, dv) or (total_q, h, dv), lse (b, h, s)
    or (h, total_q), both contiguous); its real implementation is the eager public function, so
    validation, dispatch, caches and errors are the eager ones, raised when the graph runs;
  * the backward (`register_autograd`) is one `flash_attn_sm120::bwd` node, driver_bwd.py at run
    time, with dq/dk/dv laid out like q/k/v (the eager backward's buffers, by construction).

Python callables cannot be custom-op arguments. A `score_mod` / `mask_mod` registered with
`register_mod` travels by name and compiles with no graph break (its `aux_tensors` and
`aux_scalars` as op arguments; an empty list means none); a `learnable_sink` is an op argument too
(its gradient comes back from the backward op). An unregistered callable, a tensor `max_seqlen_*` or
an unsupported feature (`qv`, block sparsity, ...) takes a documented graph break: the eager function
runs outside the graph (`fullgraph=True` raises). So does a call with a modifier or aux tensors whose
backward will run: the backward op carries no modifiers, and the eager backward applies them.
Eager calls never come here: the per-call host path is unchanged.
"""

# no `from __future__ import annotations`: torch.library reads the ops' annotations as real types
from typing import Callable, List, Optional, Sequence

import torch

import flash_attn.cute.interface as upstream
from flash_attn_sm120 import device, validation

OP_NAMESPACE = "flash_attn_sm120"
_MODS: dict[str, Callable] = {}  # name -> score_mod / mask_mod
_NAME_OF: dict[Callable, str] = {}  # the reverse map, read at trace time

# arguments that only the eager path takes (each makes a graph break when set)
_EAGER_ONLY = ("qv", "gather_kv_indices", "block_sparse_tensors", "block_sparse_tensors_bwd",
               "scheduler_metadata", "gather_bwd_token_chunk", "score_mod_bwd")
_INDEX = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table")
_TENSORS = (*_INDEX, "learnable_sink")  # the optional tensor arguments of the forward op, in its order


def register_mod(fn: Callable, name: Optional[str] = None) -> Callable:
    """Make a score_mod / mask_mod usable under torch.compile without a graph break; returns fn.

    The compiled graph carries the name; the eager call it runs looks the callable up again. A name
    names one callable for the life of the process (registering another under it is refused).
    """
    if not callable(fn):
        raise TypeError(f"register_mod needs a callable, got {type(fn).__name__}")
    name = name or getattr(fn, "__qualname__", None) or repr(fn)
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_mod: a mod name must be a non-empty str, got {name!r}")
    if _MODS.get(name, fn) is not fn:
        raise ValueError(f"register_mod: the name {name!r} is already registered for another callable")
    _MODS[name] = fn
    _NAME_OF[fn] = name
    return fn


def registered_mod(name: str) -> Optional[Callable]:
    """The callable registered under name ('' is none)."""
    if not name:
        return None
    try:
        return _MODS[name]
    except KeyError:
        raise ValueError(f"no score_mod / mask_mod is registered under {name!r} (flash_attn_sm120.register_mod)") from None


@torch.compiler.assume_constant_result
def _routes_to_sm120(device_type: str, index: int) -> bool:
    """True if a tensor on this device runs this package's kernels (CPU too: its call raises the eager
    validation error when the graph runs). A constant of the trace."""
    if device_type != "cuda":
        return True
    return device.device_info(torch.device("cuda", index)).uses_sm120_kernels


def _call_eager(args: dict, varlen: bool):
    from flash_attn_sm120 import interface

    return (interface.flash_attn_varlen_func if varlen else interface.flash_attn_func)(**args)


# an argument only the eager path takes: run it outside the graph (the documented graph break)
_eager_graph_break = torch.compiler.disable(_call_eager)


def traced_call(args: dict, varlen: bool):
    """What flash_attn_func / flash_attn_varlen_func do while Dynamo traces them: (out, lse or None)."""
    q = args["q"]
    if not _routes_to_sm120(q.device.type, -1 if q.device.index is None else q.device.index):
        name = "flash_attn_varlen_func" if varlen else "flash_attn_func"
        return getattr(upstream, name)(**validation.upstream_kwargs(name, args))
    mods = [args.get("score_mod"), args.get("mask_mod")]
    if (any(args.get(n) is not None for n in _EAGER_ONLY) or args.get("gather_bwd_recompute_p")
            or any(m is not None and m not in _NAME_OF for m in mods)
            or any(isinstance(args.get(n), torch.Tensor) for n in ("max_seqlen_q", "max_seqlen_k"))):
        return _eager_graph_break(args, varlen)
    # the eager checks of the flags, before they become op arguments (a bool() would accept "False")
    softcap = validation.check_scalars(args["softmax_scale"], args["softcap"])
    validation.check_flags(causal=args["causal"], pack_gqa=args["pack_gqa"], return_lse=args["return_lse"],
                           deterministic=args["deterministic"])
    validation.check_num_splits(args["num_splits"])
    left, right = validation.normalize_window(args["window_size"])
    k, v = args["k"], args["v"]
    sink = args.get("learnable_sink")
    # needs_grad: the dQ/dK/dV backward will run, so its refusals apply (the eager rule)
    want_lse, _, needs_grad = validation.grad_plan(q, k, v, sink, args["return_lse"])
    if needs_grad and (any(m is not None for m in mods) or args.get("aux_tensors")):
        # the backward op carries no modifiers: a modifier's backward runs eagerly (a graph break)
        return _eager_graph_break(args, varlen)
    return_lse = bool(args["return_lse"])
    aux = args.get("aux_tensors")
    out, lse = torch.ops.flash_attn_sm120.fwd(
        q, k, v, *(args.get(n) for n in _TENSORS), list(aux or ()), *_encode_scalars(args.get("aux_scalars")),
        args["softmax_scale"], bool(args["causal"]), left, right, float(softcap or 0.0),
        int(args["num_splits"]), args["pack_gqa"], bool(args["deterministic"]), args.get("max_seqlen_q"),
        args.get("max_seqlen_k"), _name(mods[0]), _name(mods[1]), return_lse, want_lse, needs_grad, varlen,
    )
    return out, (lse if want_lse else None)


# aux_scalars as two plain lists (values as float, kinds), which every torch with custom ops accepts; a
# Python int stays an int and a bool a bool, as the kernels specialize on the type
_KINDS = {bool: 2, int: 1, float: 0}


def _encode_scalars(scalars: Optional[Sequence]) -> tuple[list[float], list[int]]:
    """(values, kinds) of Python or CuTe (Int32, Float32, Boolean) scalars; the eager call turns them
    back into the same CuTe types (validation.normalize_aux_scalars)."""
    import cutlass

    cute_kinds = {cutlass.Boolean: 2, cutlass.Int32: 1, cutlass.Float32: 0}
    values, kinds = [], []
    for x in scalars or ():
        kind = cute_kinds.get(type(x)) if isinstance(x, cutlass.Numeric) else _KINDS.get(type(x))
        if kind is None:
            raise TypeError(f"aux_scalars under torch.compile must hold int, float or bool values (or cutlass "
                            f"Int32, Float32, Boolean), got {type(x).__name__}")
        values.append(float(x.value if isinstance(x, cutlass.Numeric) else x))
        kinds.append(kind)
    return values, kinds


def _decode_scalars(values: Sequence[float], kinds: Sequence[int]) -> Optional[tuple]:
    cast = {2: bool, 1: int, 0: float}
    return tuple(cast[k](v) for v, k in zip(values, kinds)) or None


def _name(mod: Optional[Callable]) -> str:
    return "" if mod is None else _NAME_OF[mod]


@torch.library.custom_op(f"{OP_NAMESPACE}::fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor], seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor],
    page_table: Optional[torch.Tensor], learnable_sink: Optional[torch.Tensor], aux_tensors: List[torch.Tensor],
    aux_scalar_values: List[float], aux_scalar_kinds: List[int], softmax_scale: Optional[float],
    causal: bool, window_left: Optional[int], window_right: Optional[int], softcap: float, num_splits: int,
    pack_gqa: Optional[bool], deterministic: bool, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
    score_mod: str, mask_mod: str, return_lse: bool, want_lse: bool, needs_grad: bool, varlen: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): the eager call; lse is an empty tensor unless want_lse (return_lse: the caller's own
    flag, which decides whether the LSE's gradient counts; needs_grad: the backward will run)."""
    from flash_attn_sm120 import interface

    args = dict(q=q, k=k, v=v, softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
                softcap=softcap, num_splits=num_splits, pack_gqa=pack_gqa, deterministic=deterministic,
                score_mod=registered_mod(score_mod), mask_mod=registered_mod(mask_mod),
                aux_tensors=list(aux_tensors) or None, aux_scalars=_decode_scalars(aux_scalar_values, aux_scalar_kinds),
                learnable_sink=learnable_sink, return_lse=want_lse)
    if varlen:
        args.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
                    page_table=page_table, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if needs_grad:  # the eager refusals a backward would meet, at forward time as in eager
        interface._check_common_features(
            qv=None, gather_kv_indices=None, num_splits=num_splits, block_sparse_tensors=None,
            page_table=page_table, requires_grad=True, score_mod=args["score_mod"], mask_mod=args["mask_mod"],
        )
    with torch.no_grad():  # below autograd: the graph's own backward node does the backward
        out, lse = _call_eager(args, varlen)
    return out, (lse if want_lse and lse is not None else _no_lse(q))


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, learnable_sink,
                        aux_tensors, aux_scalar_values, aux_scalar_kinds, softmax_scale, causal, window_left,
                        window_right, softcap, num_splits, pack_gqa, deterministic, max_seqlen_q, max_seqlen_k,
                        score_mod, mask_mod, return_lse, want_lse, needs_grad, varlen):
    num_heads, head_dim_v = q.shape[-2], v.shape[-1]
    varlen_q = cu_seqlens_q is not None
    rows = (q.shape[0],) if varlen_q else (q.shape[0], q.shape[1])
    out = q.new_empty((*rows, num_heads, head_dim_v))
    if not want_lse:
        return out, _no_lse(q)
    lse_shape = (num_heads, q.shape[0]) if varlen_q else (q.shape[0], num_heads, q.shape[1])
    return out, q.new_empty(lse_shape, dtype=torch.float32)


def _no_lse(q: torch.Tensor) -> torch.Tensor:
    return q.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op(f"{OP_NAMESPACE}::bwd", mutates_args=())
def attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dlse: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
    seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], learnable_sink: Optional[torch.Tensor],
    softmax_scale: Optional[float], causal: bool, window_left: Optional[int], window_right: Optional[int],
    softcap: float, deterministic: bool, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsink) on this package's SM120 backward (driver_bwd.py; dsink from sinks.py, an empty
    tensor without a sink). out and lse are the sink's (O', LSE') when there is one."""
    from flash_attn_sm120 import driver_bwd, interface, sinks

    target = interface._sm120_target(q)
    if target is None or target == ("validate-only",):
        raise RuntimeError(f"flash_attn_sm120::bwd: the graph was traced for SM120 kernels, but {q.device} runs "
                           "upstream FA4 now (FLASH_ATTN_SM120_EMULATE changed?); trace it again")
    dq, dk, dv = (_grad_buffer(x) for x in (q, k, v))  # from the saved inputs' metadata, as the fake op
    # the forward op copied its inputs into upstream's layouts inside its eager call; the tensors saved for
    # the backward are the caller's, so the kernels get the same copies here
    q, k, v, learnable_sink = interface._canonical(q, k, v, learnable_sink)
    dq, dk, dv = driver_bwd.backward(
        q, k, v, out, dout, lse, softmax_scale=softmax_scale, causal=causal, window_size_left=window_left,
        window_size_right=window_right, softcap=softcap, emulate_host_smem=target[0], cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, dlse=dlse, deterministic=deterministic, dq=dq, dk=dk, dv=dv,
    )
    if learnable_sink is None:
        return dq, dk, dv, _no_lse(q)
    rows = sinks.valid_rows(lse, cu_seqlens_q, seqused_q)
    return dq, dk, dv, sinks.sink_grad(out, dout, lse, dlse, learnable_sink, rows)


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                        learnable_sink, softmax_scale, causal, window_left, window_right, softcap, deterministic,
                        max_seqlen_q, max_seqlen_k):
    dsink = _no_lse(q) if learnable_sink is None else torch.empty_like(learnable_sink)
    return (*(_grad_buffer(x) for x in (q, k, v)), dsink)


def _grad_buffer(x: torch.Tensor) -> torch.Tensor:
    """A gradient for x, from metadata alone (the fake and the real op must agree, and a fake tensor has
    no address): x's layout when its strides meet the kernels' 16-byte rule, else contiguous."""
    align = max(1, 16 // x.element_size())
    if x.stride(-1) == 1 and all(s % align == 0 for s in x.stride()[:-1]):
        return torch.empty_like(x)  # keeps a dense layout (a transposed view); an overlapping one goes contiguous
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


_FWD_ARGS = ("q", "k", "v", *_TENSORS, "aux_tensors", "aux_scalar_values", "aux_scalar_kinds", "softmax_scale", "causal", "window_left", "window_right",
             "softcap", "num_splits", "pack_gqa", "deterministic", "max_seqlen_q", "max_seqlen_k", "score_mod",
             "mask_mod", "return_lse", "want_lse", "needs_grad", "varlen")


def _setup_context(ctx, inputs, output) -> None:
    a = dict(zip(_FWD_ARGS, inputs))
    out, lse = output
    ctx.save_for_backward(a["q"], a["k"], a["v"], out, lse, *(a[n] for n in _INDEX[:4]), a["learnable_sink"])
    ctx.scalars = tuple(a[n] for n in ("softmax_scale", "causal", "window_left", "window_right", "softcap",
                                       "deterministic", "max_seqlen_q", "max_seqlen_k"))  # bwd's order
    ctx.return_lse = a["return_lse"]
    # the backward returns one gradient per input, in the inputs' structure (a list for a list input)
    # (torch takes a list of tensors as a list of inputs, any other list as one input)
    ctx.no_grads = [[None] * len(x) if isinstance(x, list) and (not x or isinstance(x[0], torch.Tensor)) else None
                    for x in inputs]
    ctx.sink_index = _FWD_ARGS.index("learnable_sink")


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *index, sink = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsink = torch.ops.flash_attn_sm120.bwd(
        dout, q, k, v, out, lse, dlse if ctx.return_lse else None, *index, sink, *ctx.scalars,
    )
    grads = list(ctx.no_grads)
    grads[:3] = dq, dk, dv
    if sink is not None:
        grads[ctx.sink_index] = dsink
    return tuple(grads)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)

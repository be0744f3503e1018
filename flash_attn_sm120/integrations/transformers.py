"""Hugging Face transformers: `attn_implementation="fa4_sm120"`.

    import flash_attn_sm120.integrations.transformers  # registers the name
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fa4_sm120")

Why not "flash_attn_sm120": transformers 5 treats every implementation name that contains "flash"
as a flash-attention package or Hub kernel and preloads it by name when a model is built
(`_check_and_adjust_attn_implementation` -> `lazy_import_flash_attention`), which fails for any
name it does not know. `register` refuses such names for that reason.

Importing this module registers two things under `NAME`, through transformers' own extension
points (`AttentionInterface.register`, `AttentionMaskInterface.register`):

  * the attention function below, which takes transformers' (batch, heads, seq, dim) tensors;
  * transformers' flash-attention mask builder, so layers receive a 2-D padding mask, or None when
    nothing is padded (without a registered mask builder transformers would pass no mask at all).

One call becomes one `flash_attn_sm120` call, with transformers' flash-attention conventions:
  * nothing padded: `flash_attn_func`, causal as the module says (bottom-right aligned with a KV
    cache), GQA/MQA heads as they are (no repeat_kv), `sliding_window` w as window (w - 1, w - 1),
    softcap, `s_aux` as `learnable_sink`. Under torch.compile this is the custom op, but a batch of one
    with `position_ids` (Llama passes them) reads the ids to tell packed sequences apart, a
    data-dependent branch, as transformers' own flash-attention path does: `fullgraph=True` stops there;
  * a padding mask (left or right padded): unpadded into `flash_attn_varlen_func` (cu_seqlens from
    the mask, a longer static-cache KV cut to the mask) and padded back with zeros;
  * packed sequences: precomputed `cu_seq_lens_q/k` + `max_length_q/k` (transformers'
    DataCollatorWithFlattening), or batch-1 `position_ids` that restart.
Refused with a clear error: attention dropout while training, and a 4-D (custom) mask.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids
except ImportError as exc:  # pragma: no cover - the [hf] extra is optional
    raise ImportError("flash_attn_sm120.integrations.transformers needs transformers >= 5: "
                      "pip install 'flash_attn_sm120[hf]'") from exc

from flash_attn_sm120.interface import flash_attn_func, flash_attn_varlen_func

NAME = "fa4_sm120"


def register(name: str = NAME) -> str:
    """Register the attention function and its mask builder under name (done once at import)."""
    if "flash" in name:
        raise ValueError(f"{name!r}: transformers takes a name containing 'flash' for a flash-attention package or "
                         "Hub kernel and tries to load it; choose a name without 'flash'")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (b, h, s, d) in, ((b, s, h, dv), None) out."""
    if dropout:
        raise ValueError(f"flash_attn_sm120 has no attention dropout (got {dropout}): set the config's attention_dropout "
                         "to 0, or call model.eval()")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"flash_attn_sm120 takes a 2-D padding mask (batch, kv_len), got a {attention_mask.dim()}-D mask: "
                         "custom 4-D masks need attn_implementation='sdpa' or 'flex_attention'")
    q, k, v = (_to_attn_dtype(t.transpose(1, 2), module) for t in (query, key, value))
    causal = module.is_causal if is_causal is None else bool(is_causal)
    window = (None, None)
    if sliding_window is not None and k.shape[1] > sliding_window:
        window = (sliding_window - 1, sliding_window - 1)
    deterministic = kwargs.get("deterministic")
    if deterministic is None:  # transformers' own switch for its flash-attention paths
        deterministic = os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
    common = dict(softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap or 0.0,
                  learnable_sink=None if s_aux is None else s_aux.to(q.dtype), deterministic=bool(deterministic))
    if attention_mask is not None:
        return _padded(q, k, v, attention_mask, common), None
    varlen = _packed_lengths(q, kwargs)
    if varlen is not None:
        (cu_q, cu_k), (max_q, max_k) = varlen
        flat = [t.reshape(-1, *t.shape[-2:]) for t in (q, k, v)]
        out, _ = flash_attn_varlen_func(*flat, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=_host_int(max_q),
                                        max_seqlen_k=_host_int(max_k), **common)
        return out.view(q.shape[0], -1, *out.shape[-2:]), None
    out, _ = flash_attn_func(q, k, v, **common)
    return out, None


def _to_attn_dtype(t: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """fp32 activations (autocast off, or PEFT's fp32 norms) go to the dtype the layer computes in."""
    if t.dtype != torch.float32:
        return t
    if torch.is_autocast_enabled(t.device.type):
        return t.to(torch.get_autocast_dtype(t.device.type))
    config = getattr(module, "config", None)
    if getattr(config, "_is_quantized", False):  # the Linear weights are packed integers: the config's dtype
        dtype = getattr(config, "dtype", None)
        if dtype in (torch.float16, torch.bfloat16):
            return t.to(dtype)
    weight = next((m.weight for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
    if weight is None or weight.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError("flash_attn_sm120 computes in fp16/bf16: load the model in bfloat16 or float16, or run under autocast")
    return t.to(weight.dtype)


def _packed_lengths(q: torch.Tensor, kwargs: dict):
    """((cu_q, cu_k), (max_q, max_k)) for packed sequences, else None."""
    given = [kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    if all(x is not None for x in given):
        return (given[0].to(torch.int32), given[1].to(torch.int32)), (given[2], given[3])
    position_ids = kwargs.get("position_ids")
    if position_ids is None or q.shape[0] != 1 or position_ids.shape[-1] <= 1:
        return None
    pos = position_ids.reshape(-1)
    if bool((pos[1:] - pos[:-1] == 1).all()):  # one sequence (reads the ids, as transformers' FA path does)
        return None
    return prepare_fa_kwargs_from_position_ids(position_ids)


def _host_int(x) -> int:
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def _padded(q, k, v, mask: torch.Tensor, common: dict) -> torch.Tensor:
    """Unpad by a (b, kv_len) mask, run varlen, pad the output back (zeros at padded queries)."""
    batch, q_len = q.shape[:2]
    mask = mask.to(torch.bool)
    if k.shape[1] > mask.shape[-1]:  # a static cache longer than the tokens seen
        k, v = k[:, : mask.shape[-1]], v[:, : mask.shape[-1]]
    idx_k, cu_k, max_k = _unpad_index(mask)
    k_flat, v_flat = (t.reshape(-1, *t.shape[2:])[idx_k] for t in (k, v))
    if q_len == mask.shape[-1]:
        idx_q, cu_q, max_q = idx_k, cu_k, max_k
    elif q_len == 1:  # decode: one query per sequence
        idx_q = None
        cu_q, max_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device), 1
    else:  # the queries are the last q_len tokens (left padding)
        idx_q, cu_q, max_q = _unpad_index(mask[:, -q_len:])
    q_flat = q.reshape(-1, *q.shape[2:]) if idx_q is None else q.reshape(-1, *q.shape[2:])[idx_q]
    out, _ = flash_attn_varlen_func(q_flat, k_flat, v_flat, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                    max_seqlen_q=max_q, max_seqlen_k=max_k, **common)
    if idx_q is None:
        return out.view(batch, 1, *out.shape[1:])
    full = out.new_zeros(batch * q_len, *out.shape[1:])
    full[idx_q] = out
    return full.view(batch, q_len, *out.shape[1:])


def _unpad_index(mask: torch.Tensor):
    """(flat indices of kept tokens, int32 cu_seqlens, max length) of a (b, s) bool mask."""
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    idx = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return idx, cu, int(seqlens.max().item())


register()

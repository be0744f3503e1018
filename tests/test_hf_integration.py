"""The transformers integration's logic on a CPU: registration, masks, unpadding, windows, refusals.

The integration turns transformers' calls into flash_attn_func / flash_attn_varlen_func calls. Here
those two are replaced (in the integration module only) by an fp32 reference that honours the same
arguments, so whole random Llama / Mistral / Qwen2 models built with
attn_implementation="fa4_sm120" can be compared with the same models on "sdpa": right and
left padding, decode with a KV cache, Mistral's sliding window, packed sequences, GQA. The GPU test
(test_hf_gpu.py) runs the real kernels.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flash_attn_sm120.integrations import transformers as hf  # noqa: E402
from flash_attn_sm120.testing import attention_ref  # noqa: E402

CALLS: list[dict] = []


def _ref_func(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
              learnable_sink=None, deterministic=False, **_):
    CALLS.append(dict(kind="dense", causal=causal, window=window_size, shape=tuple(q.shape),
                      sink=learnable_sink is not None))
    out, lse = attention_ref(q, k, v, causal=causal, window=window_size, softmax_scale=softmax_scale, softcap=softcap,
                             learnable_sink=learnable_sink)
    return out.to(q.dtype), lse


def _ref_varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                causal=False, window_size=(None, None), softcap=0.0, learnable_sink=None, deterministic=False, **_):
    assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
    CALLS.append(dict(kind="varlen", causal=causal, window=window_size, batch=cu_seqlens_q.numel() - 1,
                      sink=learnable_sink is not None))
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    for b in range(cu_seqlens_q.numel() - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_seqlens_q[b], cu_seqlens_q[b + 1], cu_seqlens_k[b], cu_seqlens_k[b + 1]))
        o, _ = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal, window=window_size,
                             softmax_scale=softmax_scale, softcap=softcap, learnable_sink=learnable_sink)
        out[q0:q1] = o[0].to(q.dtype)
    return out, None


@pytest.fixture
def reference_kernels(monkeypatch):
    monkeypatch.setattr(hf, "flash_attn_func", _ref_func)
    monkeypatch.setattr(hf, "flash_attn_varlen_func", _ref_varlen)
    CALLS.clear()
    yield CALLS


def _config(family: str, **over):
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    common.update(over)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(sliding_window=6, **common)
    return transformers.Qwen2Config(**common)


def _models(family: str, **over):
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(_config(family, **over), attn_implementation=hf.NAME,
                                                         dtype=torch.float32)
    sdpa = transformers.AutoModelForCausalLM.from_config(_config(family, **over), attn_implementation="sdpa",
                                                         dtype=torch.float32)
    sdpa.load_state_dict(ours.state_dict())
    # fp32 weights would be refused (the kernels compute in bf16/fp16): run both under CPU autocast
    return ours.eval(), sdpa.eval()


def _logits(model, ids, mask=None, **kw):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=ids, attention_mask=mask, **kw).logits.float()


def test_registered_name_is_accepted():
    assert hf.NAME in transformers.AttentionInterface().valid_keys()
    assert hf.NAME in transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS.valid_keys()
    with pytest.raises(ValueError, match="flash"):  # transformers would try to load it as a Hub kernel
        hf.register("flash_attn_sm120")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_unpadded_batch_matches_sdpa(reference_kernels, family):
    ours, sdpa = _models(family)
    ids = torch.randint(0, 96, (2, 20))
    torch.testing.assert_close(_logits(ours, ids), _logits(sdpa, ids), rtol=0.05, atol=0.05)
    assert {c["kind"] for c in reference_kernels} == {"dense"}
    assert all(c["causal"] for c in reference_kernels)
    if family == "mistral":  # sliding_window 6 -> window (5, 5), transformers' flash convention
        assert all(c["window"] == (5, 5) for c in reference_kernels)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_matches_sdpa_at_real_tokens(reference_kernels, side):
    ours, sdpa = _models("llama")
    ids = torch.randint(0, 96, (3, 16))
    mask = torch.ones(3, 16, dtype=torch.long)
    for row, n in ((0, 5), (2, 11)):
        if side == "right":
            mask[row, n:] = 0
        else:
            mask[row, : 16 - n] = 0
    a, b = _logits(ours, ids, mask), _logits(sdpa, ids, mask)
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep], rtol=0.05, atol=0.05)
    assert {c["kind"] for c in reference_kernels} == {"varlen"}


def test_generate_with_left_padding_and_cache_matches_sdpa(reference_kernels):
    ours, sdpa = _models("qwen2")
    ids = torch.randint(1, 96, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        b = sdpa.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(a, b)
    assert any(c["kind"] == "varlen" and c["batch"] == 2 for c in reference_kernels)


def test_packed_position_ids_use_varlen(reference_kernels):
    ours, _ = _models("llama")
    ids = torch.randint(0, 96, (1, 14))
    position_ids = torch.tensor([list(range(6)) + list(range(8))])
    packed = _logits(ours, ids, position_ids=position_ids)
    first = _logits(ours, ids[:, :6])
    second = _logits(ours, ids[:, 6:])
    torch.testing.assert_close(packed[:, :6], first, rtol=0.05, atol=0.05)
    torch.testing.assert_close(packed[:, 6:], second, rtol=0.05, atol=0.05)
    assert any(c["kind"] == "varlen" for c in reference_kernels)


def test_refusals_name_the_problem(reference_kernels):
    module = torch.nn.Linear(4, 4).to(torch.bfloat16)
    module.is_causal = True
    q = torch.randn(1, 4, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dropout"):
        hf.attention_forward(module, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match="4-D"):
        hf.attention_forward(module, q, q, q, torch.ones(1, 1, 8, 8, dtype=torch.bool))
    with pytest.raises(TypeError, match="bfloat16"):
        hf.attention_forward(torch.nn.Linear(4, 4), q.float(), q.float(), q.float(), None)
    out, weights = hf.attention_forward(module, q.float(), q.float(), q.float(), None)  # cast to the layer's bf16
    assert out.dtype == torch.bfloat16 and out.shape == (1, 8, 4, 16) and weights is None


@pytest.mark.parametrize("padded", [False, True])
def test_gpt_oss_sinks_and_sliding_layers_match_eager(reference_kernels, padded):
    """gpt-oss passes its per-head sinks as s_aux: they arrive as learnable_sink, on sliding and full layers."""
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1, sliding_window=6,
                  layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256)
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**common),
                                                         attn_implementation=hf.NAME, dtype=torch.float32).eval()
    ref = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**common),
                                                        attn_implementation="eager", dtype=torch.float32).eval()
    ref.load_state_dict(ours.state_dict())
    for layer in ours.model.layers:  # sinks away from zero, so that they matter
        torch.nn.init.normal_(layer.self_attn.sinks, std=2.0)
    ref.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 96, (2, 15))
    mask = torch.ones(2, 15, dtype=torch.long)
    if padded:
        mask[1, 9:] = 0
    a, b = _logits(ours, ids, mask), _logits(ref, ids, mask)
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep], rtol=0.05, atol=0.05)
    assert reference_kernels and all(c["sink"] for c in reference_kernels)
    assert {c["window"] for c in reference_kernels} == {(5, 5), (None, None)}

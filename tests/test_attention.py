import torch
from transformers.integrations.sdpa_attention import repeat_kv

from rollout_lab.engine.kernels.attention import gqa_decode_attention


class _Module(torch.nn.Module):
    num_key_value_groups = 4
    is_causal = True


def reference(query, key, value, mask, groups):
    k, v = repeat_kv(key, groups), repeat_kv(value, groups)
    out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask)
    return out.transpose(1, 2)


def test_one_token_gqa_equals_repeated_kv():
    torch.manual_seed(0)
    batch, kv_heads, groups, seq, dim = 3, 2, 4, 11, 16
    query = torch.randn(batch, kv_heads * groups, 1, dim)
    key, value = torch.randn(batch, kv_heads, seq, dim), torch.randn(batch, kv_heads, seq, dim)
    keep = torch.rand(batch, 1, 1, seq) > 0.3
    keep[..., -1] = True
    for mask in (keep, torch.where(keep, 0.0, torch.finfo(torch.float32).min)):
        out, _ = gqa_decode_attention(_Module(), query, key, value, mask)
        assert out.shape == (batch, 1, kv_heads * groups, dim)
        torch.testing.assert_close(out, reference(query, key, value, mask, groups))


def test_prefill_goes_to_hf_sdpa():
    torch.manual_seed(1)
    query = torch.randn(2, 8, 5, 16)
    key, value = torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    out, _ = gqa_decode_attention(_Module(), query, key, value, None, is_causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, 4), repeat_kv(value, 4), is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, expected)


def test_decode_steps_use_it_and_hf_paths_keep_sdpa():
    from conftest import get_tiny
    from transformers import AttentionInterface

    from rollout_lab import Rollout, RolloutConfig
    from rollout_lab.engine.kernels.attention import NAME, register

    register()
    model = get_tiny("qwen2")  # 4 query heads, 2 KV heads
    calls = []
    original = AttentionInterface._global_mapping[NAME]

    def counted(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return original(module, query, *args, **kwargs)

    AttentionInterface._global_mapping[NAME] = counted
    try:
        Rollout(model, RolloutConfig(mode="bucketed")).generate([[5, 6, 7], [8, 9]], max_new_tokens=4)
    finally:
        AttentionInterface._global_mapping[NAME] = original
    layers = model.config.num_hidden_layers
    assert calls == [1] * (3 * layers)  # three decode steps, one call per layer, one query token
    assert model.config._attn_implementation == "sdpa"

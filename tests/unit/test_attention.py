"""dschat.models.attention: the steps' models compute SDPA in fp32 for 16-bit weights on CPU, take the same
masks as SDPA, decode with an fp32 KV cache, and save nothing of it."""

from __future__ import annotations

import json

import pytest
import torch

from dschat.data.collate import IGNORE_INDEX
from dschat.generation.kv_decode import decode, position_ids_from_mask
from dschat.generation.sampling import SamplingConfig
from dschat.models.attention import FAST_ATTENTION, decode_cache, use_fast_attention
from tests.unit.test_ppo_trainer import micro_llama


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows, the first left-padded by 3: (2, 12)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, mask


def _forward_and_grads(model, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits of the real positions (N, V) and the gradient of the first block's query weight."""
    model.zero_grad()
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
    ).logits.float()
    (logits[mask.bool()].logsumexp(-1).sum()).backward()
    return logits[mask.bool()].detach(), model.model.layers[0].self_attn.q_proj.weight.grad.float()


def test_bf16_on_cpu_is_at_least_as_close_to_fp32_as_sdpa_forward_and_backward():
    """The bf16 model against the same weights in fp32 (left padding, so the mask matters): with the
    attention computed in fp32 its logits and gradients are no further from fp32 than bf16 SDPA's (a
    wrong mask or a lost gradient would put it far off)."""
    ids, mask = _ids()
    want_logits, want_grad = _forward_and_grads(micro_llama(64, seed=1).train(), ids, mask)
    err = {}
    for attn in ("sdpa", FAST_ATTENTION):
        model = micro_llama(64, seed=1).train().to(torch.bfloat16)
        if attn == FAST_ATTENTION:
            use_fast_attention(model)
        assert model.config._attn_implementation == attn
        logits, grad = _forward_and_grads(model, ids, mask)
        err[attn] = (
            (logits - want_logits).abs().max().item(),
            ((grad - want_grad).norm() / want_grad.norm()).item(),
        )
    assert (
        err[FAST_ATTENTION][0] <= 1.1 * err["sdpa"][0] and err[FAST_ATTENTION][1] <= 1.1 * err["sdpa"][1]
    ), err
    assert err[FAST_ATTENTION][0] < 0.1 and err[FAST_ATTENTION][1] < 0.05, err


def test_fp32_weights_run_sdpa_itself():
    ids, mask = _ids()
    plain = micro_llama(64, seed=1)
    fast = use_fast_attention(micro_llama(64, seed=1))
    with torch.no_grad():
        assert torch.equal(
            fast(input_ids=ids, attention_mask=mask).logits, plain(input_ids=ids, attention_mask=mask).logits
        )


def test_decoding_with_the_fp32_cache_is_at_least_as_close_to_fp32_as_the_16_bit_cache():
    """A bf16 model decoding with the fp32 cache (attention in fp32 at every new token) against its own bf16
    cache (bf16 SDPA): the same sampled tokens, and log-probs no further from the same weights run in fp32
    over those tokens. Only a fast-attention bf16 model on CPU gets the cache."""
    import copy

    model = use_fast_attention(micro_llama(64, seed=2).to(torch.bfloat16))
    ids, mask = _ids()
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0)
    out = {}
    for name, cache in (("fp32", decode_cache(model)), ("own", None)):
        out[name] = decode(model, ids, mask, sampling, eos_token_id=None, pad_token_id=0, cache=cache,
                           generator=torch.Generator().manual_seed(3), return_logprobs=True)  # fmt: skip
    assert type(decode_cache(model)).__name__ == "Fp32DynamicCache"
    seq = out["fp32"].sequences
    assert torch.equal(seq, out["own"].sequences)
    full = torch.cat([mask, torch.ones(2, 8, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        logits = copy.deepcopy(model).float()(input_ids=seq, attention_mask=full,
                                              position_ids=position_ids_from_mask(full)).logits  # fmt: skip
    want = torch.log_softmax(logits[:, -9:-1], dim=-1).gather(-1, seq[:, -8:, None]).squeeze(-1)
    err = {k: (o.logprobs - want).abs().max().item() for k, o in out.items()}
    assert err["fp32"] <= 1.1 * err["own"] and err["fp32"] < 0.02, err
    assert decode_cache(use_fast_attention(micro_llama(64))) is None  # fp32 weights
    assert decode_cache(micro_llama(64).to(torch.bfloat16)) is None  # plain sdpa


@pytest.mark.parametrize("kind", ["causal_lm", "reward_model"])
def test_the_loaders_switch_and_save_nothing_of_it(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    from dschat.models.loading import load_causal_lm
    from dschat.models.reward import load_reward_model

    micro_llama(64).save_pretrained(tmp_path / "m")
    model = (
        load_causal_lm(str(tmp_path / "m")) if kind == "causal_lm" else load_reward_model(str(tmp_path / "m"))
    )
    hf = model if kind == "causal_lm" else model.hf_model
    assert hf.config._attn_implementation == FAST_ATTENTION
    hf.save_pretrained(tmp_path / "saved")
    assert FAST_ATTENTION not in json.dumps(json.loads((tmp_path / "saved" / "config.json").read_text()))
    if kind == "causal_lm":  # a plain transformers load, without this project's registration, works
        assert AutoModelForCausalLM.from_pretrained(tmp_path / "saved").config._attn_implementation == "sdpa"


def test_fp32_for_16_bit_tensors_on_cpu_only():
    from dschat.models.attention import _in_fp32

    def q(dtype):
        return torch.zeros(2, 4, 3, 8, dtype=dtype)

    assert _in_fp32(q(torch.bfloat16)) and _in_fp32(q(torch.float16))
    assert not _in_fp32(q(torch.float32))


def test_cuda_leaves_out_cudnn_and_nothing_else_is_restricted():
    from torch.nn.attention import SDPBackend

    from dschat.models.attention import sdpa_backends

    allowed = sdpa_backends("cuda")
    assert SDPBackend.CUDNN_ATTENTION not in allowed
    assert {SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH} <= set(allowed)
    assert sdpa_backends("cpu") is None


def test_causal_only_drops_a_mask_that_pads_only_on_the_right():
    from dschat.models.attention import causal_only

    right = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    assert causal_only(right) is None and causal_only(None) is None
    for kept in ([[1, 1, 1], [0, 1, 1]], [[1, 0, 1], [1, 1, 1]]):  # left padding, a hole
        mask = torch.tensor(kept)
        assert causal_only(mask) is mask


@pytest.mark.parametrize("padding", ["right", "left"])
def test_loss_and_gradients_are_the_same_without_the_mask_of_a_right_padded_batch(padding):
    """sft_loss (which drops a right-padded batch's mask) == the loss of the masked forward on the
    model's own logits, with the same gradients; left padding keeps its mask (dropping it would let
    real tokens attend to the padding before them)."""
    from dschat import lm
    from dschat.losses import mean_token_nll

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    if padding == "right":
        mask[1, 6:], mask[2, 3:] = 0, 0
    else:
        mask[1, :4], mask[2, :7] = 0, 0
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    model = use_fast_attention(micro_llama(64, seed=1))
    seen = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["attention_mask"]), with_kwargs=True
    )
    loss, _ = lm.sft_loss(model, ids, mask, labels)
    hook.remove()
    assert (seen[0] is None) == (padding == "right")
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want, _ = mean_token_nll(model(input_ids=ids, attention_mask=mask).logits, labels)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for a, p in zip(got, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_left_padded_bf16_backward_on_cuda_has_finite_gradients():
    """cuDNN's SDPA backward (the default kernel on H100/H200 with PyTorch 2.11-2.13) returned NaN query
    gradients for masks with fully masked rows at lengths of 64 mod 128: left padding at 64 positions.
    With dschat_sdpa every gradient is finite and close to the fp32 model's."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (4, 64), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[0, :20], mask[1, :5] = 0, 0
    want_logits, want_grad = _forward_and_grads(micro_llama(64, seed=1).train().cuda(), ids, mask)
    model = use_fast_attention(micro_llama(64, seed=1).train().cuda().to(torch.bfloat16))
    logits, grad = _forward_and_grads(model, ids, mask)
    assert all(bool(p.grad.isfinite().all()) for p in model.parameters() if p.grad is not None)
    assert ((grad - want_grad).norm() / want_grad.norm()).item() < 0.05
    assert (logits - want_logits).abs().max().item() < 0.1

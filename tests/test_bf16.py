"""bf16 where it is safe (`composer_diloco.policy.precision`): frozen linear weights stored in bf16 compute
bit-identical outputs under autocast. A ``--dtype bf16`` node training next to an fp32 node in one run is in
test_lora.py's LoRA run (one run for both: the suite's time)."""

import copy
from pathlib import Path

import pytest
import torch

from composer_diloco.config import LoraSection, load_config
from composer_diloco.policy import build_tiny_model, load_default_tokenizer
from composer_diloco.policy.lora import apply_lora, base_sha256
from composer_diloco.policy.precision import autocast_forward, bf16_linear_params, frozen_linears_to_bf16, is_autocast

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_tiny_model(load_default_tokenizer(), 0)


def _ids() -> torch.Tensor:
    return torch.randint(0, 800, (2, 48), generator=torch.Generator().manual_seed(1))


def _autocast_logits(m) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return m(input_ids=_ids()).logits


def test_frozen_reference_in_bf16_is_bit_identical_under_autocast(model):
    """Full fine-tuning's DPO reference: every linear weight in bf16, the tied embedding and the norms fp32; its
    logits equal the fp32 copy's under autocast bit for bit, and a deep copy keeps the autocast wrapper."""
    expected = _autocast_logits(model)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    linear = bf16_linear_params(ref)
    assert frozen_linears_to_bf16(ref) == 2 * sum(p.numel() for p in linear) > 0
    embedding = ref.get_input_embeddings().weight
    assert embedding.dtype == torch.float32  # tied to lm_head: an embedding lookup is not autocast
    assert all(p.dtype == torch.bfloat16 for p in linear) and not any(p is embedding for p in linear)
    with pytest.raises(RuntimeError):  # a bf16 weight meets fp32 activations without autocast
        ref(input_ids=_ids())
    autocast_forward(ref, "cpu")
    assert is_autocast(ref) and torch.equal(ref(input_ids=_ids()).logits, expected)
    again = copy.deepcopy(ref)
    assert is_autocast(again) and torch.equal(again(input_ids=_ids()).logits, expected)


def test_lora_base_in_bf16_trains_fp32_adapters_and_generates_the_same_tokens(model):
    """A LoRA policy: the base's linear weights go bf16, the adapters stay fp32 and train (fp32 gradients); the
    forward, ``generate`` (peft's generate never calls PeftModel.forward: the base model's forward is the one
    wrapped) and the adapters-disabled reference are bit-identical to fp32 storage under autocast; the base hash,
    taken before the cast as a node does, is the fp32 one."""
    section = LoraSection(r=4, lora_alpha=8, target_modules="all-linear")
    torch.manual_seed(0)
    fp32 = apply_lora(copy.deepcopy(model), section)
    with torch.no_grad():  # adapters off zero, so the LoRA path counts in the comparison
        for name, p in fp32.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(2))
    prompt = _ids()[:1, :8]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = fp32(input_ids=_ids()).logits
        tokens = fp32.generate(input_ids=prompt, max_new_tokens=12, do_sample=False)
        with fp32.disable_adapter():
            base_logits = fp32(input_ids=_ids()).logits
    bf16 = copy.deepcopy(fp32)
    base_hash = base_sha256(bf16)
    assert frozen_linears_to_bf16(bf16) > 0
    autocast_forward(bf16, "cpu")
    kinds = {(str(p.dtype), p.requires_grad) for p in bf16.parameters()}
    assert kinds == {("torch.bfloat16", False), ("torch.float32", False), ("torch.float32", True)}, kinds
    assert all(p.dtype == torch.float32 for n, p in bf16.named_parameters() if "lora_" in n)
    assert torch.equal(bf16(input_ids=_ids()).logits, logits)
    assert torch.equal(bf16.generate(input_ids=prompt, max_new_tokens=12, do_sample=False), tokens)
    with bf16.disable_adapter():
        assert torch.equal(bf16(input_ids=_ids()).logits, base_logits)
    loss = bf16(input_ids=_ids(), labels=_ids()).loss
    loss.backward()
    grads = [p.grad for p in bf16.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.dtype == torch.float32 for g in grads)
    assert base_hash == base_sha256(fp32)


def test_full_fine_tuning_dpo_reference_copy_is_bf16_under_autocast(model):
    """The DPO channel of a bf16 policy (full fine-tuning) keeps a reference copy whose linear weights are bf16 and
    which stays under autocast; an fp32 policy's copy stays fp32; `after_outer_step` rounds theta into it."""
    from composer_diloco.channels.base import ChannelContext
    from composer_diloco.channels.dpo import DpoChannel
    from composer_diloco.channels.hints import HintRegistry
    from composer_diloco.rollout.env_package import load_env_package

    config = load_config(SMOKE)
    assert config.loss.beta_dpo > 0 and config.lora is None
    env = load_env_package(config.env.server_module)
    hints = HintRegistry.from_config(config.hints, reason_hints=env.reason_hints)
    for bf16 in (False, True):
        policy = copy.deepcopy(model)
        if bf16:
            autocast_forward(policy, "cpu")
        ctx = ChannelContext(config=config, model=policy, tokenizer=load_default_tokenizer(), sessions=[None],
                             env=env, hints=hints)
        channel = DpoChannel.from_context(ctx)
        reference = channel.reference_model
        dtypes = {p.dtype for p in reference.parameters()}
        assert dtypes == ({torch.float32, torch.bfloat16} if bf16 else {torch.float32}), dtypes
        assert is_autocast(reference) == bf16 and not any(p.requires_grad for p in reference.parameters())
    with torch.no_grad():  # an outer step moved theta: the bf16 reference takes it, rounded
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 1e-3)
    channel.after_outer_step()
    for ref, cur in zip(reference.parameters(), policy.parameters(), strict=True):
        assert torch.equal(ref, cur.to(ref.dtype))

"""The GRPO channel through our trainer is TRL GRPOTrainer's loss; the extra channels add to it."""

import copy

import pytest
import torch
from datasets import Dataset
from trl import GRPOTrainer

from composer_diloco.config import LossConfig, RunConfig
from composer_diloco.policy import build_tiny_model, load_default_tokenizer
from composer_diloco.rollout.episodes import EnvSession
from composer_diloco.inner.trainer import ComposerGRPOTrainer, env_reward, grpo_args


def grpo_batch(tok, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, p, c = 8, 12, 20
    completion_mask = torch.ones(b, c, dtype=torch.long)
    completion_mask[:, 15:] = 0
    tool_mask = torch.ones(b, c, dtype=torch.long)
    tool_mask[:, 5:9] = 0  # a tool reply inside the completion: no loss there
    return {
        "prompt_ids": torch.randint(3, len(tok), (b, p), generator=g),
        "prompt_mask": torch.ones(b, p, dtype=torch.long),
        "completion_ids": torch.randint(3, len(tok), (b, c), generator=g),
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
        "advantages": torch.randn(b, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_grpo_loss_equals_trl(tmp_path, loss_type):
    tok = load_default_tokenizer()
    model = build_tiny_model(tok, seed=0)
    config = RunConfig(loss=LossConfig(alpha_sdpo=0.0, beta_dpo=0.0), grpo={"loss_type": loss_type})
    args = grpo_args(config, output_dir=tmp_path / "a", max_steps=1, use_cpu=True, bf16=False)
    ours = ComposerGRPOTrainer(model=model, tokenizer=tok, config=config, sessions=[EnvSession()] * 8,
                               peer_name="t", args=args)
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "x"}]}] * 8)
    theirs = GRPOTrainer(model=copy.deepcopy(model), reward_funcs=[env_reward], args=args, train_dataset=rows,
                         processing_class=tok)
    for trainer in (ours, theirs):
        trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop; one micro-batch per step
    batch = grpo_batch(tok)
    a = ours._compute_loss(ours.model, dict(batch))
    b = theirs._compute_loss(theirs.model, dict(batch))
    assert torch.allclose(a, b, atol=0, rtol=0), (a, b)
    assert ours.round_stats.steps[-1].loss_grpo == pytest.approx(b.item()) and ours.round_stats.steps[-1].loss_sdpo == 0.0

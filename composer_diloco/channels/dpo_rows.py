"""DPO's rows: preference pairs -> padded ``prompt + chosen`` / ``prompt + rejected`` tensors with the reference
policy's log-probs (trace-replay DPO: `composer_diloco.channels.dpo_pairs` collects the pairs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from composer_diloco.channels.base import pad_rows
from composer_diloco.channels.losses import sequence_logprobs

__all__ = ["dpo_rows"]


@torch.no_grad()
def dpo_rows(pairs: Sequence[Any], reference_model: torch.nn.Module, *, pad_token_id: int, max_length: int,
         stats: Any) -> dict[str, torch.Tensor]:
    """DPO's rows (`DPO_KEYS` of `composer_diloco.channels.dpo`): ``dpo_chosen_ids`` / ``dpo_rejected_ids`` (P, L)
    long (``prompt + chosen`` / ``prompt + rejected``, right-padded with ``pad_token_id``), their ``*_attention_mask``
    and ``*_response_mask`` (P, L) (1 on response tokens), and ``dpo_ref_chosen_logps`` / ``dpo_ref_rejected_logps``
    (P,) float32: the reference policy's summed response log-probs (nats, no grad, computed on its device, returned on
    CPU). A pair's ``chosen_mask`` (a multi-turn chosen: its env replies are context) zeroes those tokens of the chosen
    response mask. A pair whose longer response reaches ``max_length`` tokens is dropped (``stats.dpo_skipped_truncated``);
    the prompt is cut from the left to fit. Returns ``{}`` when no pair fits; counts kept pairs in
    ``stats.dpo_pairs``.

    Args:
        pairs: `composer_diloco.channels.dpo_pairing.PreferencePair` s (``prompt_ids``, ``chosen_ids``,
            ``rejected_ids``).
        reference_model: the reference policy: the round's global model theta_r, frozen at the round's start, the
            anchor every peer shares (so DPO's trust region is the same on every node and moves with the outer step).
        stats: a `composer_diloco.channels.dpo.DpoStats` (its ``dpo_pairs`` and ``dpo_skipped_truncated``).
    """
    rows_c, rows_r = [], []
    for p in pairs:
        longest = max(len(p.chosen_ids), len(p.rejected_ids))
        if longest >= max_length:
            stats.dpo_skipped_truncated += 1
            continue
        prompt = list(p.prompt_ids)[-(max_length - longest):]
        rows_c.append((prompt + list(p.chosen_ids), len(prompt), p.chosen_mask))
        rows_r.append((prompt + list(p.rejected_ids), len(prompt), None))
    if not rows_c:
        return {}
    out = {}
    device = next(reference_model.parameters()).device
    for name, rows in (("chosen", rows_c), ("rejected", rows_r)):
        ids, att = pad_rows([r[0] for r in rows], pad_token_id)
        resp = torch.zeros_like(ids)
        for row, (seq, n_prompt, mask) in enumerate(rows):
            resp[row, n_prompt:len(seq)] = 1 if mask is None else torch.tensor(mask, dtype=resp.dtype)
        logits = reference_model(input_ids=ids.to(device), attention_mask=att.to(device)).logits.float()
        out[f"dpo_{name}_ids"], out[f"dpo_{name}_attention_mask"] = ids, att
        out[f"dpo_{name}_response_mask"] = resp
        out[f"dpo_ref_{name}_logps"] = sequence_logprobs(logits, ids.to(device), resp.to(device)).cpu()
    stats.dpo_pairs += len(rows_c)
    return out

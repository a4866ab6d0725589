"""TrainingBatch <-> verl `DataProto`, in the layout verl's PPO step reads.

verl splits each row into a left-padded prompt and a right-padded response:

    prompts [N, P]  responses [N, R]  input_ids = attention_mask = position_ids: [N, P + R]
    response_mask [N, R]: 1 on tokens the policy is trained on (engine-generated); tool results and
        template text between merged calls are inside the response but 0, as in verl's multi-turn
        agent loop
    old_log_probs, rollout_log_probs [N, R]: the engine's logprobs (verl may recompute old_log_probs)
    rollout_log_probs_known [N, R]: 0 where the engine gave no usable logprob (its 0.0 above is a
        placeholder: agl's backends re-score such a token or leave it out, backends/agreement.py)
    after_switch [N, R]: 1 where a token was sampled after a keep switch in its call
    token_level_scores, token_level_rewards [N, R]: the rollout's reward on the row's last trained
        token, plus per-call rewards where they were placed
    advantages, returns [N, R]: when given
    non_tensor_batch: uid (the group: rollouts of one task), rollout_id, task_id

A row's prompt is everything before its first trained token. verl's GRPO treats each row as one
response; rows of one multi-sample rollout then weigh more than a single-sample rollout. To keep
agl's rollout normalisation, compute advantages with agl's algorithms and pass them in.
Per-rollout arrays travel in meta_info (agl_*), so `from_dataproto` rebuilds the TrainingBatch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from agl_trainer.batch import TrainingBatch

if TYPE_CHECKING:
    from verl import DataProto


def _split_points(batch: TrainingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: prompt length (index of the first trained token) and total length."""
    lengths = batch.attention_mask.sum(dim=1)
    trained = batch.loss_mask > 0
    first = torch.where(trained.any(dim=1), trained.float().argmax(dim=1), lengths)
    return first.long(), lengths.long()


def to_dataproto(
    batch: TrainingBatch,
    *,
    advantages: torch.Tensor | None = None,
    returns: torch.Tensor | None = None,
    pad_token_id: int = 0,
) -> DataProto:
    """Convert `batch`. `advantages`/`returns` are [N, L] (batch layout), [N] (per row) or [R] (per
    rollout); scalars are broadcast over the row's trained tokens."""
    from verl import DataProto

    n = batch.num_samples
    prompt_lengths, lengths = _split_points(batch)
    response_lengths = lengths - prompt_lengths
    width_p = int(prompt_lengths.max()) if n else 0
    width_r = max(int(response_lengths.max()) if n else 0, 1)

    prompts = torch.full((n, width_p), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, width_p), dtype=torch.long)
    responses = torch.full((n, width_r), pad_token_id, dtype=torch.long)
    response_attention = torch.zeros((n, width_r), dtype=torch.long)

    def response_part(source: torch.Tensor, fill: float, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((n, width_r), fill, dtype=dtype)
        for row in range(n):
            p, length = int(prompt_lengths[row]), int(lengths[row])
            out[row, : length - p] = source[row, p:length].to(dtype)
        return out

    for row in range(n):
        p, length = int(prompt_lengths[row]), int(lengths[row])
        prompts[row, width_p - p :] = batch.input_ids[row, :p]
        prompt_mask[row, width_p - p :] = 1
        responses[row, : length - p] = batch.input_ids[row, p:length]
        response_attention[row, : length - p] = 1

    response_mask = response_part(batch.loss_mask, 0.0, torch.float32)
    logprobs = response_part(batch.engine_logprobs, 0.0, torch.float32)
    versions = response_part(batch.policy_versions, -1, torch.long)
    known = response_part(batch.known_logprobs(), 1, torch.float32)
    switched = response_part(batch.switched(), 0, torch.float32)
    scores = response_part(batch.token_rewards, 0.0, torch.float32)
    trained_rows = response_mask.any(dim=1)
    last_trained = width_r - 1 - response_mask.flip(dims=[1]).argmax(dim=1)
    row_rewards = batch.rollout_rewards[batch.rollout_index]
    rows = torch.arange(n)[trained_rows]
    scores[rows, last_trained[trained_rows]] += row_rewards[trained_rows]

    attention_mask = torch.cat([prompt_mask, response_attention], dim=1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "response_mask": response_mask,
        "old_log_probs": logprobs,
        "rollout_log_probs": logprobs.clone(),
        "token_level_scores": scores,
        "token_level_rewards": scores.clone(),
        "policy_versions": versions,
        "rollout_log_probs_known": known,
        "after_switch": switched,
        "rollout_index": batch.rollout_index.clone(),
    }
    for name, value in (("advantages", advantages), ("returns", returns)):
        if value is not None:
            tensors[name] = _per_token(value, batch, response_part, response_mask, name)
    group = batch.rollout_group_index[batch.rollout_index].tolist()
    non_tensors = {
        "uid": np.array([f"group-{index}" for index in group], dtype=object),
        "rollout_id": np.array([batch.rollout_ids[i] for i in batch.rollout_index.tolist()], dtype=object),
        "task_id": np.array([batch.task_ids[i] for i in batch.rollout_index.tolist()], dtype=object),
    }
    meta_info = {
        "agl_rollout_ids": list(batch.rollout_ids),
        "agl_task_ids": list(batch.task_ids),
        "agl_rollout_rewards": batch.rollout_rewards.tolist(),
        "agl_rollout_group_index": batch.rollout_group_index.tolist(),
        "global_token_num": attention_mask.sum(dim=1).tolist(),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)


def _per_token(
    value: torch.Tensor, batch: TrainingBatch, response_part, response_mask: torch.Tensor, name: str
) -> torch.Tensor:
    if value.dim() == 2 and tuple(value.shape) == tuple(batch.input_ids.shape):
        return response_part(value, 0.0, torch.float32)
    if value.dim() == 1 and value.shape[0] == batch.num_samples:
        return value.float()[:, None] * response_mask
    if value.dim() == 1 and value.shape[0] == batch.num_rollouts:
        return value.float()[batch.rollout_index][:, None] * response_mask
    raise ValueError(
        f"to_dataproto: {name} must be [N, L] = {list(batch.input_ids.shape)}, [N] = [{batch.num_samples}]"
        f" or [R] = [{batch.num_rollouts}], got {list(value.shape)}"
    )


def from_dataproto(data: DataProto, pad_token_id: int = 0) -> TrainingBatch:
    """The TrainingBatch a `to_dataproto` DataProto came from (rows may have been split or concatenated)."""
    tensors = data.batch
    meta = data.meta_info
    prompts, responses = tensors["prompts"], tensors["responses"]
    width_p = prompts.shape[1]
    attention = tensors["attention_mask"]
    n = prompts.shape[0]
    rows = []
    for row in range(n):
        prompt = prompts[row][attention[row, :width_p] > 0]
        response_length = int(attention[row, width_p:].sum())
        rows.append((prompt, response_length))
    width = max((p.shape[0] + r for p, r in rows), default=0)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    engine_logprobs = torch.zeros((n, width), dtype=torch.float32)
    policy_versions = torch.full((n, width), -1, dtype=torch.long)
    token_rewards = torch.zeros((n, width), dtype=torch.float32)
    known = torch.ones((n, width), dtype=torch.bool)
    switched = torch.zeros((n, width), dtype=torch.bool)
    has_masks = "rollout_log_probs_known" in tensors.keys()  # older exports have none
    rollout_index = tensors["rollout_index"].long()
    rollout_rewards = torch.tensor(meta["agl_rollout_rewards"], dtype=torch.float32)
    scores = tensors["token_level_scores"].clone()
    mask = tensors["response_mask"]
    for row, (prompt, r) in enumerate(rows):
        p = prompt.shape[0]
        trained = torch.nonzero(mask[row] > 0).flatten()
        if trained.numel():  # undo the rollout reward placed on the last trained token
            scores[row, trained[-1]] -= rollout_rewards[rollout_index[row]]
        input_ids[row, :p] = prompt
        input_ids[row, p : p + r] = responses[row, :r]
        attention_mask[row, : p + r] = 1
        loss_mask[row, p : p + r] = mask[row, :r].float()
        engine_logprobs[row, p : p + r] = tensors["rollout_log_probs"][row, :r]
        policy_versions[row, p : p + r] = tensors["policy_versions"][row, :r]
        token_rewards[row, p : p + r] = scores[row, :r]
        if has_masks:
            known[row, p : p + r] = tensors["rollout_log_probs_known"][row, :r] > 0
            switched[row, p : p + r] = tensors["after_switch"][row, :r] > 0
    return TrainingBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        loss_mask=loss_mask,
        engine_logprobs=engine_logprobs,
        policy_versions=policy_versions,
        token_rewards=token_rewards,
        rollout_index=rollout_index,
        rollout_rewards=rollout_rewards,
        rollout_group_index=torch.tensor(meta["agl_rollout_group_index"], dtype=torch.long),
        rollout_ids=list(meta["agl_rollout_ids"]),
        task_ids=list(meta["agl_task_ids"]),
        logprob_known=known,
        after_switch=switched,
    )

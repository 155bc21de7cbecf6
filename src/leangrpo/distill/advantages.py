"""The sampled reverse-KL advantage of on-policy distillation (`distill.objective: sampled`).

    r_t = -(log p_student(y_t) - log p_teacher(y_t))
    D_t = sum over k >= t in t's sequence of discount^(k - t) * r_k
    A_t = A_reward(sequence of t) + weight * D_t

on the packed layout: (T,) completion tokens (the model's tokens only, in order, each
sequence's contiguous), `token_seq` naming each one's sequence. The student's log-prob is
the ratio's denominator (the old log-probs: the policy that sampled), so A_t is fixed for
the batch, detached, like the reward advantage. The discounted sum is a segmented reverse
scan in log2(longest sequence) vectorised steps (Hillis-Steele): after the step with
offset d, each token holds its window [t, t + 2d) of its own sequence; no loop over
tokens, and one host sync (the longest sequence) only when discount > 0. Computed in
float64 and returned in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor


def reverse_kl_rewards(student: Tensor, teacher: Tensor) -> Tensor:
    """(T,) r_t = log p_teacher(y_t) - log p_student(y_t), float64, detached."""
    return teacher.detach().double() - student.detach().double()


def discounted_sums(rewards: Tensor, token_seq: Tensor, discount: float) -> Tensor:
    """(T,) D_t = sum_{k >= t, same sequence} discount^(k - t) r_k (rewards' dtype)."""
    if discount == 0.0 or rewards.numel() == 0:
        return rewards.clone()
    t = rewards.numel()
    # tokens after t within its sequence: sequences are contiguous, so the last index of
    # t's sequence minus t
    index = torch.arange(t, device=rewards.device)
    counts = torch.bincount(token_seq)
    ends = torch.cumsum(counts, 0) - 1  # last token index of each sequence
    after = ends[token_seq] - index
    out = rewards.clone()
    offset, factor = 1, discount
    longest = int(after.max().item()) + 1 if t else 0
    while offset < longest:
        shifted = torch.zeros_like(out)
        shifted[:-offset] = out[offset:]
        out = out + torch.where(after >= offset, factor * shifted, torch.zeros_like(out))
        offset, factor = 2 * offset, factor * factor
    return out


def distill_advantages(
    student: Tensor, teacher: Tensor, token_seq: Tensor, weight: float, discount: float
) -> Tensor:
    """(T,) weight * D_t in float32, detached: the distillation part of A_t."""
    rewards = reverse_kl_rewards(student, teacher)
    return (weight * discounted_sums(rewards, token_seq, discount)).float()

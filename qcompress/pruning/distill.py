"""Optional knowledge-distillation losses (DeepSpeed left KD to example code).

Layer mapping with layer reduction (student i <- teacher teacher_layer[i]):
  attentions     student i      <-> teacher teacher_layer[i]
  hidden states  student 0 (embeddings) <-> teacher 0, student i+1 <-> teacher teacher_layer[i]+1
(DeepSpeed's example uses teacher_layer[0]-1 for the embeddings, which is -1 when the first
mapped layer is 0; we always map embeddings to embeddings.)
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.nn.functional as F


def soft_cross_entropy(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Mean over samples of -sum_c softmax(teacher/T) * log_softmax(student/T); teacher detached."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    target = F.softmax(teacher_logits.detach().float() / temperature, dim=-1)
    logp = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return -(target * logp).sum(-1).mean()


def hidden_state_map(teacher_layer: Sequence[int]) -> List[int]:
    """Teacher hidden-state index for each student hidden state (index 0 = embeddings)."""
    return [0] + [t + 1 for t in teacher_layer]


def hidden_state_mse(
    student_hidden: Sequence[torch.Tensor], teacher_hidden: Sequence[torch.Tensor], teacher_layer: Sequence[int]
) -> torch.Tensor:
    """Sum of MSE between each student hidden state and its mapped teacher hidden state."""
    mapping = hidden_state_map(teacher_layer)
    if len(student_hidden) != len(mapping):
        raise ValueError(
            f"student gave {len(student_hidden)} hidden states, expected "
            f"{len(mapping)} (embeddings + {len(teacher_layer)} layers)"
        )
    if max(mapping) >= len(teacher_hidden):
        raise ValueError(f"teacher_layer needs teacher hidden state {max(mapping)}, teacher gave {len(teacher_hidden)}")
    return sum(F.mse_loss(s.float(), teacher_hidden[t].detach().float()) for s, t in zip(student_hidden, mapping))


def attention_mse(
    student_attn: Sequence[torch.Tensor], teacher_attn: Sequence[torch.Tensor], teacher_layer: Sequence[int]
) -> torch.Tensor:
    """Sum of MSE between student attention scores i and teacher scores teacher_layer[i]."""
    if len(student_attn) != len(teacher_layer):
        raise ValueError(f"student gave {len(student_attn)} attention maps for {len(teacher_layer)} mapped layers")
    return sum(F.mse_loss(s.float(), teacher_attn[t].detach().float()) for s, t in zip(student_attn, teacher_layer))

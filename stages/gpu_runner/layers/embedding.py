"""Token embeddings and the LM head, split by vocabulary ranges under tensor parallelism. Either may
hold quantized blocks (layers/linear.py): the embedding then decodes the rows it gathers, and the
tied head multiplies the blocks as any linear layer does."""
from __future__ import annotations

import torch
from torch import nn

from stages.gpu_runner.layers.linear import linear, method_for
from stages.gpu_runner.layers.quantization.base import QuantizedWeight
from stages.gpu_runner.parallel.group import TensorParallel
from stages.gpu_runner.parallel.sharding import vocab_shard_size


class VocabEmbedding(nn.Embedding):
    """Each rank holds a contiguous range of token ids; its lookups of other ids are zeros, and the
    all-reduce sums the ranks' rows into every row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel | None) -> None:
        per_rank = vocab_size if tp is None else vocab_shard_size(vocab_size, tp.size)
        # An empty weight (the loader fills it): nn.Embedding's own random init would, on the meta
        # device, import torch._dynamo, and with it Triton's library (60+ MB on a CPU runner).
        super().__init__(per_rank, hidden_size, _weight=torch.empty(per_rank, hidden_size))
        self.tp = tp
        self.vocab_start = 0 if tp is None else tp.rank * per_rank

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):  # held whole: never under tensor parallelism
            return method_for(self.weight).embed(self.weight, input_ids, self.compute_dtype)
        if self.tp is None:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        held = (local >= 0) & (local < self.num_embeddings)
        x = super().forward(torch.where(held, local, 0)) * held.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(x)


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor, tp: TensorParallel | None, vocab_size: int,
              softcap: float | None, out: torch.Tensor | None) -> torch.Tensor | None:
    """Normed hidden [n, hidden] -> float32 logits [n, vocab] (into `out` if given); under tensor
    parallelism rank 0 gets the gathered logits and the other ranks None."""
    logits = linear(hidden, weight, None)
    if tp is not None:
        logits = tp.gather_logits(logits, vocab_size)
        if logits is None:
            return None
    if softcap is not None:
        logits = torch.tanh(logits.float() / softcap) * softcap
    return logits.float() if out is None else out.copy_(logits)

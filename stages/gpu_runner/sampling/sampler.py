"""On-device sampling: logits in, one token per row out, no host synchronisation.

Which stages run (penalties, min_tokens, top-k, top-p, min-p, seeded noise, logprobs) is
decided from host-known flags computed in `SamplingMetadata.build` (metadata.py), never from device values,
so a step never waits for the device.

Seeded rows draw their noise from a counter-based hash of (seed, output_pos, vocab index), so a
seeded request gets the same tokens whatever else is in its batch, however its prompt was
chunked, and in async as in sync mode. Sampling is an exponential race: token =
argmax(probs / E) with E ~ Exp(1) per vocab entry, which picks token i with probability probs[i].
On the CPU, unseeded rows invert their cumulative distribution instead (one uniform per row,
fused with temperature and softmax where the compiled kernels are built: cpu_ops): the same
distribution, without a vocabulary of exponentials drawn one at a time.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from stages.gpu_runner import cpu_ops
from stages.gpu_runner.sampling.metadata import SamplingMetadata

# splitmix64 constants as two's-complement int64, since torch has no uint64 arithmetic.
_GAMMA = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64
_UNIFORM_BITS = 24  # float32 holds 24 bits exactly


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # int32 [n]
    logprobs: torch.Tensor | None  # float32 [n, 1 + k]: the sampled token's, then the top k
    logprob_token_ids: torch.Tensor | None  # int32 [n, 1 + k]


class Sampler:
    """Stateless apart from the generator that unseeded rows draw from."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata,
                 constrain: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SamplerOutput:
        """logits: float [n, vocab] for the sampled rows, in the same order as meta. `constrain`
        masks and biases a float32 copy of them (grammars, logit_bias) before anything else;
        logprobs stay those of the model's raw distribution."""
        if logits.dim() != 2 or logits.shape[0] != meta.num_rows:
            raise ValueError(f"logits must be [{meta.num_rows}, vocab], got {tuple(logits.shape)}")
        processed = penalized_logits(logits, meta, constrain)
        token_ids = self.draw(processed, meta).to(torch.int32)

        if meta.max_num_logprobs is None:
            return SamplerOutput(token_ids, None, None)
        logprobs, logprob_token_ids = token_logprobs(logits, token_ids, meta.max_num_logprobs)
        return SamplerOutput(token_ids, logprobs, logprob_token_ids)

    def draw(self, processed: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """int64 [n]: each row's token from its penalised logits (`penalized_logits`; overwritten):
        the argmax on greedy rows, a draw from `sampling_probs` on the others. A seeded row's draw
        depends only on its logits, seed and output position."""
        if meta.all_greedy:
            return processed.argmax(dim=-1)
        if meta.any_greedy:
            greedy_ids = processed.argmax(dim=-1)  # before _sample scales and filters in place
            return torch.where(meta.greedy, greedy_ids, self._sample(processed, meta))
        return self._sample(processed, meta)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if logits.device.type == "cpu" and cpu_ops.library() is not None:
            return self._sample_on_cpu(logits, meta)
        return self.race(sampling_probs(logits, meta), meta)

    def _sample_on_cpu(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """`_sample` with the compiled CPU sampler: unseeded rows draw from their filtered logits
        in one fused pass (temperature, softmax and the draw together, at one uniform each);
        seeded rows race with their own noise."""
        temperature = meta.temperature
        if meta.any_min_p or meta.any_top_p or meta.any_top_k:
            logits, temperature = sampling_logits(logits, meta), torch.ones_like(temperature)
        if meta.num_seeded < meta.num_rows:
            points = torch.rand(meta.num_rows, generator=self.generator, dtype=torch.float64)
            tokens = cpu_ops.sample_logits(logits, temperature, points)
        else:
            tokens = torch.empty(meta.num_rows, dtype=torch.int64)
        if meta.num_seeded:
            rows = logits.index_select(0, meta.seeded_rows).div_(temperature[meta.seeded_rows].unsqueeze(1))
            tokens.index_copy_(0, meta.seeded_rows, self._seeded_race(rows.softmax(dim=-1), meta))
        return tokens

    def race(self, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """One token per row, drawn with probability proportional to `probs` [n, vocab] (which need
        not sum to 1): a seeded row's noise depends only on its seed and output position."""
        if probs.device.type == "cpu":
            return self._invert(probs, meta)
        noise = torch.empty_like(probs)
        if meta.num_seeded < meta.num_rows:
            noise.exponential_(generator=self.generator)
        if meta.num_seeded:
            seeded = _seeded_exponential(meta.seeds, meta.seeded_output_pos, probs.shape[1], probs.device)
            noise.index_copy_(0, meta.seeded_rows, seeded)
        # exponential_ may return exactly 0; 0/0 would be NaN, which argmax would pick.
        noise.clamp_min_(torch.finfo(torch.float32).tiny)
        return probs.div_(noise).argmax(dim=-1)

    def _invert(self, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """`race` on the CPU, where a vocabulary of exponentials costs more than the forward's
        attention (torch draws them one by one): unseeded rows invert their cumulative
        distribution (float64) at one uniform each; seeded rows race with their own noise."""
        if meta.num_seeded < meta.num_rows:
            cumulative = probs.cumsum(dim=-1, dtype=torch.float64)
            point = torch.rand(meta.num_rows, 1, generator=self.generator, dtype=torch.float64)
            # right=True: the first token whose cumulative sum exceeds the point, never one of probability 0
            tokens = torch.searchsorted(cumulative, point.mul_(cumulative[:, -1:]), right=True).squeeze(1)
            tokens.clamp_max_(probs.shape[1] - 1)
        else:
            tokens = torch.empty(meta.num_rows, dtype=torch.int64)
        if meta.num_seeded:
            tokens.index_copy_(0, meta.seeded_rows, self._seeded_race(probs.index_select(0, meta.seeded_rows), meta))
        return tokens

    @staticmethod
    def _seeded_race(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The race of the seeded rows alone (`probs` [num_seeded, vocab], in meta.seeded_rows' order)."""
        noise = _seeded_exponential(meta.seeds, meta.seeded_output_pos, probs.shape[1], probs.device)
        return probs.div_(noise.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(dim=-1)


def sampling_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution each row samples from: temperature, then min-p, top-k and top-p, then
    softmax. `logits` (float32, penalties applied) is overwritten."""
    return sampling_logits(logits, meta).softmax(dim=-1)


def sampling_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """`sampling_probs` before its softmax: the logits divided by the temperature, -inf where
    min-p, top-k or top-p drop a token. `logits` is overwritten."""
    logits = logits.div_(meta.temperature.unsqueeze(1))
    if meta.any_min_p:
        probs = logits.softmax(dim=-1)
        threshold = meta.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill_(probs < threshold, float("-inf"))
    if meta.any_top_p:
        logits = _top_k_top_p_sorted(logits, meta)
    elif meta.any_top_k:
        logits = _top_k(logits, meta)
    return logits


def penalized_logits(logits: torch.Tensor, meta: SamplingMetadata,
                     constrain: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """A float32 copy of `logits` [n, vocab], masked and biased by `constrain` (grammars,
    logit_bias), then penalised and with the blocked ids (min_tokens' stop ids) set to -inf:
    what greedy rows take the argmax of and the others sample from."""
    processed = logits.to(torch.float32, copy=True)
    if constrain is not None:
        processed = constrain(processed)
    if meta.any_penalty:
        processed = _apply_penalties(processed, meta)
    if meta.blocked_token_ids is not None:
        processed = _block_ids(processed, meta.blocked_token_ids)
    return processed


def _apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty over prompt + outputs (HF semantics: positive logits divided, negative
    multiplied); presence and frequency penalties over outputs only (OpenAI semantics).
    Table slots at or beyond a row's num_tokens may hold placeholders or stale ids: masked out."""
    n, vocab = logits.shape
    width = meta.max_num_tokens
    history = meta.token_table[:, :width].index_select(0, meta.rows).to(torch.int64)
    position = torch.arange(width, device=logits.device).unsqueeze(0)
    known = position < meta.num_tokens.unsqueeze(1)
    is_output = known & (position >= meta.num_prompt_tokens.unsqueeze(1))
    history = torch.where(known, history, 0)  # masked slots add 0 below, at a safe index

    seen = torch.zeros(n, vocab, dtype=torch.float32, device=logits.device)
    seen.scatter_add_(1, history, known.to(torch.float32))
    output_counts = torch.zeros_like(seen).scatter_add_(1, history, is_output.to(torch.float32))

    penalty = meta.repetition_penalty.unsqueeze(1)
    repeated = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(seen > 0, repeated, logits)
    logits -= meta.frequency_penalty.unsqueeze(1) * output_counts
    logits -= meta.presence_penalty.unsqueeze(1) * (output_counts > 0).to(torch.float32)
    return logits


def _block_ids(logits: torch.Tensor, blocked_token_ids: torch.Tensor) -> torch.Tensor:
    """Set the blocked ids to -inf. Padding and ids outside the vocabulary land in a spare
    column that is dropped, so no id needs checking on the host."""
    n, vocab = logits.shape
    ids = blocked_token_ids
    ids = torch.where((ids < 0) | (ids >= vocab), vocab, ids)
    bias = torch.zeros(n, vocab + 1, dtype=logits.dtype, device=logits.device)
    bias.scatter_(1, ids, float("-inf"))
    return logits.add_(bias[:, :vocab])


def _top_k(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Keep each row's top_k largest logits (all of them where top_k is 0)."""
    vocab = logits.shape[1]
    max_k = min(meta.max_top_k, vocab)
    top_values = logits.topk(max_k, dim=-1).values
    k = meta.top_k.clamp(max=max_k)
    kth = top_values.gather(1, (k - 1).clamp(min=0).unsqueeze(1))
    threshold = torch.where(k.unsqueeze(1) > 0, kth, float("-inf"))
    return logits.masked_fill_(logits < threshold, float("-inf"))


def _top_k_top_p_sorted(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """top_k then top_p (over the top_k-renormalised distribution) on one descending sort.
    top_p keeps the smallest prefix whose mass reaches top_p: a token stays when the mass of
    the tokens before it is still below top_p."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    if meta.any_top_k:
        k = meta.top_k.unsqueeze(1)
        sorted_logits.masked_fill_((k > 0) & (rank >= k), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    top_p = meta.top_p.unsqueeze(1)
    # rows with top_p == 1 keep everything, whatever the cumsum's rounding says
    sorted_logits.masked_fill_((mass_before >= top_p) & (top_p < 1.0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, sorted_ids, sorted_logits)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 viewed as uint64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser in int64 (multiplication wraps like uint64)."""
    x = x ^ _shift_right(x, 30)
    x = x * _MIX1
    x = x ^ _shift_right(x, 27)
    x = x * _MIX2
    return x ^ _shift_right(x, 31)


def _seeded_exponential(seeds: torch.Tensor, output_pos: torch.Tensor, vocab: int,
                        device: torch.device) -> torch.Tensor:
    """Exp(1) noise [m, vocab] that depends only on (seed, output_pos, vocab index): a
    splitmix64 stream keyed by (seed, output_pos), one draw per vocab index."""
    key = _mix64(_mix64(seeds + _GAMMA) + output_pos * _GAMMA)
    index = torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _GAMMA
    bits = _shift_right(_mix64(key.unsqueeze(1) + index.unsqueeze(0)), 64 - _UNIFORM_BITS)
    uniform = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << _UNIFORM_BITS))  # in (0, 1)
    return uniform.log_().neg_()


def token_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor,
                   num_logprobs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled token's logprob, then the top num_logprobs, under the model's raw
    distribution (before penalties, temperature and filters)."""
    logprobs = raw_logits.to(torch.float32).log_softmax(dim=-1)
    sampled_ids = token_ids.to(torch.int64).unsqueeze(1)
    sampled = logprobs.gather(1, sampled_ids)
    top_values, top_ids = logprobs.topk(min(num_logprobs, logprobs.shape[1]), dim=-1)
    values = torch.cat([sampled, top_values], dim=1)
    ids = torch.cat([sampled_ids, top_ids], dim=1).to(torch.int32)
    return values, ids

"""One speculative step in the runner: propose drafts, then sample every output entry.

The plan says which rows verify how many drafts (each at most K, rows packed without padding); the drafts themselves are proposed here, on the device,
from the token table as the previous step left it, written into the table after each row's last
known token, and read back as inputs. After the forward, the entries of rows without drafts are
sampled as in any step and the verifying rows go through rejection.py. Each verifying row's
output (its accepted drafts and one more token) is written into the token table where the next
step reads it; its rejected count goes into `lag`, which the next plan's lagged rows subtract
from their positions. Nothing here waits for the device.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from stages.contracts.plan import StepPlan
from stages.contracts.speculative import SpeculativeConfig
from stages.gpu_runner.inputs.input_batch import InputBatch
from stages.gpu_runner.inputs.step_inputs import StepInputs, to_device
from stages.gpu_runner.sampling.metadata import SamplingMetadata
from stages.gpu_runner.sampling.sampler import Sampler, SamplerOutput, token_logprobs
from stages.gpu_runner.speculative.ngram import NgramProposer
from stages.gpu_runner.speculative.proposer import Proposer
from stages.gpu_runner.speculative.rejection import unpack, verify
from stages.gpu_runner.speculative.spec_inputs import SpecInputs
from stages.gpu_runner.speculative.suffix import SuffixProposer

if TYPE_CHECKING:
    from stages.gpu_runner.sampling.constraints import RowConstraints
    from stages.gpu_runner.speculative.draft_model import DraftModelProposer


class Speculator:
    def __init__(self, config: SpeculativeConfig, batch: InputBatch, draft: DraftModelProposer | None = None,
                 share: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 constraints: RowConstraints | None = None) -> None:
        """`draft`: a DraftModelProposer (draft_model.py) for method draft_model. `share`: under
        tensor parallelism, broadcasts rank 0's drafts to the other ranks. `constraints`: the
        rows' grammars, which mask each verified position of a grammar row."""
        self.share = share
        self.constraints = constraints
        self.k = config.num_speculative_tokens
        self.batch = batch
        self.lag = torch.zeros(batch.max_num_seqs, dtype=torch.int64, device=batch.device)
        self.proposer: Proposer | None
        if config.method == "ngram":
            self.proposer = NgramProposer(self.k, config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.method == "suffix":
            self.proposer = SuffixProposer(config, batch.num_prompt_tokens)
        else:
            self.proposer = draft
        self.draft = draft
        self._drafts: torch.Tensor | None = None
        self._host_drafts: tuple[torch.Tensor, torch.cuda.Event | None] | None = None  # for grammar rows

    def apply(self, plan: StepPlan) -> None:
        """Tell a proposer that keeps per-row state (suffix decoding) which rows the plan frees;
        called before the batch applies the plan."""
        release = getattr(self.proposer, "release", None)
        if release is not None and len(plan.freed_rows):
            release(plan.freed_rows, plan.freed_num_tokens, self.batch.token_table)

    def propose(self, inputs: StepInputs) -> None:
        """Put the verifying rows' drafts into the token table and read the step's inputs again."""
        spec = inputs.spec
        self._drafts = self._host_drafts = None
        if not spec.num_drafts:
            return
        if spec.num_drafts > self.k:
            raise ValueError(f"a row verifies {spec.num_drafts} drafts, more than num_speculative_tokens {self.k}")
        batch, width = self.batch, self.batch.max_model_len
        known = spec.verify_start + 1
        if self.proposer is None:  # a tensor-parallel rank whose draft model runs on rank 0
            drafts = torch.empty(len(spec.verify_rows), spec.num_drafts, dtype=torch.int64, device=batch.device)
        else:
            drafts = self.proposer.propose(batch.token_table, spec.verify_rows_dev, known,
                                           int(spec.verify_planned_start.max()) + 1, spec.num_drafts)
        if self.share is not None:
            drafts = self.share(drafts)
        column = torch.arange(spec.num_drafts, device=drafts.device).unsqueeze(0)
        where = (spec.verify_rows_dev * width + known).unsqueeze(1) + column
        # A row's drafts past its own count go to the scratch row: only its first ones are computed.
        where = torch.where(column < spec.verify_drafts_dev.unsqueeze(1), where, batch.scratch_discard)
        batch.padded_token_table.view(-1).index_copy_(0, where.view(-1), drafts.reshape(-1).to(torch.int32))
        inputs.input_ids = batch.token_table.view(-1)[inputs.gather_index]
        self._drafts = drafts
        if self.constraints is not None and self.constraints.constrains(spec.verify_rows):
            self._host_drafts = _to_host(drafts)  # on its way while the forward runs

    def sample(self, logits: torch.Tensor | None, inputs: StepInputs, sampler: Sampler,
               sample_plain: Callable[[torch.Tensor], SamplerOutput | None], eos_token_ids: list[int],
               share: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SamplerOutput:
        """Every output entry's token ([M], entries as the plan's output_rows) and, when a row asks,
        logprobs; `logits` [M, vocab]; sample_plain samples the entries of rows without drafts.
        Under tensor parallelism only rank 0 has logits (the others None): `share` broadcasts its
        tokens, and every rank writes them into its token table and takes its lags from them."""
        spec, batch = inputs.spec, self.batch
        num_entries = len(spec.plain_entries) + len(spec.verify_entries)
        device = batch.device
        tokens = torch.empty(num_entries, dtype=torch.int32, device=device)
        plain_index, verify_index = to_device(spec.plain_entries, device), to_device(spec.verify_entries, device)
        if logits is not None:
            if len(spec.plain_entries):
                tokens.index_copy_(0, plain_index, sample_plain(logits[plain_index]).token_ids)
            if spec.num_drafts:
                verified = self._verify(logits[verify_index], spec, sampler, eos_token_ids)
                tokens.index_copy_(0, verify_index, verified)
        if share is not None:
            tokens = share(tokens)
        if len(spec.plain_entries):
            batch.token_table.view(-1).index_copy_(0, inputs.sampled_token_index, tokens[plain_index])
        self.lag.zero_()
        if spec.num_drafts:
            verified = unpack(tokens[verify_index], spec.verify_drafts_dev, spec.num_drafts + 1)
            self._write_verified(spec, verified)
            accepted = (verified >= 0).sum(dim=1) - 1
            self.lag.index_copy_(0, spec.verify_rows_dev, spec.verify_drafts_dev - accepted)
        rows = _entry_rows(inputs)
        asked = batch.sampling.logprobs[rows]
        if logits is None or not len(rows) or asked.max() < 0:
            return SamplerOutput(tokens, None, None)
        values, ids = token_logprobs(logits, tokens.clamp_min(0), int(asked.max()))
        return SamplerOutput(tokens, values, ids)

    def _verify(self, logits: torch.Tensor, spec: SpecInputs, sampler: Sampler, eos_token_ids: list[int]) -> torch.Tensor:
        """The verifying rows' entries (int32, packed as their logits): accepted drafts, the drawn
        token, -1 for each rejected draft. A grammar row's positions are each masked with the
        grammar after the drafts before it: a draft the grammar rejects has probability 0 where it
        is verified, so it is rejected, and the matcher is sent only what was accepted."""
        counts = spec.verify_drafts + 1
        first = np.cumsum(counts) - counts
        rows = np.repeat(spec.verify_rows, counts)
        planned = np.repeat(spec.verify_planned_start, counts)
        num_tokens = planned + 1 + np.arange(counts.sum()) - np.repeat(first, counts)
        meta = SamplingMetadata.for_rows(self.batch, rows, num_tokens, eos_token_ids)
        start = torch.repeat_interleave(spec.verify_start, spec.verify_drafts_dev + 1, output_size=len(rows))
        shift_meta(meta, to_device(planned, logits.device) - start)
        if self._host_drafts is not None:
            self._mask_grammar_rows(logits, spec, counts, first)
        tokens, _ = verify(logits, self._drafts, meta, sampler, spec.verify_drafts_dev)
        if self._host_drafts is not None:
            self.constraints.sampled(spec.verify_rows, tokens)
        return tokens[tokens_index(spec, tokens.device)]

    def _mask_grammar_rows(self, logits: torch.Tensor, spec: SpecInputs, counts: np.ndarray,
                           first: np.ndarray) -> None:
        """Mask each verified position of the grammar rows (packed logits: row i's counts[i]
        positions from first[i]) with the grammar after the drafts before it."""
        host, ready = self._host_drafts
        if ready is not None:
            ready.synchronize()
        grammar_index, bitmask = self.constraints.draft_bitmask(spec.verify_rows, host.numpy())
        if not grammar_index:
            return
        width = host.shape[1] + 1  # bitmask rows per grammar row: one per position of all its drafts
        entries = np.concatenate([first[i] + np.arange(counts[i]) for i in grammar_index])
        masks = np.concatenate([g * width + np.arange(counts[i]) for g, i in enumerate(grammar_index)])
        self.constraints.mask(logits, entries, bitmask[masks])

    def _write_verified(self, spec: SpecInputs, verified: torch.Tensor) -> None:
        """Each verifying row's outputs ([d, num_drafts + 1]) go where the next step reads them, the
        -1 of its rejected drafts to the scratch row."""
        batch, width = self.batch, self.batch.max_model_len
        where = (spec.verify_rows_dev * width + spec.verify_start + 1).unsqueeze(1) \
            + torch.arange(verified.shape[1], device=verified.device)
        where = torch.where(verified >= 0, where, batch.scratch_discard)
        batch.padded_token_table.view(-1).index_copy_(0, where.view(-1), verified.view(-1))


def _to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A host copy of `tensor`, and the event that completes it (None on the CPU)."""
    if tensor.device.type == "cpu":
        return tensor, None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def tokens_index(spec: SpecInputs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of each verifying entry in the [d, num_drafts + 1] layout, packed order."""
    counts = spec.verify_drafts + 1
    row = np.repeat(np.arange(len(counts)), counts)
    column = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return to_device(row, device), to_device(column, device)


def shift_meta(meta: SamplingMetadata, shift: torch.Tensor) -> None:
    """Move the metadata's device positions back by `shift` (int64 [n]): rows whose real history is
    that much shorter than the host's count (lagged rows of a speculative step)."""
    meta.num_tokens = meta.num_tokens - shift
    if meta.num_seeded:
        meta.seeded_output_pos = meta.seeded_output_pos - shift.index_select(0, meta.seeded_rows)


def _entry_rows(inputs: StepInputs) -> np.ndarray:
    spec = inputs.spec
    rows = np.empty(len(spec.plain_entries) + len(spec.verify_entries), np.int64)
    rows[spec.plain_entries] = inputs.sampled_rows
    rows[spec.verify_entries] = np.repeat(spec.verify_rows, spec.verify_drafts + 1)
    return rows

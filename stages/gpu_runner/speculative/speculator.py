"""One speculative step in the runner: propose drafts, then sample every output entry.

The plan says which rows verify K drafts; the drafts themselves are proposed here, on the device,
from the token table as the previous step left it, written into the table after each row's last
known token, and read back as inputs. After the forward, the entries of rows without drafts are
sampled as in any step and the verifying rows go through rejection.py. Each verifying row's
output (its accepted drafts and one more token) is written into the token table where the next
step reads it; its rejected count goes into `lag`, which the next plan's lagged rows subtract
from their positions. Nothing here waits for the device.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from stages.contracts.speculative import SpeculativeConfig
from stages.gpu_runner.input_batch import InputBatch
from stages.gpu_runner.sampler import Sampler, SamplerOutput, SamplingMetadata, _logprobs
from stages.gpu_runner.speculative.ngram import NgramProposer
from stages.gpu_runner.speculative.rejection import verify
from stages.gpu_runner.step_inputs import SpecInputs, StepInputs


class Speculator:
    def __init__(self, config: SpeculativeConfig, batch: InputBatch, draft=None) -> None:
        """`draft`: a DraftModelProposer (draft_model.py) for method draft_model."""
        self.k = config.num_speculative_tokens
        self.batch = batch
        self.lag = torch.zeros(batch.max_num_seqs, dtype=torch.int64, device=batch.device)
        if config.method == "ngram":
            self.proposer = NgramProposer(self.k, config.prompt_lookup_min, config.prompt_lookup_max)
        else:
            self.proposer = draft
        self.draft = draft
        self._drafts: torch.Tensor | None = None

    def propose(self, inputs: StepInputs) -> None:
        """Put the verifying rows' drafts into the token table and read the step's inputs again."""
        spec = inputs.spec
        self._drafts = None
        if not spec.num_drafts:
            return
        batch, width = self.batch, self.batch.max_model_len
        known = spec.verify_start + 1
        drafts = self.proposer.propose(batch.token_table, spec.verify_rows_dev, known,
                                       int(spec.verify_planned_start.max()) + 1)
        where = (spec.verify_rows_dev * width + known).unsqueeze(1) + torch.arange(self.k, device=drafts.device)
        batch.token_table.view(-1).index_copy_(0, where.view(-1), drafts.view(-1).to(torch.int32))
        inputs.input_ids = batch.token_table.view(-1)[inputs.gather_index]
        self._drafts = drafts

    def sample(self, logits: torch.Tensor, inputs: StepInputs, sampler: Sampler,
               sample_plain: Callable[[torch.Tensor], SamplerOutput | None], eos_token_ids: list[int]) -> SamplerOutput:
        """Every output entry's token ([M], entries as the plan's output_rows) and, when a row asks,
        logprobs; `logits` [M, vocab]; sample_plain samples the entries of rows without drafts."""
        spec, batch = inputs.spec, self.batch
        num_entries = logits.shape[0]
        tokens = torch.empty(num_entries, dtype=torch.int32, device=logits.device)
        if len(spec.plain_entries):
            plain = sample_plain(logits[_index(spec.plain_entries, logits.device)])
            tokens.index_copy_(0, _index(spec.plain_entries, logits.device), plain.token_ids)
            batch.token_table.view(-1).index_copy_(0, inputs.sampled_token_index, plain.token_ids)
        self.lag.zero_()
        if spec.num_drafts:
            verified, accepted = self._verify(logits[_index(spec.verify_entries, logits.device)], spec, sampler,
                                              eos_token_ids)
            tokens.index_copy_(0, _index(spec.verify_entries, logits.device), verified.view(-1))
            self.lag.index_copy_(0, spec.verify_rows_dev, self.k - accepted)
        rows = _entry_rows(inputs)
        asked = batch.sampling.logprobs[rows]
        if not len(rows) or asked.max() < 0:
            return SamplerOutput(tokens, None, None)
        values, ids = _logprobs(logits, tokens.clamp_min(0), int(asked.max()))
        return SamplerOutput(tokens, values, ids)

    def _verify(self, logits: torch.Tensor, spec: SpecInputs, sampler: Sampler,
                eos_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        batch, width, k = self.batch, self.batch.max_model_len, self.k
        d = len(spec.verify_rows)
        step = np.arange(k + 1)
        rows = np.repeat(spec.verify_rows, k + 1)
        num_tokens = (np.repeat(spec.verify_planned_start, k + 1) + 1 + np.tile(step, d))
        meta = SamplingMetadata.for_rows(batch, rows, num_tokens, eos_token_ids)
        planned = _index(np.repeat(spec.verify_planned_start, k + 1), logits.device)
        shift_meta(meta, planned - torch.repeat_interleave(spec.verify_start, k + 1))
        verified, accepted = verify(logits, self._drafts, meta, sampler)
        # The row's outputs go where the next step reads them; the rejected ones to the scratch row.
        where = (spec.verify_rows_dev * width + spec.verify_start + 1).unsqueeze(1) \
            + torch.arange(k + 1, device=logits.device)
        scratch = batch.max_num_seqs * width
        where = torch.where(verified >= 0, where, scratch)
        batch.padded_token_table.view(-1).index_copy_(0, where.view(-1), verified.view(-1))
        return verified, accepted


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
    rows[spec.verify_entries] = np.repeat(spec.verify_rows, spec.num_drafts + 1)
    return rows


def _index(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array, np.int64))
    return tensor if device.type == "cpu" else tensor.pin_memory().to(device, non_blocking=True)

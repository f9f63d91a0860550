"""Per-row output constraints in the runner: grammar token masks and logit bias, applied before sampling.

A constrained row's mask for step N+1 depends on its token of step N. The runner launches step
N+1's forward first; then, before sampling it, `constrain` waits for step N's tokens of the
grammar rows alone (a small device-to-host copy started right after step N's sampling, whose
event completes while step N+1's forward runs), advances those rows' matchers, fills their
bitmask on the host (llguidance, in parallel over rows) and applies it on the device. Rows
without a grammar never wait, and a step with none does no copy and no wait at all.

A row that verifies K drafts has K + 1 positions to mask: `draft_bitmask` checks the drafts
against the matcher (those after the first it rejects can never be accepted, and their positions
are left unmasked), computes the mask after each accepted prefix and rolls the matcher back;
`sampled` then sends the row's accepted tokens on their way like any step's, so the matcher
ends up having consumed exactly what was accepted.

A row's matcher is built when its request takes the row, from the outputs it already has (a
re-admitted or resumed request's delivered tokens), so preemption and recovery rebuild it exactly.
A token the matcher cannot take (a request that already ended, whose next token is discarded)
leaves it stopped: it then allows only EOS and never raises.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shm.clock import sleep_until_ns
from stages.contracts.plan import StepPlan
from stages.gpu_runner.inputs.step_inputs import to_device

_BITS = 32
# Threads that fill a step's masks: a quarter of the CPUs (the other stages need theirs), at most 8.
MASK_THREADS = max(1, min(8, (os.cpu_count() or 1) // 4))


@dataclass(slots=True)
class _PendingTokens:
    """Step tokens of grammar rows on their way to the host: row i of them belongs to matchers[i]
    (several for a row that verified drafts, -1 for each rejected one)."""

    host: torch.Tensor  # int32 [g, tokens per row]
    ready: torch.cuda.Event | None  # None on the CPU, where the copy is done when made
    matchers: list  # llguidance.LLMatcher per token
    ready_at_ns: int = 0  # on the simulated device: when the tokens exist (CLOCK_MONOTONIC)


class RowConstraints:
    """The grammar matchers and logit biases of the batch's rows."""

    def __init__(self, max_num_seqs: int, vocab_size: int, eos_token_ids: list[int],
                 tokenizer_path: Path | None, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer_path = tokenizer_path
        self.device = device
        self.constrained = np.zeros(max_num_seqs, bool)  # a row has a grammar or a logit bias
        self._matchers: dict[int, object] = {}
        self._bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._pending: list[_PendingTokens] = []
        self._compiler = None  # built at the first grammar, with the tokenizer's vocabulary
        self._executor = None
        self._shifts: torch.Tensor | None = None

    def apply(self, plan: StepPlan) -> None:
        """Free and admit rows as the plan does (InputBatch.apply's order)."""
        if not len(plan.freed_rows) and not plan.new_requests:
            return
        for row in plan.freed_rows.tolist():
            self._matchers.pop(row, None)
            self._bias.pop(row, None)
            self.constrained[row] = False
        for new in plan.new_requests:
            params = new.params
            spec = params.guided
            if spec is not None:
                matcher = self._grammars().matcher(spec)
                outputs = new.token_ids[new.num_prompt_tokens:].tolist()
                if outputs:
                    matcher.consume_tokens(outputs)
                self._matchers[new.row] = matcher
            if params.logit_bias:
                ids = np.fromiter(params.logit_bias.keys(), np.int64, len(params.logit_bias))
                values = np.fromiter(params.logit_bias.values(), np.float32, len(params.logit_bias))
                in_vocab = ids < self.vocab_size
                self._bias[new.row] = (ids[in_vocab], values[in_vocab])
            self.constrained[new.row] = spec is not None or bool(params.logit_bias)

    def constrains(self, rows: np.ndarray) -> bool:
        return bool(self.constrained[rows].any())

    def constrain(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """Mask and bias `logits` [n, vocab] of the sampled `rows` (in that order), in place."""
        if not self.constrains(rows):
            return logits
        row_list = rows.tolist()
        grammar_index, bitmask = self.step_bitmask(rows)
        if grammar_index:
            self.mask(logits, np.array(grammar_index, np.int64), bitmask)
        biased = [(i, self._bias[row]) for i, row in enumerate(row_list) if row in self._bias]
        if biased:
            row_index = np.concatenate([np.full(len(ids), i, np.int64) for i, (ids, _) in biased])
            token_index = np.concatenate([ids for _, (ids, _) in biased])
            values = np.concatenate([v for _, (_, v) in biased])
            logits.index_put_((to_device(row_index, logits.device), to_device(token_index, logits.device)),
                              to_device(values, logits.device).to(logits.dtype), accumulate=True)
        return logits

    def step_bitmask(self, rows: np.ndarray) -> tuple[list[int], np.ndarray | None]:
        """The positions in `rows` of the grammar rows, and their bitmask (`bitmask`); waits for
        the tokens still on their way to the host."""
        grammar_index, matchers = self._grammar_rows(rows)
        return grammar_index, self.bitmask(matchers) if matchers else None

    def bitmask(self, matchers: list) -> np.ndarray:
        """int32 [len(matchers), ceil(vocab / 32)]: bit t of row i set when matchers[i] allows token
        t next, once the tokens sampled for them so far are in."""
        from llguidance.numpy import fill_next_token_bitmask_par

        self._take_pending()
        bitmask = np.empty((len(matchers), -(-self.vocab_size // _BITS)), np.int32)
        fill_next_token_bitmask_par(self._mask_executor(), [(m, i) for i, m in enumerate(matchers)], bitmask)
        return bitmask

    def _mask_executor(self):
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
        return self._executor

    def sampled(self, rows: np.ndarray, token_ids: torch.Tensor, ready_at_ns: int = 0) -> None:
        """Start bringing this step's tokens of the grammar rows to the host (no wait): int32 [n],
        or [n, K + 1] for rows that verified drafts (-1 for each rejected one). On the simulated
        device the tokens are host memory that exists from `ready_at_ns` on."""
        if not self._matchers or not self.constrains(rows):
            return
        grammar_index, matchers = self._grammar_rows(rows)
        if not grammar_index:
            return
        tokens = token_ids.index_select(0, to_device(np.array(grammar_index, np.int64), token_ids.device))
        self._send(tokens.view(len(grammar_index), -1), matchers, ready_at_ns)

    def draft_bitmask(self, rows: np.ndarray, drafts: np.ndarray) -> tuple[list[int], np.ndarray | None]:
        """The positions in `rows` (verifying drafts [d, K]) of the grammar rows, and their bitmask
        [g * (K + 1), words]: row i's K + 1 masks one after another, the mask after each prefix of
        its drafts the grammar accepts, all tokens allowed after the first draft it rejects.
        Waits for the tokens still on their way to the host; leaves each matcher as it found it."""
        from llguidance.numpy import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

        grammar_index, matchers = self._grammar_rows(rows)
        if not matchers:
            return grammar_index, None
        self._take_pending()
        k = drafts.shape[1]
        bitmask = np.full((len(matchers) * (k + 1), -(-self.vocab_size // _BITS)), -1, np.int32)
        with_drafts, without = [], []  # llguidance refuses an empty draft list
        for i, (index, matcher) in enumerate(zip(grammar_index, matchers)):
            row_drafts = drafts[index].tolist()
            row_drafts = row_drafts[:matcher.validate_tokens(row_drafts)]
            if row_drafts:
                with_drafts.append((matcher, i * (k + 1), row_drafts))
            else:
                without.append((matcher, i * (k + 1)))
        if with_drafts:
            fill_next_token_bitmask_par_with_draft_tokens(self._mask_executor(), with_drafts, bitmask)
        if without:
            fill_next_token_bitmask_par(self._mask_executor(), without, bitmask)
        return grammar_index, bitmask

    def mask(self, logits: torch.Tensor, index: np.ndarray, bitmask: np.ndarray) -> None:
        """Set the entries of `logits` [n, vocab] rows `index` that `bitmask` disallows to -inf."""
        rows = to_device(np.asarray(index, np.int64), logits.device)
        allowed = self._unpack(to_device(bitmask, logits.device), logits.shape[1])
        logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))

    def _send(self, tokens: torch.Tensor, matchers: list, ready_at_ns: int) -> None:
        if tokens.device.type == "cpu":
            self._pending.append(_PendingTokens(tokens, None, matchers, ready_at_ns))
            return
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        self._pending.append(_PendingTokens(host, ready, matchers))

    def _grammar_rows(self, rows: np.ndarray) -> tuple[list[int], list]:
        """The positions in `rows` of the rows with a grammar, and their matchers."""
        grammar_index = [i for i, row in enumerate(rows.tolist()) if row in self._matchers]
        return grammar_index, [self._matchers[int(rows[i])] for i in grammar_index]

    def _take_pending(self) -> None:
        """Advance the matchers by every step's tokens still on their way, oldest first."""
        for pending in self._pending:
            if pending.ready is not None:
                pending.ready.synchronize()
            if pending.ready_at_ns:
                sleep_until_ns(pending.ready_at_ns)
            for matcher, tokens in zip(pending.matchers, pending.host.tolist()):
                for token in tokens:
                    if token >= 0 and not matcher.is_stopped():
                        matcher.consume_token(token)
        self._pending.clear()

    def _unpack(self, bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """bool [g, vocab_size] from int32 bit words [g, ceil(vocab / 32)]."""
        if self._shifts is None or self._shifts.device != bits.device:
            self._shifts = torch.arange(_BITS, dtype=torch.int32, device=bits.device)
        allowed = (bits.unsqueeze(-1) >> self._shifts) & 1
        return allowed.view(bits.shape[0], -1)[:, :vocab_size].bool()

    def _grammars(self):
        if self._compiler is None:
            from stages.grammar import GrammarCompiler

            if self.tokenizer_path is None:
                raise ValueError("a grammar needs the model's tokenizer; this runner has none")
            self._compiler = GrammarCompiler(Path(self.tokenizer_path).read_text(), self.vocab_size,
                                             self.eos_token_ids)
        return self._compiler

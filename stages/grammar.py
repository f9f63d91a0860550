"""Output grammars (llguidance): checking a request's constraint where it enters, and compiled grammars by spec.

A request's `SamplingParams.guided` names what its output must match. Where a request enters (the
daemon, the offline `LLM`), `check_guided` compiles the spec without a vocabulary, so a bad
schema, regex or grammar is refused naming the problem before anything is queued. The runner
builds a `GrammarCompiler` over the model's tokenizer: one matcher per distinct spec, compiled once
and deep-copied for each request that asks for it.

llguidance was chosen over xgrammar by tools/micro/bench_grammar.py (compile and per-token mask time on
the tiny vocabularies and a 128k BPE vocabulary) and for its dependencies: none, where xgrammar
needs torch, transformers, triton and pydantic at run time.
"""
from __future__ import annotations

from collections import OrderedDict

from stages.contracts.params import GrammarSpec, InvalidParams, SamplingParams

MAX_CACHED_GRAMMARS = 256  # compiled specs kept by the runner, least recently used dropped first


# JSON is generated compact (", " and ": " between items, no other whitespace): free whitespace
# lets a sampled output wander in blanks until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of `spec`; InvalidParams naming its field when it cannot be read."""
    import llguidance  # here: a process that never meets a grammar does not load the library

    try:
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_OPTIONS)
        kind = "grammar" if spec.kind == "lark" else spec.kind  # "grammar" reads Lark, or converts GBNF
        return llguidance.grammar_from(kind, spec.text)
    except ValueError as exc:
        raise InvalidParams(spec.field, f"is not a valid {spec.kind}: {exc}") from None


def check_guided(params: SamplingParams) -> None:
    """Raise InvalidParams naming the field when the request's constraint cannot be compiled."""
    spec = params.guided
    if spec is None:
        return
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_text(spec))
    if error:
        raise InvalidParams(spec.field, f"is not a valid {spec.kind}: {error.strip()}")


class GrammarCompiler:
    """Matchers over one model's vocabulary, compiled once per spec.

    `tokenizer_json` is the model's tokenizer.json text; the vocabulary is padded to `vocab_size`
    (the model's logits), ids past the tokenizer's never allowed."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance

        self._llguidance = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._compiled: OrderedDict[GrammarSpec, object] = OrderedDict()

    def matcher(self, spec: GrammarSpec):
        """A fresh llguidance.LLMatcher at the start of `spec`'s grammar."""
        compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = self._llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0)
            if compiled.is_error():
                raise InvalidParams(spec.field, f"is not a valid {spec.kind}: {compiled.get_error()}")
            self._compiled[spec] = compiled
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec)
        return compiled.deep_copy()

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

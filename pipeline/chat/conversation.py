"""A chat's state: the conversation, the system prompt, the sampling settings, the last answer's timings,
and the slash commands that change them. No terminal and no socket here (terminal.py has both)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from stages.contracts.params import InvalidParams, SamplingParams

SETTABLE = {"temperature": float, "top_p": float, "max_tokens": int}
HELP = """commands:
  /system TEXT       set the system prompt (kept by /clear)
  /set NAME VALUE    temperature, top_p or max_tokens; /set alone shows them
  /clear             forget the conversation
  /stats             the last answer's tokens, rates and time to first token
  /exit              leave (Ctrl-D too); Ctrl-C stops an answer
  \"\"\"               a line of three quotes starts and ends a multi-line message"""


@dataclass(slots=True)
class AnswerStats:
    """One answer's timing, from the request sent to its last token."""

    started_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    ended_s: float | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0

    def token_arrived(self) -> None:
        if self.first_token_s is None:
            self.first_token_s = time.monotonic()

    def finished(self, prompt_tokens: int, generated_tokens: int) -> None:
        self.ended_s = time.monotonic()
        self.prompt_tokens, self.generated_tokens = prompt_tokens, generated_tokens

    def report(self) -> str:
        if self.ended_s is None or self.first_token_s is None:
            return "no answer yet"
        ttft = self.first_token_s - self.started_s
        decode_s = self.ended_s - self.first_token_s
        prompt_rate = self.prompt_tokens / ttft if ttft > 0 else 0.0
        decode_rate = (self.generated_tokens - 1) / decode_s if decode_s > 0 and self.generated_tokens > 1 else 0.0
        return (f"prompt:              {self.prompt_tokens} tokens, {prompt_rate:.1f} tokens/s\n"
                f"generated:           {self.generated_tokens} tokens, {decode_rate:.1f} tokens/s\n"
                f"time to first token: {ttft * 1000:.0f} ms\n"
                f"total:               {self.ended_s - self.started_s:.2f} s")


@dataclass
class Conversation:
    """The turns so far and how the next answer is asked for. `templated` False: the model has no
    chat template, and the conversation goes to it as one running text to complete."""

    params: dict[str, float | int]
    templated: bool = True
    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)
    last: AnswerStats | None = None

    def messages(self, user: str) -> list[dict[str, str]]:
        """The messages of the next request: the system prompt, the turns so far, then `user`."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns + [{"role": "user", "content": user}]

    def completion_prompt(self, user: str) -> str:
        """The running text a model without a chat template continues."""
        return "".join(message["content"] + "\n" for message in self.messages(user))

    def answered(self, user: str, answer: str) -> None:
        self.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]

    def command(self, line: str) -> str | None:
        """Runs a slash command and returns what to print; None for /exit. ValueError if bad."""
        name, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        if name in ("/exit", "/bye", "/quit"):
            return None
        if name == "/help" or name == "/?":
            return HELP
        if name == "/clear":
            self.turns.clear()
            return "the conversation is cleared" + (" (the system prompt stays)" if self.system else "")
        if name == "/system":
            self.system = rest or None
            return f"system prompt set: {rest}" if rest else "system prompt removed"
        if name == "/stats":
            return "no answer yet" if self.last is None else self.last.report()
        if name == "/set":
            return self._set(rest)
        raise ValueError(f"unknown command {name!r}; /help lists them")

    def _set(self, rest: str) -> str:
        if not rest:
            return "\n".join(f"{key} {self.params[key]}" for key in SETTABLE)
        key, _, value = rest.partition(" ")
        if key not in SETTABLE:
            raise ValueError(f"/set takes {', '.join(SETTABLE)}; got {key!r}")
        try:
            number = SETTABLE[key](value.strip())
        except ValueError:
            raise ValueError(f"/set {key} needs a number{' (an integer)' if SETTABLE[key] is int else ''}, "
                             f"got {value.strip()!r}") from None
        try:
            SamplingParams(**{**self.params, key: number})
        except InvalidParams as exc:
            raise ValueError(f"/set {key}: {exc}") from None
        self.params[key] = number
        return f"{key} set to {number}"

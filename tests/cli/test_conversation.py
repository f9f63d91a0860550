"""`pipeline chat`'s state and input without a daemon: commands, settings, multi-line messages, the
plain-completion prompt of a model without a chat template, the /stats report."""
from __future__ import annotations

import pytest

from pipeline.chat.conversation import AnswerStats, Conversation
from pipeline.chat.terminal import read_message


def conversation() -> Conversation:
    return Conversation({"temperature": 0.7, "top_p": 0.9, "max_tokens": 512})


def test_commands_change_the_conversation() -> None:
    chat = conversation()
    chat.answered("Hi", "Hello!")
    assert "system prompt set" in chat.command("/system Be brief.")
    assert chat.messages("Again") == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}]
    assert "cleared" in chat.command("/clear")
    assert chat.messages("x") == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}]
    assert chat.command("/set temperature 0") == "temperature set to 0.0" and chat.params["temperature"] == 0.0
    assert chat.command("/set max_tokens 7") == "max_tokens set to 7"
    assert chat.command("/set").splitlines() == ["temperature 0.0", "top_p 0.9", "max_tokens 7"]
    assert chat.command("/stats") == "no answer yet"
    assert chat.command("/exit") is None and chat.command("/bye") is None
    assert "/system" in chat.command("/help")


@pytest.mark.parametrize(("line", "says"), [("/set top_k 3", "takes temperature"), ("/set max_tokens 1.5", "integer"),
                                            ("/set temperature -1", "temperature"), ("/set top_p 2", "top_p"),
                                            ("/frobnicate", "unknown command")])
def test_bad_commands_say_why(line: str, says: str) -> None:
    chat = conversation()
    with pytest.raises(ValueError, match=says):
        chat.command(line)
    assert chat.params == conversation().params


def test_plain_completion_prompt_runs_on() -> None:
    chat = conversation()
    chat.command("/system A story.")
    chat.answered("Once", "upon a time")
    assert chat.completion_prompt("there was") == "A story.\nOnce\nupon a time\nthere was\n"


def test_multi_line_messages() -> None:
    def reader(lines: list[str]):
        it = iter(lines)

        def read(prompt: str) -> str:
            try:
                return next(it)
            except StopIteration:
                raise EOFError from None
        return read

    assert read_message(reader(["one line"])) == "one line"
    assert read_message(reader(['"""', "first", "second", '"""'])) == "first\nsecond"
    assert read_message(reader(['"""first', 'second"""'])) == "first\nsecond"
    assert read_message(reader(['"""inline"""'])) == "inline"
    with pytest.raises(EOFError):
        read_message(reader(['"""', "never closed"]))


def test_stats_report() -> None:
    stats = AnswerStats(started_s=10.0)
    stats.first_token_s, stats.ended_s = 10.5, 12.5
    stats.prompt_tokens, stats.generated_tokens = 50, 41
    assert stats.report().splitlines() == ["prompt:              50 tokens, 100.0 tokens/s",
                                           "generated:           41 tokens, 20.0 tokens/s",
                                           "time to first token: 500 ms", "total:               2.50 s"]

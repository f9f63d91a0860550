"""`pipeline chat`'s loop: read a message (prompt_toolkit's line editor and history on a terminal,
plain lines from a pipe), stream the answer, keep the conversation; Ctrl-C stops an answer."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from pipeline.chat.conversation import AnswerStats, Conversation
from pipeline.chat.daemon import ChatDaemon
from pipeline.client import Client
from pipeline.errors import PipelineError
from stages.contracts.params import InvalidParams

PROMPT, CONTINUATION = ">>> ", "... "
MULTILINE_FENCE = '"""'
HISTORY_FILE = "chat_history"


def state_dir() -> Path:
    """`$XDG_STATE_HOME/pipeline`, else `~/.local/state/pipeline` (made, owner only, if missing)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    directory = Path(base) / "pipeline"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return directory


def terminal_reader() -> Callable[[str], str]:
    """prompt_toolkit's line editor with the history kept across sessions; Alt-Enter (or Esc
    then Enter) starts a new line in the message."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory
    from prompt_toolkit.key_binding import KeyBindings

    bindings = KeyBindings()

    @bindings.add("escape", "enter")
    def _new_line(event: object) -> None:
        event.current_buffer.insert_text("\n")  # type: ignore[attr-defined]

    session = PromptSession(history=FileHistory(str(state_dir() / HISTORY_FILE)), key_bindings=bindings,
                            prompt_continuation=CONTINUATION)
    return lambda prompt: session.prompt(prompt)


def piped_reader(prompt: str) -> str:
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def read_message(read: Callable[[str], str]) -> str:
    """One message: a line, or the lines between two lines of three quotes. EOFError at the end."""
    line = read(PROMPT)
    if not line.strip().startswith(MULTILINE_FENCE):
        return line
    lines = [line.strip()[len(MULTILINE_FENCE):]]
    while not lines[-1].rstrip().endswith(MULTILINE_FENCE) or len(lines) == 1 and lines[0].strip() == "":
        lines.append(read(CONTINUATION))
    lines[-1] = lines[-1].rstrip()[:-len(MULTILINE_FENCE)]
    return "\n".join(lines).strip("\n")


def answer(client: Client, conversation: Conversation, text: str) -> None:
    """Streams the answer to `text` to stdout; on Ctrl-C the request is aborted (its connection
    closed, which aborts it on the daemon) and the conversation stays as it was."""
    stats = AnswerStats()
    pieces: list[str] = []
    try:
        if conversation.templated:
            stream = client.stream_chat(conversation.messages(text), dict(conversation.params))
        else:
            stream = client.stream(conversation.completion_prompt(text), dict(conversation.params))
        with stream:
            for delta in stream:
                if delta.token_ids:
                    stats.token_arrived()
                pieces.append(delta.text)
                sys.stdout.write(delta.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        print("\n[answer stopped]", flush=True)
        return
    except (PipelineError, InvalidParams) as exc:
        print(f"\nerror: {exc}", file=sys.stderr, flush=True)
        return
    print(flush=True)
    usage = stream.completion.usage if stream.completion is not None else None
    stats.finished(usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0)
    conversation.last = stats
    conversation.answered(text, "".join(pieces))


def run_chat(args: argparse.Namespace, socket_path: Path) -> int:
    daemon = ChatDaemon(socket_path, args.model, args.keep)
    client = daemon.connect()
    try:
        interactive = sys.stdin.isatty() and sys.stdout.isatty()
        stats = client.stats()
        if args.model is not None and daemon.process is None:
            print(f"note: using the daemon already on {socket_path} (model {stats.model}); --model names the "
                  "model of a daemon the chat starts", file=sys.stderr)
        conversation = Conversation({"temperature": args.temperature, "top_p": args.top_p,
                                     "max_tokens": args.max_tokens}, stats.chat_template, args.system)
        if interactive:
            print(f"chat with {stats.model} on {socket_path}: /help for commands, Ctrl-D or /exit to leave")
        if not conversation.templated:
            print(f"note: {stats.model} has no chat template: the conversation goes to it as plain text to "
                  "complete", file=sys.stderr)
        _loop(client, conversation, terminal_reader() if interactive else piped_reader)
    finally:
        client.close()
        note = daemon.close()
        if note:
            print(note, file=sys.stderr)
    return 0


def _loop(client: Client, conversation: Conversation, read: Callable[[str], str]) -> None:
    while True:
        try:
            text = read_message(read)
        except (EOFError, KeyboardInterrupt):
            return
        if not text.strip():
            continue
        if text.startswith("/"):
            try:
                reply = conversation.command(text)
            except ValueError as exc:
                print(f"error: {exc}", file=sys.stderr, flush=True)
                continue
            if reply is None:
                return
            print(reply, flush=True)
            continue
        answer(client, conversation, text)

"""`pipeline chat` against a live daemon on the tiny model: in a pseudo-terminal (pexpect), over a
pipe, and with a daemon of its own that it starts and stops."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pexpect
import pytest
from live_chat import Served, chat_command, chat_env, plain, shm_of, short_dir

from pipeline.chat.conversation import Conversation
from pipeline.client import Client
from pipeline.serve.daemon import read_daemon_pid
from shm.naming import pid_alive

pytestmark = pytest.mark.timeout(300)
PROMPT = ">>> "
QUESTION = "What is the capital of France?"


def spawn_chat(socket_path: Path, state_dir: Path, *options: str, timeout_s: float = 60) -> pexpect.spawn:
    command = chat_command(socket_path, *options)
    child = pexpect.spawn(command[0], command[1:], env=chat_env(state_dir), encoding="utf-8", timeout=timeout_s,
                          dimensions=(40, 200))
    child.expect_exact(PROMPT)
    return child


def ask(child: pexpect.spawn, line: str) -> str:
    """Sends a line and returns what came back before the next prompt, its echo left out (a busy
    terminal may redraw the input line, so the echo can come more than once: the last one counts)."""
    child.sendline(line)
    child.expect_exact(PROMPT)
    lines = plain(child.before).splitlines()
    echoes = [i for i, text in enumerate(lines) if text.strip().endswith(line)]
    return "\n".join(lines[echoes[-1] + 1 if echoes else 0:]).strip("\n")


def stats_of(report: str) -> dict[str, float]:
    numbers = {key: float(value) for key, value in re.findall(r"^([a-z ]+):\s+([\d.]+)", report, re.M)}
    assert {"prompt", "generated", "time to first token", "total"} <= set(numbers), report
    return numbers


INTERRUPT_TRIES = 5


def test_chat_in_a_terminal(served: Served, state_dir: Path) -> None:
    child = spawn_chat(served.socket_path, state_dir, "--max-tokens", "6")
    try:
        first = ask(child, QUESTION)
        assert first.strip(), "no answer"
        one = stats_of(ask(child, "/stats"))
        assert one["generated"] == 6 and one["prompt"] > 0
        assert one["time to first token"] / 1000 < one["total"]  # the first token came before the last
        # The second turn's prompt holds the first question and answer, and the second question.
        ask(child, "What did I just ask?")
        two = stats_of(ask(child, "/stats"))
        assert two["prompt"] > one["prompt"] + one["generated"]
        assert "system prompt set" in ask(child, "/system You answer in one word.")
        assert "temperature set to 0.0" in ask(child, "/set temperature 0")
        assert "cleared" in ask(child, "/clear")
        greedy = ask(child, QUESTION)
        ask(child, "/clear")
        assert ask(child, QUESTION) == greedy  # greedy, on the same conversation: the same answer
        assert "unknown command" in ask(child, "/nonsense")

        # Ctrl-C mid-answer aborts the request on the daemon, and the chat goes on.
        aborted_before = served.metric("pipeline:request_success_total", 'finished_reason="abort"')
        ask(child, "/set max_tokens 1500")
        ask(child, "/set temperature 1")  # sampled: a greedy answer may reach its end of text at once
        for _ in range(INTERRUPT_TRIES):
            child.sendline(QUESTION)
            child.expect_exact(QUESTION)
            child.expect(r"\S", timeout=60)  # the answer has begun
            child.sendintr()
            # A sampled answer of the tiny model may still reach its end of text before the interrupt
            # does: the Ctrl-C then lands on the next prompt, and the test asks again.
            stopped = child.expect_exact(["[answer stopped]", PROMPT]) == 0
            if stopped:
                child.expect_exact(PROMPT)
                break
        assert stopped, f"every one of {INTERRUPT_TRIES} answers ended before its Ctrl-C"
        deadline = time.monotonic() + 10
        while served.metric("pipeline:request_success_total", 'finished_reason="abort"') < aborted_before + 1:
            assert time.monotonic() < deadline, "the daemon did not count the request aborted"
            time.sleep(0.1)
        with Client(served.socket_path, timeout_s=10) as client:  # and the engine lets go of it
            while client.stats().num_running_requests:
                assert time.monotonic() < deadline, "the aborted request still runs in the engine"
                time.sleep(0.1)
        ask(child, "/set max_tokens 4")
        assert ask(child, QUESTION).strip()
        child.sendline("/exit")
        child.expect(pexpect.EOF)
        child.wait()
        assert child.exitstatus == 0
    finally:
        child.close(force=True)
    assert (state_dir / "pipeline" / "chat_history").read_text().count(QUESTION) >= 3  # history across sessions


def test_rendered_prompt_holds_every_turn(served: Served, tiny_model: Path) -> None:
    from tokenizers import Tokenizer

    conversation = Conversation({"temperature": 0.0, "max_tokens": 5}, system="Be brief.")
    with Client(served.socket_path, timeout_s=60) as client:
        first = client.chat(conversation.messages(QUESTION), conversation.params)
        conversation.answered(QUESTION, first.text)
        second = client.chat(conversation.messages("What did I just ask?"), conversation.params)
    prompt = Tokenizer.from_file(str(tiny_model / "tokenizer.json")).decode(second.prompt_token_ids,
                                                                             skip_special_tokens=False)
    turns = ["<|im_start|>system\nBe brief.<|im_end|>", f"<|im_start|>user\n{QUESTION}<|im_end|>",
             f"<|im_start|>assistant\n{first.text}<|im_end|>", "<|im_start|>user\nWhat did I just ask?<|im_end|>"]
    positions = [prompt.replace(" ", "").find(turn.replace(" ", "")) for turn in turns]
    assert -1 not in positions and positions == sorted(positions), prompt
    assert prompt.rstrip().endswith("<|im_start|>assistant")


def test_piped_chat(served: Served, state_dir: Path) -> None:
    lines = f"{QUESTION}\n/set temperature 0\n\"\"\"\nTwo lines\nof text\n\"\"\"\n/stats\n"
    run = subprocess.run(chat_command(served.socket_path, "--max-tokens", "4"), input=lines, text=True,
                         capture_output=True, timeout=120, env=chat_env(state_dir))
    assert run.returncode == 0, run.stderr
    out = run.stdout.splitlines()
    assert ">>>" not in run.stdout  # no prompts on a pipe: the answers alone
    # the answers are a tiny random model's 4 tokens, which may hold line breaks: found by what follows them
    at = out.index("temperature set to 0.0")
    stats_at = next(i for i, line in enumerate(out) if line.startswith("prompt:"))
    assert at >= 1 and stats_at > at + 1 and len(out) == stats_at + 4, run.stdout
    assert stats_of("\n".join(out[stats_at:]))["generated"] == 4


def test_chat_starts_and_stops_its_daemon(tiny_model: Path, state_dir: Path) -> None:
    directory = short_dir()
    socket_path = directory / "own.sock"
    try:
        child = spawn_chat(socket_path, state_dir, "--model", str(tiny_model), "--max-tokens", "4", timeout_s=180)
        try:
            pid = read_daemon_pid(socket_path)
            assert pid_alive(pid) and shm_of(pid)
            assert ask(child, QUESTION).strip()
            child.sendline("/exit")
            child.expect(pexpect.EOF, timeout=90)
            child.wait()
            assert child.exitstatus == 0
        finally:
            child.close(force=True)
        assert not pid_alive(pid), "the daemon the chat started still runs"
        assert shm_of(pid) == [], "the chat's daemon left shared memory"
        assert not socket_path.exists() and not socket_path.with_name("own.sock.log").exists()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_bad_model_is_a_clear_error(tmp_path: Path, state_dir: Path) -> None:
    directory = short_dir()
    socket_path = directory / "bad.sock"
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    try:
        missing = subprocess.run(chat_command(socket_path, "--model", str(tmp_path / "nothing-here")), text=True,
                                 capture_output=True, timeout=60, env=chat_env(state_dir), stdin=subprocess.DEVNULL)
        assert missing.returncode == 1 and "nothing-here" in missing.stderr, missing.stderr
        failed = subprocess.run(chat_command(socket_path, "--model", str(broken)), text=True, capture_output=True,
                                timeout=180, env=chat_env(state_dir), stdin=subprocess.DEVNULL)
        assert failed.returncode == 1, failed.stderr
        assert "the daemon exited with status" in failed.stderr and "end of its log" in failed.stderr, failed.stderr
        assert sorted(p.name for p in directory.iterdir()) == []  # no socket, no log, no pid file
        left = subprocess.run(["pgrep", "-f", str(socket_path)], capture_output=True, text=True)
        assert left.stdout == "", f"processes left: {left.stdout}"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.slow
def test_chat_with_the_default_model(state_dir: Path) -> None:
    """SmolLM2-135M-Instruct, started by the chat itself, answers a question through its chat template.

    Slow (the real model loads in the chat's own daemon); the default run covers its parts apart:
    the chat starting and stopping a daemon of its own (test_chat_starts_and_stops_its_daemon), the
    default model being SmolLM2 and its chat template's answer knowing Paris
    (tests/daemon/test_real_models.py)."""
    from real_models import smollm2_gguf

    smollm2_gguf()  # skips, naming the package to install, when the default model is missing
    directory = short_dir()
    socket_path = directory / "default.sock"
    try:
        child = spawn_chat(socket_path, state_dir, "--temperature", "0", "--max-tokens", "10", timeout_s=240)
        try:
            pid = read_daemon_pid(socket_path)
            assert "Paris" in ask(child, QUESTION)
            assert stats_of(ask(child, "/stats"))["generated"] <= 10
            child.sendline("/exit")
            child.expect(pexpect.EOF, timeout=90)
        finally:
            child.close(force=True)
        assert not pid_alive(pid) and shm_of(pid) == []
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_model_without_a_chat_template_chats_as_completion(tiny_model: Path, tmp_path: Path,
                                                             state_dir: Path) -> None:
    plain_model = tmp_path / "no-template"
    shutil.copytree(tiny_model, plain_model)
    config = json.loads((plain_model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain_model / "tokenizer_config.json").write_text(json.dumps(config))
    directory = short_dir()
    try:
        run = subprocess.run(chat_command(directory / "plain.sock", "--model", str(plain_model), "--max-tokens", "3",
                                          "--temperature", "0"),
                             input="Once upon a time\nthere was\n", text=True, capture_output=True, timeout=240,
                             env=chat_env(state_dir))
        assert run.returncode == 0, run.stderr
        assert run.stderr.count("has no chat template") == 1, run.stderr  # said once, for two messages
        # a line a reply: counted by "\n", as str.splitlines also breaks at characters a random
        # model's text may hold (\x1c-\x1e, \x85, ...)
        assert run.stdout.count("\n") == 2, run.stdout
        assert sorted(p.name for p in directory.iterdir()) == []
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_generate_applies_the_chat_template_unless_raw(served: Served) -> None:
    params = {"max_tokens": 4, "temperature": 0.0}
    with Client(served.socket_path, timeout_s=60) as client:
        chat = client.chat([{"role": "user", "content": QUESTION}], params).text
        raw = client.generate(QUESTION, params).text
    for options, expected in (([], chat), (["--raw"], raw), (["--stream"], chat)):
        run = subprocess.run([*chat_command(served.socket_path)[:3], "generate", "--socket", str(served.socket_path),
                              QUESTION, "--max-tokens", "4", "--temperature", "0", *options],
                             text=True, capture_output=True, timeout=60, env=chat_env(served.socket_path.parent))
        assert run.returncode == 0, run.stderr
        assert run.stdout == expected + "\n", options

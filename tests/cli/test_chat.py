"""``jaxllm chat`` and ``jaxllm complete`` against a running server (gunicorn on the tiny Llama): typed turns on a
terminal (a pty), each streamed answer equal to the one the `openai` client gets for the same conversation so far
(so the chat keeps its history), ``-q`` one-shots, and one line with exit status 2 when the server refuses."""

import os
import pty
import select
import subprocess
import sys
import time

import openai
import pytest

from tests.server.conftest import API_KEY, ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def greedy_chat(client, messages, max_tokens: int = 10) -> str:
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=messages, temperature=0,
                                          max_tokens=max_tokens).choices[0].message.content


class Terminal:
    """A command on a pseudo-terminal: what a user types, what they see."""

    def __init__(self, argv: list[str]):
        self.master, slave = pty.openpty()
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAXLLM_")}
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env=env)
        os.close(slave)
        self.seen = ""

    def read_until(self, text: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} never appeared; the terminal shows:\n{self.seen[-2000:]}")
            ready, _, _ = select.select([self.master], [], [], 0.5)
            if ready:
                try:
                    self.seen += os.read(self.master, 4096).decode(errors="replace").replace("\r\n", "\n")
                except OSError:  # the command exited and closed the terminal
                    break
        return self.seen

    def type(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def close(self) -> int:
        code = self.proc.wait(60)
        os.close(self.master)
        return code


def test_a_chat_on_a_terminal_keeps_its_history(server, client):
    first = greedy_chat(client, [{"role": "user", "content": "Hello there"}])
    second = greedy_chat(client, [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first},
                                  {"role": "user", "content": "Tell me more"}])
    term = Terminal([sys.executable, "-m", "jaxllm", "chat", "--url", server.url + "/v1", "--api-key", API_KEY,
                     "--temperature", "0", "--max-tokens", "10"])
    term.read_until("> ")
    term.type("Hello there")
    term.read_until(first + "\n> ")
    term.type("Tell me more")
    term.read_until(second + "\n> ")
    term.type("quit")
    assert term.close() == 0


def test_one_shot_chat_and_completion(server, client):
    base = [sys.executable, "-m", "jaxllm"]
    opts = ["--url", server.url + "/v1", "--api-key", API_KEY, "--temperature", "0", "--max-tokens", "8"]
    run = subprocess.run([*base, "chat", *opts, "-q", "Hello there"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    want = greedy_chat(client, [{"role": "user", "content": "Hello there"}], max_tokens=8)
    assert run.returncode == 0 and run.stdout == want + "\n"
    model = client.models.list().data[0].id
    want = client.completions.create(model=model, prompt="The sea is", temperature=0, max_tokens=8).choices[0].text
    run = subprocess.run([*base, "complete", *opts, "-q", "The sea is"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout == want + "\n"
    run = subprocess.run([*base, "chat", "--url", server.url + "/v1", "--api-key", "wrong", "-q", "hi"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        "error: the server answered 401: invalid or missing API key (Authorization: Bearer <key>)"]

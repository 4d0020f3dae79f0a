"""``jaxllm chat`` and ``jaxllm complete``: talk to a running OpenAI-compatible server (jaxllm's, vLLM's, any), as
``vllm chat`` / ``vllm complete`` do: streaming, with the conversation kept across turns (chat).

    jaxllm chat [--url http://localhost:8000/v1] [--model-name NAME] [--api-key KEY] [--system-prompt TEXT] [-q MSG]
    jaxllm complete [--url ...] [--model-name NAME] [--api-key KEY] [--max-tokens N] [-q PROMPT]

Without ``-q`` each line typed is a turn (a prompt, for complete); an empty line is skipped; EOF (Ctrl-D), "exit"
or "quit" ends. The model defaults to the server's first (``GET /v1/models``). A server that cannot be reached or
refuses the key is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_parsers(sub) -> None:
    for name, help_text in (("chat", "chat with a running server, streaming"),
                            ("complete", "complete prompts on a running server, streaming")):
        p = sub.add_parser(name, help=help_text, description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--url", default="http://localhost:8000/v1", help="the server's API base (default %(default)s)")
        p.add_argument("--model-name", help="default: the server's first model")
        p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                       help="default: OPENAI_API_KEY (none: no key sent)")
        p.add_argument("--max-tokens", type=int, help="most tokens per answer (default: the server's)")
        p.add_argument("--temperature", type=float, help="jaxllm's extra: sampling temperature (default: the "
                                                            "server's; 0: greedy)")
        p.add_argument("-q", "--quick", metavar="MESSAGE", help="send one message, print the answer, exit")
        if name == "chat":
            p.add_argument("--system-prompt", help="a system message before the conversation")
        p.set_defaults(run=run_chat if name == "chat" else run_complete)


def _client(args):
    import openai

    client = openai.OpenAI(base_url=args.url, api_key=args.api_key or "none", max_retries=0)
    model = args.model_name or client.models.list().data[0].id
    return client, model


def _options(args) -> dict:
    """The sampling options given (the others: the server's defaults, not sent)."""
    given = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    return {k: v for k, v in given.items() if v is not None}


def _lines(quick: str | None, prompt: str):
    if quick is not None:
        yield quick
        return
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print(prompt, end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        text = line.rstrip("\n")
        if text.strip() in ("exit", "quit"):
            return
        if text.strip():
            yield text


def _guarded(body) -> int:
    import openai

    try:
        body()
    except openai.APIConnectionError as e:
        print(f"error: cannot reach the server: {e}", file=sys.stderr)
        return 2
    except openai.APIStatusError as e:
        message = e.body.get("message") if isinstance(e.body, dict) else None
        print(f"error: the server answered {e.status_code}: {message or e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    def body():
        client, model = _client(args)
        messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
        for text in _lines(args.quick, "> "):
            messages.append({"role": "user", "content": text})
            stream = client.chat.completions.create(model=model, messages=messages, stream=True, **_options(args))
            answer = []
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    answer.append(chunk.choices[0].delta.content)
                    print(answer[-1], end="", flush=True)
            print(flush=True)
            messages.append({"role": "assistant", "content": "".join(answer)})

    return _guarded(body)


def run_complete(args: argparse.Namespace) -> int:
    def body():
        client, model = _client(args)
        for text in _lines(args.quick, "> "):
            stream = client.completions.create(model=model, prompt=text, stream=True, **_options(args))
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    print(chunk.choices[0].text, end="", flush=True)
            print(flush=True)

    return _guarded(body)

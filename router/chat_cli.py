"""`pdserve chat`: an interactive chat in the terminal, over a running router.

Each turn sends the whole conversation as a gRPC ``chat`` prompt; the router renders it
with the model's chat template, so the conversation is the model's own format. The
answer streams as it is generated and joins the conversation when it ends.

    /reset          forget the conversation (the system message stays)
    /system TEXT    set the system message (and start over); `/system` alone clears it
    /exit           quit (so does Ctrl-D)

Ctrl-C while an answer streams stops that answer (the router aborts the request) and
keeps the program; the partial answer is dropped from the conversation.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from pdserve.router.client_args import add_client_args, connect, rpc_error

HELP = "commands: /reset, /system TEXT, /exit (Ctrl-C stops an answer, Ctrl-D quits)"


class Conversation:
    """The messages so far, and the system message that heads them."""

    def __init__(self, system: str | None = None) -> None:
        self.system = system
        self.turns: list[dict[str, str]] = []

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def reset(self) -> None:
        self.turns = []


def add_chat_args(p: argparse.ArgumentParser) -> None:
    add_client_args(p)
    p.add_argument("--system", default=None, help="system message (default: the template's)")
    p.add_argument("--max-tokens", type=int, default=512, help="per answer (default 512)")
    p.add_argument("--temperature", type=float, default=0.7, help="default 0.7 (0: greedy)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of each answer (s)")


def run_chat(args: argparse.Namespace, stdin: TextIO = sys.stdin,
             stdout: TextIO = sys.stdout) -> int:
    conversation = Conversation(args.system)
    interactive = stdin.isatty()
    try:
        client = connect(args, timeout=args.timeout)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with client:
        if interactive:
            print(f"pdserve chat with {args.address}; {HELP}", file=stdout, flush=True)
        return _converse(client, conversation, args, stdin, stdout, interactive)


def _converse(client, conversation: Conversation, args: argparse.Namespace, stdin: TextIO,
              stdout: TextIO, interactive: bool) -> int:
    """Read lines until the input ends or /exit: commands act, anything else is asked."""
    while True:
        line = _read_line(stdin, stdout, interactive)
        if line is None or line.strip() == "/exit":
            return 0
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            _command(text, conversation, stdout)
        elif not _ask(client, conversation, text, args, stdout):
            return 2


def _ask(client, conversation: Conversation, text: str, args: argparse.Namespace,
         stdout: TextIO) -> bool:
    """One turn: the answer joins the conversation only when it ended well. False when
    the router cannot be reached (no point in going on)."""
    conversation.turns.append({"role": "user", "content": text})
    try:
        answer, finish = _stream_answer(client, conversation, args, stdout)
    except KeyboardInterrupt:
        conversation.turns.pop()
        print("\n[stopped]", file=stdout, flush=True)
        return True
    except Exception as exc:  # the router refused or went away
        conversation.turns.pop()
        return rpc_error(exc, args.address) != 2
    if finish == "error":
        conversation.turns.pop()
    else:
        conversation.turns.append({"role": "assistant", "content": answer})
    return True


def _read_line(stdin: TextIO, stdout: TextIO, interactive: bool) -> str | None:
    if interactive:
        try:
            return input("> ")
        except EOFError:
            print(file=stdout)
            return None
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt, not an exit
            print(file=stdout)
            return ""
    line = stdin.readline()
    return line if line else None


def _command(text: str, conversation: Conversation, stdout: TextIO) -> None:
    name, _, rest = text.partition(" ")
    if name == "/reset":
        conversation.reset()
        print("[conversation cleared]", file=stdout, flush=True)
    elif name == "/system":
        conversation.system = rest.strip() or None
        conversation.reset()
        print(f"[system message {'set' if conversation.system else 'cleared'}; conversation "
              "cleared]", file=stdout, flush=True)
    else:
        print(f"[unknown command {name}; {HELP}]", file=stdout, flush=True)


def _stream_answer(client, conversation: Conversation, args: argparse.Namespace,
                   stdout: TextIO) -> tuple[str, str]:
    parts: list[str] = []
    finish, error = "", ""
    for msg in client.stream(conversation.messages(), max_tokens=args.max_tokens,
                             temperature=args.temperature, top_p=args.top_p, seed=args.seed):
        parts.append(msg.text)
        print(msg.text, end="", flush=True, file=stdout)
        finish = msg.finish_reason or finish
        error = msg.error or error
    print(file=stdout, flush=True)
    if finish == "length":
        print(f"[answer cut at --max-tokens {args.max_tokens}]", file=stdout, flush=True)
    elif finish == "error":
        print(f"[error: {error}]", file=stdout, flush=True)
    return "".join(parts), finish

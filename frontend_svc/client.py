"""A small command-line client for people: `python -m frontend_svc.client "Tell me a story"
--stream --max-tokens 64` prints the text as it arrives; `--chat` holds a conversation, and
`--chat "question"` asks one question through the chat template; `--score "a text"` prints
how likely the model finds each of the text's tokens (prompt logprobs) and its perplexity."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc

from shared.frontend_protos import frontend_pb2 as pb
from shared.frontend_protos import frontend_pb2_grpc
from shared.grpc_auth import AuthConfigError, call_metadata, read_client_token
from shared.grpc_tls import TLSConfigError, add_client_arguments, client_tls

AUTH_TOKEN_ENV = "DUOSERVE_AUTH_TOKEN"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m frontend_svc.client", description=__doc__)
    add = parser.add_argument
    add("prompt", nargs="?", help="the prompt (with --chat: one question, then exit)")
    add("--address", default="127.0.0.1:50051", help="the frontend (default: %(default)s)")
    add("--chat", action="store_true", help="talk to the model with its chat template")
    add("--score", action="store_true", help="score the prompt: its tokens' logprobs")
    add("--system", help="a system message for --chat")
    add("--stream", action="store_true", help="print text as it arrives")
    add("--max-tokens", type=whole(1, UINT32_MAX), default=128, help="default: %(default)s")
    add("--temperature", type=float, help="0 is greedy (default: the engine's, 1.0)")
    add("--top-p", type=float)
    add("--seed", type=whole(INT64_MIN, INT64_MAX))
    add("--n", type=whole(1, UINT32_MAX), default=1, help="completions (default: %(default)s)")
    add("--stop", action="append", default=[], help="a stop string (repeatable)")
    add(
        "--bad-word",
        action="append",
        default=[],
        dest="bad_words",
        help="a word never to generate (repeatable)",
    )
    add("--timeout", type=float, default=300.0, help="deadline in seconds (default: %(default)s)")
    add(
        "--auth-token-file",
        type=Path,
        help=f"send the first line as the bearer token (or set {AUTH_TOKEN_ENV}; default: none)",
    )
    add_client_arguments(parser, "--tls", "the frontend")
    return parser


UINT32_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def whole(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high], which the request's field holds
    (the server checks what it means; this keeps protobuf from refusing it with a trace)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in [{low}, {high}]")
        return value

    return parse


def sampling_params(args: argparse.Namespace) -> pb.SamplingParams:
    params = pb.SamplingParams(
        max_tokens=args.max_tokens, n=args.n, stop=args.stop, bad_words=args.bad_words
    )
    for name in ("temperature", "top_p", "seed"):
        if getattr(args, name) is not None:
            setattr(params, name, getattr(args, name))
    return params


def print_streamed(responses: Iterable[pb.GenerateResponse], n: int) -> str:
    """Prints the text as it arrives (all choices at the end when n > 1); returns choice 0's."""
    texts: dict[int, str] = {}
    finish: dict[int, int] = {}
    usage = None
    for response in responses:
        for choice in response.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
            if n == 1:
                print(choice.text, end="", flush=True)
        if response.HasField("usage"):
            usage = response.usage
    if n == 1:
        print()
    else:
        print_choices(texts)
    print_summary(finish, usage)
    return texts.get(0, "")


def print_unary(response: pb.GenerateResponse) -> str:
    texts = {choice.index: choice.text for choice in response.choices}
    if len(texts) == 1:
        print(texts[0])
    else:
        print_choices(texts)
    print_summary({c.index: c.finish_reason for c in response.choices}, response.usage)
    return texts.get(0, "")


def print_choices(texts: dict[int, str]) -> None:
    for index in sorted(texts):
        print(f"--- choice {index} ---\n{texts[index]}")


def print_summary(finish: dict[int, int], usage: pb.Usage | None) -> None:
    reasons = ", ".join(
        pb.FinishReason.Name(finish[i]).removeprefix("FINISH_REASON_").lower()  # type: ignore[arg-type]
        for i in sorted(finish)
    )
    if usage is not None:
        counts = f"{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens"
        print(f"[{reasons}; {counts}, {usage.cached_tokens} cached]", file=sys.stderr)


def generate(
    stub: frontend_pb2_grpc.GenerationServiceStub,
    request: pb.GenerateRequest,
    args: argparse.Namespace,
) -> str:
    metadata = call_metadata(args.auth_token)
    if args.stream:
        stream = stub.GenerateStream(request, timeout=args.timeout, metadata=metadata)
        return print_streamed(stream, args.n)
    return print_unary(stub.Generate(request, timeout=args.timeout, metadata=metadata))


def score(stub: frontend_pb2_grpc.GenerationServiceStub, args: argparse.Namespace) -> int:
    """Each prompt token after the first: its logprob and rank; then the total and the
    perplexity over them. Exit code 1 where the answer has none to score."""
    params = pb.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    request = pb.GenerateRequest(prompt=args.prompt, sampling_params=params)
    response = stub.Generate(request, timeout=args.timeout, metadata=call_metadata(args.auth_token))
    entries = response.prompt_logprobs
    if not entries:
        print("nothing to score: the answer has no prompt logprobs (a prompt's first token "
              "has none: is the prompt one token long?)", file=sys.stderr)  # fmt: skip
        return 1
    for position, entry in enumerate(entries, start=1):
        token, logprob = entry.token_id, entry.logprob
        print(f"{position:6d} token {token:7d}  logprob {logprob:9.4f}  rank {entry.rank}")
    total = sum(entry.logprob for entry in entries)
    perplexity = math.exp(-total / len(entries))
    print(f"{len(entries)} tokens scored: total logprob {total:.4f}, perplexity {perplexity:.3f}")
    return 0


def chat(stub: frontend_pb2_grpc.GenerationServiceStub, args: argparse.Namespace) -> None:
    history = [pb.ChatMessage(role="system", content=args.system)] if args.system else []
    if args.prompt is not None:
        ask(stub, history, args.prompt, args)
        return
    print("Chat with the model; an empty line or Ctrl-D ends it.", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        ask(stub, history, line, args)


def ask(
    stub: frontend_pb2_grpc.GenerationServiceStub,
    history: list[pb.ChatMessage],
    question: str,
    args: argparse.Namespace,
) -> None:
    """One turn: the question and the printed reply join `history`."""
    history.append(pb.ChatMessage(role="user", content=question))
    request = pb.GenerateRequest(messages=history, sampling_params=sampling_params(args))
    reply = generate(stub, request, args)
    history.append(pb.ChatMessage(role="assistant", content=reply))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompt is None and not args.chat:
        parser.error("give a prompt, or --chat")
    if args.score and args.chat:
        parser.error("--score takes a prompt, not --chat")
    if args.score and args.n != 1:
        parser.error("--score scores the prompt once: no --n")
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        parser.error("--timeout must be a number of seconds above 0")
    if args.system is not None and not args.chat:
        parser.error("--system needs --chat")
    try:
        args.auth_token = read_client_token(args.auth_token_file, os.environ, AUTH_TOKEN_ENV)
        tls = client_tls(args, "--tls")
    except (OSError, AuthConfigError, TLSConfigError) as error:
        parser.error(str(error))
    if args.chat:
        args.stream = args.stream or args.n == 1  # a conversation reads best as it arrives
    channel = (
        grpc.insecure_channel(args.address)
        if tls is None
        else grpc.secure_channel(args.address, tls.credentials(), tls.channel_options())
    )
    with channel:
        stub = frontend_pb2_grpc.GenerationServiceStub(channel)
        try:
            if args.chat:
                chat(stub, args)
            elif args.score:
                return score(stub, args)
            else:
                request = pb.GenerateRequest(
                    prompt=args.prompt, sampling_params=sampling_params(args)
                )
                generate(stub, request, args)
        except grpc.RpcError as error:
            print(f"\nerror: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # closing the channel cancels the call: the engine aborts
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

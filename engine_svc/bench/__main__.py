"""`python -m engine_svc.bench [MODE] ...`: `offline` (the default: our engine against
Hugging Face `generate` on the same prompts), `serve` (through the frontend's gRPC API) or
`openai` (any OpenAI-compatible server's streaming completions) or `overhead` (serve with
an engine that runs no model: the stack's own cost) or `prefix` (the time to first token of
a prompt with a cached prefix, against none cached) or `steps` (where an offline batch's time
goes: prompt and decode steps, and a decode step's parts) or `kernels` (our CPU kernels at
the model's shapes against what torch does in their place) or `gc` (the garbage collector's
cost to the engine core's start and its pauses after).
`python -m engine_svc.bench MODE --help` lists a mode's options."""

from __future__ import annotations

import importlib
import signal
import sys
from types import FrameType

MODES = {
    "offline": "engine_svc.bench.offline",
    "serve": "engine_svc.bench.serve",
    "openai": "engine_svc.bench.openai_api",
    "overhead": "engine_svc.bench.overhead",
    "prefix": "engine_svc.bench.prefix_ttft",
    "steps": "engine_svc.bench.step_times",
    "kernels": "engine_svc.bench.kernel_times",
    "gc": "engine_svc.bench.gc_pause",
}


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    mode = args.pop(0) if args and args[0] in MODES else "offline"
    importlib.import_module(MODES[mode]).main(args)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (`timeout`, an operator) unwinds like Ctrl-C: the services, workers and
    temporary folders a mode started are stopped and removed on the way out."""
    sys.exit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    main()

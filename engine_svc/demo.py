"""`make demo`: generate text for a few prompts with the offline API, in process, and report
tokens/s (the services are `make run`)."""

from __future__ import annotations

import argparse
import logging
import time

from engine_svc import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing clean Python code.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    started = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=2048)
    print(f"engine ready in {time.perf_counter() - started:.1f} s")
    prompts = [
        str(
            llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        )
        for text in PROMPTS
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    for question, output in zip(PROMPTS, outputs, strict=True):
        print(
            f"\n>>> {question}\n{output.text.strip()}\n[{len(output.token_ids)} tokens, "
            f"finish: {output.finish_reason}]"
        )
    num_tokens = sum(len(o.token_ids) for o in outputs)
    print(f"\n{num_tokens} tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tokens/s")


if __name__ == "__main__":
    main()

"""Reference outputs from Hugging Face `transformers` on the same weights, in float32."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_greedy(
    model: torch.nn.Module, prompts: list[list[int]], max_tokens: list[int]
) -> list[list[int]]:
    """Greedy `generate`, one prompt at a time (no padding to blur the comparison)."""
    outputs = []
    for prompt, limit in zip(prompts, max_tokens, strict=True):
        ids = torch.tensor([prompt])
        generated = model.generate(  # type: ignore[operator]
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=limit, do_sample=False
        )
        outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


@torch.inference_mode()
def hf_token_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log-softmax over the vocabulary at each output position, teacher-forced: [len(output), V]."""
    ids = torch.tensor([prompt + output])
    logits = model(ids).logits[0].float()  # type: ignore[operator]
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(output) - 1], dim=-1)

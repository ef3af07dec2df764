"""Models without an attention layer (Qwen3.5 with only Gated DeltaNet layers, LFM2 with only short
convolutions) keep no KV: the pool gives them no pages, and every path (prefill, chunked prefill, decode,
speculative verify with MTP or n-gram drafts) runs on recurrent state alone. Greedy output equals a
transformers forward over the whole sequence at every step (its generate cannot run them: its cache needs
an attention layer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hyspec_server import LLM, SamplingParams
from hyspec_testing.tiny import build_tiny_checkpoint

PROMPTS = [[5, 9, 17, 33, 2, 7], [40, 41], list(range(3, 90))]
NEW = 10


def _reference(path: Path, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize(("arch", "layer"), [("qwen3_5", "linear_attention"), ("lfm2", "conv")])
def test_a_model_without_attention_layers_serves_exactly(tmp_path: Path, arch: str, layer: str) -> None:
    mtp = 1 if arch == "qwen3_5" else 0
    path = build_tiny_checkpoint(
        tmp_path / arch, arch, mtp_layers=mtp, config_overrides={"layer_types": [layer] * 3}
    )
    want = [_reference(path, p) for p in PROMPTS]
    runs: list[dict[str, Any]] = [
        {},
        {"max_num_batched_tokens": 32, "max_num_seqs": 1},  # chunked prefill, one request at a time
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    ]
    if mtp:
        runs.append({"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}})
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    for kw in runs:
        llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=128, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, kw
        llm.engine.leak_check()

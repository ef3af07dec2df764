"""`HyspecModelRunner`: the real model behind the `ModelRunner` seam.

Per step it builds one `ForwardBatch` through the hybrid backend: DECODE when every request brings one
token, else EXTEND (prompt chunks and decode tokens packed together). It runs the model, computes logits only
for the last token of each sampling chunk and samples on device. A decode step replays a CUDA graph when one
is captured for a batch size that fits (`cuda_graph.py`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from hyspec_attn_backends import HybridBackend, model_state_specs
from hyspec_models.loader import load_model
from hyspec_statepool.pool import HybridStatePool
from hyspec_statepool.sizing import MemoryPlan, plan_memory
from hyspec_statepool.specs import StateDtypes

from hyspec_server.config import EngineArgs
from hyspec_server.pool_memory import StatePoolMemory
from hyspec_server.runner import RunnerOutput, sampling_tensors, to_runner_output
from hyspec_server.sampler import Sampler
from hyspec_server.scheduler import SchedulerOutput

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_MAX_MODEL_LEN = 4096


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class HyspecModelRunner:
    """Loads a checkpoint, sizes the state pool for it and runs it.

    The pool holds `max_num_seqs` requests; without `kv_cache_bytes` it gets KV pages for all of them at
    `max_model_len`, otherwise `plan_memory` fits what the budget allows (preemption covers the rest).
    """

    def __init__(self, args: EngineArgs, model_dir: Path) -> None:
        self._device = torch.device(args.device)
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
        self.dtype = resolve_dtype(args.dtype, self._device)
        self.model = load_model(model_dir, device=self._device, dtype=self.dtype, progress=False)
        config = _text_config(self.model.config)
        self.vocab_size = int(config.vocab_size)
        ckpt_len = int(getattr(config, "max_position_embeddings", _DEFAULT_MAX_MODEL_LEN))
        if args.max_model_len is not None and args.max_model_len > ckpt_len:
            raise ValueError(
                f"max_model_len={args.max_model_len} is over the checkpoint's {ckpt_len} positions"
            )
        self._max_model_len = args.max_model_len or min(ckpt_len, _DEFAULT_MAX_MODEL_LEN)
        layers = self.model.mixer_layers()
        specs = model_state_specs(layers)
        dtypes = StateDtypes(kv=self.dtype, conv=self.dtype)
        # a decode graph pads its batch with rows that need one real KV page to read: a reserved request
        self.use_graphs = self._device.type == "cuda" and not args.enforce_eager
        max_running = args.max_num_seqs + (1 if self.use_graphs else 0)
        if args.kv_cache_bytes is not None:
            plan = plan_memory(
                args.kv_cache_bytes,
                specs,
                max_context=self._max_model_len,
                max_running=max_running,
                draft_shape=None,
                page_size=args.page_size,
                dtypes=dtypes,
            )
        else:
            per_req = -(-(self._max_model_len + 1) // args.page_size)
            plan = MemoryPlan(
                specs=specs,
                max_context=self._max_model_len,
                max_running=max_running,
                draft_shape=None,
                page_size=args.page_size,
                num_state_slots=max_running,
                num_kv_pages=max_running * per_req,
                dtypes=dtypes,
            )
        self.pool = HybridStatePool(plan, device=self._device)
        self._memory = StatePoolMemory(self.pool)
        self.backend = HybridBackend(
            self.pool,
            layers=layers,
            layer_types=self.model.layer_types,
            max_seqs=max_running,
            max_tokens=max(args.max_num_batched_tokens, max_running),
        )
        self.sampler = Sampler(self._device, seed=args.seed)
        self.graphs: Any = None
        if self.use_graphs:
            from hyspec_server.cuda_graph import DecodeGraphs

            try:
                self.graphs = DecodeGraphs(self.model, self.backend, self.pool, max_batch=args.max_num_seqs)
            except RuntimeError as e:
                # e.g. a layer that reads device values on the host (MoE routing): run eagerly instead
                log.warning("CUDA graph capture failed, decoding eagerly: %s", e)
                torch.cuda.synchronize()

    @property
    def memory(self) -> StatePoolMemory:
        return self._memory

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        chunks = list(step.chunks)
        rows = self.pool.req_rows([c.request.request_id for c in chunks])
        tokens = [t for c in chunks for t in c.request.token_slice(c.start, c.end)]
        q_lens = [c.num_new for c in chunks]
        prefix = [c.start for c in chunks]
        input_ids = torch.tensor(tokens, dtype=torch.int64)
        hidden: torch.Tensor
        # one token per request: recurrent decode kernels, replayed from a graph when one fits
        decode = all(q == 1 for q in q_lens)
        if decode and self.graphs is not None and self.graphs.fits(len(chunks)):
            hidden = self.graphs.run(req_rows=rows, input_ids=input_ids, prefix_lens=prefix)  # [N, H]
        elif decode:
            batch = self.backend.prepare_decode(req_rows=rows, input_ids=input_ids, prefix_lens=prefix)
            hidden = self.model(batch, self.backend).hidden_states  # [N, H]
        else:
            batch = self.backend.prepare_extend(
                req_rows=rows, input_ids=input_ids, q_lens=q_lens, prefix_lens=prefix
            )
            hidden = self.model(batch, self.backend).hidden_states  # [T, H]
        sample = [i for i, c in enumerate(chunks) if c.sample]
        if not sample:
            return RunnerOutput(tuple(None for _ in chunks))
        ends = torch.cumsum(torch.tensor(q_lens), 0) - 1  # [N] last packed token of each chunk
        last = ends[torch.tensor(sample)].to(self._device)
        logits = self.model.compute_logits(hidden[last])  # [n_sample, V]
        out = self.sampler(logits, sampling_tensors([chunks[i] for i in sample], self._device))
        return to_runner_output(step, out)

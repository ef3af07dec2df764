"""End-to-end decode speed of hyspec next to HF transformers, in one run on one GPU, with speculation.

    python tools/bench_decode.py --out benchmarks/results [--layers 32] [--prompt 512] [--new 128]

The model is Qwen3.5-9B-shaped (`Qwen3_5TextConfig()` defaults: 24 GDN + 8 attention layers, hidden 4096,
vocab 248320), random bf16 weights (decode cost does not depend on the values), built with transformers and
saved once, plus one random MTP layer (a copy of a target attention layer's tensors) so that MTP drafting
can run. The same checkpoint is then measured:

- HF transformers `generate` (greedy; flash-linear-attention kernels when fla is importable), batch 1;
- hyspec `LLM.generate` (bf16, CUDA graphs), batch 1 and `--batch` rows: decode tokens/s is (new - 1) per row
  over the time from the first token to the last (the requests' own timestamps), so prefill, and with a
  model drafter its draft extend over the prompt, are excluded; HF's is (new - 1) / (time for `new` tokens -
  time for 1 token), also without prefill. With several rows the first-to-last window still holds the other
  rows' prefill chunks, so the steady decode tokens/s counts only the engine steps in which every row
  decodes (from the last row's first token to the first row's finish);
- plain and adaptive batch 1 also run 8 more requests each on the same engine (`next8`, their mean): a
  single request's figure varies by a few percent between requests;
- hyspec with speculation, batch 1: MTP S=3 with fixed length (random MTP weights accept ~nothing: the cost
  of useless drafting), MTP with the cost-aware adaptive length (it should drop to plain decoding), and an
  oracle drafter proposing the plain run's own continuation (every draft right: what verify and commit give
  when drafts are good; the draft itself costs nothing, so this is an upper bound for a real drafter).

The roofline is the bytes one decode step must read (weights except the embedding table, one embedding row,
and the recurrent state read + written) over the copy bandwidth measured in the same run. Results go to
`<out>/<device>-decode.json` and `.md`.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

BF16 = torch.bfloat16


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written)."""
    x = torch.empty(1024**3, dtype=BF16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t, n = time.perf_counter(), 20
    for _ in range(n):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 2 / ((time.perf_counter() - t) / n)


def build_checkpoint(
    out: Path, layers: int, vocab_size: int | None = None, *, decisive: bool = False
) -> tuple[Any, dict[str, Any]]:
    """Random bf16 Qwen3.5-9B-shaped checkpoint with one MTP layer (`vocab_size`: another vocabulary than
    Qwen3.5's) -> (config, byte counts).

    `decisive`: the same shapes with values whose greedy choices are far from ties. A random model's logits
    are nearly flat and its residual stream is chaotic, so bf16 verify blocks and decode steps (or two batch
    shapes) pick different tokens at a large share of positions. Here every residual branch's output
    projection is scaled by 1e-3 (the final hidden state is mostly the current token's embedding) and the
    lm_head rows are the embedding rows in a random order, so each token's greedy successor wins by a wide
    margin (a fixed random permutation of the vocabulary). Speed does not depend on the values."""
    from hyspec_testing.tiny_tokenizer import write_tokenizer
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(num_hidden_layers=layers)
    if vocab_size is not None:
        cfg.vocab_size = vocab_size
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM._from_config(cfg, dtype=BF16)
    model.eval()
    if decisive:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
                    p.mul_(1e-3)
            emb_w = model.model.embed_tokens.weight
            perm = torch.randperm(emb_w.shape[0], generator=torch.Generator().manual_seed(2))
            assert model.lm_head.weight.data_ptr() != emb_w.data_ptr(), "a tied lm_head"
            model.lm_head.weight.copy_(emb_w[perm.to(emb_w.device)].clone())
    nparam = sum(p.numel() for p in model.parameters())
    emb = model.model.embed_tokens.weight.numel()
    model.save_pretrained(out)
    # MTP layer 0: the tensors of the target's first full-attention layer, renamed (values do not matter)
    attn = cfg.layer_types.index("full_attention")
    prefix = f"model.layers.{attn}."
    mtp = {
        "mtp." + "layers.0." + k[len(prefix) :]: v.detach().clone().cpu()
        for k, v in model.state_dict().items()
        if k.startswith(prefix)
    }
    h = cfg.hidden_size
    g = torch.Generator().manual_seed(1)
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        mtp[name] = (0.2 * torch.randn(h, generator=g)).to(BF16)
    mtp["mtp.fc.weight"] = (torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5).to(BF16)
    save_file(mtp, str(out / "mtp.safetensors"), metadata={"format": "pt"})
    index_path = out / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:  # a single-file save: make it an index over both files
        index = {"metadata": {}, "weight_map": {}}
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "pt") as f:
            index["weight_map"] = {k: "model.safetensors" for k in f.keys()}
    index["weight_map"].update({k: "mtp.safetensors" for k in mtp})
    index_path.write_text(json.dumps(index))
    cfg_json = json.loads((out / "config.json").read_text())
    cfg_json["mtp_num_hidden_layers"] = 1
    cfg_json["mtp_use_dedicated_embeddings"] = False
    (out / "config.json").write_text(json.dumps(cfg_json))
    write_tokenizer(out)
    gdn_layers = cfg.layer_types.count("linear_attention")
    state = gdn_layers * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    sizes = {
        "params": nparam,
        "weight_bytes_per_token": (nparam - emb + h) * 2,
        "gdn_state_bytes_per_token": 2 * state,  # fp32 state read + written
    }
    return model, sizes


def hf_decode(
    model: Any, rows: Sequence[list[int]], new: int, *, pad: int = 0, device: str = "cuda", **kw: Any
) -> dict[str, Any]:
    """HF `generate` (greedy, `kw` passed on) over left-padded rows: decode tok/s = (new - 1) per row / (time
    for `new` tokens - time for 1 token), so prefill is excluded; `tokens` is each row's new tokens."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    kw |= {"attention_mask": mask, "do_sample": False, "pad_token_id": pad}

    def gen(n: int) -> tuple[float, list[list[int]]]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out[:, width:].tolist()

    gen(4)
    t1, _ = gen(1)
    tn, toks = gen(new)
    return {"decode_tok_s": len(rows) * (new - 1) / (tn - t1), "tokens": toks}


def hyspec_decode(llm: Any, prompts: Sequence[list[int]], new: int) -> dict[str, Any]:
    from hyspec_server import SamplingParams

    items = [{"prompt_token_ids": p} for p in prompts]

    engine = llm.engine
    steps: list[tuple[float, float]] = []  # (start, end) of every engine step, time.monotonic (as metrics)

    def timed_step() -> Any:
        t = time.monotonic()
        out = step()
        steps.append((t, time.monotonic()))
        return out

    def gen(n: int) -> tuple[float, list[Any]]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(items, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        torch.cuda.synchronize()
        return time.perf_counter() - t0, outs

    gen(4)
    t1, _ = gen(1)
    step = engine.step
    engine.step = timed_step
    try:
        tn, outs = gen(new)
    finally:
        del engine.step
    stats = [o.spec_stats for o in outs if o.spec_stats is not None]
    # decode time runs from the first token (prefill done, including a drafter's extend over the prompt) to
    # the last one; the older figure, total minus a one-token request's time, is kept for comparison
    first = min(o.metrics.first_token_time or 0.0 for o in outs)
    last = max(o.metrics.finished_time or 0.0 for o in outs)
    arrived = min(o.metrics.arrival_time for o in outs)
    # every row decodes between the last first token and the first finish: no prefill in those steps
    both = max(o.metrics.first_token_time or 0.0 for o in outs)
    done = min(o.metrics.finished_time or 0.0 for o in outs)
    inside = [(a, b) for a, b in steps if a >= both and b <= done]
    res: dict[str, Any] = {
        "decode_tok_s": len(prompts) * (new - 1) / (last - first),
        # with a batch the first-to-last window holds the other rows' prefill too: this one does not
        "steady_decode_tok_s": (
            len(prompts) * len(inside) / (inside[-1][1] - inside[0][0]) if len(inside) > 1 else None
        ),
        "decode_tok_s_minus_one_token_run": len(prompts) * (new - 1) / (tn - t1),
        # time to the first token (the step that prefills the first prompts, a drafter's extend included)
        "first_token_ms": (first - arrived) * 1e3,
        "tokens": [o.outputs[0].token_ids for o in outs],
    }
    runner = llm.engine.runner
    c = runner.graphs.counts
    res["graph_counts"] = {
        "decode_replays": c.decode_replays,
        "decode_eager": c.decode_eager,
        "verify_replays": c.verify_replays,
        "verify_eager": c.verify_eager,
    }
    if runner.spec is not None:
        costs = runner.spec.costs.at(len(prompts))  # measured costs (seconds) the adaptive length uses
        res["measured_ms"] = {
            "decode": costs.decode_s() * 1e3,
            "round_with_1_draft": costs.round_s(1) * 1e3 if costs.ready else None,
            "round_with_3_drafts": costs.round_s(3) * 1e3 if costs.ready else None,
            "catch_up": costs.catch_up_s() * 1e3,
        }
        s = runner.spec.num_speculative_tokens
        if s not in (1, 3):  # a round at the config's own length (what its speed-up is made of)
            res["measured_ms"][f"round_with_{s}_drafts"] = costs.round_s(s) * 1e3 if costs.ready else None
        dc = getattr(runner.spec.drafter, "graph_counts", None)
        if dc is not None:
            res["draft_graph_counts"] = {"replays": dc.replays, "eager": dc.eager}
    if stats:
        drafts = sum(s.num_drafts for s in stats)
        res["verify_rounds"] = drafts
        res["mean_accept_length"] = 1 + sum(s.num_accepted_tokens for s in stats) / drafts if drafts else 0.0
    return res


def repeated(llm: Any, prompts: Sequence[list[int]], new: int, times: int) -> dict[str, Any]:
    """`hyspec_decode` run `times` times on the same engine: the mean tokens/s and each run's figures."""
    more = [hyspec_decode(llm, prompts, new) for _ in range(times)]
    return {
        **more[-1],
        "decode_tok_s": sum(m["decode_tok_s"] for m in more) / len(more),
        "decode_tok_s_each": [m["decode_tok_s"] for m in more],
        "verify_rounds_each": [m.get("verify_rounds", 0) for m in more],
    }


def oracle_registry(refs: Sequence[list[int]], steps: int, *, wrong: bool = False) -> Any:
    """A drafter registry whose "ngram" drafter proposes the reference continuation (every draft right), or
    with `wrong` each of those tokens off by one (every draft wrong: a useless drafter at the same cost).

    Each request finds its reference once (the one its history starts with); every later round checks only
    that its last token (the target's last choice) is the reference's at that position and proposes the
    next reference tokens: O(1) per row, so a round times the engine, not the oracle. A row that parted
    from its reference (a bf16 near-tie) goes on with another reference that continues its history (rows
    of one prompt), else proposes nothing from then on (`reanchored` runs it again on its own output).
    """
    from hyspec_runner.speculative import DrafterContext, DrafterRegistry
    from hyspec_spec_workers import DraftBatch, DraftOutput, VerifyTree

    class Oracle:
        method = "ngram"
        max_draft_tokens = steps + 1

        def __init__(self) -> None:
            # request id -> (its reference or None once parted, history length when last checked)
            self._refs: dict[Any, tuple[list[int] | None, int]] = {}
            # its blocks' grids built once per shape, as the repo's ngram drafter keeps them (on the host, as
            # its drafts: the round moves the tree to the device in one packed copy; trees before
            # `ChainLayouts` build them every round)
            self._chain: dict[str, Any] = {}
            try:
                from hyspec_spec_workers.tree import ChainLayouts

                self._chain["layouts"] = ChainLayouts()
            except ImportError:
                pass

        def _reference(self, rid: Any, h: Any) -> list[int] | None:
            n = len(h)
            ref, seen = self._refs.get(rid, (None, -1))
            if n <= seen or (ref is None and seen < 0):
                # a new request (or one whose id came back): find its reference once
                hist = list(h[:n])
                ref = next((r for r in refs if r[:n] == hist), None)
            elif ref is not None and (n > len(ref) or ref[n - 1] != int(h[-1])):
                # parted from its reference: another one may go on from here (rows with one prompt), else
                # none (rare, so the full search costs nothing per round)
                hist = list(h[:n])
                ref = next((r for r in refs if r[:n] == hist), None)
            self._refs[rid] = (ref, n)
            return ref

        def propose(self, batch: DraftBatch) -> DraftOutput:
            rows = []
            num = []
            for rid, h, s in zip(batch.req_ids, batch.histories, batch.num_steps, strict=True):
                ref = self._reference(rid, h)
                n = len(h)
                nxt = [] if ref is None else ref[n : n + min(s, steps)]
                if wrong:
                    nxt = [t - 1 if t > 0 else 1 for t in nxt]
                rows.append(nxt + [0] * (steps - len(nxt)))
                num.append(len(nxt))
            drafts = torch.tensor(rows, dtype=torch.int64)
            return DraftOutput(VerifyTree.chain(batch.root_tokens, drafts, torch.tensor(num), **self._chain))

        # a `RequestKeyedDrafter`: the round drops an ended request's reference (and checks for leaks)
        def forget(self, request_ids: Sequence[Any]) -> None:
            for rid in request_ids:
                self._refs.pop(rid, None)

        @property
        def followed(self) -> frozenset[Any]:
            return frozenset(self._refs)

    def build(ctx: DrafterContext) -> Any:
        return Oracle()

    return DrafterRegistry().with_builder("ngram", build)


def reanchored(
    llm: Any,
    prompts: Sequence[list[int]],
    new: int,
    refs: list[list[int]],
    first: dict[str, Any],
    passes: int = 3,
) -> dict[str, Any]:
    """An oracle run (`first`, of `hyspec_decode` with an `oracle_registry` over `refs`) run again with
    each row re-anchored on its own output, until every row followed its reference (at most `passes` more).

    bf16 verify blocks and decode steps round differently, so at a near-tie a row can part from the plain
    reference, and the oracle then proposes nothing for it: the run mixes rounds with and without drafts.
    The engine's greedy output is its own best reference; `refs` (the registry's list) is updated in place.
    Adds `oracle_followed`: the share of rows whose output is their reference's continuation.
    """
    r = first
    for _ in range(passes):
        own = [list(p) + list(t) for p, t in zip(prompts, r["tokens"], strict=True)]
        if own == refs:
            break
        refs[:] = own
        r = hyspec_decode(llm, prompts, new)
    followed = [list(p) + list(t) == ref for p, t, ref in zip(prompts, r["tokens"], refs, strict=True)]
    r["oracle_followed"] = sum(followed) / len(followed)
    r["oracle_reanchored_to_own_output"] = all(followed)
    return r


def make_llm(
    path: Path,
    *,
    spec: dict[str, Any] | None,
    drafters: Any = None,
    max_num_seqs: int,
    max_len: int,
    kv_cache_bytes: int | None = None,
    max_num_batched_tokens: int | None = 2048,
) -> Any:
    """An engine on the GPU; `kv_cache_bytes` bounds its cache (several engines in one process) instead of
    the default share of GPU memory; `max_num_batched_tokens` the step's token budget (prompt chunks; None:
    the engine's default)."""
    # EngineArgs as the server exports it: the same import in trees from before the runner's package
    from hyspec_server import LLM, EngineArgs
    from hyspec_server.builder import build_engine

    args = EngineArgs(
        model=str(path),
        device="cuda",
        dtype="bfloat16",
        max_model_len=max_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        speculative_config=spec,
        kv_cache_bytes=kv_cache_bytes,
    )
    return LLM.from_engine(build_engine(args, drafters=drafters))


def free(*objs: Any) -> None:
    del objs
    gc.collect()
    torch.cuda.empty_cache()


def agreement(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two greedy outputs."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    a = ap.parse_args()

    import transformers
    import triton

    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "layers": a.layers,
        "prompt_len": a.prompt,
        "new_tokens": a.new,
    }
    try:
        import fla

        res["fla"] = fla.__version__
    except ImportError:
        res["fla"] = None
    res["copy_bw_TBps"] = copy_bandwidth() / 1e12
    with tempfile.TemporaryDirectory(prefix="hyspec-bench-") as tmp:  # a 9B-wide checkpoint: tens of GB
        run_all(Path(tmp) / "qwen3_5-9b-shaped", a, res)
    write(a.out, res)


def run_all(ckpt: Path, a: argparse.Namespace, res: dict[str, Any]) -> None:
    """Builds the checkpoint, then times HF and every hyspec configuration on it (into `res`)."""
    bw = res["copy_bw_TBps"] * 1e12
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    hf_model, sizes = build_checkpoint(ckpt, a.layers)
    res["build_s"] = time.perf_counter() - t0
    res.update(sizes)
    step_bytes = sizes["weight_bytes_per_token"] + sizes["gdn_state_bytes_per_token"]
    res["roofline_tok_s_batch1"] = bw / step_bytes
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(0, vocab, (a.prompt,), generator=g).tolist() for _ in range(a.batch)]
    if not a.skip_hf:
        res["hf_batch1"] = hf_decode(hf_model, prompts[:1], a.new)
        print("hf", res["hf_batch1"]["decode_tok_s"], flush=True)
    free(hf_model)
    hf_model = None

    max_len = a.prompt + a.new + 16
    runs: dict[str, Any] = {}
    llm = make_llm(ckpt, spec=None, max_num_seqs=a.batch, max_len=max_len)
    runs["plain_batch1"] = hyspec_decode(llm, prompts[:1], a.new)
    runs["plain_next8_batch1"] = repeated(llm, prompts[:1], a.new, 8)
    runs[f"plain_batch{a.batch}"] = hyspec_decode(llm, prompts, a.new)
    print({k: (v["decode_tok_s"], v["graph_counts"]) for k, v in runs.items()}, flush=True)
    free(llm)
    llm = None

    s = 3
    oracle_ref = [prompts[0] + runs["plain_batch1"]["tokens"][0]]  # what the oracle proposes from
    spec_runs: list[tuple[str, dict[str, Any] | None, Callable[[], Any] | None]] = [
        ("mtp_fixed_s3", {"method": "mtp", "num_speculative_tokens": s}, None),
        ("mtp_adaptive", {"method": "mtp", "num_speculative_tokens": s, "adaptive": True}, None),
        (
            "oracle_s3",
            {"method": "ngram", "num_speculative_tokens": s},
            lambda: oracle_registry(oracle_ref, s),
        ),
    ]
    for name, spec, registry in spec_runs:
        llm = make_llm(
            ckpt,
            spec=spec,
            drafters=None if registry is None else registry(),
            max_num_seqs=a.batch,
            max_len=max_len,
        )
        runs[name + "_batch1"] = r = hyspec_decode(llm, prompts[:1], a.new)
        if name == "mtp_adaptive":
            # the same request again on the same engine: its adaptive lengths start from what the first
            # one measured (a long-running server), where the first started from nothing
            runs[name + "_again_batch1"] = hyspec_decode(llm, prompts[:1], a.new)
            # eight more: the engine probes about once per probe wait in all, so a single request may or
            # may not pay a probe; their mean is what a long-running engine pays
            runs[name + "_next8_batch1"] = repeated(llm, prompts[:1], a.new, 8)
        if name.startswith("oracle"):
            runs[name + "_batch1"] = r = reanchored(llm, prompts[:1], a.new, oracle_ref, r)
        print(
            name,
            runs[name + "_batch1"]["decode_tok_s"],
            runs[name + "_batch1"].get("mean_accept_length"),
            runs[name + "_batch1"]["graph_counts"],
            runs[name + "_batch1"].get("measured_ms"),
            runs[name + "_batch1"].get("draft_graph_counts"),
            flush=True,
        )
        free(llm)
        llm = None
    res["hyspec"] = runs
    plain1 = runs["plain_batch1"]["tokens"][0]
    res["greedy_prefix_agreement"] = {
        k: agreement(plain1, v["tokens"][0]) for k, v in runs.items() if k.endswith("_batch1")
    }
    if "hf_batch1" in res:
        res["greedy_prefix_agreement"]["hf"] = agreement(plain1, res["hf_batch1"]["tokens"][0])


def write(out: Path, res: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9]+", "-", res["device"]).strip("-").lower() + "-decode"
    slim = json.loads(json.dumps(res))
    for r in [slim.get("hf_batch1", {}), *slim["hyspec"].values()]:
        r.pop("tokens", None)
    (out / f"{stem}.json").write_text(json.dumps(slim, indent=1) + "\n")
    h = slim["hyspec"]
    roof = slim["roofline_tok_s_batch1"]
    b = next(k for k in h if k.startswith("plain_batch") and k != "plain_batch1")
    lines = [
        f"# End-to-end decode on {slim['device']}",
        "",
        f"torch {slim['torch']}, triton {slim['triton']}, transformers {slim['transformers']}, "
        f"fla {slim['fla']}. Qwen3.5-9B-shaped model ({slim['layers']} layers, {slim['params'] / 1e9:.2f} B "
        f"params, random bf16), prompt {slim['prompt_len']} tokens, {slim['new_tokens']} new tokens, greedy; "
        f"decode tokens/s = generated tokens after the first / time from first to last token (prefill and a "
        f"drafter's extend over the prompt excluded; HF: time for all minus time for one token). "
        f"Copy bandwidth {slim['copy_bw_TBps']:.2f} TB/s; one decode step "
        f"reads {slim['weight_bytes_per_token'] / 1e9:.2f} GB of weights + "
        f"{slim['gdn_state_bytes_per_token'] / 1e6:.0f} MB of GDN state traffic: roofline {roof:.0f} tok/s "
        "at batch 1. Produced by `tools/bench_decode.py`.",
        "",
        "| engine | batch | decode tok/s | of roofline | mean accept length | steady decode tok/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    if "hf_batch1" in slim:
        t = slim["hf_batch1"]["decode_tok_s"]
        lines.append(f"| HF transformers generate | 1 | {t:.1f} | {t / roof:.1%} | | |")
    for k, r in h.items():
        batch = int(k.rsplit("batch", 1)[1])
        t = r["decode_tok_s"]
        # the roofline bounds one token per step: for plain decoding only
        frac = f"{t / roof:.1%}" if batch == 1 and k.startswith("plain") else ""
        acc = f"{r['mean_accept_length']:.2f}" if "mean_accept_length" in r else ""
        steady = r.get("steady_decode_tok_s")
        st = f"{steady:.1f}" if steady and batch > 1 else ""
        lines.append(f"| hyspec {k.rsplit('_batch', 1)[0]} | {batch} | {t:.1f} | {frac} | {acc} | {st} |")
    lines += [
        "",
        "Measured by the engine's cost tracker (EMAs the adaptive length decides with, ms) and graph use:",
        "",
        "| run | plain decode step | round with 1 draft | round with 3 drafts | catch-up (probe) "
        "| target graphs (replayed / eager) | draft graphs (replayed / eager) | verify rounds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k, r in h.items():
        m, gc_ = r.get("measured_ms") or {}, r["graph_counts"]
        dg = r.get("draft_graph_counts")

        def ms(x: float | None) -> str:
            return "" if x is None else f"{x:.1f}"

        replayed = gc_["decode_replays"] + gc_["verify_replays"]
        eager = gc_["decode_eager"] + gc_["verify_eager"]
        draft = "" if dg is None else f"{dg['replays']} / {dg['eager']}"
        lines.append(
            f"| {k} | {ms(m.get('decode'))} | {ms(m.get('round_with_1_draft'))} | "
            f"{ms(m.get('round_with_3_drafts'))} | {ms(m.get('catch_up'))} | {replayed} / {eager} | {draft} "
            f"| {r.get('verify_rounds', '')} |"
        )
    lines += [
        "",
        f"Batch {b.removeprefix('plain_batch')} rows decode together (one CUDA graph per step).",
        "Greedy agreement with hyspec plain (common prefix of the batch-1 outputs, tokens): "
        + ", ".join(f"{k} {v}" for k, v in slim["greedy_prefix_agreement"].items())
        + " (random bf16 weights have many near-ties, so engines may part early without an error; the"
        " speculative runs part at the same bf16 near-tie, and the oracle re-anchors on its own output).",
        "",
    ]
    (out / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Training stages of the demo models (called by tools/train_demo.py).

Targets are transformers' own model classes in training mode (Qwen3_5ForCausalLM, Lfm2ForCausalLM), so what
is trained is exactly what `AutoModelForCausalLM.from_pretrained` loads. The GDN layers run transformers'
torch chunked form (train_demo.py hides flash-linear-attention: fla 0.6.0 refuses its GDN backward on Hopper
with triton < 3.7.1). The draft networks are tools/demo/drafts.py.

Every stage trains for a wall-clock budget (or a fixed number of steps with --steps) with AdamW, bf16
autocast and a warm-up + cosine learning rate keyed on the fraction of the budget spent; batches are drawn
from the token stream by a seeded generator. Drafters learn the frozen target's next-token distribution at
every position (soft cross-entropy), since acceptance means agreeing with the target, not with the corpus.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tools.demo import drafts

# --------------------------------------------------------------------------------------------------------
# Model shapes (sizes chosen so that everything shipped stays under 32 MB in bf16, each file under 16 MB)

VOCAB = 6144
SEQ = 1024


def qwen_config(vocab: int, ids: dict[str, int]) -> dict[str, Any]:
    """Qwen3.5 text config: 8 layers, full attention every 4th (as the released models), one MTP layer."""
    return {
        "vocab_size": vocab,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 8,
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        **ids,
    }


def lfm2_config(vocab: int, ids: dict[str, int]) -> dict[str, Any]:
    """LFM2 config: 6 layers, short convolutions with attention at layers 2 and 5."""
    return {
        "vocab_size": vocab,
        "hidden_size": 192,
        "intermediate_size": 512,
        "num_hidden_layers": 6,
        "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "conv_L_cache": 3,
        "block_auto_adjust_ff_dim": False,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "norm_eps": 1e-5,
        "tie_word_embeddings": True,
        **ids,
    }


EAGLE3_AUX = {"qwen3_5": [1, 4, 6], "lfm2": [1, 3, 4]}
DFLASH_AUX = [1, 4, 6]
DFLASH_BLOCK = 8
MTP_STEPS = 3  # chain steps unrolled while training the MTP layer
EAGLE3_STEPS = 4


# --------------------------------------------------------------------------------------------------------
# Data and schedule


class TokenStream:
    """Random windows of a token array held on the device."""

    def __init__(self, tokens: Tensor, seed: int) -> None:
        self.tokens = tokens  # [N] int32 on the device
        self.gen = torch.Generator(device=tokens.device)
        self.gen.manual_seed(seed)

    def batch(self, rows: int, length: int) -> Tensor:
        n = self.tokens.shape[0] - length
        start = torch.randint(0, n, (rows,), generator=self.gen, device=self.tokens.device)
        idx = start[:, None] + torch.arange(length, device=self.tokens.device)[None, :]
        return self.tokens[idx].long()  # [rows, length]


def lr_factor(frac: float, warmup: float = 0.03, final: float = 0.1) -> float:
    if frac < warmup:
        return frac / warmup
    p = min(1.0, (frac - warmup) / (1 - warmup))
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * p))


@dataclass
class Budget:
    seconds: float
    steps: int | None = None  # fixed step count (reproduction); the time budget then only guards


@dataclass
class History:
    name: str
    points: list[dict[str, float]] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0


def optimize(
    name: str,
    params: list[nn.Parameter],
    loss_fn: Callable[[], tuple[Tensor, dict[str, Tensor]]],
    *,
    budget: Budget,
    peak_lr: float,
    tokens_per_step: int,
    weight_decay: float = 0.1,
) -> History:
    """Run AdamW steps of `loss_fn` until the budget is spent; returns the loss history."""
    from tqdm import tqdm

    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=peak_lr,
        betas=(0.9, 0.95),
        fused=params[0].is_cuda,
    )
    hist = History(name)
    t0 = time.perf_counter()
    bar = tqdm(total=round(budget.seconds), desc=name, unit="s", dynamic_ncols=True, mininterval=5)
    shown = 0
    step = 0
    while True:
        elapsed = time.perf_counter() - t0
        if budget.steps is not None:
            if step >= budget.steps:
                break
            frac = step / budget.steps
        else:
            frac = elapsed / budget.seconds
        if elapsed >= budget.seconds * (1.5 if budget.steps is not None else 1.0):
            break
        for g in opt.param_groups:
            g["lr"] = peak_lr * lr_factor(frac)
        with torch.autocast(params[0].device.type, dtype=torch.bfloat16):
            loss, parts = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 25 == 1:
            point = {"step": float(step), "seconds": elapsed, "loss": float(loss.item())}
            point.update({k: float(v.item()) for k, v in parts.items()})
            hist.points.append(point)
            bar.set_postfix({k: f"{v:.3f}" for k, v in point.items() if k not in ("step", "seconds")})
        now = round(time.perf_counter() - t0)
        if now > shown:
            bar.update(min(now, bar.total) - min(shown, bar.total))
            shown = now
    bar.close()
    hist.steps, hist.seconds, hist.tokens = step, time.perf_counter() - t0, step * tokens_per_step
    print(f"{name}: {step} steps, {hist.seconds:.0f} s, {hist.tokens / 1e6:.0f}M tokens", flush=True)
    return hist


# --------------------------------------------------------------------------------------------------------
# Target helpers


class Captured:
    """Forward hooks collecting the outputs (residual stream) of chosen decoder layers."""

    def __init__(self, layers: nn.ModuleList, ids: list[int]) -> None:
        self.out: dict[int, Tensor] = {}
        self.handles = [layers[i].register_forward_hook(self._hook(i)) for i in ids]
        self.ids = ids

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _inp: Any, out: Any) -> None:
            self.out[i] = out[0] if isinstance(out, tuple) else out

        return hook

    def cat(self) -> Tensor:
        return torch.cat([self.out[i] for i in self.ids], dim=-1)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def backbone(model: nn.Module) -> nn.Module:
    inner = model.model
    assert isinstance(inner, nn.Module)
    return inner


def embed_of(model: nn.Module) -> nn.Embedding:
    emb = model.get_input_embeddings()
    assert isinstance(emb, nn.Embedding)
    return emb


def final_hidden(model: nn.Module, ids: Tensor) -> Tensor:
    """The target's final-normed hidden states [B, T, H]."""
    out: Tensor = backbone(model)(input_ids=ids).last_hidden_state
    return out


def soft_ce(logits: Tensor, probs: Tensor) -> Tensor:
    """Mean over rows of -sum(probs * log_softmax(logits)) (probs from the frozen target)."""
    return -(probs.float() * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


def shift_right(x: Tensor) -> Tensor:
    """feature of step k + 1 at p = output of step k at p - 1 (position 0 gets zeros; it is never scored)."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


# --------------------------------------------------------------------------------------------------------
# Stages


def train_qwen(
    stream: TokenStream, cfg: dict[str, Any], *, budget: Budget, rows: int, seed: int
) -> tuple[nn.Module, drafts.MTPHead, History]:
    """The Qwen3.5 target and its MTP layer, trained jointly (next token + chained next-next tokens)."""
    import transformers as tf

    torch.manual_seed(seed)
    dev = stream.tokens.device
    model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**cfg)).to(dev)
    mtp = drafts.MTPHead(model.config.to_dict()).to(dev)
    model.train()
    emb, head = embed_of(model), model.get_output_embeddings()
    cos, sin = drafts.rope_cos_sin(torch.arange(SEQ, device=dev), mtp.rotary_dim, mtp.theta)
    weights = (0.3, 0.15, 0.1)

    def loss_fn() -> tuple[Tensor, dict[str, Tensor]]:
        x = stream.batch(rows, SEQ + 2)
        h = final_hidden(model, x[:, :SEQ])
        main = F.cross_entropy(head(h).flatten(0, 1).float(), x[:, 1 : SEQ + 1].flatten())
        parts = {"main": main}
        total = main
        e_next, labels = emb(x[:, 1 : SEQ + 1]), x[:, 2 : SEQ + 2]
        feat, cache = h, drafts.ChainCache()
        for k in range(MTP_STEPS):
            out = mtp.step(e_next, feat, cos, sin, cache)
            lk = F.cross_entropy(head(out[:, k:]).flatten(0, 1).float(), labels[:, k:].flatten())
            parts[f"mtp{k}"] = lk
            total = total + weights[k] * lk
            feat = shift_right(out)
        return total, parts

    params = [p for p in [*model.parameters(), *mtp.parameters()] if p.requires_grad]
    hist = optimize("qwen3_5+mtp", params, loss_fn, budget=budget, peak_lr=2.5e-3, tokens_per_step=rows * SEQ)
    return model.eval(), mtp.eval(), hist


def train_lfm2(
    stream: TokenStream, cfg: dict[str, Any], *, budget: Budget, rows: int, seed: int
) -> tuple[nn.Module, History]:
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.Lfm2ForCausalLM(tf.Lfm2Config(**cfg)).to(stream.tokens.device)
    model.train()
    head = model.get_output_embeddings()

    def loss_fn() -> tuple[Tensor, dict[str, Tensor]]:
        x = stream.batch(rows, SEQ + 1)
        h = final_hidden(model, x[:, :SEQ])
        loss = F.cross_entropy(head(h).flatten(0, 1).float(), x[:, 1:].flatten())
        return loss, {}

    params = [p for p in model.parameters() if p.requires_grad]
    hist = optimize("lfm2", params, loss_fn, budget=budget, peak_lr=3e-3, tokens_per_step=rows * SEQ)
    return model.eval(), hist


def _frozen(model: nn.Module) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def teacher(model: nn.Module, x: Tensor, cap: Captured) -> tuple[Tensor, Tensor]:
    """Frozen target pass: (concat of captured layer outputs [B, T, n·H], next-token probs [B, T, V] bf16)."""
    with torch.no_grad():
        h = final_hidden(model, x)
        probs = F.softmax(model.get_output_embeddings()(h).float(), dim=-1).to(torch.bfloat16)
        return cap.cat(), probs


def train_eagle3(
    stream: TokenStream,
    target: nn.Module,
    aux_ids: list[int],
    *,
    budget: Budget,
    rows: int,
    seed: int,
    inter: int,
) -> tuple[drafts.Eagle3Head, History, dict[str, Any]]:
    """An EAGLE-3 draft of the frozen target, unrolled over EAGLE3_STEPS chained steps."""
    torch.manual_seed(seed)
    _frozen(target)
    c = target.config
    hidden, heads = int(c.hidden_size), int(c.num_attention_heads)
    kv_heads, head_dim = int(c.num_key_value_heads), int(getattr(c, "head_dim", None) or hidden // heads)
    theta = 1e4
    draft = drafts.Eagle3Head(hidden, inter, heads, kv_heads, head_dim, theta).to(stream.tokens.device)
    cap = Captured(backbone(target).layers, aux_ids)
    emb, head = embed_of(target), target.get_output_embeddings()
    dev = stream.tokens.device
    cos, sin = drafts.rope_cos_sin(torch.arange(SEQ, device=dev), head_dim, theta)
    weights = [0.8**k for k in range(EAGLE3_STEPS)]

    def loss_fn() -> tuple[Tensor, dict[str, Tensor]]:
        x = stream.batch(rows, SEQ + 1)
        aux, probs = teacher(target, x[:, :SEQ], cap)
        # pair p = (x[p+1], f[p]) predicts x[p+2]: the target's distribution at position p + 1
        e_next, labels = emb(x[:, 1 : SEQ + 1]), probs[:, 1:]
        feat, cache = draft.fc(aux), drafts.ChainCache()
        total, parts = torch.zeros((), device=dev), {}
        for k in range(EAGLE3_STEPS):
            normed, out = draft.step(e_next, feat, cos, sin, cache)
            lk = soft_ce(head(normed[:, k : SEQ - 1]), labels[:, k:])
            parts[f"step{k}"] = lk
            total = total + weights[k] * lk
            feat = shift_right(out)
        return total / sum(weights), parts

    hist = optimize(
        "eagle3", list(draft.parameters()), loss_fn, budget=budget, peak_lr=2e-3, tokens_per_step=rows * SEQ
    )
    cap.close()
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "target_hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": theta,
        "vocab_size": int(c.vocab_size),
        "draft_vocab_size": int(c.vocab_size),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids},
        "torch_dtype": "bfloat16",
    }
    return draft.eval(), hist, config


def train_dflash(
    stream: TokenStream, target: nn.Module, mask_id: int, *, budget: Budget, rows: int, seed: int
) -> tuple[drafts.DFlashHead, History, dict[str, Any]]:
    """A DFlash block draft of the frozen target: block [x[L], MASK...] predicts x[L+1..L+B-1]."""
    torch.manual_seed(seed)
    _frozen(target)
    c = target.config
    hidden, inter, layers, heads, kv_heads, head_dim = int(c.hidden_size), 512, 2, 4, 2, 64
    theta, blk = 1e6, DFLASH_BLOCK
    dev = stream.tokens.device
    draft = drafts.DFlashHead(hidden, inter, layers, heads, kv_heads, head_dim, len(DFLASH_AUX), theta).to(
        dev
    )
    cap = Captured(backbone(target).layers, DFLASH_AUX)
    emb, head = embed_of(target), target.get_output_embeddings()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed + 1)
    weights = torch.tensor([0.9**i for i in range(blk - 1)], device=dev)

    def loss_fn() -> tuple[Tensor, dict[str, Tensor]]:
        x = stream.batch(rows, SEQ)
        aux, probs = teacher(target, x, cap)
        first = int(torch.randint(1, blk + 1, (1,), generator=gen))
        anchors = torch.arange(first, SEQ - blk + 2, blk, device=dev)  # L <= SEQ - B + 1
        nb = anchors.shape[0]
        ids = torch.full((rows, nb, blk), mask_id, dtype=torch.long, device=dev)
        ids[:, :, 0] = x[:, anchors]
        normed = draft(aux, emb(ids.view(rows, nb * blk)), anchors, blk).view(rows, nb, blk, -1)
        logits = head(normed[:, :, 1:])  # [rows, NB, B-1, V]: output i predicts x[L+i]
        lab_pos = anchors[:, None] + torch.arange(blk - 1, device=dev)[None, :]  # target probs at L+i-1
        labels = probs[:, lab_pos]  # [rows, NB, B-1, V]
        per_pos = -(labels.float() * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean(dim=(0, 1))  # [B-1]
        loss = (per_pos * weights).sum() / weights.sum()
        return loss, {"pos1": per_pos[0], f"pos{blk - 1}": per_pos[-1]}

    hist = optimize(
        "dflash", list(draft.parameters()), loss_fn, budget=budget, peak_lr=2e-3, tokens_per_step=rows * SEQ
    )
    cap.close()
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": theta,
        "vocab_size": int(c.vocab_size),
        "block_size": blk,
        "dflash_config": {"target_layer_ids": DFLASH_AUX, "mask_token_id": mask_id, "block_size": blk},
        "torch_dtype": "bfloat16",
    }
    return draft.eval(), hist, config


# --------------------------------------------------------------------------------------------------------
# Evaluation and saving


def evaluate(model: nn.Module, docs: list[list[int]], *, seq: int = SEQ) -> tuple[float, int]:
    """(total nats, tokens scored) over the validation documents (each scored from its start, in windows)."""
    dev = next(model.parameters()).device
    head = model.get_output_embeddings()
    total, count = 0.0, 0
    windows: list[list[int]] = []
    for d in docs:
        for s in range(0, len(d) - 1, seq):
            windows.append(d[s : s + seq + 1])
    model.eval()
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
        for w in _batches(windows, 64):
            n = max(len(x) for x in w)
            ids = torch.full((len(w), n), 0, dtype=torch.long)
            mask = torch.zeros(len(w), n - 1, dtype=torch.bool)
            for i, x in enumerate(w):
                ids[i, : len(x)] = torch.tensor(x)
                mask[i, : len(x) - 1] = True
            ids, mask = ids.to(dev), mask.to(dev)
            logits = head(final_hidden(model, ids[:, :-1])).float()
            nll = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
            total += float(nll[mask.flatten()].sum())
            count += int(mask.sum())
    return total, count


def _batches(items: list[list[int]], n: int) -> Iterator[list[list[int]]]:
    items = sorted(items, key=len)
    for i in range(0, len(items), n):
        yield items[i : i + n]


def save_safetensors(tensors: dict[str, Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in sorted(tensors.items())},
        str(path),
        metadata={"format": "pt"},
    )


def save_target(
    model: nn.Module, out: Path, *, stop_ids: list[int], mtp: drafts.MTPHead | None = None
) -> None:
    """save_pretrained in bf16, plus `mtp.*` tensors and `mtp_num_hidden_layers` for a Qwen3.5 target.

    generation_config.json stops at every id of `stop_ids` (end of text and the chat's end of turn).
    """
    from safetensors.torch import load_file

    model.generation_config.eos_token_id = stop_ids
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.float()
    if mtp is not None:
        weights = out / "model.safetensors"
        tensors = load_file(str(weights))
        tensors.update({f"mtp.{k}": v for k, v in mtp.state_dict().items()})
        save_safetensors(tensors, weights)
        cfg = json.loads((out / "config.json").read_text())
        cfg["mtp_num_hidden_layers"] = 1
        cfg["mtp_use_dedicated_embeddings"] = False
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_draft(draft: nn.Module, config: dict[str, Any], out: Path) -> None:
    save_safetensors(dict(draft.state_dict()), out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

"""Check that the training-mode drafts (tools/demo/drafts.py) compute what hyspec runs at inference.

    python tools/demo/check_drafts.py

On random weights, CPU fp32:
* the MTP layer (`QwenAttentionLayer`, step 0 of `MTPHead`) against transformers' own Qwen3_5DecoderLayer
  loaded with the same state dict (hyspec's MTP is tested against that layer in test_models_mtp.py);
* a chained step (ChainCache with step > 0) against recomputing the chain node by node with plain causal
  attention over [context keys of step 0, the chain's own keys], which is how hyspec drafts a chain.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.demo import drafts


def check_mtp_layer() -> float:
    import transformers as tf
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    cfg = tf.Qwen3_5TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        layer_types=["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    mine = drafts.QwenAttentionLayer(cfg.to_dict())
    with torch.no_grad():
        for p in mine.parameters():
            p.normal_(0, 0.3)
    hf = m.Qwen3_5DecoderLayer(cfg, 0).eval()
    hf.load_state_dict(mine.state_dict(), strict=True)
    rot = m.Qwen3_5TextRotaryEmbedding(cfg)
    t = 9
    x = torch.randn(1, t, 32)
    pos = torch.arange(t)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = hf(x, position_embeddings=rot(x, pos[None]), attention_mask=mask)
        want = want[0] if isinstance(want, tuple) else want
        cos, sin = drafts.rope_cos_sin(pos, 4, 1e4)
        got = mine(x, cos, sin, drafts.ChainCache())
    return float((got - want).abs().max())


def check_chain() -> float:
    """Step 2 of an unrolled EAGLE-3 chain at position p equals node-by-node drafting from root p - 2."""
    torch.manual_seed(1)
    h, t = 32, 10
    head = drafts.Eagle3Head(h, 48, 4, 2, 8, 1e4)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    emb = torch.randn(1, t, h)
    feat0 = torch.randn(1, t, h)
    cos, sin = drafts.rope_cos_sin(torch.arange(t), 8, 1e4)
    cache = drafts.ChainCache()
    with torch.no_grad():
        feat = feat0
        outs = []
        for _ in range(3):
            normed, out = head.step(emb, feat, cos, sin, cache)
            outs.append(normed)
            feat = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
        # reference: root r = 5; the chain's nodes at r, r+1, r+2 recomputed one by one
        r = 5
        ctx = drafts.ChainCache()
        head.step(emb[:, :r], feat0[:, :r], cos[:r], sin[:r], ctx)  # step-0 keys of the context
        a = head.midlayer.self_attn
        keys, values = [ctx.keys[0]], [ctx.values[0]]
        f = feat0[:, r : r + 1]
        node = None
        for j in range(3):
            p = r + j
            m = head.midlayer
            x = torch.cat([m.input_layernorm(emb[:, p : p + 1]), m.hidden_norm(f)], dim=-1)
            q, _ = a.query(x, cos[p : p + 1], sin[p : p + 1])
            k, v = a.kv(x, cos[p : p + 1], sin[p : p + 1])
            keys.append(k)
            values.append(v)
            o = a.attend(
                q, torch.cat(keys, 2), torch.cat(values, 2), torch.ones(1, r + j + 1, dtype=torch.bool), None
            )
            hh = f + o
            out = hh + m.mlp(m.post_attention_layernorm(hh))
            node = head.norm(out)
            f = out
        assert node is not None
    return float((outs[2][:, r + 2] - node[:, 0]).abs().max())


def main() -> None:
    e1, e2 = check_mtp_layer(), check_chain()
    print(f"MTP layer vs transformers: max abs diff {e1:.2e}")
    print(f"unrolled chain step 2 vs node-by-node drafting: max abs diff {e2:.2e}")
    if max(e1, e2) > 1e-4:
        raise SystemExit("MISMATCH")


if __name__ == "__main__":
    main()

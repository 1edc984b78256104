"""The reference of the GPU check's speed step: PyTorch's own training loop.

transformers' LlamaForCausalLM with SDPA attention, fp32 weights under bf16 autocast
(the mixed precision synerfuse's --bf16 runs: fp32 masters and gradients, bf16
compute), torch.optim.AdamW(fused=True), gradient clipping at 1.0 as Megatron's default,
`accum` micro-batches of `mbs` sequences per step. Prints one JSON line.
"""

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    p = argparse.ArgumentParser()
    for name in ["layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "seq", "mbs", "accum",
                 "warmup", "steps"]:
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()
    cuda = a.device.startswith("cuda")
    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads,
                         num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                         mlp_bias=False, attn_implementation="sdpa")
    with torch.device(a.device):
        model = LlamaForCausalLM(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                  fused=cuda)
    forward = torch.compile(model) if a.compile else model
    # bf16 autocast on the GPU; the CPU stand-in computes fp32, as synerfuse does there.
    precision = "bf16 autocast, fp32 weights" if cuda else "fp32"
    batches = [torch.randint(0, a.vocab, (a.mbs, a.seq), device=a.device)
               for _ in range(a.accum)]
    times = []
    for i in range(a.warmup + a.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for tokens in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss = forward(input_ids=tokens, labels=tokens).loss / a.accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    tokens = a.mbs * a.accum * a.seq * len(times)
    result = {
        "tokens_per_s": tokens / sum(times),
        "median_step_s": sorted(times)[len(times) // 2],
        "step_s_spread": [min(times), max(times)],
        "precision": precision,
        "compiled": a.compile,
        "micro_batch_size": a.mbs,
        "micro_batches": a.accum,
        "torch": torch.__version__,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

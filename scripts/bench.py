"""Benchmarks, measured side by side in one process and reported as ratios.

    python scripts/bench.py train     # training tokens/s vs transformers' LlamaForCausalLM, and MFU

The machine may be shared and noisy, so the contenders run in alternating rounds and each
reports its median step time; compare the ratio, not a single absolute figure.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lm import ModelConfig, Transformer

# The reference shape named in the README and the issues.
REFERENCE = dict(vocab_size=8192, n_layer=6, d_model=384, n_head=6, n_kv_head=2, d_ff=1024,
                 max_seq_len=256, tie_embeddings=True)


def matmul_peak_flops(size: int = 2048, repeats: int = 10) -> float:
    """Best observed fp32 FLOP/s of one square matmul: the ceiling MFU is measured against."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def hf_llama(cfg: ModelConfig) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False,
    )
    hf_cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(hf_cfg)


def train_step_fn(model: torch.nn.Module, logits_of):
    """One fp32 training step: forward, loss, backward, fused AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(batch: torch.Tensor) -> None:
        logits = logits_of(model, batch[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def bench_train(args) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(**REFERENCE)
    ours = Transformer(cfg)
    contenders = {
        "lm": train_step_fn(ours, lambda m, x: m(x)),
        "transformers": train_step_fn(hf_llama(cfg), lambda m, x: m(input_ids=x).logits),
    }
    batch = torch.randint(0, cfg.vocab_size, (args.batch, cfg.max_seq_len + 1))
    for step in contenders.values():
        for _ in range(args.warmup):
            step(batch)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.steps):  # alternate, so background load hits both alike
        for name, step in contenders.items():
            start = time.perf_counter()
            step(batch)
            times[name].append(time.perf_counter() - start)

    peak = matmul_peak_flops()
    tokens = args.batch * cfg.max_seq_len
    flops_per_step = ours.flops_per_token(cfg.max_seq_len) * tokens
    print(f"training step, fp32, {torch.get_num_threads()} threads: vocab {cfg.vocab_size}, {cfg.n_layer} layers, "
          f"d_model {cfg.d_model}, {cfg.n_head} heads / {cfg.n_kv_head} KV, SwiGLU {cfg.d_ff}, "
          f"seq {cfg.max_seq_len}, batch {args.batch}, tied embeddings; {args.steps} steps each")
    print(f"measured fp32 matmul peak: {peak / 1e9:.0f} GFLOP/s")
    print(f"{'':14}{'median step s':>14}{'tokens/s':>10}{'MFU':>7}")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in medians.items():
        print(f"{name:14}{seconds:14.3f}{tokens / seconds:10.0f}{flops_per_step / seconds / peak:7.1%}")
    print(f"lm / transformers tokens/s: {medians['transformers'] / medians['lm']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    train = sub.add_parser("train", help="training tokens/s and MFU against transformers' Llama")
    train.add_argument("--steps", type=int, default=10, help="measured steps per contender")
    train.add_argument("--warmup", type=int, default=2, help="unmeasured steps per contender first")
    train.add_argument("--batch", type=int, default=8)
    train.set_defaults(run=bench_train)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()

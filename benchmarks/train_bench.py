"""`scripts/bench.py train`: one training step of the reference shape (or a conf/model shape) against
transformers' LlamaForCausalLM (and litgpt's GPT where installed), eager and compiled, with MFU; and
ours again with the loss made a chunk of positions at a time, as training makes it (`loss_chunk`).

The contenders step in alternating rounds and each keeps its median step time, so background load
hits all of them alike: compare the ratios, not one absolute figure.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics

import torch

from benchmarks.bench_models import (
    REFERENCE,
    bench_device,
    bench_dtype,
    dense_bf16_peak,
    describe_device,
    hf_llama,
    timed,
)
from lm import ModelConfig, Transformer
from lm.attention import SoftmaxSpec, spec_from_dict
from lm.config.compose import CONF_DIR
from lm.studies.train_step import optimizer_step_fn, train_step_fn
from lm.training.scoring import Scorer
from lm.util.errors import ConfigError

MODEL_CONFIGS = CONF_DIR / "model"
SHAPE_FIELDS = ("vocab_size", "n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "max_seq_len", "tie_embeddings")


def matmul_peak_flops(device: torch.device, repeats: int = 10) -> float:
    """Best observed FLOP/s of one square matmul in the device's benchmark dtype: the ceiling the
    CPU's MFU is measured against (a GPU's is its data sheet's dense bf16 peak; this is printed
    beside it). 2048 on the CPU, 4096 on CUDA, where a smaller product cannot fill the GPU."""
    size = 4096 if device.type == "cuda" else 2048
    a, b = (torch.randn(size, size, device=device, dtype=bench_dtype(device)) for _ in range(2))
    a @ b
    return 2 * size**3 / min(timed(lambda: a @ b) for _ in range(repeats))


def chunked_loss_step_fn(model: Transformer, chunk: int, compile: bool = False,
                         autocast: torch.dtype | None = None):
    """One training step as `lm` trains (`loss_chunk`), through training's own Scorer: the final
    hidden states (compiled with `compile`, as `compile=true` trains), then the head and the
    cross-entropy `chunk` positions at a time (lm.model.linear_cross_entropy), never the whole
    logits; under autocast, as bf16-mixed training runs it."""
    scorer = Scorer(model, chunk, compile)

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast(batch.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            return scorer(batch, "mean", accuracy=False)[0]

    return optimizer_step_fn(model, loss_of)


def variant_spec(variant: str) -> SoftmaxSpec:
    """'gate=elementwise,qk_norm=true' -> the reference's softmax spec with those options, each value
    read by Hydra's override parser, as `attn.<option>=<value>` would be on a training command."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    items = variant.split(",")
    if any("=" not in item or item.startswith("=") for item in items):
        raise ConfigError(f"--variants entry {variant!r} must be option=value[,option=value...]")
    try:
        overrides = OverridesParser.create().parse_overrides(items)
    except HydraException as e:
        raise ConfigError(f"--variants entry {variant!r}: {str(e).strip().splitlines()[0]}") from None
    return spec_from_dict({"kind": "softmax", **{o.key_or_group: o.value() for o in overrides}})


def checked_variant(variant: str) -> str:
    """argparse's type for --variants: refused at parsing, before any model is built."""
    try:
        variant_spec(variant)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return variant


def model_shapes() -> list[str]:
    """--model's choices: the reference shape, then conf/model/'s."""
    return ["reference", *sorted(p.stem for p in MODEL_CONFIGS.glob("*.yaml"))]


def bench_shape(args) -> ModelConfig:
    """--model: the reference shape, or one of conf/model/ (MHA, as `attn=mha` trains it);
    --vocab and --seq change its vocabulary and sequence length."""
    if args.model == "reference":
        shape = dict(REFERENCE)
    else:
        from lm.config.compose import compose_train

        model = compose_train([f"model={args.model}"]).model
        shape = {key: model[key] for key in ("n_layer", "d_model", "n_head", "d_ff", "max_seq_len", "tie_embeddings")}
        shape.update(vocab_size=REFERENCE["vocab_size"], n_kv_head=model.n_head)  # the built-in corpus's vocabulary
    if args.vocab:
        shape["vocab_size"] = args.vocab
    if args.seq:
        shape["max_seq_len"] = args.seq
    return ModelConfig(**shape)


def litgpt_model(cfg: ModelConfig) -> torch.nn.Module | None:
    """litgpt's GPT of the same shape (Llama's layout: RMSNorm, SwiGLU, RoPE on every dimension,
    no biases), or None where litgpt is not installed."""
    try:
        from litgpt.config import Config
        from litgpt.model import GPT
    except ImportError as e:
        if e.name != "litgpt":  # installed, but something it imports is missing: say what
            print(f"litgpt row: importing litgpt failed: {e}")
        return None
    config = Config(name="lm-shape", block_size=cfg.max_seq_len, vocab_size=cfg.vocab_size,
                    padded_vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.d_model,
                    n_query_groups=cfg.n_kv_head, head_size=cfg.head_dim, rotary_percentage=1.0,
                    parallel_residual=False, bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
                    intermediate_size=cfg.d_ff)
    return GPT(config)


def train_contenders(cfg: ModelConfig, args, autocast: torch.dtype | None) -> tuple[dict, dict, list[str]]:
    """({name: model}, {name: its training step}, the peers' names): ours, transformers' (and
    litgpt's), a compiled copy of ours (--no-compile: none) and of the peers (--compile-peers), copies
    of ours with the loss a chunk at a time, eager and compiled (--loss-chunk 0: none), and ours with
    each of --variants' attention options. Built on the current default device."""
    ours = Transformer(cfg)

    def copy_of_ours() -> Transformer:
        twin = Transformer(cfg)
        twin.load_state_dict(ours.state_dict())
        return twin

    peers = {"transformers": (hf_llama(cfg), lambda m, x: m(input_ids=x).logits)}
    litgpt = litgpt_model(cfg)
    if litgpt is not None:
        peers["litgpt"] = (litgpt, lambda m, x: m(x))
    models = {"lm": ours, **{name: model for name, (model, _) in peers.items()}}
    steps = {"lm": train_step_fn(ours, lambda m, x: m(x), autocast)}
    for name, (model, logits_of) in peers.items():
        steps[name] = train_step_fn(model, logits_of, autocast)
    if args.compile:  # a second copy of our model, compiled as `compile=true` training compiles it
        twin = copy_of_ours()
        compiled = torch.compile(twin)
        models["lm compiled"] = twin
        steps["lm compiled"] = train_step_fn(twin, lambda m, x: compiled(x), autocast)
        if args.compile_peers:  # the peers compiled alike, each a copy of its eager model
            for name, (model, logits_of) in peers.items():
                copy_ = copy.deepcopy(model)
                compiled_peer = torch.compile(copy_)
                models[f"{name} compiled"] = copy_
                steps[f"{name} compiled"] = train_step_fn(copy_, lambda m, x, f=compiled_peer, of=logits_of: of(f, x),
                                                          autocast)
    # ours again, trained as `lm` trains: the loss a chunk of positions at a time, eager and compiled
    for name, compile in (("lm chunked loss", False), ("lm compiled chunked loss", True)):
        if args.loss_chunk and (args.compile or not compile):
            models[name] = copy_of_ours()
            steps[name] = chunked_loss_step_fn(models[name], args.loss_chunk, compile, autocast)
    for variant in args.variants:  # the same shape with attention options: gate, qk_norm, softcap ...
        models[variant] = Transformer(dataclasses.replace(cfg, attention=variant_spec(variant)))
        steps[variant] = train_step_fn(models[variant], lambda m, x: m(x), autocast)
    return models, steps, list(peers)


def bench_train(args) -> dict:
    """Prints the table; returns it as plain data (--json)."""
    device = bench_device(args.device)
    autocast = bench_dtype(device) if device.type == "cuda" else None  # bf16-mixed on a GPU, fp32 on the CPU
    torch.manual_seed(0)
    cfg = bench_shape(args)
    with device:  # every model's weights built where it trains
        models, contenders, peers = train_contenders(cfg, args, autocast)
        batch = torch.randint(0, cfg.vocab_size, (args.batch, cfg.max_seq_len + 1))
    first_step = {}
    for name, step in contenders.items():
        first_step[name] = timed(lambda step=step: step(batch))  # compiles, for the compiled contender
        for _ in range(args.warmup):
            step(batch)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.steps):  # alternate, so background load hits both alike
        for name, step in contenders.items():
            times[name].append(timed(lambda step=step: step(batch)))

    measured_peak = matmul_peak_flops(device)
    spec_peak = dense_bf16_peak(device) if device.type == "cuda" else None
    peak = spec_peak or measured_peak
    tokens = args.batch * cfg.max_seq_len
    # Each of our models counts its own FLOPs (a variant's gate adds some); a peer is the same shape as ours.
    ours = models["lm"]
    counted = {name: models[name] if isinstance(models[name], Transformer) else ours for name in contenders}
    flops_per_step = {name: model.flops_per_token(cfg.max_seq_len) * tokens for name, model in counted.items()}
    precision = "bf16-mixed" if autocast else "fp32"
    print(f"training step, {precision}, {describe_device(device)}: {ours.num_params() / 1e6:.1f}M parameters, "
          f"vocab {cfg.vocab_size}, {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads / "
          f"{cfg.n_kv_head} KV, SwiGLU {cfg.d_ff}, seq {cfg.max_seq_len}, batch {args.batch}, "
          f"{'tied' if cfg.tie_embeddings else 'untied'} embeddings; {args.steps} steps each")
    if spec_peak:
        print(f"MFU against the data sheet's dense bf16 peak {spec_peak / 1e12:.0f} TFLOP/s "
              f"(measured bf16 matmul peak {measured_peak / 1e12:.0f} TFLOP/s)")
    else:
        print(f"measured {'bf16' if autocast else 'fp32'} matmul peak: {measured_peak / 1e9:.0f} GFLOP/s")
    if "litgpt" not in peers:
        print("litgpt row: left out (pip install litgpt to time it)")
    width = max(14, *(len(name) + 2 for name in contenders))
    print(f"{'':{width}}{'median step s':>14}{'tokens/s':>10}{'MFU':>7}{'first step s':>14}")
    medians = {name: statistics.median(t) for name, t in times.items()}
    rows = [{"name": name, "median_step_s": seconds, "tokens_per_s": tokens / seconds,
             "mfu": flops_per_step[name] / seconds / peak, "first_step_s": first_step[name],
             "flops_per_step": flops_per_step[name]} for name, seconds in medians.items()]
    for row in rows:
        print(f"{row['name']:{width}}{row['median_step_s']:14.3f}{row['tokens_per_s']:10.0f}{row['mfu']:7.1%}"
              f"{row['first_step_s']:14.1f}")
    for name, suffix in (("lm", ""), ("lm compiled", " compiled")):  # each against its like: eager, compiled
        for peer in (f"{p}{suffix}" if f"{p}{suffix}" in medians else p for p in peers):
            if name in medians:
                print(f"{name} / {peer} tokens/s: {medians[peer] / medians[name]:.2f}x")
    for name in ("lm chunked loss", "lm compiled chunked loss"):
        if name in medians:
            plain = name.replace(" chunked loss", "")
            if plain in medians:
                print(f"{name} / {plain} tokens/s: {medians[plain] / medians[name]:.2f}x")
    for variant in args.variants:
        print(f"{variant} / lm tokens/s: {medians['lm'] / medians[variant]:.2f}x")
    return {"device": describe_device(device), "precision": precision, "params": ours.num_params(),
            "shape": {key: getattr(cfg, key) for key in SHAPE_FIELDS}, "batch": args.batch, "tokens_per_step": tokens,
            "steps": args.steps, "measured_peak_flops": measured_peak, "peak_flops": peak, "rows": rows}

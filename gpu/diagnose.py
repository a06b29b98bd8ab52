"""What the gpu tier and bench-train left open, measured in one short run on a GPU machine:

  taylor     linear-taylor-mqa's compiled decoding against eager, part by part: the compiled prefill's
             logits and cache state, three steps captured as a CUDA graph and compiled without one,
             each from the eager prefill's cache; the same for Taylor with 4 K/V heads and elu's MQA
  inductor   where inductor goes wrong in that prefill: each backend, inductor with one option off,
             the chunkwise kernel with Taylor features compiled alone
  odd_chunk  gated_delta-mha-odd-chunk's bf16 gradient error beside gated_delta's, with cuDNN's TF32
             on and off, and the GPU's float32 gradient against the CPU's
  profile    the compiled `model=base` training step of bench-train (sequence 1024, batch 16,
             bf16-mixed): step time, MFU, the CUDA time of matmuls, attention and the rest, the top
             kernels; then the step with the loss inside the compiled graph, at batch 16 and 32; the
             step as compile=true trains (loss_chunk 512)
  autotune   the step with the loss compiled under max-autotune at batch 32 (its compile takes minutes)
  ragged     16 ragged prompts of bench-decode's lengths on its weights: lm compiled and transformers
             eager against lm eager, in float32 (TF32 off) and bf16: rows equal, and where a row first
             differs, how far eager's top two logits lie apart there (a near-tie rounding can flip, or
             a fault)

    # after a gpu/run stage, which installs the wheels under /tmp/lm-site:
    PYTHONPATH=/tmp/lm-site:$PWD python3 gpu/diagnose.py [taylor] [inductor] [odd_chunk] [profile] [autotune] [ragged]
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

os.environ.setdefault("LM_GPU_TIER_DEVICE", "cuda")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

def taylor() -> None:
    """Which compiled part gives linear-taylor-mqa other tokens than eager: the prefill (compiled with
    static shapes, no CUDA graph) or the step (captured as a CUDA graph, or compiled without one),
    measured as logits and cache states side by side from the same starting cache; then a Taylor
    model with a K/V head per query head, and elu's MQA, so the feature map and the grouping are
    told apart."""
    import test_gpu as tier

    from lm import generate
    from lm.attention import LinearSpec
    from lm.model.generation_cache import GenerationCache

    tier.KINDS["linear-taylor-mha"] = (LinearSpec(feature_map="taylor"), 4)
    tier.KINDS["linear-elu-mqa"] = (LinearSpec(), 1)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, tier.VOCAB, (n,), generator=g).tolist() for n in (3, 17, 9)]  # the tier's prompts

    def states(cache) -> list[torch.Tensor]:
        return [t.clone() for t in cache.held_tensors()]

    def difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return max(tier.relative_error(x, y) for x, y in zip(a, b, strict=True))

    for name in ("linear-taylor-mqa", "linear-taylor-mha", "linear-elu-mqa"):
        model = tier.gpu_model(name).eval()
        torch._dynamo.reset()
        compiled_prefill = torch.compile(model, dynamic=False)
        graph_step = torch.compile(model.decode_step, fullgraph=True, mode="reduce-overhead")
        plain_step = torch.compile(model.decode_step, fullgraph=True)
        for n, prompt in enumerate(prompts):
            idx = torch.tensor([prompt], device=tier.DEVICE)
            pad = torch.zeros(1, dtype=torch.long, device=tier.DEVICE)
            with torch.no_grad():
                eager_cache, compiled_cache = (GenerationCache(model, pad=pad, max_len=64) for _ in range(2))
                eager = model(idx, cache=eager_cache)[:, -1]  # (1, V)
                compiled = compiled_prefill(idx, cache=compiled_cache)[:, -1]
                eager_cache.advance(idx.shape[1])
                compiled_cache.advance(idx.shape[1])
                top2 = eager[0].topk(2).values
                print(f"{name} prompt{n}: prefill logits rel err {tier.relative_error(compiled, eager):.2e}, "
                      f"state rel err {difference(states(compiled_cache), states(eager_cache)):.2e}, "
                      f"argmax {int(compiled.argmax())} vs eager {int(eager.argmax())} "
                      f"(eager's top-2 gap {float(top2[0] - top2[1]):.2e})")
                start = states(eager_cache)
                token = eager.argmax(-1, keepdim=True)  # (1, 1)
                results = {}
                for label, step in (("eager", model.decode_step), ("cuda graph", graph_step), ("no graph", plain_step)):
                    for held, saved in zip(eager_cache.held_tensors(), start, strict=True):
                        held.copy_(saved)  # every step from the same cache
                    pos = eager_cache.lengths.clone()
                    outs = [step(token, eager_cache, pos).clone() for _ in range(3)]  # each step writes the state
                    results[label] = (outs, states(eager_cache))
                base, base_state = results["eager"]
                for label in ("cuda graph", "no graph"):
                    outs, state = results[label]
                    errors = [f"{tier.relative_error(o, b):.1e}" for o, b in zip(outs, base, strict=True)]
                    print(f"    three steps, {label}: logits rel err {errors}, "
                          f"state rel err after them {difference(state, base_state):.2e}")
        torch._dynamo.reset()
        print(f"{name} generate: compiled {[r[-8:] for r in generate(model, prompts, 8, compile=True)]}")
        print(f"{name} generate: eager    {[r[-8:] for r in generate(model, prompts, 8)]}")


def inductor() -> None:
    """Where inductor goes wrong in linear-taylor-mqa's prefill through the cache (docs/gpu-logs/
    taylor-probes.log): the prefill compiled by each backend, with its four state tensors; by
    inductor with one of its options off at a time; and the layer's chunkwise kernel with Taylor
    features compiled alone, its state written back in place to plain or static-marked buffers."""
    import test_gpu as tier
    import torch._inductor.config as inductor_config

    from lm.attention.cache import keep_in_place
    from lm.attention.feature_maps import taylor
    from lm.attention.linear import chunked_linear_attention
    from lm.model.generation_cache import GenerationCache

    model = tier.gpu_model("linear-taylor-mqa").eval()
    idx = torch.randint(0, tier.VOCAB, (1, 17), generator=torch.Generator().manual_seed(1)).to(tier.DEVICE)
    pad = torch.zeros(1, dtype=torch.long, device=tier.DEVICE)

    def prefill(run) -> tuple[torch.Tensor, list[torch.Tensor]]:
        cache = GenerationCache(model, pad=pad, max_len=64)
        return run(idx, cache=cache), cache.held_tensors()

    with torch.no_grad():
        eager, eager_state = prefill(model)

        def report(label: str, run) -> None:
            torch._dynamo.reset()
            logits, state = prefill(run)
            errors = [f"{tier.relative_error(a, b):.2e}" for a, b in zip(state, eager_state, strict=True)]
            print(f"{label}: logits rel err {tier.relative_error(logits, eager):.2e}, states {errors}")

        for backend in ("aot_eager", "aot_eager_decomp_partition", "inductor"):
            report(f"prefill by {backend}", torch.compile(model, dynamic=False, backend=backend))
        for option in ("shape_padding", "allow_buffer_reuse", "inplace_buffers", "pattern_matcher"):
            with inductor_config.patch({option: False}):
                report(f"prefill by inductor, {option} off", torch.compile(model, dynamic=False))

        def kernel(q, k, v, S, z):
            out, state = chunked_linear_attention(taylor(q), taylor(k), v, 1e-6, (S, z), 64)
            keep_in_place((S, z), state)
            return out

        g = torch.Generator().manual_seed(2)
        for static in (False, True):
            for T in (17, 64, 100):
                q, k, v = (torch.randn(1, n, T, 32, generator=g).to(tier.DEVICE) for n in (4, 1, 1))
                features = 1 + 32 + 32 * 32  # Taylor's at head size 32
                eager_S = torch.zeros(1, 1, features, 32, device=tier.DEVICE)
                eager_z = torch.zeros(1, 1, features, device=tier.DEVICE)
                S, z = eager_S.clone(), eager_z.clone()
                if static:
                    torch._dynamo.mark_static_address(S)
                    torch._dynamo.mark_static_address(z)
                out = kernel(q, k, v, eager_S, eager_z)
                torch._dynamo.reset()
                compiled = torch.compile(kernel, dynamic=False)(q, k, v, S, z)
                print(f"kernel alone, {'static' if static else 'plain'} state, T {T}: out rel err "
                      f"{tier.relative_error(compiled, out):.2e}, S {tier.relative_error(S, eager_S):.2e}, "
                      f"z {tier.relative_error(z, eager_z):.2e}")


def odd_chunk() -> None:
    """The bf16 autocast test's gradient error for gated_delta-mha-odd-chunk (chunk size 5), beside
    gated_delta: overall and the parameters that differ most, with cuDNN's TF32 convolutions on
    (PyTorch's default) and off, and float32's own gradient against the CPU's."""
    import test_gpu as tier

    idx_cpu = torch.randint(0, tier.VOCAB, (2, 97), generator=torch.Generator().manual_seed(1))

    def gradients(model, idx, autocast: bool):
        model.zero_grad(set_to_none=True)
        device = idx.device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            logits = model(idx[:, :-1])  # (2, 96, V)
        F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten()).backward()
        return {n: p.grad.detach().float().flatten().cpu() for n, p in model.named_parameters() if p.grad is not None}

    def whole(grads: dict) -> torch.Tensor:
        return torch.cat(list(grads.values()))

    print(f"TF32: cuDNN {torch.backends.cudnn.allow_tf32}, matmul {torch.backends.cuda.matmul.allow_tf32}")
    for name in ("gated_delta-mha-odd-chunk", "gated_delta"):
        model = tier.gpu_model(name)
        idx = idx_cpu.to(tier.DEVICE)
        for tf32 in (True, False):
            torch.backends.cudnn.allow_tf32 = tf32
            g32, g16 = gradients(model, idx, False), gradients(model, idx, True)
            worst = sorted(((tier.relative_error(g16[n], g32[n]), n) for n in g32), reverse=True)[:4]
            print(f"{name} cuDNN TF32 {tf32}: gradient rel err {tier.relative_error(whole(g16), whole(g32)):.3f}; "
                  f"worst {', '.join(f'{n} {e:.3f}' for e, n in worst)}")
        torch.backends.cudnn.allow_tf32 = True
        cpu32, cpu16 = gradients(model.cpu(), idx_cpu, False), gradients(model, idx_cpu, True)
        print(f"{name} on the CPU: bf16 gradient rel err {tier.relative_error(whole(cpu16), whole(cpu32)):.3f}; "
              f"the GPU's float32 gradient against the CPU's {tier.relative_error(whole(g32), whole(cpu32)):.2e}")


def seconds_per_call(fn, calls: int = 10) -> float:
    for _ in range(3):  # compiles, then warms
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


class BaseTraining:
    """bench-train's `model=base` model on the GPU (sequence 1024), batches of 16 and 32 rows, the
    MFU of a step as bench-train counts it, and the step with the loss inside a compiled graph."""

    def __init__(self) -> None:
        from benchmarks.bench_models import dense_bf16_peak
        from benchmarks.train_bench import bench_shape
        from lm import Transformer

        self.cfg = bench_shape(SimpleNamespace(model="base", vocab=None, seq=1024))
        torch.manual_seed(0)
        self.model = Transformer(self.cfg).cuda()
        self.batch = torch.randint(0, self.cfg.vocab_size, (16, 1025), device="cuda")
        self.wide = torch.randint(0, self.cfg.vocab_size, (32, 1025), device="cuda")
        self.flops, self.peak = self.model.flops_per_token(1024), dense_bf16_peak(torch.device("cuda"))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)

    def mfu(self, seconds: float, rows: int) -> str:
        return f"{seconds * 1e3:.1f} ms, MFU {self.flops * rows * 1024 / seconds / self.peak:.1%}"

    def loss_of(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = self.model(x)  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def step_with(self, compiled_loss):
        """A training step whose forward, loss and backward are `compiled_loss`'s graph."""

        def step(rows: torch.Tensor) -> None:
            compiled_loss(rows[:, :-1], rows[:, 1:]).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

        return step


def profile() -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as cuda_profile

    from benchmarks.train_bench import chunked_loss_step_fn
    from lm.studies.train_step import train_step_fn

    base = BaseTraining()
    compiled = torch.compile(base.model)
    step = train_step_fn(base.model, lambda m, x: compiled(x), torch.bfloat16)  # bench-train's "lm compiled"
    print(f"base step (loss outside compile): {base.mfu(seconds_per_call(lambda: step(base.batch)), 16)}")
    with cuda_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step(base.batch)
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events)

    def share(*words: str) -> float:
        return sum(e.device_time_total for e in events if any(w in e.key.lower() for w in words)) / total

    matmuls, attention = share("gemm", "nvjet", "cutlass", "xmma", "cublas"), share("flash", "fmha", "sdpa")
    print(f"CUDA time: matmuls {matmuls:.0%}, attention {attention:.0%}, other {1 - matmuls - attention:.0%}")
    print(events.table(sort_by="device_time_total", row_limit=18, max_name_column_width=70))

    step_with_loss = base.step_with(torch.compile(base.loss_of))
    print(f"base step (loss compiled): {base.mfu(seconds_per_call(lambda: step_with_loss(base.batch)), 16)}")
    print(f"base step batch 32 (loss compiled): {base.mfu(seconds_per_call(lambda: step_with_loss(base.wide), 5), 32)}")

    # the step as `compile=true bf16-mixed` training takes it: hidden states compiled, the head and
    # the loss 512 positions at a time, eager (lm.model.linear_cross_entropy)
    chunked = chunked_loss_step_fn(base.model, 512, compile=True, autocast=torch.bfloat16)
    seconds = seconds_per_call(lambda: chunked(base.batch))
    print(f"base step as compile=true trains (loss_chunk 512): {base.mfu(seconds, 16)}")
    print(f"  the same at batch 32: {base.mfu(seconds_per_call(lambda: chunked(base.wide), 5), 32)}")


def autotune() -> None:
    """Inductor's GEMM templates and tuned pointwise kernels: does autotuning close the MFU gap?"""
    import torch._inductor.config as inductor_config

    base = BaseTraining()
    with inductor_config.patch(coordinate_descent_tuning=True):  # this part's compiles only
        tuned_step = base.step_with(torch.compile(base.loss_of, mode="max-autotune-no-cudagraphs"))
        started = time.perf_counter()
        tuned_step(base.wide)
        print(f"max-autotune compile: {time.perf_counter() - started:.0f} s")
        seconds = seconds_per_call(lambda: tuned_step(base.wide), 5)
    print(f"base step batch 32 (loss compiled, max-autotune): {base.mfu(seconds, 32)}")


def ragged() -> None:
    from benchmarks.bench_models import REFERENCE
    from benchmarks.decode_bench import hf_twin, ragged_prompts, theirs
    from lm import ModelConfig, Transformer, generate

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # the CPU: to try the part out
        torch.manual_seed(0)
        cfg = ModelConfig(**{**REFERENCE, "max_seq_len": 192 + 64})
        reference = Transformer(cfg).eval()
        prompts = ragged_prompts(16, 128, cfg.vocab_size)
        for dtype in (torch.float32, torch.bfloat16):
            model, hf = copy.deepcopy(reference).to(dtype), hf_twin(reference, dtype)
            eager = generate(model, prompts, 64)
            others = {"lm compiled": generate(model, prompts, 64, compile=True),
                      "transformers eager": theirs(hf, prompts, 64)()}
            for name, rows in others.items():
                gaps = []
                for prompt, mine, theirs_row in zip(prompts, eager, rows, strict=True):
                    if mine == theirs_row:
                        continue
                    at = next(i for i, (a, b) in enumerate(zip(mine, theirs_row, strict=True)) if a != b)
                    with torch.no_grad():
                        logits = model(torch.tensor([mine[:at]]))[0, -1].float()  # (V,)
                    top2 = logits.topk(2)
                    gaps.append(f"token {at - len(prompt)}: top logit {float(top2.values[0]):.3f}, gap "
                                f"{float(top2.values[0] - top2.values[1]):.1e}, eager's token its arg-max "
                                f"{int(top2.indices[0]) == mine[at]}")  # the uncached forward's view of it
                print(f"{dtype} {name}: {16 - len(gaps)} of 16 rows equal to lm eager; {'; '.join(gaps) or '-'}")
            torch._dynamo.reset()


if __name__ == "__main__":
    parts = {"taylor": taylor, "inductor": inductor, "odd_chunk": odd_chunk, "profile": profile, "autotune": autotune,
             "ragged": ragged}
    for name in sys.argv[1:] or list(parts):
        try:
            parts[name]()
        except Exception as e:  # one part's failure still lets the other report
            print(f"{name} failed: {type(e).__name__}: {e}")

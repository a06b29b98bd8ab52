"""What the gpu tier and bench-train left open, measured in one short call on a GPU machine:

  taylor   linear-taylor-mqa's compiled decoding against eager: the plain forward compiled by
           aot_eager and by inductor, then generate(compile=True) one prompt at a time and batched
  profile  the compiled `model=base` training step of bench-train (sequence 1024, batch 16,
           bf16-mixed): step time, MFU, the CUDA time of matmuls, attention and the rest, the top
           kernels; then the step with the loss inside the compiled graph, at batch 16 and 32

    PYTHONPATH=/tmp/lm-site:$PWD python3 gpu/diagnose.py [taylor] [profile]   # after a gpu/run stage
"""

from __future__ import annotations

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
    import test_gpu as tier

    from lm import generate

    model = tier.gpu_model("linear-taylor-mqa").eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, tier.VOCAB, (n,), generator=g).tolist() for n in (3, 17, 9)]  # the tier's prompts
    for n, prompt in enumerate(prompts):
        idx = torch.tensor([prompt], device=tier.DEVICE)
        with torch.no_grad():
            eager = model(idx)
            for backend in ("aot_eager", "inductor"):
                torch._dynamo.reset()
                compiled = torch.compile(model, dynamic=False, backend=backend)(idx)
                same = bool((compiled.argmax(-1) == eager.argmax(-1)).all())
                print(f"taylor prompt{n} len{len(prompt)} {backend}: rel err "
                      f"{tier.relative_error(compiled, eager):.2e}, argmax same {same}")
    torch._dynamo.reset()
    for n, prompt in enumerate(prompts):
        compiled, eager = generate(model, [prompt], 8, compile=True), generate(model, [prompt], 8)
        print(f"taylor alone prompt{n}: compiled {compiled[0][-8:]} eager {eager[0][-8:]}")
    torch._dynamo.reset()
    compiled, eager = generate(model, prompts, 8, compile=True), generate(model, prompts, 8)
    print("taylor batch:", [row[-8:] for row in compiled], [row[-8:] for row in eager])


def seconds_per_call(fn, calls: int = 10) -> float:
    for _ in range(3):  # compiles, then warms
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def profile() -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as cuda_profile

    from lm import Transformer
    from lm.studies.bench_models import dense_bf16_peak
    from lm.studies.train_bench import bench_shape, train_step_fn

    cfg = bench_shape(SimpleNamespace(model="base", vocab=None, seq=1024))
    torch.manual_seed(0)
    model = Transformer(cfg).cuda()
    compiled = torch.compile(model)
    step = train_step_fn(model, lambda m, x: compiled(x), torch.bfloat16)  # bench-train's "lm compiled"
    batch = torch.randint(0, cfg.vocab_size, (16, 1025), device="cuda")
    flops, peak = model.flops_per_token(1024), dense_bf16_peak(torch.device("cuda"))  # as bench-train counts

    def mfu(seconds: float, rows: int) -> str:
        return f"{seconds * 1e3:.1f} ms, MFU {flops * rows * 1024 / seconds / peak:.1%}"

    print(f"base step (loss outside compile): {mfu(seconds_per_call(lambda: step(batch)), 16)}")
    with cuda_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step(batch)
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events)

    def share(*words: str) -> float:
        return sum(e.device_time_total for e in events if any(w in e.key.lower() for w in words)) / total

    matmuls, attention = share("gemm", "nvjet", "cutlass", "xmma", "cublas"), share("flash", "fmha", "sdpa")
    print(f"CUDA time: matmuls {matmuls:.0%}, attention {attention:.0%}, other {1 - matmuls - attention:.0%}")
    print(events.table(sort_by="device_time_total", row_limit=18, max_name_column_width=70))

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    compiled_loss = torch.compile(loss_of)

    def step_with_loss(rows: torch.Tensor) -> None:
        compiled_loss(rows[:, :-1], rows[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    print(f"base step (loss compiled): {mfu(seconds_per_call(lambda: step_with_loss(batch)), 16)}")
    wide = torch.randint(0, cfg.vocab_size, (32, 1025), device="cuda")
    print(f"base step batch 32 (loss compiled): {mfu(seconds_per_call(lambda: step_with_loss(wide), 5), 32)}")


if __name__ == "__main__":
    parts = {"taylor": taylor, "profile": profile}
    for name in sys.argv[1:] or list(parts):
        try:
            parts[name]()
        except Exception as e:  # one part's failure still lets the other report
            print(f"{name} failed: {type(e).__name__}: {e}")

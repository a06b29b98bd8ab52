"""The decoding step through torch.compile: `compile=true`, and `compile_mode=max-autotune` on the CPU.

`compile_mode=default` compiles `model.decode_step` as one graph (fullgraph; on CUDA captured as a CUDA
graph, "reduce-overhead"). Its matmuls stay calls into the CPU's BLAS, and at one row a step that is
the matrix-vector product MKL runs far below the memory's speed on AMD EPYCs: 9.6 GB/s over a 48 MB
weight, where a plain sum reads 21-27 GB/s (docs/performance.md, "fp32 decoding at the memory's
speed"). `compile_mode=max-autotune` compiles the step with inductor's freezing (the weights become
constants of the graph, so it can lay them out for its own GEMM templates) and max-autotune (each
matmul shape timed against those templates and the BLAS call, the fastest kept): 2.1-2.7x the tokens a
second of `default` at the reference shape, for a first call of seconds to a minute.

Freezing bakes the weights into the graph, and torch's guards do not look at their values, so a
model whose weights changed after its step compiled (an optimizer step, load_state_dict) would decode
with the old ones. `FrozenWeightsStep` passes a tag of the model's tensors (which ones, where their
storage is, and torch's count of in-place writes to each) as a constant of the graph, taken when a
generation starts, so a change compiles the step again, and the entries of the model's older weights
are dropped first (they hold a copy of them, and would count towards torch's recompile limit). Not
seen: writes through `.data` (torch counts none of them) and changes in the middle of one generation;
after such a write, `torch._dynamo.reset()`.
"""

from __future__ import annotations

import functools
import itertools
import threading
import warnings
import weakref

import torch

from lm.attention.scores import cpu_threads
from lm.model.transformer import Transformer
from lm.util.errors import GenerationError

COMPILE_MODES = ("default", "max-autotune")


def check_compile_mode(compile_mode: str, compile: bool) -> None:
    """One of COMPILE_MODES, and max-autotune only where the step is compiled at all."""
    if compile_mode not in COMPILE_MODES:
        raise GenerationError(f"compile_mode={compile_mode!r} must be one of {', '.join(COMPILE_MODES)}")
    if compile_mode != "default" and not compile:
        raise GenerationError(f"compile_mode={compile_mode} chooses how compile=true compiles: set compile=true")


def check_device(compile_mode: str, device: torch.device) -> None:
    """max-autotune's frozen-weight templates are inductor's CPU GEMMs; on CUDA the step is already one
    CUDA graph (`default`), and this mode has not been measured there."""
    if compile_mode == "max-autotune" and device.type != "cpu":
        raise GenerationError(f"compile_mode=max-autotune is for the CPU (inductor's frozen-weight GEMM "
                              f"templates); on {device.type} use compile_mode=default")


def check_float_weights(compile_mode: str, quantized: bool) -> None:
    """max-autotune tunes float matmuls. An int8 model's run its own kernels, which it left as they were or
    made slower: with VNNI, native compiled 742.1 -> 755.9 tokens/s at batch 1 and 2,762.5 -> 261.0 at
    batch 16, dynamic compiled 959.3 -> 216.1 at batch 1 (docs/performance.md)."""
    if compile_mode == "max-autotune" and quantized:
        raise GenerationError("compile_mode=max-autotune tunes float matmuls, and this model's are int8 "
                              "(quantize=int8), whose kernels it does not speed up: use compile_mode=default")


def check_fits(compile_mode: str, device: torch.device | str, quantized: bool) -> None:
    """What compile_mode asks of the run, checked alike by the scripts (before the checkpoint loads) and
    by compiled_step: max-autotune on the CPU and with float weights."""
    check_device(compile_mode, torch.device(device))
    check_float_weights(compile_mode, quantized)


def holds_int8_weights(model: Transformer) -> bool:
    """Whether any layer keeps its matmul weight as int8, as lm.quantize_int8's layers do (asked by the
    weight's dtype: the quantize module imports decoding, which imports this one)."""
    return any(isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dtype == torch.int8
               for m in model.modules())


def declare_constants() -> None:
    """What torch must know before it traces lm's decoding: lm.attention.scores.cpu_threads
    (torch.get_num_threads, which dynamo cannot call) is a constant of the graph, read once as it is
    traced. Declared here, where compiling is asked for, and not where it is defined: the declaration
    imports dynamo, 1.5-2 s at the start of every process that imports lm. Declaring it again does nothing."""
    torch.compiler.assume_constant_result(cpu_threads)


def compiled_step(model: Transformer, compile_mode: str = "default"):
    """model.decode_step compiled as `compile_mode` says, the eager step past torch's recompile limit."""
    device = next(model.parameters()).device
    check_fits(compile_mode, device, holds_int8_weights(model))
    declare_constants()
    if compile_mode == "max-autotune":
        return EagerPastRecompileLimit(FrozenWeightsStep(model), model.decode_step)
    step = torch.compile(model.decode_step, fullgraph=True,
                         mode="reduce-overhead" if device.type == "cuda" else None)
    return EagerPastRecompileLimit(step, model.decode_step)


def compiled_functions(model: Transformer, compile_mode: str = "default"):
    """(prefill, step) for compile=true: the step as compiled_step makes it; on the CPU the prefill
    compiled separately, with static shapes: each prompt width compiles once (symbolic chunk counts break
    inductor's views in the chunkwise kinds), and past torch's recompile limit a width simply runs
    eagerly. A prompt longer than one prefill chunk runs its later chunks eagerly
    (Generation._prefill). torch.compile keeps its graphs with the code, so later generations of
    the same shapes reuse them. The prefill never freezes: it runs once per prompt, and each prompt
    width would pay max-autotune's timing again.

    On CUDA the prefill runs eagerly, as the server's does: one pass per prompt, where a GPU's eager
    kernels are already fast, and inductor (torch 2.11.0+cu130, H100) computed the second layer's
    state of Taylor linear attention's compiled prefill wrongly (relative error about 1, where the
    compiled step and the compiled plain forward agree with eager: docs/gpu.md)."""
    step = compiled_step(model, compile_mode)
    on_cuda = next(model.parameters()).is_cuda
    prefill = model if on_cuda else compiled_prefill(model)
    return prefill, step


def compiled_prefill(model: Transformer):
    """The CPU's prefill: the whole model compiled with static shapes, by inductor."""
    declare_constants()  # a one-token prompt of a GQA or MQA model folds its heads (lm.attention.scores.folds)
    return torch.compile(model, dynamic=False)


def weights_tag(model: Transformer) -> str:
    """Which tensors the model holds, where their storage is, and how often each was written in place
    (torch's count; writes through `.data` are not counted): equal tags, equal weights."""
    held = itertools.chain(model.parameters(), model.buffers())
    return f"{id(model)}:{hash(tuple((id(t), t.data_ptr(), t._version) for t in held))}"


def _step_with(model: Transformer, weights: str, ids: torch.Tensor, cache, pos: torch.Tensor) -> torch.Tensor:
    """The step, with the weights' tag as an argument. dynamo guards only what the traced code reads, and
    guards a string it reads by its value: so the tag is read, and another tag compiles anew."""
    if not weights:
        raise GenerationError("the frozen decoding step needs its weights' tag")
    return model.decode_step(ids, cache, pos)


@functools.cache
def _frozen_autotuned():
    # Made once per process: every model and tag is one more entry of the same compiled function. Without
    # the two reporting options inductor writes every matmul's timings to stderr, a screen per model.
    return torch.compile(_step_with, fullgraph=True, options={
        "max_autotune": True, "max_autotune_report_choices_stats": False, "autotune_num_choices_displayed": 0})


# Frozen steps run one at a time: the freezing flag is the process's, and two threads setting and putting
# it back in turn could leave it set. (A compile of another kind in another thread while a frozen step
# compiles would still see it.)
_FROZEN_LOCK = threading.Lock()
# Each model's weights tag when its frozen step was last made: a new tag drops the old weights' entries.
_LAST_TAGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class FrozenWeightsStep:
    """The step compiled with frozen weights and max-autotune, for the weights the model holds when it
    is made (once per generation; the server's engine once).

    inductor reads `freezing` while dynamo traces, which happens on a call (the first, and any whose
    guards fail), not when torch.compile wraps the function, and `options=` reaches only inductor; so
    the flag is set around each call, through inductor's own `config.patch` (about 17 us a call, against
    steps of milliseconds), which puts it back however the call ends."""

    def __init__(self, model: Transformer):
        self.model, self.tag = model, weights_tag(model)
        with _FROZEN_LOCK:
            if _LAST_TAGS.get(model, self.tag) != self.tag:
                # torch frees compiled entries only by their code: this drops every model's frozen steps
                # (the others compile again on their next use), not only this model's older weights.
                torch._dynamo.reset_code(_step_with.__code__)
            _LAST_TAGS[model] = self.tag

    def __call__(self, ids: torch.Tensor, cache, pos: torch.Tensor) -> torch.Tensor:
        # here, not at the top: inductor's package imports dynamo, 1.3 s at every start of a process that
        # imports lm (lm.generation) whether it compiles or not
        import torch._inductor.config as inductor_config

        with _FROZEN_LOCK, inductor_config.patch(freezing=True):
            return _frozen_autotuned()(self.model, self.tag, ids, cache, pos)


class EagerPastRecompileLimit:
    """The compiled step until torch refuses to compile it once more, the eager step from then on.

    torch compiles one function at most `torch._dynamo.config.recompile_limit` (8) times per process;
    every model of another shape is one more. Past the limit a non-fullgraph function quietly runs
    eagerly, but a fullgraph one raises, so a process that decodes with a ninth kind of model would
    stop. The refusal comes before the step runs (nothing has been written to the cache yet), so
    running the eager step instead is safe; it gives the same tokens, only slower, and says so once."""

    def __init__(self, compiled, eager):
        self.compiled, self.eager, self.fell_back = compiled, eager, False

    def __call__(self, *args, **kwargs):
        if not self.fell_back:
            try:
                return self.compiled(*args, **kwargs)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                self.fell_back = True
                warnings.warn("torch's recompile limit (torch._dynamo.config.recompile_limit = "
                              f"{torch._dynamo.config.recompile_limit}) is reached in this process: this "
                              "generation decodes eagerly; torch._dynamo.reset() starts the count again",
                              stacklevel=2)
        return self.eager(*args, **kwargs)
